"""Graph -> Graph rewrites on the typed IR. Each pass is a pure function that returns a new,
verified graph and an id map for callers that hold node ids."""

from .simplify import cse, dce, fold_permutes, renumber

__all__ = ["cse", "dce", "fold_permutes", "renumber"]

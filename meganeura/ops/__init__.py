"""The op set. ``OPS`` maps each op name to its OpDef; it is assembled here, explicitly,
from the family modules. The user-facing functions live in ``meganeura.ops.functional``."""

from . import elementwise, linalg, loss, nn, reduce, shape, update
from .registry import OpDef, ShapeError, collect

LEAF_OPS = ("input", "parameter", "state", "constant")

OPS: dict[str, OpDef] = collect(
    elementwise.DEFS, reduce.DEFS, shape.DEFS, linalg.DEFS, nn.DEFS, loss.DEFS, update.DEFS
)

__all__ = ["OPS", "OpDef", "ShapeError", "LEAF_OPS"]

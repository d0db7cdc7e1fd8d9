"""The op set. ``OPS`` maps each op name to its OpDef; it is assembled here, explicitly,
from the family modules. The user-facing functions live in ``meganeura.ops.functional``."""

from ..graph.ir import LEAF_OPS
from . import (
    attention,
    conv,
    creation,
    elementwise,
    indexing,
    inplace,
    linalg,
    loss,
    nn,
    norm,
    quantized,
    reduce,
    shape,
    update,
)
from .registry import OpDef, ShapeError, collect

OPS: dict[str, OpDef] = collect(
    elementwise.DEFS,
    creation.DEFS,
    reduce.DEFS,
    shape.DEFS,
    indexing.DEFS,
    inplace.DEFS,
    linalg.DEFS,
    nn.DEFS,
    conv.DEFS,
    norm.DEFS,
    attention.DEFS,
    quantized.DEFS,
    loss.DEFS,
    update.DEFS,
)

__all__ = ["OPS", "OpDef", "ShapeError", "LEAF_OPS"]

"""Shape ops: reshape, permute, broadcast_to. ``reshape`` is a view (no kernel); ``permute``
copies; ``broadcast_to`` materializes (fusion passes fold it into consumers)."""

from __future__ import annotations

import math

import numpy as np

from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def _reshape_type(types, attrs):
    (t,) = types
    shape = tuple(attrs["shape"])
    if math.prod(shape) != t.numel or any(s < 0 for s in shape):
        raise ShapeError(f"cannot reshape {t.numel} elements of {list(t.shape)} into {list(shape)}")
    return TensorType(shape, t.dtype)


def _permute_type(types, attrs):
    (t,) = types
    dims = tuple(attrs["dims"])
    if sorted(dims) != list(range(t.ndim)):
        raise ShapeError(f"dims {list(dims)} is not a permutation of {t.ndim} axes")
    return TensorType(tuple(t.shape[d] for d in dims), t.dtype)


def _broadcast_type(types, attrs):
    (t,) = types
    shape = tuple(attrs["shape"])
    if any(s < 0 for s in shape):
        raise ShapeError(f"target shape {list(shape)} has a negative dim")
    if len(shape) < t.ndim:
        raise ShapeError(f"cannot broadcast {list(t.shape)} to fewer dims {list(shape)}")
    for s, d in zip(reversed(t.shape), reversed(shape)):
        if s != d and s != 1:
            raise ShapeError(f"cannot broadcast {list(t.shape)} to {list(shape)}")
    return TensorType(shape, t.dtype)


def _permute_grad(node, i, o, g):
    dims = node.attr("dims")
    inverse = tuple(int(k) for k in np.argsort(dims))
    return (F.permute(g, inverse),)


DEFS = [
    OpDef(
        "reshape",
        _reshape_type,
        lambda x, a: x[0].reshape(a["shape"]),
        lambda n, i, o, g: (F.reshape(g, i[0].shape),),
        arity=1,
    ),
    OpDef(
        "permute",
        _permute_type,
        lambda x, a: np.ascontiguousarray(np.transpose(x[0], a["dims"])),
        _permute_grad,
        arity=1,
    ),
    # The gradient is g itself: autodiff sums it back over the broadcast dims.
    OpDef(
        "broadcast_to",
        _broadcast_type,
        lambda x, a: np.ascontiguousarray(np.broadcast_to(x[0], a["shape"])),
        lambda n, i, o, g: (g,),
        arity=1,
    ),
    OpDef(
        "stop_gradient", lambda t, a: t[0], lambda x, a: x[0], lambda n, i, o, g: (None,), arity=1
    ),
]

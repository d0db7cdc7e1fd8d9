"""Reductions over a set of dims, with ``keepdim`` as in PyTorch: sum, mean, amax.

Attributes: ``dims`` (sorted, non-negative, unique; normalized by the functional API) and
``keepdim``. Reducing over zero elements is rejected when the graph is built.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DType
from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def _reduce_type(types, attrs):
    (t,) = types
    dims = attrs["dims"]
    if any(d < 0 or d >= t.ndim for d in dims) or len(set(dims)) != len(dims):
        raise ShapeError(f"dims {dims} invalid for a {t.ndim}-d tensor")
    if t.dtype is DType.bool:
        raise ShapeError("cannot reduce a bool tensor; cast it first")
    if math.prod(t.shape[d] for d in dims) == 0:
        raise ShapeError(f"reduction over zero elements (dims {dims} of shape {list(t.shape)})")
    if attrs["keepdim"]:
        shape = tuple(1 if i in dims else s for i, s in enumerate(t.shape))
    else:
        shape = tuple(s for i, s in enumerate(t.shape) if i not in dims)
    return TensorType(shape, t.dtype)


def kept_shape(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with the reduced ``dims`` set to 1 (the keepdim shape)."""
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


def _expand_back(node, x, g):
    dims = node.attr("dims")
    return F.broadcast_to(F.reshape(g, kept_shape(x.shape, dims)), x.shape)


def _sum_grad(node, i, o, g):
    return (_expand_back(node, i[0], g),)


def _mean_grad(node, i, o, g):
    n = math.prod(i[0].shape[d] for d in node.attr("dims"))
    return (_expand_back(node, i[0], g) / float(n),)


def _amax_grad(node, i, o, g):
    # Ties share the gradient equally, as torch.amax documents.
    x = i[0]
    dims = node.attr("dims")
    mask = F.cast(F.eq(x, _expand_back(node, x, o)), x.dtype)
    count = F.sum(mask, dims, keepdim=True)
    return (mask * _expand_back(node, x, g) / count,)


def _np_reduce(fn):
    def ref(xs, a):
        return np.asarray(fn(xs[0], axis=tuple(a["dims"]), keepdims=a["keepdim"]), xs[0].dtype)

    return ref


DEFS = [
    OpDef("sum", _reduce_type, _np_reduce(np.sum), _sum_grad, arity=1),
    OpDef("mean", _reduce_type, _np_reduce(np.mean), _mean_grad, arity=1),
    OpDef("amax", _reduce_type, _np_reduce(np.max), _amax_grad, arity=1),
]

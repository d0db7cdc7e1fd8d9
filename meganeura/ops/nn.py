"""Neural-network ops with their own kernels: softmax and log_softmax along one dim.

Both subtract the row maximum before exponentiating (so logits of any magnitude are safe);
gradients (PyTorch's formulas):
  softmax:     dx = y * (g - sum(g * y, dim))
  log_softmax: dx = g - exp(y) * sum(g, dim)
"""

from __future__ import annotations

import numpy as np

from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def _softmax_type(types, attrs):
    (t,) = types
    d = attrs["dim"]
    if not t.dtype.is_floating:
        raise ShapeError(f"expects a floating-point operand, got {t.dtype}")
    if not 0 <= d < t.ndim:
        raise ShapeError(f"dim {d} out of range for a {t.ndim}-d tensor")
    if t.shape[d] == 0:
        raise ShapeError(f"softmax over an empty dim {d}")
    return TensorType(t.shape, t.dtype)


def log_softmax_np(x: np.ndarray, dim: int) -> np.ndarray:
    m = np.max(x, axis=dim, keepdims=True)
    z = x - m
    return z - np.log(np.sum(np.exp(z), axis=dim, keepdims=True))


def _softmax_grad(node, i, o, g):
    d = node.attr("dim")
    return (o * (g - F.sum(g * o, d, keepdim=True)),)


def _log_softmax_grad(node, i, o, g):
    d = node.attr("dim")
    return (g - F.exp(o) * F.sum(g, d, keepdim=True),)


DEFS = [
    OpDef(
        "softmax",
        _softmax_type,
        lambda x, a: np.exp(log_softmax_np(x[0], a["dim"])).astype(x[0].dtype),
        _softmax_grad,
        arity=1,
    ),
    OpDef(
        "log_softmax",
        _softmax_type,
        lambda x, a: log_softmax_np(x[0], a["dim"]).astype(x[0].dtype),
        _log_softmax_grad,
        arity=1,
    ),
]

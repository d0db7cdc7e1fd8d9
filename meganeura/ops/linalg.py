"""Matrix multiplication with NumPy/PyTorch ``matmul`` semantics for operands of rank >= 2:
``[..., M, K] @ [..., K, N] -> [..., M, N]`` with the leading (batch) dims broadcast."""

from __future__ import annotations

import numpy as np

from ..graph.ir import TensorType
from .elementwise import broadcast_shapes
from .registry import OpDef, ShapeError


def _matmul_type(types, attrs):
    a, b = types
    if a.dtype is not b.dtype or not a.dtype.is_floating:
        raise ShapeError(f"operands must share a floating dtype, got {a.dtype} and {b.dtype}")
    if a.ndim < 2 or b.ndim < 2:
        raise ShapeError("operands must have at least 2 dims; reshape vectors to [1,K] or [K,1]")
    if a.shape[-1] != b.shape[-2]:
        raise ShapeError(f"inner dimensions differ: {a.shape[-1]} vs {b.shape[-2]}")
    batch = broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return TensorType(batch + (a.shape[-2], b.shape[-1]), a.dtype)


def _matmul_grad(node, i, o, g):
    a, b = i
    return (g @ b.mT, a.mT @ g)


DEFS = [
    OpDef("matmul", _matmul_type, lambda x, a: np.matmul(x[0], x[1]), _matmul_grad, arity=2),
]

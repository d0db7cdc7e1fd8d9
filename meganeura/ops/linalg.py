"""Matrix multiplication with NumPy/PyTorch ``matmul`` semantics for operands of rank >= 2:
``[..., M, K] @ [..., K, N] -> [..., M, N]`` with the leading (batch) dims broadcast."""

from __future__ import annotations

import math

import numpy as np

from ..graph.ir import TensorType
from . import functional as F
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


def _is_mt(t) -> bool:
    """Whether ``t`` is ``x.mT`` of a 2-D ``x`` (a linear layer's ``W^T``)."""
    n = t.node
    return n.op == "permute" and n.attr("dims") == (1, 0)


def _matmul_grad(node, i, o, g):
    a, b = i
    grad_a = g @ b.mT
    if b.ndim != 2:
        return (grad_a, a.mT @ g)
    # b is shared by every batch entry: fold the batch into rows (free reshape views) so its
    # gradient is one 2-D matmul rather than a batched matmul plus a sum over the batch.
    k, n = b.shape
    rows = math.prod(g.shape[:-1])
    a2 = F.broadcast_to(a, g.shape[:-1] + (k,))  # a may broadcast over g's batch dims
    a2 = F.reshape(a2, (rows, k))
    g2 = F.reshape(g, (rows, n))
    if _is_mt(b):
        # b = W^T: W's gradient is (a^T g)^T = g^T a. Written that way the permute pass
        # cancels the two transposes and the matmul reads g^T in place, instead of
        # materializing a^T g and transposing it (same products, same summation index).
        return (grad_a, (g2.mT @ a2).mT)
    return (grad_a, a2.mT @ g2)


DEFS = [
    OpDef("matmul", _matmul_type, lambda x, a: np.matmul(x[0], x[1]), _matmul_grad, arity=2),
]

"""Loss ops with dedicated kernels: cross_entropy on integer class indices.

``cross_entropy(logits [N, C], target i32 [N])`` follows torch.nn.functional.cross_entropy:
per row ``logsumexp(logits) - logits[target]``; rows whose target equals ``ignore_index`` add
nothing; ``reduction="mean"`` divides by the number of rows not ignored, ``"sum"`` does not.
When every row is ignored the mean is 0 (PyTorch returns NaN; a NaN loss helps nobody).
Its gradient is ``(softmax(logits) - onehot(target)) * g / count`` on rows not ignored, one
kernel (``cross_entropy_backward``); it is not differentiated again.

Targets outside [0, C) are rejected on the host before a step runs (Program.label_checks).
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.ir import TensorType
from .nn import log_softmax_np
from .registry import OpDef, ShapeError


def _check_ce(logits: TensorType, target: TensorType, attrs) -> None:
    if logits.ndim != 2 or not logits.dtype.is_floating:
        raise ShapeError(f"logits must be a floating [N, C] tensor, got {logits}; reshape first")
    if target.dtype is not DType.i32 or target.shape != logits.shape[:1]:
        raise ShapeError(f"target must be i32[{logits.shape[0]}] class indices, got {target}")
    if attrs.get("reduction") not in ("mean", "sum"):
        raise ShapeError(f"reduction must be 'mean' or 'sum', got {attrs.get('reduction')!r}")


def _ce_type(types, attrs):
    logits, target = types
    _check_ce(logits, target, attrs)
    return TensorType((), logits.dtype)


def _ce_bwd_type(types, attrs):
    logits, target, g = types
    _check_ce(logits, target, attrs)
    if g.shape != () or g.dtype is not logits.dtype:
        raise ShapeError(f"upstream gradient must be {logits.dtype}[], got {g}")
    return logits


def _valid(target, attrs):
    ii = attrs.get("ignore_index")
    return np.ones(target.shape, bool) if ii is None else target != ii


def _divisor(valid, attrs):
    if attrs["reduction"] == "sum":
        return 1.0
    return float(max(int(valid.sum()), 1))


def cross_entropy_np(xs, attrs):
    logits, target = xs
    valid = _valid(target, attrs)
    lsm = log_softmax_np(logits, 1)
    safe = np.where(valid, target, 0)
    rows = -lsm[np.arange(len(target)), safe] * valid
    return np.asarray(rows.sum() / _divisor(valid, attrs), logits.dtype)


def cross_entropy_backward_np(xs, attrs):
    logits, target, g = xs
    valid = _valid(target, attrs)
    p = np.exp(log_softmax_np(logits, 1))
    safe = np.where(valid, target, 0)
    p[np.arange(len(target)), safe] -= 1.0
    p *= valid[:, None]
    return (p * (g / _divisor(valid, attrs))).astype(logits.dtype)


def _ce_grad(node, i, o, g):
    logits, target = i
    b = logits.builder
    return (b.add("cross_entropy_backward", [logits, target, g], node.attr_dict), None)


DEFS = [
    OpDef("cross_entropy", _ce_type, cross_entropy_np, _ce_grad, arity=2),
    OpDef(
        "cross_entropy_backward",
        _ce_bwd_type,
        cross_entropy_backward_np,
        differentiable=False,
        arity=3,
    ),
]

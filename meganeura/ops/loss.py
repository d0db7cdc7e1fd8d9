"""Loss ops and functions: cross_entropy, binary_cross_entropy_with_logits, l1_loss.

``cross_entropy(logits [N, C], target i32 [N])`` follows torch.nn.functional.cross_entropy:
per row ``logsumexp(logits) - logits[target]``; rows whose target equals ``ignore_index`` add
nothing; ``reduction="mean"`` divides by the number of rows not ignored, ``"sum"`` does not,
``"none"`` keeps the [N] row losses (0 on ignored rows). When every row is ignored the mean is
0 (PyTorch returns NaN; a NaN loss helps nobody). With ``label_smoothing`` = e (PyTorch's
formula) a row loss is ``(1 - e) * nll + e * mean_c(-log_softmax)``, i.e.
``lse - (1 - e) * z[target] - e * mean(z)`` for ``z = logits - max``. Its gradient is
``(softmax(logits) - (1 - e) * onehot(target) - e / C) * g / count`` on rows not ignored, one
kernel (``cross_entropy_backward``); it is not differentiated again. Targets outside [0, C)
are rejected on the host before a step runs (Program.label_checks).

Probability targets (float [N, C]) are a composite: ``-sum(target' * log_softmax(logits))``
with ``target' = (1 - e) * target + e / C``, divided by N for ``"mean"`` (PyTorch).

``binary_cross_entropy_with_logits`` is an elementwise op (PyTorch's ``reduction="none"``
values) in the stable form ``max(x, 0) - x * t + log1p(exp(-|x|))``; weighting and reduction
are ordinary ops. Gradients: ``d/dx = sigmoid(x) - t``, ``d/dt = -x``.

``l1_loss`` is the composite ``|x - y|`` = ``maximum(d, -d)``, whose tie rule gives the
gradient 0 at d = 0, as torch's ``sign``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor
from ..graph.ir import TensorType
from . import functional as F
from .nn import log_softmax_np
from .registry import OpDef, ShapeError

REDUCTIONS = ("mean", "sum", "none")


def _check_ce(logits: TensorType, target: TensorType, attrs) -> None:
    if logits.ndim != 2 or not logits.dtype.is_floating:
        raise ShapeError(f"logits must be a floating [N, C] tensor, got {logits}; reshape first")
    if target.dtype is not DType.i32 or target.shape != logits.shape[:1]:
        raise ShapeError(f"target must be i32[{logits.shape[0]}] class indices, got {target}")
    if attrs.get("reduction") not in REDUCTIONS:
        raise ShapeError(f"reduction must be one of {REDUCTIONS}, got {attrs.get('reduction')!r}")
    ls = attrs.get("label_smoothing", 0.0)
    if not isinstance(ls, float) or not 0.0 <= ls <= 1.0:
        raise ShapeError(f"label_smoothing must be a float in [0, 1], got {ls!r}")


def _loss_shape(logits: TensorType, attrs) -> tuple[int, ...]:
    return logits.shape[:1] if attrs["reduction"] == "none" else ()


def _ce_type(types, attrs):
    logits, target = types
    _check_ce(logits, target, attrs)
    return TensorType(_loss_shape(logits, attrs), logits.dtype)


def _ce_bwd_type(types, attrs):
    logits, target, g = types
    _check_ce(logits, target, attrs)
    want = TensorType(_loss_shape(logits, attrs), logits.dtype)
    if g != want:
        raise ShapeError(f"upstream gradient must be {want}, got {g}")
    return logits


def _valid(target, attrs):
    ii = attrs.get("ignore_index")
    return np.ones(target.shape, bool) if ii is None else target != ii


def _divisor(valid, attrs):
    if attrs["reduction"] != "mean":
        return 1.0
    return float(max(int(valid.sum()), 1))


def cross_entropy_np(xs, attrs):
    logits, target = xs
    valid = _valid(target, attrs)
    ls = attrs.get("label_smoothing", 0.0)
    lsm = log_softmax_np(logits, 1)
    safe = np.where(valid, target, 0)
    picked = lsm[np.arange(len(target)), safe]
    if ls:
        picked = (1.0 - ls) * picked + ls * np.mean(lsm, axis=1)
    rows = np.where(valid, -picked, 0.0)
    if attrs["reduction"] == "none":
        return rows.astype(logits.dtype)
    return np.asarray(rows.sum() / _divisor(valid, attrs), logits.dtype)


def cross_entropy_backward_np(xs, attrs):
    logits, target, g = xs
    valid = _valid(target, attrs)
    ls = attrs.get("label_smoothing", 0.0)
    p = np.exp(log_softmax_np(logits, 1))
    safe = np.where(valid, target, 0)
    if ls:
        p -= ls / logits.shape[1]
    p[np.arange(len(target)), safe] -= 1.0 - ls
    p *= valid[:, None]
    g = np.asarray(g)
    scale = g[:, None] if g.ndim else g
    return (p * (scale / _divisor(valid, attrs))).astype(logits.dtype)


def _ce_grad(node, i, o, g):
    logits, target = i
    b = logits.builder
    return (b.add("cross_entropy_backward", [logits, target, g], node.attr_dict), None)


def _bce_type(types, attrs):
    x, t = types
    if not x.dtype.is_floating or t != x:
        raise ShapeError(f"input and target must be floating tensors of one shape: {x}, {t}")
    return x


def bce_with_logits_np(xs, attrs):
    x, t = (np.asarray(v) for v in xs)
    return (np.maximum(x, 0) - x * t + np.log1p(np.exp(-np.abs(x)))).astype(x.dtype)


def _bce_grad(node, i, o, g):
    x, t = i
    return g * (F.sigmoid(x) - t), -(g * x)


DEFS = [
    OpDef("cross_entropy", _ce_type, cross_entropy_np, _ce_grad, arity=2),
    OpDef(
        "cross_entropy_backward",
        _ce_bwd_type,
        cross_entropy_backward_np,
        differentiable=False,
        arity=3,
    ),
    OpDef("binary_cross_entropy_with_logits", _bce_type, bce_with_logits_np, _bce_grad, arity=2),
]


# ---- user functions ---------------------------------------------------------------------------
def _reduce(loss: Tensor, reduction: str, what: str) -> Tensor:
    if reduction == "mean":
        return F.mean(loss)
    if reduction == "sum":
        return F.sum(loss)
    if reduction == "none":
        return loss
    raise ValueError(f"{what}: reduction must be one of {REDUCTIONS}, got {reduction!r}")


def cross_entropy(
    input: Tensor,  # noqa: A002
    target: Tensor,
    ignore_index: int | None = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy of logits [N, C] against class indices or class probabilities
    (torch.nn.functional.cross_entropy, without per-class weights).

    Args:
        input: floating logits [N, C].
        target: i32[N] class indices (rows equal to ``ignore_index`` are skipped; None
            ignores nothing), or probabilities shaped and typed like ``input``.
        reduction: ``"mean"`` (over rows not ignored; over N for probabilities), ``"sum"``
            or ``"none"`` ([N] row losses).
        label_smoothing: e in [0, 1]: the target becomes ``(1 - e) * target + e / C``.

    Returns:
        f32[] (or [N] for ``"none"``).

    Raises:
        ValueError: bad reduction, label_smoothing or target shape.
        GraphTypeError: logits not [N, C] floating, index target not i32[N].
    """
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    if reduction not in REDUCTIONS:
        raise ValueError(f"cross_entropy: reduction must be one of {REDUCTIONS}, got {reduction!r}")
    if not target.dtype.is_floating:
        attrs = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": ls}
        return input.builder.add("cross_entropy", [input, target], attrs)
    if target.shape != input.shape or target.dtype is not input.dtype or input.ndim != 2:
        raise ValueError(
            f"probability targets must match logits [N, C]: {input!r}, target {target!r}"
        )
    n, c = input.shape
    if ls:
        target = target * (1.0 - ls) + ls / c
    prod = target * F.log_softmax(input, 1)
    if reduction == "none":
        return -F.sum(prod, 1)
    total = F.sum(prod)
    return total * (-1.0 / n) if reduction == "mean" else -total


def binary_cross_entropy_with_logits(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    reduction: str = "mean",
    pos_weight: Tensor | None = None,
) -> Tensor:
    """Binary cross-entropy on logits (torch.nn.functional.binary_cross_entropy_with_logits):
    ``max(x, 0) - x * t + log1p(exp(-|x|))`` per element, times ``weight`` (broadcast), then
    reduced.

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
        NotImplementedError: ``pos_weight``.
    """
    if pos_weight is not None:
        raise NotImplementedError("binary_cross_entropy_with_logits: pos_weight")
    if input.shape != target.shape:
        raise ValueError(f"input {input!r} and target {target!r} shapes differ")
    loss = input.builder.add("binary_cross_entropy_with_logits", [input, target])
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy_with_logits")


def l1_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Mean (or sum, or elementwise) absolute difference (torch.nn.functional.l1_loss).

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    if input.shape != target.shape:
        raise ValueError(f"l1_loss: input {input!r} and target {target!r} shapes differ")
    d = input - target
    return _reduce(F.maximum(d, -d), reduction, "l1_loss")

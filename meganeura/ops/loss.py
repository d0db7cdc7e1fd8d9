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

The other losses are composites of ordinary ops, with torch's signatures (the deprecated
``size_average``/``reduce`` included) and formulas: ``nll_loss`` (``gather`` of the target's
log-probability, class weights by ``index_select``), ``cross_entropy`` with ``weight`` or
[N, C, d1, ...] logits, ``binary_cross_entropy`` (logs clamped at -100), the ``pos_weight``
form of the logits version, ``mse_loss``, ``smooth_l1_loss``, ``huber_loss`` and ``kl_div``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor, op_error
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


def legacy_reduction(size_average, reduce, reduction: str) -> str:
    """``reduction`` from torch's deprecated ``size_average``/``reduce`` flags when either is
    given (``torch.nn._reduction.legacy_get_string``)."""
    if size_average is None and reduce is None:
        return reduction
    size_average = True if size_average is None else size_average
    reduce = True if reduce is None else reduce
    return "none" if not reduce else "mean" if size_average else "sum"


def _check_reduction(what: str, reduction: str, extra: tuple[str, ...] = ()) -> None:
    if reduction not in REDUCTIONS + extra:
        raise ValueError(
            f"{what}: reduction must be one of {REDUCTIONS + extra}, got {reduction!r}"
        )


def _rows(input: Tensor, target: Tensor, what: str):  # noqa: A002
    """(input [M, C], target [M], shape of the per-element loss): torch's class dim 1 of
    [N, C, d1, ...] (or 0 of an unbatched [C]) moved last and the rest flattened."""
    if input.ndim == 1:
        want = ()
    else:
        want = input.shape[:1] + input.shape[2:]
    if target.shape != want:
        raise ValueError(
            f"{what}: class-index target must be shaped {list(want)} for input "
            f"{list(input.shape)} (classes along dim {int(input.ndim > 1)}), got {target!r}"
        )
    c = input.shape[-1] if input.ndim == 1 else input.shape[1]
    if input.ndim > 2:
        input = F.permute(input, (0, *range(2, input.ndim), 1))
    return F.reshape(input, (-1, c)), F.reshape(target, (-1,)), want


def _class_view(t: Tensor, input: Tensor) -> Tensor:  # noqa: A002
    """A [C] per-class tensor shaped to broadcast along ``input``'s class dim."""
    return t if input.ndim == 1 else F.reshape(t, (t.shape[0],) + (1,) * (input.ndim - 2))


def nll_loss(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    size_average=None,
    ignore_index: int | None = -100,
    reduce=None,
    reduction: str = "mean",
) -> Tensor:
    """Negative log-likelihood of log-probabilities (torch.nn.functional.nll_loss):
    ``-weight[t] * input[t]`` per element, composed from ``gather``.

    Args:
        input: floating log-probabilities [N, C], [N, C, d1, ...] or unbatched [C].
        target: i32 class indices [N], [N, d1, ...] or []; elements equal to
            ``ignore_index`` add nothing (None ignores nothing).
        weight: optional f32[C] class weights.
        reduction: ``"mean"`` divides by the summed weights of the elements not ignored
            (their count without ``weight``); ``"sum"``; ``"none"`` (target's shape).

    Returns:
        f32[] (or target's shape). With every element ignored the mean is 0 (torch: NaN).

    Raises:
        ValueError: bad reduction or target shape. GraphTypeError: non-integer target.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    _check_reduction("nll_loss", reduction)
    if target.dtype not in (DType.i32, DType.u32):
        raise op_error("nll_loss", [input, target], None, "target must be i32 class indices")
    x, t, shape = _rows(input, target, "nll_loss")
    valid = None if ignore_index is None else F.ne(t, int(ignore_index))
    safe = t if valid is None else F.where(valid, t, 0)
    from .gather import gather, index_select

    loss = -F.reshape(gather(x, 1, F.reshape(safe, (-1, 1))), (-1,))
    w = None if weight is None else index_select(weight, 0, safe)
    if w is not None:
        loss = loss * w
    if valid is not None:
        loss = F.where(valid, loss, 0.0)
    if reduction == "none":
        return F.reshape(loss, shape)
    total = F.sum(loss)
    if reduction == "sum":
        return total
    if w is None and valid is None:
        return total / float(t.shape[0])
    den = F.sum(w if valid is None else F.where(valid, 1.0 if w is None else w, 0.0))
    return total / F.where(F.greater(den, 0.0), den, 1.0)


def cross_entropy(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    size_average=None,
    ignore_index: int | None = -100,
    reduce=None,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
) -> Tensor:
    """Cross-entropy of logits against class indices or class probabilities
    (torch.nn.functional.cross_entropy; its arguments in its order).

    Class indices without ``weight`` run the fused ``cross_entropy`` op (rows of the
    flattened [N * d1 * ..., C] logits); with ``weight`` it is ``nll_loss(log_softmax(input))``
    and, with ``label_smoothing``, torch's weighted smoothing term
    ``-sum_c weight_c * log_softmax_c`` normalized as the nll term.

    Args:
        input: floating logits [N, C], [N, C, d1, ...] or unbatched [C].
        target: i32 class indices ([N], [N, d1, ...], []; ``ignore_index`` elements are
            skipped, None ignores nothing), or probabilities shaped like ``input``.
        weight: optional f32[C] class weights.
        reduction: ``"mean"`` (over elements not ignored, weighted; over N * d1 * ... for
            probabilities), ``"sum"`` or ``"none"`` (per-element losses).
        label_smoothing: e in [0, 1]: the target becomes ``(1 - e) * target + e / C``.

    Returns:
        f32[] (or the per-element shape for ``"none"``). With every element ignored the
        mean is 0 (torch: NaN).

    Raises:
        ValueError: bad reduction, label_smoothing or target shape.
        GraphTypeError: logits not floating, an index target not i32.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    ls = float(label_smoothing)
    if not 0.0 <= ls <= 1.0:
        raise ValueError(f"label_smoothing must be in [0, 1], got {label_smoothing}")
    _check_reduction("cross_entropy", reduction)
    cdim = 0 if input.ndim == 1 else 1
    c = input.shape[cdim]
    if target.dtype.is_floating:
        if target.shape != input.shape or target.dtype is not input.dtype:
            raise ValueError(
                f"probability targets must be shaped and typed like the logits: {input!r}, "
                f"target {target!r}"
            )
        if ls:
            target = target * (1.0 - ls) + ls / c
        prod = target * F.log_softmax(input, cdim)
        if weight is not None:
            prod = prod * _class_view(weight, input)
        rows = -F.sum(prod, cdim)
        return rows if reduction == "none" else F.sum(rows) if reduction == "sum" else F.mean(rows)
    if weight is None:
        x, t, shape = _rows(input, target, "cross_entropy")
        attrs = {"ignore_index": ignore_index, "reduction": reduction, "label_smoothing": ls}
        out = input.builder.add("cross_entropy", [x, t], attrs)
        return F.reshape(out, shape) if reduction == "none" else out
    lsm = F.log_softmax(input, cdim)
    nll = nll_loss(lsm, target, weight, ignore_index=ignore_index, reduction=reduction)
    if not ls:
        return nll
    x, t, shape = _rows(lsm, target, "cross_entropy")
    smooth = -F.sum(x * weight, 1)
    valid = None if ignore_index is None else F.ne(t, int(ignore_index))
    if valid is not None:
        smooth = F.where(valid, smooth, 0.0)
    if reduction == "none":
        smooth = F.reshape(smooth, shape)
    elif reduction == "sum":
        smooth = F.sum(smooth)
    else:
        from .gather import index_select

        w = index_select(weight, 0, t if valid is None else F.where(valid, t, 0))
        den = F.sum(w if valid is None else F.where(valid, w, 0.0))
        smooth = F.sum(smooth) / F.where(F.greater(den, 0.0), den, 1.0)
    return nll * (1.0 - ls) + smooth * (ls / c)


def binary_cross_entropy_with_logits(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    size_average=None,
    reduce=None,
    reduction: str = "mean",
    pos_weight: Tensor | None = None,
) -> Tensor:
    """Binary cross-entropy on logits (torch.nn.functional.binary_cross_entropy_with_logits):
    ``max(x, 0) - x * t + log1p(exp(-|x|))`` per element (one op), times ``weight``
    (broadcast), then reduced. With ``pos_weight`` (broadcast along the last dim, as torch)
    it is torch's composite ``(1 - t) x + (1 + (pw - 1) t) (log1p(exp(-|x|)) + max(-x, 0))``.

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    if input.shape != target.shape:
        raise ValueError(f"input {input!r} and target {target!r} shapes differ")
    if pos_weight is None:
        loss = input.builder.add("binary_cross_entropy_with_logits", [input, target])
    else:
        from .elementwise import abs as _abs
        from .elementwise import log1p

        lw = (pos_weight - 1.0) * target + 1.0
        soft = log1p(F.exp(-_abs(input))) + F.relu(-input)
        loss = (1.0 - target) * input + lw * soft
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy_with_logits")


def binary_cross_entropy(
    input: Tensor,  # noqa: A002
    target: Tensor,
    weight: Tensor | None = None,
    size_average=None,
    reduce=None,
    reduction: str = "mean",
) -> Tensor:
    """Binary cross-entropy of probabilities (torch.nn.functional.binary_cross_entropy):
    ``-(t log(x) + (1 - t) log(1 - x))`` with each log clamped to >= -100, as torch, times
    ``weight`` (broadcast), reduced. The gradient is autodiff's of that formula,
    ``(x - t) / (x (1 - x))`` inside (0, 1); torch's kernel divides by
    ``max(x (1 - x), 1e-12)`` instead, which differs only at x = 0 or 1.

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    if input.shape != target.shape:
        raise ValueError(f"binary_cross_entropy: input {input!r} and target {target!r} differ")
    from .elementwise import clamp

    log_x = clamp(F.log(input), min=-100.0)
    log_1mx = clamp(F.log(1.0 - input), min=-100.0)
    loss = -(target * log_x + (1.0 - target) * log_1mx)
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "binary_cross_entropy")


def l1_loss(input: Tensor, target: Tensor, size_average=None, reduce=None, reduction="mean"):  # noqa: A002
    """Mean (or sum, or elementwise) absolute difference (torch.nn.functional.l1_loss).

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    if input.shape != target.shape:
        raise ValueError(f"l1_loss: input {input!r} and target {target!r} shapes differ")
    d = input - target
    return _reduce(F.maximum(d, -d), reduction, "l1_loss")


def mse_loss(input: Tensor, target: Tensor, size_average=None, reduce=None, reduction="mean"):  # noqa: A002
    """Mean (or sum, or elementwise) squared difference (torch.nn.functional.mse_loss).

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    if input.shape != target.shape:
        raise ValueError(f"mse_loss: input {input!r} and target {target!r} shapes differ")
    d = input - target
    return _reduce(d * d, reduction, "mse_loss")


def _piecewise(what: str, input, target, bound: float):  # noqa: A002
    if input.shape != target.shape:
        raise ValueError(f"{what}: input {input!r} and target {target!r} shapes differ")
    if bound < 0:
        raise ValueError(f"{what}: {'beta' if what == 'smooth_l1_loss' else 'delta'} must be >= 0")
    d = input - target
    return d, F.maximum(d, -d)


def smooth_l1_loss(
    input: Tensor,  # noqa: A002
    target: Tensor,
    size_average=None,
    reduce=None,
    reduction: str = "mean",
    beta: float = 1.0,
) -> Tensor:
    """``0.5 d^2 / beta`` where ``|d| < beta``, else ``|d| - 0.5 beta``, for ``d = x - y``
    (torch.nn.functional.smooth_l1_loss; beta = 0 is l1_loss).

    Raises:
        ValueError: bad reduction, a negative beta, or shapes that differ.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    d, a = _piecewise("smooth_l1_loss", input, target, beta)
    if beta == 0.0:
        return _reduce(a, reduction, "smooth_l1_loss")
    loss = F.where(F.less(a, float(beta)), d * d * (0.5 / beta), a - 0.5 * beta)
    return _reduce(loss, reduction, "smooth_l1_loss")


def huber_loss(
    input: Tensor,  # noqa: A002
    target: Tensor,
    reduction: str = "mean",
    delta: float = 1.0,
    weight: Tensor | None = None,
) -> Tensor:
    """``0.5 d^2`` where ``|d| < delta``, else ``delta (|d| - 0.5 delta)``
    (torch.nn.functional.huber_loss; ``beta * smooth_l1_loss`` with beta = delta), times
    ``weight`` (broadcast) before the reduction.

    Raises:
        ValueError: bad reduction, a negative delta, or shapes that differ.
    """
    d, a = _piecewise("huber_loss", input, target, delta)
    loss = F.where(F.less(a, float(delta)), d * d * 0.5, (a - 0.5 * delta) * float(delta))
    if weight is not None:
        loss = loss * weight
    return _reduce(loss, reduction, "huber_loss")


def kl_div(
    input: Tensor,  # noqa: A002
    target: Tensor,
    size_average=None,
    reduce=None,
    reduction: str = "mean",
    log_target: bool = False,
) -> Tensor:
    """Kullback-Leibler divergence of log-probabilities ``input`` from ``target``
    (torch.nn.functional.kl_div): ``target * (log(target) - input)`` per element, 0 where
    the target is 0 (torch's xlogy), or ``exp(target) * (target - input)`` with
    ``log_target``. ``reduction="batchmean"`` divides the sum by dim 0's size (the
    mathematical KL); ``"mean"`` by the element count, as torch.

    Raises:
        ValueError: bad reduction, or input and target of different shapes.
    """
    reduction = legacy_reduction(size_average, reduce, reduction)
    _check_reduction("kl_div", reduction, ("batchmean",))
    if input.shape != target.shape:
        raise ValueError(f"kl_div: input {input!r} and target {target!r} shapes differ")
    if log_target:
        loss = F.exp(target) * (target - input)
    else:
        zero = F.eq(target, 0.0)  # log of a safe 1 there: no -inf * 0 in the gradient
        loss = target * F.log(F.where(zero, 1.0, target)) - target * input
    if reduction == "batchmean":
        return F.sum(loss) / float(input.shape[0] if input.ndim else 1)
    return _reduce(loss, reduction, "kl_div")

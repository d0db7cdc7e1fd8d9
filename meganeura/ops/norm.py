"""Normalization ops: layer_norm, rms_norm, group_norm, batch_norm (and dropout, see
``ops/dropout.py``, whose definitions this family's ``DEFS`` includes).

Every norm normalizes *groups* of elements with per-group statistics and then applies a
per-*channel* affine map. ``group_dims`` says what a group and a channel are for each op:
  * layer_norm / rms_norm: a group is one row of the trailing ``normalized_ndim`` dims; the
    channel of an element is its position in that row (weight shaped like the row);
  * group_norm: a group is (sample n, group j) of ``x [N, C, *]``: C/G channels x spatial;
  * batch_norm: a group is one channel c over every sample and spatial position.
Statistics are computed in f32 with two passes (mean, then the mean of squared deviations:
no E[x^2] - E[x]^2 cancellation) over ``x - x_first`` (the group's first element), so a large
common offset cancels exactly before any rounding; rms_norm uses ``mean(x^2)``
(torch.nn.functional.rms_norm).

Operands: ``(x, weight, bias)`` (rms_norm: ``(x, weight)``; batch_norm in eval mode:
``(x, running_mean, running_var, weight, bias)``). A missing weight or bias is the scalar
constant 1.0 / 0.0, which the kernels inline, so one op serves the affine and plain forms.

Gradients (PyTorch's formulas, recomputing mean/rstd from x in the backward kernels rather than
saving them): with ``xhat = (x - mean) * rstd`` and ``gw = g * weight``,
  dx = rstd * (gw - mean_group(gw) - xhat * mean_group(gw * xhat))    (rms_norm: no mean(gw))
  dweight = sum over non-channel positions of g * xhat;   dbias = sum of g likewise.
``dx`` and ``dweight`` are dedicated ops (``<op>_backward``, ``<op>_weight_backward``, not
differentiated again); ``dbias`` is a plain ``sum``. batch_norm in eval mode is an affine map
of x with fixed statistics; its gradient is written with elementwise ops and sums.

batch_norm in training mode also appends ``batch_norm_update_stats`` (an effect op writing the
``state`` leaves running_mean/running_var in place, as torch.nn.functional.batch_norm does):
``running = (1 - momentum) * running + momentum * batch_stat`` with the *unbiased* batch
variance, while the output is normalized with the biased one. Its optional fourth operand is the
non-finite guard's clip coefficient (``optim.guard``): when it is inf or NaN (by bit pattern, the
guard tripped) the op writes nothing, as the optimizer updates do; a guarded training program
moves the op after the guard's decision (``optim.guard.defer_update_stats``, issue 11 item 3).
``batch_norm_stats(x)`` is the batch mean and unbiased variance per channel, ``[2, C]``;
``batch_norm_update_stats_into(stats, src_mean, src_var, mean, var, take_src, clip)`` writes
``momentum * stats + (1 - momentum) * src`` into ``mean``/``var``, with ``src`` = ``src_*``
when ``take_src`` is nonzero, else ``mean``/``var`` themselves, and nothing when ``clip`` is
non-finite: with gradient accumulation and the guard, the micro-batches stage their updates
in pending copies and the guarded last micro-batch commits them (``optim.guard``); the
statistics are computed in the forward, so the batch input is not kept for the update.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor, op_error
from ..graph.ir import TensorType
from . import functional as F
from .dropout import DEFS as DROPOUT_DEFS
from .norm_ref import (
    backward_np,
    batch_stats_np,
    channel_axes,
    group_dims,
    norm_np,
    update_stats_into_np,
    update_stats_np,
    weight_backward_np,
)
from .registry import OpDef, ShapeError

KINDS = ("layer_norm", "rms_norm", "group_norm", "batch_norm")
RMS_EPS_F32 = float(np.finfo(np.float32).eps)  # torch's default rms_norm eps for float32


# ---- type rules -------------------------------------------------------------------------------
def _check_params(x: TensorType, params, shape: tuple[int, ...], what: tuple[str, ...]) -> None:
    for t, name in zip(params, what, strict=True):
        if t.dtype is not x.dtype or t.shape not in ((), shape):
            raise ShapeError(f"{name} must be {x.dtype}[{','.join(map(str, shape))}], got {t}")


def _x_type(t: TensorType) -> None:
    if not t.dtype.is_floating:
        raise ShapeError(f"expects a floating-point input, got {t}")


def _norm_type(kind: str):
    def rule(types, attrs):
        x = types[0]
        _x_type(x)
        _, _, wshape = group_dims(x.shape, kind, attrs)
        if kind == "rms_norm":
            names = ("weight",)
        elif kind == "batch_norm" and not attrs["training"]:
            names = ("running_mean", "running_var", "weight", "bias")
        else:
            names = ("weight", "bias")
        if len(types) != 1 + len(names):
            raise ShapeError(f"expects {1 + len(names)} operands (x, {', '.join(names)})")
        _check_params(x, types[1:], wshape, names)
        if kind == "batch_norm" and not attrs["training"]:
            if types[1].shape != wshape or types[2].shape != wshape:
                raise ShapeError(f"running statistics must be {x.dtype}[{wshape[0]}]")
        return x

    return rule


def _backward_type(types, attrs, kind: str):
    x, w, g = types
    _x_type(x)
    _check_params(x, [w], group_dims(x.shape, kind, attrs)[2], ("weight",))
    if g != x:
        raise ShapeError(f"upstream gradient {g} does not match the input {x}")
    return x


def _weight_backward_type(types, attrs, kind: str):
    x, g = types
    _x_type(x)
    if g != x:
        raise ShapeError(f"upstream gradient {g} does not match the input {x}")
    return TensorType(group_dims(x.shape, kind, attrs)[2], x.dtype)


def _update_stats_type(types, attrs):
    if len(types) not in (3, 4):
        raise ShapeError(f"expects x, running_mean, running_var[, clip], got {len(types)} operands")
    x, rm, rv = types[:3]
    _x_type(x)
    if len(types) == 4 and types[3] != TensorType((), DType.f32):
        raise ShapeError(f"clip must be f32[], got {types[3]}")
    _, m, wshape = group_dims(x.shape, "batch_norm", attrs)
    _check_params(x, [rm, rv], wshape, ("running_mean", "running_var"))
    if rm.shape != wshape or rv.shape != wshape:
        raise ShapeError(f"running statistics must be {x.dtype}[{wshape[0]}]")
    if m < 2:
        raise ShapeError(f"needs more than 1 value per channel, got input {list(x.shape)}")
    return TensorType((), DType.u32)


def _batch_stats_type(types, attrs):
    (x,) = types
    _x_type(x)
    _, m, wshape = group_dims(x.shape, "batch_norm", attrs)
    if m < 2:
        raise ShapeError(f"needs more than 1 value per channel, got input {list(x.shape)}")
    return TensorType((2, *wshape), x.dtype)


def _update_stats_into_type(types, attrs):
    if len(types) != 7:
        raise ShapeError(
            "expects stats, src_mean, src_var, mean, var, take_src, clip, got "
            f"{len(types)} operands"
        )
    stats = types[0]
    c = stats.shape[-1] if stats.ndim == 2 else -1
    if stats.ndim != 2 or stats.shape[0] != 2 or not stats.dtype.is_floating:
        raise ShapeError(f"stats must be [2, C] (batch_norm_stats), got {stats}")
    for t, name in zip(types[1:5], ("src_mean", "src_var", "mean", "var"), strict=True):
        if t != TensorType((c,), stats.dtype):
            raise ShapeError(f"{name} must be {stats.dtype}[{c}], got {t}")
    for t, what in zip(types[5:], ("take_src", "clip"), strict=True):
        if t != TensorType((), DType.f32):
            raise ShapeError(f"{what} must be f32[], got {t}")
    return TensorType((), DType.u32)


# ---- gradient rules ---------------------------------------------------------------------------
def _is_const(t: Tensor) -> bool:
    return t.node.op == "constant"


def _bias_grad(g: Tensor, b: Tensor, kind: str, attrs) -> Tensor | None:
    if _is_const(b):
        return None
    if b.ndim == 0 or kind in ("layer_norm", "rms_norm"):
        return g  # autodiff sums the broadcast dims back (trailing alignment holds)
    return F.sum(g, channel_axes(g.ndim, kind, attrs))


def _norm_grad(kind: str):
    def rule(node, i, o, g):
        x, w = i[0], i[1]
        attrs = node.attr_dict
        b = x.builder
        dx = b.add(f"{kind}_backward", [x, w, g], attrs)
        dw = None if _is_const(w) else b.add(f"{kind}_weight_backward", [x, g], attrs)
        if kind == "rms_norm":
            return dx, dw
        return dx, dw, _bias_grad(g, i[2], kind, attrs)

    return rule


def _batch_norm_grad(node, i, o, g):
    if node.attr("training"):
        return _norm_grad("batch_norm")(node, i, o, g)
    x, mean, var, w, bias = i
    attrs = node.attr_dict
    shape = (x.shape[1],) + (1,) * (x.ndim - 2)
    inv = 1.0 / F.sqrt(F.reshape(var, shape) + attrs["eps"])
    dw = None
    if not _is_const(w):
        gx = g * ((x - F.reshape(mean, shape)) * inv)
        dw = gx if w.ndim == 0 else F.sum(gx, channel_axes(x.ndim, "batch_norm", attrs))
    scale = inv * (w if w.ndim == 0 else F.reshape(w, shape))
    return g * scale, None, None, dw, _bias_grad(g, bias, "batch_norm", attrs)


def _defs() -> list[OpDef]:
    out = []
    for kind in KINDS:
        grad = _batch_norm_grad if kind == "batch_norm" else _norm_grad(kind)
        out.append(OpDef(kind, _norm_type(kind), norm_np(kind), grad))
        out.append(
            OpDef(
                f"{kind}_backward",
                lambda t, a, k=kind: _backward_type(t, a, k),
                backward_np(kind),
                differentiable=False,
                arity=3,
            )
        )
        out.append(
            OpDef(
                f"{kind}_weight_backward",
                lambda t, a, k=kind: _weight_backward_type(t, a, k),
                weight_backward_np(kind),
                differentiable=False,
                arity=2,
            )
        )
    out.append(
        OpDef(
            "batch_norm_update_stats",
            _update_stats_type,
            update_stats_np,
            differentiable=False,
            writes=(1, 2),
        )
    )
    out.append(
        OpDef("batch_norm_stats", _batch_stats_type, batch_stats_np, differentiable=False, arity=1)
    )
    out.append(
        OpDef(
            "batch_norm_update_stats_into",
            _update_stats_into_type,
            update_stats_into_np,
            differentiable=False,
            writes=(3, 4),
            arity=7,
        )
    )
    return out


DEFS: list[OpDef] = _defs() + DROPOUT_DEFS


# ---- user functions ---------------------------------------------------------------------------
class _Call:
    """One call of a user-facing norm, for its error messages: the function's name, its input
    and its other arguments as the user passed them (those left None are not shown)."""

    def __init__(self, fn: str, input: Tensor, **args) -> None:  # noqa: A002
        self.fn, self.input = fn, input
        self.args = {k: v for k, v in args.items() if v is not None}

    def error(self, message: str, error: type[Exception] = ValueError) -> Exception:
        return op_error(self.fn, [self.input], self.args, message, error)


def _param(p: Tensor | None, call: _Call, default: float, shape, name: str, of: str) -> Tensor:
    """``p`` checked to be a Tensor of the input's graph shaped ``shape`` (``of`` says where
    that shape comes from), or the scalar ``default`` when None."""
    like = call.input
    if p is None:
        return like.builder.constant(default, like.dtype)
    if not isinstance(p, Tensor) or p.builder is not like.builder:
        raise call.error(f"{name} must be a Tensor of the input's graph or None", TypeError)
    if p.shape != tuple(shape):
        raise call.error(f"{name} must have shape {list(shape)} ({of}), got {p.type}")
    return p


def _normalized(call: _Call, normalized_shape) -> tuple[int, ...]:
    x = call.input
    if not isinstance(x, Tensor):
        raise call.error(f"input must be a Tensor, got {x!r}", TypeError)
    ns = (normalized_shape,) if isinstance(normalized_shape, int) else tuple(normalized_shape)
    ns = tuple(int(s) for s in ns)
    if not ns:
        raise call.error("normalized_shape must name at least one dim")
    if len(ns) > x.ndim:
        raise call.error(f"normalized_shape {list(ns)} has more dims than the input {x.type}")
    if x.shape[x.ndim - len(ns) :] != ns:
        raise call.error(
            f"normalized_shape {list(ns)} must be the input's trailing dims, which are "
            f"{list(x.shape[x.ndim - len(ns) :])}"
        )
    return ns


def layer_norm(
    input: Tensor,  # noqa: A002
    normalized_shape: int | tuple[int, ...],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Layer normalization over the trailing dims (torch.nn.functional.layer_norm).

    ``y = (x - mean) / sqrt(var + eps) * weight + bias`` with mean and biased variance over
    the last ``len(normalized_shape)`` dims (Ba et al., "Layer Normalization", 2016).

    Args:
        input: floating tensor [*, *normalized_shape].
        normalized_shape: the trailing dims to normalize over (an int for one dim).
        weight, bias: tensors shaped ``normalized_shape``, or None (1 and 0).
        eps: added to the variance.

    Returns:
        A tensor shaped and typed like ``input``.

    Raises:
        ValueError: when ``normalized_shape`` is not the input's trailing dims, or weight/bias
            have another shape.
    """
    call = _Call("layer_norm", input, normalized_shape=normalized_shape, weight=weight, bias=bias)
    ns = _normalized(call, normalized_shape)
    w = _param(weight, call, 1.0, ns, "weight", "normalized_shape")
    b = _param(bias, call, 0.0, ns, "bias", "normalized_shape")
    attrs = {"normalized_ndim": len(ns), "eps": float(eps)}
    return input.builder.add("layer_norm", [input, w, b], attrs)


def rms_norm(
    input: Tensor,  # noqa: A002
    normalized_shape: int | tuple[int, ...],
    weight: Tensor | None = None,
    eps: float | None = None,
) -> Tensor:
    """Root-mean-square normalization (torch.nn.functional.rms_norm).

    ``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims
    (Zhang & Sennrich, "Root Mean Square Layer Normalization", 2019).

    Args:
        input: floating tensor [*, *normalized_shape].
        normalized_shape: the trailing dims to normalize over.
        weight: tensor shaped ``normalized_shape`` or None.
        eps: added to the mean square; None means float32's machine epsilon, as PyTorch.

    Raises:
        ValueError: as ``layer_norm``.
    """
    call = _Call("rms_norm", input, normalized_shape=normalized_shape, weight=weight)
    ns = _normalized(call, normalized_shape)
    w = _param(weight, call, 1.0, ns, "weight", "normalized_shape")
    eps = RMS_EPS_F32 if eps is None else float(eps)
    return input.builder.add("rms_norm", [input, w], {"normalized_ndim": len(ns), "eps": eps})


def group_norm(
    input: Tensor,  # noqa: A002
    num_groups: int,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
) -> Tensor:
    """Group normalization (torch.nn.functional.group_norm; Wu & He, 2018).

    The C channels of ``input [N, C, *]`` are split into ``num_groups`` consecutive groups;
    each (sample, group) is normalized with its mean and biased variance, then
    ``weight[c]``, ``bias[c]`` are applied per channel.

    Raises:
        ValueError: when the input has fewer than 2 dims, ``num_groups`` does not divide C,
            or weight/bias are not [C].
    """
    call = _Call("group_norm", input, num_groups=num_groups, weight=weight, bias=bias)
    if not isinstance(input, Tensor):
        raise call.error(f"input must be a Tensor, got {input!r}", TypeError)
    if input.ndim < 2:
        raise call.error(f"input must be [N, C, *], got {input.type}")
    if not isinstance(num_groups, int) or num_groups < 1:
        raise call.error(f"num_groups must be an int >= 1, got {num_groups!r}")
    c = input.shape[1]
    if c % num_groups:
        raise call.error(f"num_groups {num_groups} does not divide the input's {c} channels")
    w = _param(weight, call, 1.0, (c,), "weight", "one per channel")
    b = _param(bias, call, 0.0, (c,), "bias", "one per channel")
    attrs = {"num_groups": num_groups, "eps": float(eps)}
    return input.builder.add("group_norm", [input, w, b], attrs)


def batch_norm(
    input: Tensor,  # noqa: A002
    running_mean: Tensor | None,
    running_var: Tensor | None,
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    training: bool = False,
    momentum: float = 0.1,
    eps: float = 1e-5,
) -> Tensor:
    """Batch normalization over ``input [N, C, *]`` per channel (torch.nn.functional.batch_norm;
    Ioffe & Szegedy, 2015).

    Training: normalizes with the batch mean and biased variance over (N, *) and, when running
    statistics are given, appends ``batch_norm_update_stats``, which updates them in place
    within the same step: ``running = (1 - momentum) * running + momentum * stat`` with the
    unbiased variance. Eval: normalizes with the running statistics.

    Args:
        running_mean, running_var: f32[C] ``state`` leaves (``GraphBuilder.state``; state is
            zero at start, so load running_var = 1 as PyTorch initializes it), or None in
            training mode.
        weight, bias: [C] or None.
        momentum: the running-average factor (None, PyTorch's cumulative average, is not
            supported).

    Raises:
        ValueError: bad shapes, statistics missing in eval mode, running statistics that are
            not state leaves in training mode, or a single value per channel in training
            mode (PyTorch raises too).
        NotImplementedError: ``momentum=None``.
    """
    call = _Call(
        "batch_norm",
        input,
        running_mean=running_mean,
        running_var=running_var,
        weight=weight,
        bias=bias,
        training=training,
    )
    if not isinstance(input, Tensor):
        raise call.error(f"input must be a Tensor, got {input!r}", TypeError)
    if input.ndim < 2:
        raise call.error(f"input must be [N, C, *], got {input.type}")
    c = input.shape[1]
    w = _param(weight, call, 1.0, (c,), "weight", "one per channel")
    b = _param(bias, call, 0.0, (c,), "bias", "one per channel")
    stats = [running_mean, running_var]
    for s, name in zip(stats, ("running_mean", "running_var")):
        if s is not None:
            _param(s, call, 0.0, (c,), name, "one per channel")
    attrs = {"training": bool(training), "eps": float(eps)}
    if not training:
        if running_mean is None or running_var is None:
            raise call.error("eval mode (training=False) needs running_mean and running_var")
        return input.builder.add("batch_norm", [input, running_mean, running_var, w, b], attrs)
    if input.type.numel // c <= 1:
        raise call.error(f"expected more than 1 value per channel when training, got {input.type}")
    if (running_mean is None) != (running_var is None):
        raise call.error("give both running_mean and running_var, or neither")
    out = input.builder.add("batch_norm", [input, w, b], attrs)
    if running_mean is not None:
        if momentum is None:
            raise NotImplementedError("momentum=None (cumulative moving average) is not supported")
        for s in stats:
            if s.node.op != "state":
                raise call.error(f"running statistics must be state leaves to be updated: {s!r}")
        input.builder.add(
            "batch_norm_update_stats",
            [input, running_mean, running_var],
            {"momentum": float(momentum)},
        )
    return out

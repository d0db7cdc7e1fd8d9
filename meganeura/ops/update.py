"""Optimizer update ops: in-place writes to a parameter and its optimizer state, and the
gradient accumulator of micro-batch training.

Inputs are ``(param, grad, hyper, clip, *state)``:
  * ``hyper`` is the per-step f32 vector the host computes (learning rate and bias
    corrections), so the schedule can change every step without recompiling;
  * ``clip`` is an f32[] coefficient that multiplies the gradient (1.0 without clipping;
    ``min(1, max_norm / (total_norm + 1e-6))`` with it, as torch.nn.utils.clip_grad_norm_).
The op's value is an unused token (u32[]); what matters is the write to ``param`` and state.

Formulas follow torch.optim (single-tensor implementations, PyTorch 2.x docs):
  sgd:  d = g + wd*p;  buf = d if first step else momentum*buf + (1-dampening)*d;
        d = d + momentum*buf (nesterov) or buf;  p -= lr*d.         hyper = [lr, first_step]
  adam: g += wd*p (Adam) or p *= 1 - lr*wd (AdamW);  m += (1-b1)*(g-m);
        v = b2*v + (1-b2)*g*g;  p -= step_size * m / (sqrt(v)/bc2_sqrt + eps)
        with step_size = lr/(1-b1^t), bc2_sqrt = sqrt(1-b2^t).
        hyper = [lr, step_size, bc2_sqrt]

``accumulate(acc, value, first)`` is the effect op of gradient accumulation (``optim.accumulate``):
``acc = value if first else acc + value``, with ``first`` an f32[] flag the host feeds (nonzero on
a step's first micro-batch). Overwriting on the first micro-batch instead of zeroing after the
update means an accumulator never needs clearing: a step that fails half way leaves nothing
behind for the next one, and NaN or inf from an earlier step cannot leak in.

The non-finite guard (``optim.guard``; PyTorch's GradScaler ``found_inf``):
  * a non-finite ``clip`` (by bit pattern) makes an update op write nothing: parameter and
    state keep their bits (torch's fused optimizers skip on ``found_inf`` likewise);
  * ``guard_clip(clip, skipped, reset, *checked)`` (attr ``sticky``) is ``clip``, or NaN when
    some ``checked`` scalar (the loss, the gradients' sum of squares) is non-finite, or, with
    ``sticky``, when ``skipped`` (steps skipped since the host's last read) is nonzero and
    ``reset`` is 0: once tripped, later steps are skipped too until the host reads;
  * ``found_inf(*xs)`` is f32[]: inf when an element of some ``xs`` (the gradients) is inf or
    NaN, else 0 (one pass over every element, as GradScaler's ``found_inf``; two kernels);
  * ``guard_count(skipped, clip, reset)`` is the effect op counting skipped steps:
    ``skipped = (0 if reset else skipped) + (1 if clip is non-finite else 0)``.
Non-finite means exponent bits all ones (``bits & 0x7f800000 == 0x7f800000``): WGSL compilers
may assume floats are finite, so the kernels never test ``x != x``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.ir import TensorType
from .registry import OpDef, ShapeError

TOKEN = TensorType((), DType.u32)


def _update_type(n_state: int, n_hyper: int):
    def rule(types, attrs):
        if len(types) != 4 + n_state:
            raise ShapeError(f"expects {4 + n_state} operands, got {len(types)}")
        p, g, hyper, clip = types[:4]
        if not p.dtype.is_floating:
            raise ShapeError(f"parameter must be floating, got {p}")
        if g != p:
            raise ShapeError(f"gradient {g} does not match parameter {p}")
        if hyper != TensorType((n_hyper,), DType.f32):
            raise ShapeError(f"hyper must be f32[{n_hyper}], got {hyper}")
        if clip != TensorType((), DType.f32):
            raise ShapeError(f"clip must be f32[], got {clip}")
        for s in types[4:]:
            if s != p:
                raise ShapeError(f"state {s} does not match parameter {p}")
        return TOKEN

    return rule


def nonfinite(x) -> bool:
    """Whether any element of ``x`` is inf or NaN, by bit pattern as the kernels test it."""
    x = np.asarray(x)
    bits = x.astype(np.float32).view(np.uint32)
    return bool(((bits & 0x7F800000) == 0x7F800000).any())


def _sgd_np(xs, a):
    p, g, hyper, clip, *state = (np.asarray(x) for x in xs)
    if nonfinite(clip):  # the guard skipped this step
        return (p, *state)
    lr, first = hyper[0], hyper[1]
    d = g * clip
    if a["maximize"]:
        d = -d
    if a["weight_decay"]:
        d = d + a["weight_decay"] * p
    if state:
        (buf,) = state
        buf = d.copy() if first else a["momentum"] * buf + (1 - a["dampening"]) * d
        d = d + a["momentum"] * buf if a["nesterov"] else buf
        return (p - lr * d).astype(p.dtype), buf.astype(p.dtype)
    return ((p - lr * d).astype(p.dtype),)


def _adam_np(xs, a):
    p, g, hyper, clip, m, v = (np.asarray(x) for x in xs)
    if nonfinite(clip):  # the guard skipped this step
        return p, m, v
    lr, step_size, bc2_sqrt = hyper[0], hyper[1], hyper[2]
    g = g * clip
    if a["maximize"]:
        g = -g
    wd = a["weight_decay"]
    if wd and a["decoupled"]:
        p = p * (1 - lr * wd)
    elif wd:
        g = g + wd * p
    m = m + (1 - a["beta1"]) * (g - m)
    v = a["beta2"] * v + (1 - a["beta2"]) * g * g
    p = p - step_size * m / (np.sqrt(v) / bc2_sqrt + a["eps"])
    return p.astype(xs[0].dtype), m.astype(xs[0].dtype), v.astype(xs[0].dtype)


def _accumulate_type(types, attrs):
    acc, value, first = types
    if not acc.dtype.is_floating:
        raise ShapeError(f"accumulator must be floating, got {acc}")
    if value != acc:
        raise ShapeError(f"value {value} does not match the accumulator {acc}")
    if first != TensorType((), DType.f32):
        raise ShapeError(f"first must be f32[], got {first}")
    return TOKEN


def _accumulate_np(xs, a):
    acc, value, first = (np.asarray(x) for x in xs)
    out = value if first != 0 else acc + value
    return (out.astype(xs[0].dtype),)


def _scalar_f32(t: TensorType, what: str) -> None:
    if t != TensorType((), DType.f32):
        raise ShapeError(f"{what} must be f32[], got {t}")


def _guard_clip_type(types, attrs):
    if len(types) < 4:
        raise ShapeError(f"expects clip, skipped, reset and checked scalars, got {len(types)}")
    for t, what in zip(types[:3], ("clip", "skipped", "reset"), strict=True):
        _scalar_f32(t, what)
    for t in types[3:]:
        _scalar_f32(t, "a checked value")
    return TensorType((), DType.f32)


def _guard_clip_np(xs, a):
    clip, skipped, reset, *checked = (np.asarray(x, np.float32) for x in xs)
    trip = any(nonfinite(c) for c in checked)
    trip = trip or (a["sticky"] and reset == 0 and skipped != 0)
    return np.array(np.nan if trip else clip, np.float32)


def _found_inf_type(types, attrs):
    if not types or not all(t.dtype.is_floating for t in types):
        raise ShapeError(f"expects floating operands, got {list(types)}")
    return TensorType((), DType.f32)


def _found_inf_np(xs, a):
    return np.array(np.inf if any(nonfinite(x) for x in xs) else 0.0, np.float32)


def _guard_count_type(types, attrs):
    for t, what in zip(types, ("skipped", "clip", "reset"), strict=True):
        _scalar_f32(t, what)
    return TOKEN


def _guard_count_np(xs, a):
    skipped, clip, reset = (np.asarray(x, np.float32) for x in xs)
    base = np.float32(0) if reset != 0 else skipped
    return (np.array(base + np.float32(nonfinite(clip)), np.float32),)


DEFS = [
    OpDef("sgd_update", _update_type(0, 2), _sgd_np, differentiable=False, writes=(0,), arity=4),
    OpDef(
        "sgd_momentum_update",
        _update_type(1, 2),
        _sgd_np,
        differentiable=False,
        writes=(0, 4),
        arity=5,
    ),
    OpDef(
        "adam_update", _update_type(2, 3), _adam_np, differentiable=False, writes=(0, 4, 5), arity=6
    ),
    OpDef(
        "accumulate", _accumulate_type, _accumulate_np, differentiable=False, writes=(0,), arity=3
    ),
    OpDef("found_inf", _found_inf_type, _found_inf_np, differentiable=False),
    OpDef("guard_clip", _guard_clip_type, _guard_clip_np, differentiable=False),
    OpDef(
        "guard_count",
        _guard_count_type,
        _guard_count_np,
        differentiable=False,
        writes=(0,),
        arity=3,
    ),
]

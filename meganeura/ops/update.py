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


def _sgd_np(xs, a):
    p, g, hyper, clip, *state = (np.asarray(x) for x in xs)
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
]

"""Elementwise ops: unary math, binary arithmetic with NumPy broadcasting, comparisons,
``where`` and ``cast``.

Binary ops require equal dtypes (no implicit promotion) and broadcast shapes by NumPy's rule
(https://numpy.org/doc/stable/user/basics.broadcasting.html). Gradients are written for the
broadcast shape; autodiff sums them back to each operand's shape in one central place.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def broadcast_shapes(*shapes: tuple[int, ...]) -> tuple[int, ...]:
    """NumPy broadcasting of shapes.

    Raises:
        ShapeError: when two dims differ and neither is 1.
    """
    ndim = max(len(s) for s in shapes)
    out = []
    for i in range(ndim):
        dims = {s[len(s) - ndim + i] for s in shapes if len(s) - ndim + i >= 0}
        dims.discard(1)
        if len(dims) > 1:
            raise ShapeError(
                f"shapes {' and '.join(str(list(s)) for s in shapes)} do not broadcast"
            )
        out.append(dims.pop() if dims else 1)
    return tuple(out)


def _float_unary(types, attrs):
    (t,) = types
    if not t.dtype.is_floating:
        raise ShapeError(f"expects a floating-point operand, got {t.dtype}")
    return t


def _numeric_unary(types, attrs):
    (t,) = types
    if t.dtype is DType.bool:
        raise ShapeError("expects a numeric operand, got bool")
    return t


def _binary(types, attrs):
    a, b = types
    if a.dtype is not b.dtype:
        raise ShapeError(f"dtype mismatch {a.dtype} vs {b.dtype}; cast one operand explicitly")
    if a.dtype is DType.bool:
        raise ShapeError("arithmetic on bool; cast to a numeric dtype first")
    return TensorType(broadcast_shapes(a.shape, b.shape), a.dtype)


def _compare(types, attrs):
    a, b = types
    if a.dtype is not b.dtype:
        raise ShapeError(f"dtype mismatch {a.dtype} vs {b.dtype}")
    return TensorType(broadcast_shapes(a.shape, b.shape), DType.bool)


def _where(types, attrs):
    c, a, b = types
    if c.dtype is not DType.bool:
        raise ShapeError(f"condition must be bool, got {c.dtype}")
    if a.dtype is not b.dtype:
        raise ShapeError(f"branch dtypes differ: {a.dtype} vs {b.dtype}")
    return TensorType(broadcast_shapes(c.shape, a.shape, b.shape), a.dtype)


def _cast(types, attrs):
    (t,) = types
    return TensorType(t.shape, DType(attrs["dtype"]))


def _sigmoid_np(x):
    # Split by sign so exp never overflows (float64 reference keeps full accuracy).
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


def _zero_like_where(cond, g):
    return F.where(cond, g, F.zero(g))


def _tie_split(a_wins, b_wins, g):
    """Gradients of maximum/minimum: the winner takes g, a tie gives each operand g/2."""
    half = g * 0.5
    return (
        F.where(a_wins, g, F.where(b_wins, F.zero(g), half)),
        F.where(b_wins, g, F.where(a_wins, F.zero(g), half)),
    )


DEFS = [
    OpDef("neg", _numeric_unary, lambda x, a: -x[0], lambda n, i, o, g: (-g,), arity=1),
    OpDef("exp", _float_unary, lambda x, a: np.exp(x[0]), lambda n, i, o, g: (g * o,), arity=1),
    OpDef("log", _float_unary, lambda x, a: np.log(x[0]), lambda n, i, o, g: (g / i[0],), arity=1),
    OpDef(
        "sqrt",
        _float_unary,
        lambda x, a: np.sqrt(x[0]),
        lambda n, i, o, g: (g / (o * 2.0),),
        arity=1,
    ),
    OpDef(
        "relu",
        _float_unary,
        lambda x, a: np.maximum(x[0], 0).astype(x[0].dtype),
        lambda n, i, o, g: (_zero_like_where(i[0] > 0.0, g),),
        arity=1,
    ),
    OpDef(
        "tanh",
        _float_unary,
        lambda x, a: np.tanh(x[0]),
        lambda n, i, o, g: (g * (1.0 - o * o),),
        arity=1,
    ),
    OpDef(
        "sigmoid",
        _float_unary,
        lambda x, a: _sigmoid_np(x[0]),
        lambda n, i, o, g: (g * o * (1.0 - o),),
        arity=1,
    ),
    OpDef("add", _binary, lambda x, a: x[0] + x[1], lambda n, i, o, g: (g, g), arity=2),
    OpDef("sub", _binary, lambda x, a: x[0] - x[1], lambda n, i, o, g: (g, -g), arity=2),
    OpDef(
        "mul", _binary, lambda x, a: x[0] * x[1], lambda n, i, o, g: (g * i[1], g * i[0]), arity=2
    ),
    OpDef(
        "div",
        _binary,
        lambda x, a: x[0] / x[1],
        lambda n, i, o, g: (g / i[1], -(g * o) / i[1]),
        arity=2,
    ),
    # Ties split the gradient equally between the operands, as torch.maximum/minimum do.
    OpDef(
        "maximum",
        _binary,
        lambda x, a: np.maximum(x[0], x[1]),
        lambda n, i, o, g: _tie_split(F.greater(i[0], i[1]), F.less(i[0], i[1]), g),
        arity=2,
    ),
    OpDef(
        "minimum",
        _binary,
        lambda x, a: np.minimum(x[0], x[1]),
        lambda n, i, o, g: _tie_split(F.less(i[0], i[1]), F.greater(i[0], i[1]), g),
        arity=2,
    ),
    OpDef("greater", _compare, lambda x, a: x[0] > x[1], differentiable=False, arity=2),
    OpDef("greater_equal", _compare, lambda x, a: x[0] >= x[1], differentiable=False, arity=2),
    OpDef("less", _compare, lambda x, a: x[0] < x[1], differentiable=False, arity=2),
    OpDef("less_equal", _compare, lambda x, a: x[0] <= x[1], differentiable=False, arity=2),
    OpDef("eq", _compare, lambda x, a: x[0] == x[1], differentiable=False, arity=2),
    OpDef("ne", _compare, lambda x, a: x[0] != x[1], differentiable=False, arity=2),
    OpDef(
        "where",
        _where,
        lambda x, a: np.where(x[0], x[1], x[2]),
        lambda n, i, o, g: (None, F.where(i[0], g, F.zero(g)), F.where(i[0], F.zero(g), g)),
        arity=3,
    ),
    OpDef(
        "cast",
        _cast,
        lambda x, a: x[0].astype(DType(a["dtype"]).numpy),
        lambda n, i, o, g: (F.cast(g, i[0].dtype) if i[0].dtype.is_floating else None,),
        arity=1,
    ),
]

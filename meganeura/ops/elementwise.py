"""Elementwise ops: unary math, binary arithmetic with NumPy broadcasting, comparisons,
logical ops, ``isneginf``, ``pow``, ``clamp``, ``where`` and ``cast``; activations live in
``activation``, whose ``DEFS`` are appended here and whose functions are re-exported.

Binary IR ops require equal dtypes (the user functions promote first, inserting casts:
``functional.promote_operands``) and broadcast shapes by NumPy's rule
(https://numpy.org/doc/stable/user/basics.broadcasting.html). Gradients are written for the
broadcast shape; autodiff sums them back to each operand's shape in one central place.
Semantics are PyTorch's where it differs from NumPy (``sign`` of NaN is 0, ``clamp`` with
``min > max`` gives ``max``, ``pow`` and its gradients at 0). The user-facing functions at the
end carry PyTorch's names, some shadowing builtins (``abs``, ``pow``) inside this module.
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor, check_fill_value, op_error
from ..graph.ir import TensorType
from . import activation
from . import functional as F
from .activation import gelu, leaky_relu, sigmoid_np, silu, softplus  # noqa: F401 (re-exported)
from .registry import OpDef, ShapeError
from .registry import float_unary as _float_unary


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


def _tie_split(a, b, a_wins, b_wins, g):
    """Gradients of maximum/minimum: the loser gets 0, a tie gives each operand g/2, and
    otherwise (a winner, or a NaN operand) the operand gets g: torch's
    ``where(a == b, g / 2, g).masked_fill_(a < b, 0)``, so a NaN passes g to both operands."""
    half = g * 0.5
    tie = F.eq(a, b)
    return (
        F.where(b_wins, F.zero(g), F.where(tie, half, g)),
        F.where(a_wins, F.zero(g), F.where(tie, half, g)),
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
        # torch's threshold_backward: 0 where x <= 0, else g (so g at a NaN input)
        lambda n, i, o, g: (F.where(i[0] <= 0.0, F.zero(g), g),),
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
        lambda x, a: sigmoid_np(x[0]),
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
        lambda n, i, o, g: _tie_split(i[0], i[1], F.greater(i[0], i[1]), F.less(i[0], i[1]), g),
        arity=2,
    ),
    OpDef(
        "minimum",
        _binary,
        lambda x, a: np.minimum(x[0], x[1]),
        lambda n, i, o, g: _tie_split(i[0], i[1], F.less(i[0], i[1]), F.greater(i[0], i[1]), g),
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


# ---- math ops added for the workloads and torch parity ----------------------------------------
def _float_binary(types, attrs):
    a, b = types
    if a.dtype is not b.dtype or not a.dtype.is_floating:
        raise ShapeError(f"expects two floating operands of one dtype, got {a.dtype} and {b.dtype}")
    return TensorType(broadcast_shapes(a.shape, b.shape), a.dtype)


def _logical(types, attrs):
    if len({t.dtype for t in types}) > 1:
        raise ShapeError(f"dtype mismatch {' vs '.join(str(t.dtype) for t in types)}")
    return TensorType(broadcast_shapes(*(t.shape for t in types)), DType.bool)


def _clamp_type(types, attrs):
    (t,) = types
    if t.dtype is DType.bool:
        raise ShapeError("clamp of bool; cast to a numeric dtype first")
    bound_type = float if t.dtype.is_floating else int
    for k in ("min", "max"):
        v = attrs.get(k)
        if v is not None and (type(v) is not bound_type or (t.dtype is DType.u32 and v < 0)):
            raise ShapeError(f"clamp {k}={v!r} is not a valid {bound_type.__name__} for {t.dtype}")
    return t


def _float_test(types, attrs):
    (t,) = types
    if not t.dtype.is_floating:
        raise ShapeError(f"expects a floating-point operand, got {t.dtype}")
    return TensorType(t.shape, DType.bool)


def _sign_np(x):
    return (x > 0).astype(x.dtype) - (x < 0).astype(x.dtype)  # 0 for NaN, as torch.sign


_erf_vec = np.vectorize(math.erf, otypes=[np.float64])


def _erf_np(x):
    return _erf_vec(x).astype(x.dtype)


def _pow_np(a, b):
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        return np.power(a, b)


def _clamp_np(x, attrs):
    if attrs.get("min") is not None:
        x = np.maximum(x, attrs["min"])
    if attrs.get("max") is not None:
        x = np.minimum(x, attrs["max"])
    return x


def _constant_value(t: Tensor) -> float | None:
    return float(t.node.attr("value")) if t.node.op == "constant" else None


def _pow_grad(n, i, o, g):
    """torch's pow_backward_self / pow_backward_exponent: ``b * a^(b-1)`` (0 where b == 0)
    and ``out * log(a)`` (0 where a == 0 and b >= 0)."""
    a, b = i
    e = _constant_value(b)
    if e is not None:  # tensor ** scalar: exponent arithmetic in Python, no grad for b
        if e == 0.0:
            return None, None
        if e in (1.0, 2.0):
            return (g if e == 1.0 else g * (a * 2.0)), None
        return g * (pow(a, e - 1.0) * e), None
    ga = g * F.where(F.eq(b, 0.0), 0.0, b * pow(a, b - 1.0))
    c = _constant_value(a)
    if c is not None and c > 0.0:  # scalar ** tensor
        return None, g * (o * math.log(c))
    zero_base = logical_and(F.eq(a, 0.0), F.greater_equal(b, 0.0))
    return ga, g * F.where(zero_base, 0.0, o * F.log(a))


def _clamp_grad(n, i, o, g):
    """Gradient passes where ``min <= x <= max`` (bounds included, as torch.clamp)."""
    x, lo, hi = i[0], n.attr("min"), n.attr("max")
    inside = None if lo is None else F.greater_equal(x, lo)
    if hi is not None:
        le = F.less_equal(x, hi)
        inside = le if inside is None else logical_and(inside, le)
    return (F.where(inside, g, 0.0),)


def _math(name, infer, ref, grad=None) -> OpDef:
    return OpDef(name, infer, lambda x, a: ref(x[0]), grad, grad is not None, arity=1)


_TWO_OVER_SQRT_PI = 2.0 / math.sqrt(math.pi)
MATH_DEFS = [
    _math("abs", _numeric_unary, np.abs, lambda n, i, o, g: (g * sign(i[0]),)),
    _math("sign", _numeric_unary, _sign_np),
    _math("reciprocal", _float_unary, lambda x: 1 / x, lambda n, i, o, g: ((g * o) * (-o),)),
    # d/dx x^-1/2 = -x^-3/2 / 2 = out / (-2 x)
    _math("rsqrt", _float_unary, lambda x: 1 / np.sqrt(x),
          lambda n, i, o, g: ((g * o) / (i[0] * -2.0),)),
    _math("sin", _float_unary, np.sin, lambda n, i, o, g: (g * cos(i[0]),)),
    _math("cos", _float_unary, np.cos, lambda n, i, o, g: (-g * sin(i[0]),)),
    _math("erf", _float_unary, _erf_np,
          lambda n, i, o, g: (g * (F.exp(i[0] * (-i[0])) * _TWO_OVER_SQRT_PI),)),
    _math("log1p", _float_unary, np.log1p, lambda n, i, o, g: (g / (i[0] + 1.0),)),
    _math("expm1", _float_unary, np.expm1, lambda n, i, o, g: (g * (o + 1.0),)),
    _math("floor", _float_unary, np.floor),  # no gradient flows (torch's is zero)
    _math("logical_not", _logical, np.logical_not),
    _math("isneginf", _float_test, np.isneginf),
    OpDef("pow", _float_binary, lambda x, a: _pow_np(x[0], x[1]), _pow_grad, arity=2),
    OpDef("clamp", _clamp_type, lambda x, a: _clamp_np(x[0], a), _clamp_grad, arity=1),
    *(
        OpDef(f"logical_{k}", _logical, lambda x, a, f=f: f(x[0], x[1]), differentiable=False,
              arity=2)
        for k, f in (("and", np.logical_and), ("or", np.logical_or), ("xor", np.logical_xor))
    ),
]  # fmt: skip
DEFS += MATH_DEFS + activation.DEFS


# ---- user-facing functions (torch names; re-exported by meganeura.ops.functional) -------------
def _unary(op: str, x: Tensor, attrs: dict | None = None) -> Tensor:
    return x.builder.add(op, [x], attrs)


def abs(input: Tensor) -> Tensor:  # noqa: A001, A002 - PyTorch's names
    """``|x|`` (torch.abs), f32/i32/u32, any shape; gradient ``sign(x)`` (0 at 0, as torch).

    Raises:
        GraphTypeError: for bool.
    """
    return _unary("abs", input)


def sign(input: Tensor) -> Tensor:  # noqa: A002
    """-1, 0 or 1 by the sign of x (torch.sign: 0 for +-0 and NaN), same dtype; no gradient
    flows through it (torch's is zero).

    Raises:
        GraphTypeError: for bool.
    """
    return _unary("sign", input)


def reciprocal(input: Tensor) -> Tensor:  # noqa: A002
    """``1 / x`` (torch.reciprocal), f32; gradient ``-1/x^2``."""
    return _unary("reciprocal", input)


def rsqrt(input: Tensor) -> Tensor:  # noqa: A002
    """``1 / sqrt(x)`` (torch.rsqrt), f32; inf at 0, NaN below; gradient ``-x^-1.5 / 2``."""
    return _unary("rsqrt", input)


def sin(input: Tensor) -> Tensor:  # noqa: A002
    """``sin(x)`` (torch.sin), f32; within 1e-7 absolute for ``|x| <= 8192`` on every adapter
    (Cephes range reduction in the kernel), less accurate beyond."""
    return _unary("sin", input)


def cos(input: Tensor) -> Tensor:  # noqa: A002
    """``cos(x)`` (torch.cos), f32; accuracy as ``sin``."""
    return _unary("cos", input)


def erf(input: Tensor) -> Tensor:  # noqa: A002
    """The error function (torch.erf), f32, within 1 ulp (FreeBSD msun's erff); gradient
    ``2/sqrt(pi) * exp(-x^2)``."""
    return _unary("erf", input)


def log1p(input: Tensor) -> Tensor:  # noqa: A002
    """``log(1 + x)`` accurate for tiny x (torch.log1p), f32; gradient ``1 / (1 + x)``."""
    return _unary("log1p", input)


def expm1(input: Tensor) -> Tensor:  # noqa: A002
    """``exp(x) - 1`` accurate for tiny x (torch.expm1), f32; gradient ``exp(x)``."""
    return _unary("expm1", input)


def pow(input, exponent) -> Tensor:  # noqa: A001, A002
    """``input ** exponent`` elementwise with broadcasting and type promotion (torch.pow);
    either operand may be a Python number.

    Floating results (f32): a negative base with an integer exponent keeps the sign of odd
    powers, with a non-integer exponent gives NaN; ``x ** 0`` is 1; ``0 ** b`` is 0 (b > 0) or
    inf (b < 0). Gradients (torch's pow_backward): ``b * a^(b-1)`` for the base (0 where
    b == 0), and ``out * log(a)`` for the exponent (0 where a == 0 and b >= 0). Integer
    results (an i32 tensor to a Python int power) are exact products, wrapping on overflow as
    torch's.

    Raises:
        TypeError: when neither operand is a Tensor.
        GraphTypeError: shapes that do not broadcast; an integer result with a tensor
            exponent (not implemented: cast to f32) or a negative exponent (torch raises too).
    """
    dtype, (a, b) = F.promote_operands("pow", input, exponent)
    if dtype.is_floating:
        return a.builder.add("pow", [a, b])
    if F.scalar_dtype(input) is not None or F.scalar_dtype(exponent) not in (DType.i32, DType.bool):
        raise op_error("pow", [input, exponent], None, f"an integer power with a tensor "
                       f"exponent is not implemented for {dtype}; cast to f32 first")  # fmt: skip
    e = int(exponent)
    if e < 0:
        raise op_error("pow", [input, exponent], None,
                       "integers to negative integer powers are not allowed")  # fmt: skip
    out = None
    while e:  # square and multiply: exact in the integer dtype
        if e & 1:
            out = a if out is None else a.builder.add("mul", [out, a])
        e >>= 1
        if e:
            a = a.builder.add("mul", [a, a])
    return F.broadcast_to(a.builder.constant(1, dtype), a.shape) if out is None else out


def clamp(input: Tensor, min=None, max=None) -> Tensor:  # noqa: A001, A002
    """``min(max(x, min), max)`` (torch.clamp): NaN stays NaN, ``min > max`` gives ``max``
    everywhere; the gradient passes where ``min <= x <= max`` (bounds included). Scalar
    bounds are attributes of one ``clamp`` node; an integer tensor with a float bound is
    clamped in f32 (torch's promotion); an infinite bound that clips nothing is dropped.
    Tensor bounds (broadcast, promoted with ``x``) are ``where(x < min, min, x)`` then
    ``where(y > max, max, y)``; a bound gets the gradient where it is the result.

    Raises:
        ValueError: when both bounds are None, or a scalar bound is NaN or would clip to inf,
            or is finite beyond the dtype's range (1e39 for f32: PyTorch refuses it too,
            ``check_fill_value``).
    """
    if min is None and max is None:
        raise ValueError("clamp: at least one of min and max must not be None")
    if isinstance(min, Tensor) or isinstance(max, Tensor):
        bounds = [v for v in (min, max) if v is not None]
        _, (x, *ops) = F.promote_operands("clamp", input, *bounds)
        if min is not None:
            lo = ops.pop(0)
            x = F.where(F.less(x, lo), lo, x)
        if max is not None:
            x = F.where(F.greater(x, ops[0]), ops[0], x)
        return x
    if not input.dtype.is_floating and any(F.scalar_dtype(v) is DType.f32 for v in (min, max)):
        input = F.cast(input, DType.f32)  # torch.clamp(int_tensor, min=0.5) is float
    attrs = {}
    for key, v, drop in (("min", min, -math.inf), ("max", max, math.inf)):
        if v is None:
            continue
        check_fill_value("clamp", v, input.dtype, [input], key)
        if math.isnan(v) or (math.isinf(v) and v != drop):
            raise ValueError(f"clamp: {key}={v!r} is not representable in a kernel")
        if v == drop:
            continue
        attrs[key] = float(v) if input.dtype.is_floating else int(v)
    return _unary("clamp", input, attrs) if attrs else input


def _logical_op(op: str, a, b) -> Tensor:
    _, ops = F.promote_operands(op, a, b)
    return ops[0].builder.add(op, ops)


def logical_and(input, other) -> Tensor:  # noqa: A002
    """Elementwise ``input != 0 and other != 0`` as bool, broadcasting (torch.logical_and);
    operands of different dtypes are compared in their promoted dtype."""
    return _logical_op("logical_and", input, other)


def logical_or(input, other) -> Tensor:  # noqa: A002
    """Elementwise ``input != 0 or other != 0`` as bool (torch.logical_or)."""
    return _logical_op("logical_or", input, other)


def logical_xor(input, other) -> Tensor:  # noqa: A002
    """Elementwise ``(input != 0) != (other != 0)`` as bool (torch.logical_xor)."""
    return _logical_op("logical_xor", input, other)


def isneginf(input: Tensor) -> Tensor:  # noqa: A002
    """True where ``input`` is -inf (torch.isneginf), as bool; no gradient.

    The kernel compares the bit pattern, never the value: shader compilers may assume floats
    are finite and fold ``x < -FLT_MAX`` to false.

    Raises:
        GraphTypeError: for a non-floating operand.
    """
    return _unary("isneginf", input)


def logical_not(input: Tensor) -> Tensor:  # noqa: A002
    """Elementwise ``input == 0`` as bool (torch.logical_not), any dtype."""
    return _unary("logical_not", input)


def floor(input: Tensor) -> Tensor:  # noqa: A002
    """The largest integer <= x (torch.floor), f32; integer tensors are returned as they are.
    No gradient flows through it (torch's is zero)."""
    return input if not input.dtype.is_floating else _unary("floor", input)


def ceil(input: Tensor) -> Tensor:  # noqa: A002
    """The smallest integer >= x (torch.ceil): ``-floor(-x)``, exact (-0.0 for (-1, 0))."""
    return input if not input.dtype.is_floating else -floor(-input)


def trunc(input: Tensor) -> Tensor:  # noqa: A002
    """x rounded toward zero (torch.trunc): ``ceil`` below 0, ``floor`` above; exact."""
    if not input.dtype.is_floating:
        return input
    return F.where(F.less(input, 0.0), ceil(input), floor(input))

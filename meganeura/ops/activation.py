"""Activation functions with PyTorch semantics: ``silu``, ``gelu`` (exact and tanh forms),
``softplus`` and ``leaky_relu``, and the backward ops of the first three.

Part of the elementwise family: ``meganeura.ops.elementwise`` appends ``DEFS`` to its own and
re-exports the functions. Each backward op computes ``grad * f'(x)`` in one kernel from the
same formula as its forward (so forward and backward never mix approximations) and is marked
not differentiable (no double backward). Formulas are those of PyTorch's CPU/CUDA kernels
(aten/src/ATen/native/cpu/Activation.cpp); the WGSL lowerings evaluate algebraically equal
forms that do not overflow or cancel (``codegen/wgsl/core/mathlib.py``). References are float64
safe: they keep their input's dtype.
"""

from __future__ import annotations

import math

import numpy as np

from ..graph.builder import Tensor
from . import functional as F
from .registry import OpDef, ShapeError
from .registry import float_unary as _float_unary

GELU_APPROXIMATIONS = ("none", "tanh")


def _grad_pair(types, attrs):
    """(output gradient, forward input): same floating type, which the result has too."""
    g, x = types
    if not x.dtype.is_floating or g != x:
        raise ShapeError(f"expects a gradient typed like the floating input, got {g} and {x}")
    return x


def sigmoid_np(x: np.ndarray) -> np.ndarray:
    """Logistic sigmoid, split by sign so exp never overflows (any float dtype)."""
    x = np.asarray(x)
    out = np.empty_like(x)
    pos = x >= 0
    out[pos] = 1.0 / (1.0 + np.exp(-x[pos]))
    ex = np.exp(x[~pos])
    out[~pos] = ex / (1.0 + ex)
    return out


_erfc = np.vectorize(math.erfc, otypes=[np.float64])
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)


def _gelu_np(x: np.ndarray, approximate: str, grad: bool = False) -> np.ndarray:
    x = np.asarray(x)
    if approximate == "tanh":
        t = np.tanh(_SQRT_2_OVER_PI * (x + 0.044715 * x**3))
        if not grad:
            return 0.5 * x * (1.0 + t)
        dt = _SQRT_2_OVER_PI * (1.0 + 3 * 0.044715 * x * x)
        return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * dt
    cdf = (0.5 * _erfc(-x.astype(np.float64) / math.sqrt(2.0))).astype(x.dtype)
    if not grad:
        return x * cdf
    return cdf + x * np.exp(-0.5 * x * x) / math.sqrt(2.0 * math.pi)


def _softplus_np(x: np.ndarray, beta: float, threshold: float) -> np.ndarray:
    t = np.asarray(x) * beta
    soft = (np.maximum(t, 0) + np.log1p(np.exp(-np.abs(t)))) / beta
    return np.where(t > threshold, x, soft)


def _silu_backward_np(g: np.ndarray, x: np.ndarray) -> np.ndarray:
    s = sigmoid_np(x)
    return g * s * (1.0 + x * (1.0 - s))


def _backward(op: str, n, x: Tensor, g: Tensor) -> Tensor:
    return g.builder.add(op, [g, x], n.attr_dict or None)


DEFS = [
    OpDef(
        "silu",
        _float_unary,
        lambda x, a: x[0] * sigmoid_np(x[0]),
        lambda n, i, o, g: (_backward("silu_backward", n, i[0], g),),
        arity=1,
    ),
    OpDef(
        "silu_backward",
        _grad_pair,
        lambda x, a: _silu_backward_np(x[0], x[1]),
        differentiable=False,
        arity=2,
    ),
    OpDef(
        "gelu",
        _float_unary,
        lambda x, a: _gelu_np(x[0], a["approximate"]),
        lambda n, i, o, g: (_backward("gelu_backward", n, i[0], g),),
        arity=1,
    ),
    OpDef(
        "gelu_backward",
        _grad_pair,
        lambda x, a: x[0] * _gelu_np(x[1], a["approximate"], grad=True),
        differentiable=False,
        arity=2,
    ),
    OpDef(
        "softplus",
        _float_unary,
        lambda x, a: _softplus_np(x[0], a["beta"], a["threshold"]),
        lambda n, i, o, g: (_backward("softplus_backward", n, i[0], g),),
        arity=1,
    ),
    OpDef(
        "softplus_backward",
        _grad_pair,
        lambda x, a: np.where(
            x[1] * a["beta"] > a["threshold"], x[0], x[0] * sigmoid_np(x[1] * a["beta"])
        ),
        differentiable=False,
        arity=2,
    ),
    OpDef(
        "leaky_relu",
        _float_unary,
        lambda x, a: np.where(x[0] > 0, x[0], x[0] * a["negative_slope"]),
        lambda n, i, o, g: (F.where(i[0] > 0.0, g, g * n.attr("negative_slope")),),
        arity=1,
    ),
]


def _finite(name: str, value) -> float:
    v = float(value)
    if not math.isfinite(v):
        raise ValueError(f"{name} must be finite, got {value!r}")
    return v


def silu(input: Tensor) -> Tensor:  # noqa: A002 - PyTorch's argument name
    """``x * sigmoid(x)`` (torch.nn.functional.silu), f32 in and out, any shape.

    Gradient ``sigmoid(x) * (1 + x * (1 - sigmoid(x)))`` (PyTorch's silu_backward), one
    kernel (``silu_backward``).

    Raises:
        GraphTypeError: for a non-floating operand.
    """
    return input.builder.add("silu", [input])


def gelu(input: Tensor, approximate: str = "none") -> Tensor:  # noqa: A002
    """Gaussian error linear unit (torch.nn.functional.gelu), f32, any shape.

    ``approximate="none"``: ``x * Phi(x)``, ``Phi(x) = (1 + erf(x / sqrt 2)) / 2`` with an f32
    erf accurate to about 1 ulp (FreeBSD msun's erff, see ``codegen/wgsl/core/mathlib.py``).
    ``approximate="tanh"``: ``0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))``. Each
    backward differentiates its own forward formula (PyTorch's GeluBackward).

    Raises:
        ValueError: for another ``approximate``.
        GraphTypeError: for a non-floating operand.
    """
    if approximate not in GELU_APPROXIMATIONS:
        raise ValueError(f"gelu: approximate must be 'none' or 'tanh', got {approximate!r}")
    return input.builder.add("gelu", [input], {"approximate": approximate})


def softplus(input: Tensor, beta: float = 1.0, threshold: float = 20.0) -> Tensor:  # noqa: A002
    """``log(1 + exp(beta x)) / beta``, and ``x`` where ``beta x > threshold``
    (torch.nn.functional.softplus), f32, any shape; gradient ``sigmoid(beta x)`` (1 above the
    threshold). Evaluated as ``max(t, 0) + log1p(exp(-|t|))``, which neither overflows nor
    loses tiny values.

    Raises:
        ValueError: for a zero or non-finite ``beta`` or a non-finite ``threshold``.
        GraphTypeError: for a non-floating operand.
    """
    beta = _finite("softplus: beta", beta)
    if beta == 0.0:
        raise ValueError("softplus: beta must be nonzero")
    attrs = {"beta": beta, "threshold": _finite("softplus: threshold", threshold)}
    return input.builder.add("softplus", [input], attrs)


def leaky_relu(input: Tensor, negative_slope: float = 0.01) -> Tensor:  # noqa: A002
    """``x`` where ``x > 0``, else ``negative_slope * x`` (torch.nn.functional.leaky_relu),
    f32, any shape; the gradient at 0 is ``negative_slope``, as PyTorch's.

    Raises:
        ValueError: for a non-finite slope.
        GraphTypeError: for a non-floating operand.
    """
    slope = _finite("leaky_relu: negative_slope", negative_slope)
    return input.builder.add("leaky_relu", [input], {"negative_slope": slope})

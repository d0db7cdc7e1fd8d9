"""Op-database entries for the elementwise ops added in issue 3: unary math (abs, sign,
reciprocal, rsqrt, sin, cos, erf, log1p, expm1), activations (silu, gelu in both forms,
softplus, leaky_relu), clamp, pow, the logical ops and isneginf (-inf, inf, NaN, -FLT_MAX and
-0.0 among its samples).

Invariants of the samples: every unary entry has sizes 1, 3, 7, 257, 1000 and a 3-d shape,
plus an edge sample (zeros, ties at the kink, tails); binary entries broadcast [3, 1, 5] with
[4, 5] and take Python numbers; inputs stay inside the domain where the op and its gradient
are finite unless the sample is forward-only (``grad=()``), which checks inf/NaN placement.
sin/cos use moderate arguments (|x| <= 100): GPUs' own sin/cos are only specified to 2^-11 on
[-pi, pi]; ours reduce like Cephes and stay within 1e-7 up to |x| = 8192 (see the codegen
tests), but torch reduces exactly at any magnitude.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as TF

from meganeura.ops import elementwise as E

from . import OpInfo, Sample

SHAPES = [(1,), (3,), (7,), (257,), (1000,), (3, 1, 5)]


def _name(shape) -> str:
    return "x".join(map(str, shape)) or "scalar"


def _unary_samples(lo, hi, edges=(), kwargs=None, ints=False, inf_nan=()):
    def samples(rng):
        kw = dict(kwargs or {})
        out = [Sample((rng.uniform(lo, hi, s),), kw, name=_name(s)) for s in SHAPES]
        if len(edges):
            out.append(Sample((np.asarray(edges, np.float64),), kw, name="edges"))
        if len(inf_nan):  # forward only: inf and NaN must land where torch puts them
            out.append(Sample((np.asarray(inf_nan, np.float64),), kw, name="inf_nan", grad=()))
        if ints:
            out.append(Sample((rng.integers(-50, 50, (257,)),), kw, name="i32"))
        return out

    return samples


def _unary(name, fn, ref, lo, hi, edges=(), ops=None, **kw) -> OpInfo:
    sample_kw = {k: kw.pop(k) for k in ("kwargs", "ints", "inf_nan") if k in kw}
    return OpInfo(name, fn, ref, _unary_samples(lo, hi, edges, **sample_kw), ops or (name,), **kw)


_ZEROS = [0.0, -0.0, 1.0, -1.0, 1e-30, -1e-30, 3.0]
_TAILS = [-60.0, -20.0, -8.0, -1e-4, 0.0, 1e-4, 8.0, 20.0, 60.0]

UNARY = [
    _unary("abs", E.abs, torch.abs, -3, 3, _ZEROS, ints=True),
    _unary("sign", E.sign, torch.sign, -3, 3, _ZEROS, ints=True, differentiable=False),
    _unary(
        "floor",
        E.floor,
        torch.floor,
        -40,
        40,
        [-2.5, -1.0, -0.5, -0.0, 0.0, 0.5, 1.0, 1.5, 8388607.5, -8388609.0, 3e38],
        inf_nan=[-np.inf, np.nan, np.inf, -1e-30],
        differentiable=False,
    ),
    _unary(
        "reciprocal",
        E.reciprocal,
        torch.reciprocal,
        0.5,
        4,
        [-4.0, -0.5, 1e-3, 1e30],
        inf_nan=[0.0, -0.0, 2.0],
    ),
    _unary(
        "rsqrt", E.rsqrt, torch.rsqrt, 1e-3, 100, [1e-6, 1.0, 4.0, 3e30], inf_nan=[0.0, -1.0, 4.0]
    ),
    _unary("sin", E.sin, torch.sin, -10, 10, [-100.0, -3.14159274, 0.0, 1e-20, 1.5707964, 99.0]),
    _unary("cos", E.cos, torch.cos, -10, 10, [-100.0, -3.14159274, 0.0, 1e-20, 1.5707964, 99.0]),
    _unary(
        "erf",
        E.erf,
        torch.erf,
        -4,
        4,
        [-10, -6, -3, -0.84375, -1e-20, 0, 1e-8, 0.5, 1.25, 2.857, 5.9, 100],
        inf_nan=[-np.inf, 0.0, np.inf],
    ),
    _unary(
        "log1p",
        E.log1p,
        torch.log1p,
        -0.99,
        10,
        [-0.5, -0.29, -1e-7, 0.0, 1e-10, 0.41, 1e6],
        inf_nan=[-1.0, -2.0, 0.5],
    ),
    _unary("expm1", E.expm1, torch.expm1, -5, 5, [-80.0, -0.5, -1e-7, 0.0, 1e-10, 0.5, 30.0]),
    _unary("silu", E.silu, TF.silu, -8, 8, _TAILS, ops=("silu", "silu_backward")),
    _unary("gelu", E.gelu, TF.gelu, -6, 6, _TAILS, ops=("gelu", "gelu_backward")),
    _unary(
        "gelu_tanh",
        E.gelu,
        TF.gelu,
        -6,
        6,
        _TAILS,
        kwargs={"approximate": "tanh"},
        ops=("gelu", "gelu_backward"),
    ),
    _unary(
        "softplus",
        E.softplus,
        TF.softplus,
        -30,
        30,
        _TAILS + [19.99, 20.01],
        ops=("softplus", "softplus_backward"),
    ),
    _unary(
        "softplus_beta",
        E.softplus,
        TF.softplus,
        -5,
        5,
        [-3.0, 0.0, 2.49, 2.51, 4.0],
        kwargs={"beta": 2.0, "threshold": 5.0},
        ops=("softplus", "softplus_backward"),
    ),
    _unary("leaky_relu", E.leaky_relu, TF.leaky_relu, -3, 3, _ZEROS, ops=("leaky_relu",)),
    _unary(
        "leaky_relu_slope",
        E.leaky_relu,
        TF.leaky_relu,
        -3,
        3,
        _ZEROS,
        kwargs={"negative_slope": 0.2},
        ops=("leaky_relu",),
    ),
]


def _clamp_samples(rng):
    grid = np.linspace(-2.0, 2.0, 17)  # hits the bounds exactly: gradient 1 there, as torch
    out = [
        Sample((rng.uniform(-3, 3, s),), {"min": -1.0, "max": 1.5}, name=_name(s)) for s in SHAPES
    ]
    return out + [
        Sample((grid,), {"min": -1.0, "max": 1.5}, name="bounds"),
        Sample((grid,), {"min": 0.5}, name="min_only"),
        Sample((grid,), {"max": -0.25}, name="max_only"),
        Sample((grid,), {"min": 1.0, "max": -1.0}, name="min_above_max"),
        Sample((rng.integers(-50, 50, (257,)),), {"min": -7, "max": 20}, name="i32"),
    ]


def _pow_samples(rng):
    def pos(shape):
        return rng.uniform(0.5, 3.0, shape)

    def expo(shape):
        return rng.uniform(-2.0, 3.0, shape)

    ints_b = rng.integers(-3, 4, (7, 33)).astype(np.float64)
    zero_base = np.array([0.0, 0.0, 0.0, 0.0, 2.0, 0.5])
    zero_expo = np.array([0.0, 1.0, 2.0, 2.5, 0.0, -1.0])
    out = [Sample((pos(s), expo(s)), name=_name(s)) for s in SHAPES[:5]]
    return out + [
        Sample((pos((3, 1, 5)), expo((4, 5))), name="bcast_3x1x5_4x5"),
        Sample((pos((4, 5)), expo((3, 1, 5))), name="bcast_4x5_3x1x5"),
        Sample((pos((257,)), 2.5), name="scalar_exponent"),
        Sample((rng.uniform(-3, 3, (257,)), 2), name="square"),
        Sample((rng.uniform(-3, 3, (257,)), 3.0), name="cube"),
        Sample((pos((257,)), 0.5), name="sqrt"),
        Sample((pos((257,)), -0.5), name="rsqrt"),
        Sample((rng.uniform(-3, 3, (257,)), -1.0), name="reciprocal"),
        Sample((pos((257,)), 0.0), name="zero_exponent"),
        Sample((2.0, expo((257,))), name="scalar_base"),
        Sample((-rng.uniform(0.5, 2.0, (7, 33)), ints_b), name="negative_base", grad=(0,)),
        Sample((zero_base, zero_expo), name="zero_base"),
        Sample(
            (
                np.array([-2.0, -0.0, 0.0, -0.0, 0.0, -8.0, 4.0]),
                np.array([0.5, 3.0, -1.0, -1.0, 0.0, 1.0 / 3.0, 1e6]),
            ),
            name="inf_nan",
            grad=(),
        ),
    ]


def _tensor_other(fn):
    """``fn`` with a Python ``other`` made a tensor (torch.logical_* take tensors only)."""

    def ref(a, b):
        return fn(a, b if isinstance(b, torch.Tensor) else torch.tensor(b))

    return ref


def _logical_samples(rng):
    def bools(shape):
        return rng.uniform(size=shape) < 0.5

    return [
        Sample((bools((1,)), bools((1,))), name="1"),
        Sample((bools((7,)), bools((7,))), name="7"),
        Sample((bools((1000,)), bools((1000,))), name="1000"),
        Sample((bools((3, 1, 5)), bools((4, 5))), name="bcast"),
        Sample((bools((257,)), True), name="python_true"),
        Sample(
            (
                rng.integers(-1, 2, (3, 257)).astype(np.float64),
                rng.integers(-1, 2, (257,)).astype(np.float64),
            ),
            name="f32_nonzero",
        ),
        Sample((rng.integers(-1, 2, (257,)), rng.integers(-1, 2, (257,))), name="i32"),
    ]


def _not_samples(rng):
    return [
        Sample((rng.uniform(size=(1000,)) < 0.5,), name="bool"),
        Sample((rng.uniform(size=(3, 1, 5)) < 0.5,), name="bool_3x1x5"),
        Sample((rng.integers(-1, 2, (257,)).astype(np.float64),), name="f32"),
        Sample((rng.integers(-1, 2, (7,)),), name="i32"),
    ]


def _isneginf_samples(rng):
    edges = np.array([-np.inf, np.inf, np.nan, -3.4028234663852886e38, 0.0, -0.0, -1.0, 2.5])
    x = rng.standard_normal(1000)
    x[rng.uniform(size=1000) < 0.3] = -np.inf
    y = rng.standard_normal((3, 1, 5))
    y[0, 0, 1] = y[2, 0, 4] = -np.inf
    return [
        Sample((edges,), name="edges"),
        Sample((x,), name="1000"),
        Sample((y,), name="3x1x5"),
    ]


OTHER = [
    OpInfo("clamp", E.clamp, torch.clamp, _clamp_samples, ("clamp",)),
    OpInfo("pow", E.pow, torch.pow, _pow_samples, ("pow",)),
    *(
        OpInfo(
            n,
            getattr(E, n),
            _tensor_other(getattr(torch, n)),
            _logical_samples,
            (n,),
            differentiable=False,
        )
        for n in ("logical_and", "logical_or", "logical_xor")
    ),
    OpInfo(
        "isneginf",
        E.isneginf,
        torch.isneginf,
        _isneginf_samples,
        ("isneginf",),
        differentiable=False,
    ),
    OpInfo(
        "logical_not",
        E.logical_not,
        torch.logical_not,
        _not_samples,
        ("logical_not",),
        differentiable=False,
    ),
]

ENTRIES: list[OpInfo] = [*UNARY, *OTHER]

"""Op-database entries for the elementwise family and the layout ops lowered beside it.

Covers ``meganeura/ops/elementwise.py`` (unary math, binary arithmetic with broadcasting,
comparisons, ``where``, ``cast``) and the layout ops of ``meganeura/ops/shape.py`` that exist
today (``permute``, ``broadcast_to``, ``reshape``, ``stop_gradient``), whose kernels live in
``codegen/wgsl/elementwise/maps.py``.

Invariants of the samples: every entry has sizes 1, 3, 7, 257, 1000, one spanning several
workgroup blocks (2113 = 2 * 1024 + 65) so tails are exercised, and an empty tensor; inputs
stay inside the op's domain (log/sqrt strictly positive, exp below overflow, divisors away
from 0); tie cases (relu at 0, maximum/minimum of equal values, comparisons of equal values)
are present where the gradient or result depends on them.
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.dtypes import DType
from meganeura.ops import functional as F

from . import OpInfo, Sample

SIZES = [(), (1,), (3,), (7,), (257,), (1000,), (2113,), (3, 257), (7, 1, 33), (2, 3, 5, 7), (3, 0)]


def _unary_samples(lo: float, hi: float, extra: tuple = ()):
    def samples(rng):
        out = [Sample((rng.uniform(lo, hi, s),), name="x".join(map(str, s)) or "scalar")
               for s in SIZES]  # fmt: skip
        return out + [Sample((np.array(v, np.float64),), name=n) for n, v in extra]

    return samples


def _unary(name, fn, ref, lo, hi, extra=(), **kw) -> OpInfo:
    return OpInfo(name, fn, ref, _unary_samples(lo, hi, extra), (name,), **kw)


_EDGES = np.array([-30.0, -10.0, -1e-3, 0.0, 1e-3, 10.0, 30.0])
UNARY = [
    _unary("neg", F.neg, torch.neg, -5, 5),
    _unary("exp", F.exp, torch.exp, -10, 10),
    # Outputs near 1e38: the mid-graph test rescales them by ~2^-126, and the upstream gradient
    # g * 2^-126 is subnormal, which GPUs may flush to zero (the H200 does). Forward and plain
    # gradients are still checked.
    OpInfo(
        "exp_near_overflow",
        F.exp,
        torch.exp,
        lambda rng: [Sample((np.array([80.0, 88.0, -87.0, -100.0]),), name="near_overflow")],
        ("exp",),
        mid_graph=False,
    ),
    _unary("log", F.log, torch.log, 1e-3, 100, (("tiny", [1e-30, 1e-10, 3e30]),)),
    _unary("sqrt", F.sqrt, torch.sqrt, 1e-3, 100, (("tiny", [1e-30, 1e-10, 3e30]),)),
    _unary("relu", F.relu, torch.relu, -2, 2, (("zeros", [0.0, -0.0, 1.0, -1.0]),)),
    _unary("tanh", F.tanh, torch.tanh, -5, 5, (("edges", _EDGES),)),
    _unary("sigmoid", F.sigmoid, torch.sigmoid, -10, 10, (("edges", _EDGES * 3),)),
]


def _neg_int_samples(rng):
    return [Sample((rng.integers(-1000, 1000, (257,)),), name="i32_257")]


UNARY.append(OpInfo("neg_i32", F.neg, torch.neg, _neg_int_samples, ("neg",)))

# (shape a, shape b) pairs: equal shapes, scalars, row/column broadcasting, both broadcast.
PAIRS = [
    ((1,), (1,)),
    ((7,), (7,)),
    ((1000,), (1000,)),
    ((2113,), ()),
    ((), (257,)),
    ((3, 257), (257,)),
    ((7, 1), (1, 5)),
    ((2, 1, 5), (3, 1)),
    ((4, 3, 33), (4, 1, 33)),
    ((3, 0), (1, 0)),
]


def _binary_samples(lo_b: float = -2.0, positive_b: bool = False, ties: bool = False, ints=False):
    def b_values(rng, shape):
        if positive_b:  # divisors: magnitude in [0.5, 2], both signs
            return rng.uniform(0.5, 2.0, shape) * rng.choice([-1.0, 1.0], shape)
        return rng.uniform(lo_b, 2.0, shape)

    def samples(rng):
        out = []
        for sa, sb in PAIRS:
            name = f"{'x'.join(map(str, sa)) or 's'}_{'x'.join(map(str, sb)) or 's'}"
            out.append(Sample((rng.uniform(-2, 2, sa), b_values(rng, sb)), name=name))
        out.append(Sample((rng.uniform(-2, 2, (3, 257)), 2.5), name="python_scalar"))
        if ties:  # small integers: many exact ties, each splitting the gradient
            a, b = rng.integers(-2, 3, (2, 7, 33)).astype(np.float64)
            out.append(Sample((a, b), name="ties"))
        if ints:
            a, b = rng.integers(-1000, 1000, (2, 3, 257))
            out.append(Sample((a, b[0]), name="i32_broadcast"))
        return out

    return samples


def _tensor_b(fn):
    """``fn`` with a Python-scalar second operand made a tensor of the first's dtype
    (``torch.maximum`` and friends take tensors only)."""

    def ref(a, b):
        return fn(a, b if isinstance(b, torch.Tensor) else torch.tensor(b, dtype=a.dtype))

    return ref


BINARY = [
    OpInfo("add", F.add, torch.add, _binary_samples(ints=True), ("add",)),
    OpInfo("sub", F.sub, torch.sub, _binary_samples(ints=True), ("sub",)),
    OpInfo("mul", F.mul, torch.mul, _binary_samples(ints=True), ("mul",)),
    OpInfo("div", F.div, torch.div, _binary_samples(positive_b=True), ("div",)),
    OpInfo(
        "maximum", F.maximum, _tensor_b(torch.maximum), _binary_samples(ties=True), ("maximum",)
    ),
    OpInfo(
        "minimum", F.minimum, _tensor_b(torch.minimum), _binary_samples(ties=True), ("minimum",)
    ),
]


def _compare_samples(rng):
    out = []
    for sa, sb in PAIRS:
        name = f"{'x'.join(map(str, sa)) or 's'}_{'x'.join(map(str, sb)) or 's'}"
        # Values from a small set: equal pairs are common, so >= and == differ from > and !=.
        a = rng.integers(-2, 3, sa).astype(np.float64) / 4
        b = rng.integers(-2, 3, sb).astype(np.float64) / 4
        out.append(Sample((a, b), name=name))
    out.append(Sample((rng.integers(-2, 3, (3, 257)).astype(np.float64), 1.0), name="scalar"))
    a, b = rng.integers(-3, 3, (2, 5, 66))
    out.append(Sample((a, b), name="i32"))
    return out


COMPARE = [
    OpInfo(name, getattr(F, name), ref, _compare_samples, (name,), differentiable=False)
    for name, ref in [
        ("greater", torch.gt),
        ("greater_equal", torch.ge),
        ("less", torch.lt),
        ("less_equal", torch.le),
        ("eq", torch.eq),
        ("ne", torch.ne),
    ]
]


def _where_samples(rng):
    def c(shape):
        return rng.uniform(size=shape) < 0.5

    return [
        Sample((c((1,)), rng.normal(size=(1,)), rng.normal(size=(1,))), name="1"),
        Sample((c((1000,)), rng.normal(size=1000), rng.normal(size=1000)), name="1000"),
        Sample((c((2113,)), rng.normal(size=2113), rng.normal(size=())), name="2113_scalar_y"),
        Sample((c((7, 1)), rng.normal(size=(1, 5)), rng.normal(size=(7, 5))), name="bcast_all"),
        Sample((c((3, 257)), rng.normal(size=(257,)), rng.normal(size=(3, 1))), name="bcast_ab"),
        Sample((c(()), rng.normal(size=(3, 7)), rng.normal(size=(3, 7))), name="scalar_cond"),
        Sample((c((3, 257)), rng.normal(size=(3, 257)), 0.0), name="python_zero"),
        Sample((c((0, 3)), rng.normal(size=(3,)), rng.normal(size=(0, 1))), name="empty"),
    ]


# Casts on the GPU: i32 (torch int64 on the reference side), bool, f32. f32 -> f32 is the
# identity (no node); f16 is not lowered yet.
_TORCH_DTYPE = {DType.f32: torch.float64, DType.i32: torch.int64, DType.bool: torch.bool}


def _cast_samples(rng):
    f = rng.uniform(-1000, 1000, (1000,))
    f[::7] = 0.0
    f[1::7] = np.trunc(f[1::7])  # exact integers, negative ones included
    i = rng.integers(-(2**24), 2**24, (257,))
    i[::5] = 0
    bvals = rng.uniform(size=(7, 33)) < 0.5
    return [
        Sample((f,), {"dtype": DType.i32}, name="f32_to_i32"),
        Sample((f[:7],), {"dtype": DType.i32}, name="f32_to_i32_7"),
        Sample((f,), {"dtype": DType.bool}, name="f32_to_bool"),
        Sample((i,), {"dtype": DType.f32}, name="i32_to_f32"),
        Sample((i,), {"dtype": DType.bool}, name="i32_to_bool"),
        Sample((bvals,), {"dtype": DType.f32}, name="bool_to_f32"),
        Sample((bvals,), {"dtype": DType.i32}, name="bool_to_i32"),
    ]


MISC = [
    OpInfo("where", F.where, torch.where, _where_samples, ("where",)),
    OpInfo(
        "cast",
        lambda x, dtype: F.cast(x, dtype),
        lambda x, dtype: x.to(_TORCH_DTYPE[dtype]),
        _cast_samples,
        ("cast",),
        differentiable=False,  # no float -> float cast is lowered (f16 is not)
    ),
]


def _permute_samples(rng):
    return [
        Sample((rng.normal(size=(1, 1)),), {"dims": (1, 0)}, name="1x1"),
        Sample((rng.normal(size=(7, 257)),), {"dims": (1, 0)}, name="7x257"),
        Sample((rng.normal(size=(1000, 3)),), {"dims": (-1, -2)}, name="1000x3_negative"),
        Sample((rng.normal(size=(3, 5, 7)),), {"dims": (2, 0, 1)}, name="3x5x7"),
        Sample((rng.normal(size=(2, 3, 4, 5)),), {"dims": (0, 2, 1, 3)}, name="4d_middle"),
        Sample((rng.normal(size=(2, 1, 9, 5)),), {"dims": (3, 1, 0, 2)}, name="4d_unit_dim"),
        Sample((rng.normal(size=(0, 3)),), {"dims": (1, 0)}, name="empty"),
    ]


def _broadcast_samples(rng):
    return [
        Sample((rng.normal(size=()),), {"shape": (1000,)}, name="scalar_1000"),
        Sample((rng.normal(size=(257,)),), {"shape": (3, 257)}, name="row"),
        Sample((rng.normal(size=(7, 1)),), {"shape": (7, 33)}, name="column"),
        Sample((rng.normal(size=(3, 1, 5)),), {"shape": (2, 3, 4, 5)}, name="lead_and_mid"),
        Sample((rng.normal(size=(1,)),), {"shape": (1, 1)}, name="1_to_1x1"),
        Sample((rng.normal(size=(3,)),), {"shape": (0, 3)}, name="to_empty"),
    ]


def _reshape_samples(rng):
    return [
        Sample((rng.normal(size=(3, 257)),), {"shape": (257, 3)}, name="3x257"),
        Sample((rng.normal(size=(1000,)),), {"shape": (10, -1, 10)}, name="infer"),
        Sample((rng.normal(size=(7,)),), {"shape": (7, 1)}, name="7"),
        Sample((rng.normal(size=(1,)),), {"shape": ()}, name="to_scalar"),
        Sample((rng.normal(size=(2, 3, 4)),), {"shape": (6, 4)}, name="merge"),
    ]


LAYOUT = [
    OpInfo(
        "permute",
        lambda x, dims: F.permute(x, dims),
        lambda x, dims: torch.permute(x, dims),
        _permute_samples,
        ("permute",),
    ),
    OpInfo(
        "broadcast_to",
        lambda x, shape: F.broadcast_to(x, shape),
        lambda x, shape: torch.broadcast_to(x, shape),
        _broadcast_samples,
        ("broadcast_to",),
    ),
    OpInfo(
        "reshape",
        lambda x, shape: F.reshape(x, shape),
        lambda x, shape: torch.reshape(x, shape),
        _reshape_samples,
        ("reshape",),
    ),
    # x * stop_gradient(x): forward x^2, gradient x (not 2x) as torch's x * x.detach().
    OpInfo(
        "stop_gradient",
        lambda x: x * F.stop_gradient(x),
        lambda x: x * x.detach(),
        _unary_samples(-2, 2),
        ("stop_gradient", "mul"),
    ),
]

ENTRIES: list[OpInfo] = [*UNARY, *BINARY, *COMPARE, *MISC, *LAYOUT]

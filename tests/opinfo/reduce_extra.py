"""Op-database entries for the reductions and scans added beside sum/mean/amax: ``var`` (and
the ``std`` composite), ``logsumexp``, ``amin``, ``max``/``min`` along a dim (values and
indices), ``argmax``, ``argmin`` and ``cumsum`` (``meganeura/ops/reduce.py``; kernels in
``codegen/wgsl/reduce/reductions.py`` and ``codegen/wgsl/reduce/scan.py``).

Invariants of the samples: group sizes 1, 3, 7, 257 and 1000; whole-tensor, innermost
(contiguous), outermost and middle (strided) and multi-dim groups, keepdim both ways; one
group of more than 1e4 elements per reduction (forward bound 1e-4, per the brief; extrema and
indices stay exact), which also takes the chunked two-dispatch path; data with a non-zero
mean. Ties: ``argmax``/``argmin`` and ``max``/``min`` get rows of small integers, so the first
index must win (also across chunks), and ``amin`` ties share the gradient. Index entries
demand exact indices (rtol 0). ``cumsum`` covers serial rows (<= 64), one-tile rows, blocked
multi-tile rows (contiguous and strided), i32 and a 0-d input. ``logsumexp`` has a x100
scale, a -1e4 offset and rows of -inf (forward only: torch's gradient there is NaN).
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.ops import reduce as R

from . import OpInfo, Sample

BIG = 1e-4  # forward bound for groups of more than 1e4 elements

# (shape, dim, keepdim, name); dims of size >= 2 so var's N - correction stays > 0
GROUPS = [
    ((3,), None, False, "3_all"),
    ((7,), 0, True, "7_keepdim"),
    ((1000,), None, False, "1000_all"),
    ((3, 257), 1, False, "3x257_last"),
    ((257, 3), 0, True, "257x3_first_keepdim"),
    ((5, 70, 3), 1, False, "5x70x3_middle"),
    ((7, 1, 33), -1, True, "7x1x33_last_keepdim"),
    ((2, 3, 5, 7), (0, 2), False, "4d_dims_0_2"),
    ((2, 3, 5, 7), (1, -1), True, "4d_dims_1_3_keepdim"),
]


def _all(x, dim):
    return tuple(range(x.ndim)) if dim is None else dim


def _groups(rng, lo=-0.5, hi=1.5):
    out = [
        Sample((rng.uniform(lo, hi, shape),), {"dim": dim, "keepdim": keep}, name=name)
        for shape, dim, keep, name in GROUPS
    ]
    out.append(Sample((rng.uniform(lo, hi, (2, 20000)),), {"dim": 1}, name="2x20000", rtol=BIG))
    out.append(Sample((rng.uniform(lo, hi, (12000, 2)),), {"dim": 0}, name="12000x2", rtol=BIG))
    return out


# ---- var / std --------------------------------------------------------------------------------
def _var_samples(rng):
    out = _groups(rng)
    x = rng.uniform(-0.5, 1.5, (4, 9))
    out += [
        Sample((x,), {"dim": 1, "correction": 0}, name="4x9_c0"),
        Sample((x,), {"dim": 0, "correction": 2.5}, name="4x9_c2.5"),
        Sample((rng.uniform(-1, 1, (1,)),), {"correction": 0}, name="1_c0"),
        Sample((1000.0 + rng.standard_normal((3, 5000)),), {"dim": 1}, name="mean1000"),
    ]
    return out


def _std_samples(rng):
    # sqrt'(0) is infinite: torch's and our gradients are NaN for a zero deviation
    return [s for s in _var_samples(rng) if s.name != "1_c0"]


def _var_ref(fn):
    def ref(x, dim=None, correction=1, keepdim=False):
        return fn(x, _all(x, dim), correction=correction, keepdim=keepdim)

    return ref


# ---- logsumexp --------------------------------------------------------------------------------
def _lse_samples(rng):
    out = []
    for s in _groups(rng):  # logsumexp needs dims: None becomes every dim
        x = s.args[0]
        kwargs = {**s.kwargs, "dim": _all(x, s.kwargs["dim"])}
        out.append(Sample((rng.normal(size=x.shape) * 3,), kwargs, name=s.name, rtol=s.rtol))
    out.append(Sample((rng.normal(size=(4, 66)) * 100,), {"dim": 1}, name="x100_4x66"))
    out.append(Sample((rng.normal(size=(1, 3)) - 1e4,), {"dim": 1}, name="minus_1e4"))
    x = rng.normal(size=(3, 70))
    x[0] = -np.inf
    x[1, ::2] = -np.inf
    # torch's gradient is NaN on an all -inf row; only the forward is compared
    out.append(Sample((x,), {"dim": 1}, name="neg_inf_rows", grad=()))
    return out


# ---- extrema ----------------------------------------------------------------------------------
def _ties(rng, shape):
    return rng.integers(0, 3, shape).astype(np.float64)


def _extremum_samples(rng, whole_dims: bool):
    """Single-dim samples (``max(x, dim)`` takes one dim) with ties; ``whole_dims`` adds
    dim=None."""
    out = [
        Sample((np.array(-0.25),), {"dim": 0}, name="scalar_dim0"),
        Sample((rng.uniform(-0.5, 1.5, (7,)),), {"dim": 0}, name="7"),
        Sample((rng.uniform(-0.5, 1.5, (1, 4)),), {"dim": 0, "keepdim": True}, name="1x4_dim0"),
        Sample((_ties(rng, (3, 257)),), {"dim": 1}, name="ties_3x257_last"),
        Sample((_ties(rng, (257, 3)),), {"dim": 0, "keepdim": True}, name="ties_257x3_first"),
        Sample((_ties(rng, (5, 70, 3)),), {"dim": 1}, name="ties_5x70x3_middle"),
        Sample((rng.uniform(-2.0, -1.0, (4, 1000)),), {"dim": -1}, name="negative_4x1000"),
        Sample((_ties(rng, (2, 20000)),), {"dim": 1}, name="ties_2x20000"),
        Sample((_ties(rng, (12000, 2)),), {"dim": 0}, name="ties_12000x2"),
    ]
    if whole_dims:
        out.append(Sample((_ties(rng, (7, 33)),), {"dim": None}, name="ties_all"))
        out.append(Sample((_ties(rng, (3, 5)),), {"dim": None, "keepdim": True}, name="all_keep"))
        out.append(Sample((rng.integers(-9, 9, (5, 257)),), {"dim": 1}, name="i32_ties"))
        out.append(Sample((np.array(0.5),), {"dim": None}, name="scalar"))
    return out


def _amin_samples(rng):
    out = _groups(rng)
    out.append(Sample((_ties(rng, (7, 33)),), {"dim": 1}, name="ties_rows"))
    out.append(Sample((_ties(rng, (7, 33)),), {"dim": None}, name="ties_all"))
    out.append(Sample((rng.integers(-1000, 1000, (5, 257)),), {"dim": 1}, name="i32_rows"))
    return out


def _amin_ref(x, dim=None, keepdim=False):
    return torch.amin(x, _all(x, dim), keepdim=keepdim)


def _field(fn, k):
    return lambda x, dim=None, keepdim=False: fn(x, dim, keepdim)[k]


def _torch_arg(fn):
    def ref(x, dim=None, keepdim=False):
        return fn(x, dim=dim, keepdim=keepdim)

    return ref


# ---- cumsum -----------------------------------------------------------------------------------
def _cumsum_samples(rng):
    u = lambda *s: rng.uniform(-0.5, 1.5, s)  # noqa: E731
    return [
        Sample((np.array(0.75),), {"dim": 0}, name="scalar"),
        Sample((u(1),), {"dim": 0}, name="1"),
        Sample((u(7),), {"dim": -1}, name="7"),
        Sample((u(3, 257),), {"dim": 1}, name="3x257_last"),
        Sample((u(3, 257),), {"dim": 0}, name="3x257_first"),
        Sample((u(257, 3),), {"dim": 0}, name="257x3_first"),
        Sample((u(2, 3, 5, 7),), {"dim": 2}, name="4d_middle"),
        Sample((u(2, 1000),), {"dim": 1}, name="2x1000_tile"),
        Sample((u(3, 2500),), {"dim": 1}, name="3x2500_blocked"),
        Sample((u(2, 1500, 3),), {"dim": 1}, name="2x1500x3_blocked_strided"),
        Sample((u(20000),), {"dim": 0}, name="20000_blocked", rtol=BIG),
        Sample((rng.integers(-1000, 1000, (3, 1100)),), {"dim": 1}, name="i32_blocked"),
    ]


ENTRIES: list[OpInfo] = [
    OpInfo("var", R.var, _var_ref(torch.var), _var_samples, ("var",)),
    OpInfo("std", R.std, _var_ref(torch.std), _std_samples, ("var", "sqrt")),
    OpInfo("logsumexp", R.logsumexp, torch.logsumexp, _lse_samples, ("logsumexp",)),
    OpInfo("amin", R.amin, _amin_ref, _amin_samples, ("amin",)),
    OpInfo(
        "max_dim_values",
        _field(R.max, 0),
        _field(torch.max, 0),
        lambda rng: _extremum_samples(rng, False),
        ("max", "cumsum"),
    ),
    OpInfo(
        "min_dim_values",
        _field(R.min, 0),
        _field(torch.min, 0),
        lambda rng: _extremum_samples(rng, False),
        ("min", "cumsum"),
    ),
    OpInfo(
        "max_dim_indices",
        _field(R.max, 1),
        _field(torch.max, 1),
        lambda rng: _extremum_samples(rng, False),
        ("argmax",),
        differentiable=False,
        rtol=0.0,
    ),
    OpInfo(
        "argmax",
        R.argmax,
        _torch_arg(torch.argmax),
        lambda rng: _extremum_samples(rng, True),
        ("argmax",),
        differentiable=False,
        rtol=0.0,
    ),
    OpInfo(
        "argmin",
        R.argmin,
        _torch_arg(torch.argmin),
        lambda rng: _extremum_samples(rng, True),
        ("argmin",),
        differentiable=False,
        rtol=0.0,
    ),
    OpInfo("cumsum", R.cumsum, torch.cumsum, _cumsum_samples, ("cumsum",)),
]

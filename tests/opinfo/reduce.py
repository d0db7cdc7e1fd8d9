"""Op-database entries for reductions and the row-reduction ops built on them.

Covers ``meganeura/ops/reduce.py`` (``sum``, ``mean``, ``amax`` over dim sets with and without
``keepdim``), ``meganeura/ops/nn.py`` (``softmax``, ``log_softmax`` along dims 0, 1 and -1,
lowered by the row kernels in ``codegen/wgsl/rowwise/softmax.py``) and ``functional.mse_loss`` (a
composite of ``sub``, ``mul`` and ``mean``/``sum``).

Invariants of the samples: reductions cover whole-tensor, innermost (contiguous rows),
outermost (strided rows) and multi-dim groups, rows shorter and longer than one workgroup,
and one group of more than 1e4 elements (its forward bound is 1e-4, per the brief); the data
has a non-zero mean so sums do not cancel to a tiny reference. ``amax`` has a sample with ties
(the gradient is shared equally, as ``torch.amax``). Softmax logits include a x100 scale.
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.ops import functional as F

from . import OpInfo, Sample

# (shape, dim, keepdim, name)
REDUCTIONS = [
    ((1,), None, False, "1_all"),
    ((7,), None, False, "7_all"),
    ((1000,), None, True, "1000_all_keepdim"),
    ((3, 257), 1, False, "3x257_rows"),
    ((257, 3), 0, False, "257x3_strided"),
    ((257, 3), 0, True, "257x3_strided_keepdim"),
    ((7, 1, 33), -1, True, "7x1x33_last_keepdim"),
    ((7, 1, 33), 1, False, "unit_dim"),
    ((2, 3, 5, 7), (0, 2), False, "4d_dims_0_2"),
    ((2, 3, 5, 7), (1, -1), True, "4d_dims_1_3_keepdim"),
    ((5, 70, 3), 1, False, "5x70x3_middle"),
    ((2, 1000), 1, False, "2x1000_rows"),
    ((0, 3), 1, False, "empty_rows"),  # reduces 3 elements per row, over zero rows
]


def _reduce_samples(ties: bool = False, ints: bool = False):
    def samples(rng):
        out = [
            Sample((rng.uniform(-0.5, 1.5, shape),), {"dim": dim, "keepdim": keep}, name=name)
            for shape, dim, keep, name in REDUCTIONS
        ]
        big = rng.uniform(-0.5, 1.5, (3, 20000))
        out.append(Sample((big,), {"dim": 1}, name="3x20000_rows", rtol=1e-4))
        out.append(Sample((big[:, :7000].T.copy(),), {"dim": 0}, name="7000x3_cols"))
        if ties:
            x = rng.integers(0, 3, (7, 33)).astype(np.float64)
            out.append(Sample((x,), {"dim": 1}, name="ties_rows"))
            out.append(Sample((x,), {"dim": None}, name="ties_all"))
        if ints:
            x = rng.integers(-1000, 1000, (5, 257))
            out.append(Sample((x,), {"dim": 1}, name="i32_rows"))
        return out

    return samples


def _reduce_ref(fn):
    def ref(x, dim=None, keepdim=False):
        if dim is None:
            dim = tuple(range(x.ndim))
        return fn(x, dim=dim, keepdim=keepdim)

    return ref


REDUCE = [
    OpInfo("sum", F.sum, _reduce_ref(torch.sum), _reduce_samples(ints=True), ("sum",)),
    OpInfo("mean", F.mean, _reduce_ref(torch.mean), _reduce_samples(), ("mean",)),
    OpInfo("amax", F.amax, _reduce_ref(torch.amax), _reduce_samples(True, True), ("amax",)),
]


# (shape, dim, scale, name)
SOFTMAX = [
    ((1,), 0, 1.0, "1"),
    ((7,), -1, 1.0, "7"),
    ((3, 257), 1, 1.0, "3x257_dim1"),
    ((257, 3), 0, 1.0, "257x3_dim0"),
    ((2, 3, 70), 1, 1.0, "2x3x70_dim1"),
    ((5, 1000), -1, 1.0, "5x1000_last"),
    ((4, 66), -1, 100.0, "x100_4x66"),
    ((1000, 2), 0, 100.0, "x100_1000x2_dim0"),
    ((3, 7, 33), 0, 100.0, "x100_3x7x33_dim0"),
    ((0, 5), 1, 1.0, "empty_rows"),
    # a softmax dim followed only by ones: rows are contiguous, but not along the last dim
    # (issue 11: the team kernel took shape[-1] = 1 as the row and returned all ones)
    ((7, 1), 0, 1.0, "7x1_dim0_trailing_one"),
    ((2, 7, 1, 1), 1, 1.0, "2x7x1x1_dim1_trailing_ones"),
]


def _near_tie(x: np.ndarray, dim: int) -> np.ndarray:
    """``x`` with each row's runner-up moved to 0.5 below its maximum.

    With logits x100 a random row is one-hot to within e^-30, so its exact gradient is ~1e-13
    and any f32 evaluation of ``y * (g - sum(g * y))`` is round-off (torch's own f32 backward
    reaches cosine 0.994 there). A near tie keeps the forward at full magnitude and gives the
    gradient a well-conditioned part that the test can measure.
    """
    rows = np.moveaxis(x.copy(), dim, -1)
    order = np.argsort(rows, axis=-1)
    top = np.take_along_axis(rows, order[..., -1:], -1)
    np.put_along_axis(rows, order[..., -2:-1], top - 0.5, -1)
    return np.ascontiguousarray(np.moveaxis(rows, -1, dim))


def _softmax_samples(rng):
    out = []
    for shape, dim, scale, name in SOFTMAX:
        x = rng.normal(size=shape) * scale
        out.append(Sample((_near_tie(x, dim) if scale > 1 else x,), {"dim": dim}, name=name))
    return out


def _mse_samples(rng):
    out = []
    for shape in [(1,), (7,), (3, 257), (1000,), (2, 3, 5, 7)]:
        name = "x".join(map(str, shape))
        a, b = rng.normal(size=shape), rng.normal(size=shape)
        out.append(Sample((a, b), name=name))
        out.append(Sample((a, b), {"reduction": "sum"}, name=f"{name}_sum"))
    return out


ENTRIES: list[OpInfo] = [
    *REDUCE,
    OpInfo("softmax", F.softmax, torch.softmax, _softmax_samples, ("softmax",)),
    OpInfo("log_softmax", F.log_softmax, torch.log_softmax, _softmax_samples, ("log_softmax",)),
    OpInfo(
        "mse_loss",
        F.mse_loss,
        torch.nn.functional.mse_loss,
        _mse_samples,
        ("sub", "mul", "mean", "sum"),
    ),
]

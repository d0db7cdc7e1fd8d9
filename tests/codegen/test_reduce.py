"""sum / mean / amax over dim sets, keepdim both ways, small to 2^21-element groups."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from ..ids import dims_id, shape_id
from .harness import check, run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(7)


REDUCTIONS = [
    ((6, 5), (1,)),
    ((6, 5), (0,)),
    ((6, 5), (0, 1)),
    ((3, 4, 5), (0, 2)),
    ((3, 4, 5), (1,)),
    ((2, 1, 3, 4), (1, 2)),
    ((4, 300), (1,)),  # contiguous rows >= 64: one workgroup per row
    ((300, 70), (0,)),  # strided rows >= 64: 32 rows per workgroup
    ((5, 200, 3), (1,)),
    ((2, 9, 3, 80), (1, 3)),
    ((4, 1), (1,)),  # reduce over a size-1 dim only
]


@pytest.mark.parametrize(
    "shape,dims", REDUCTIONS, ids=[f"{shape_id(s)}-{dims_id(d)}" for s, d in REDUCTIONS]
)
@pytest.mark.parametrize("keepdim", [False, True], ids=["drop", "keepdim"])
def test_reductions(shape, dims, keepdim):
    b = GraphBuilder()
    x = b.input("x", shape)
    for op in ("sum", "mean", "amax"):
        b.output(op, getattr(F, op)(x, dims, keepdim))
    xs = rng.standard_normal(shape).astype(np.float32) - 2.0  # amax of all-negative groups
    check(b.build(), {"x": xs})


def test_integer_reductions():
    b = GraphBuilder()
    x = b.input("x", (5, 100), DType.i32)
    b.output("sum", F.sum(x, 1))
    b.output("mean", F.mean(x, 0))
    b.output("amax", F.amax(x, 1, keepdim=True))
    check(b.build(), {"x": rng.integers(-1000, 1000, (5, 100)).astype(np.int32)})


def test_sum_of_two_million_keeps_f32_accuracy():
    n = 2**21
    b = GraphBuilder()
    x = b.input("x", (n,))
    s = b.output("sum", F.sum(x))
    m = b.output("mean", F.mean(F.reshape(x, (2, n // 2)), 1))
    g = b.build()
    xs = np.random.default_rng(0).uniform(0, 1, n).astype(np.float32)
    exact = xs.astype(np.float64).sum()
    # the data is one where a naive serial f32 sum misses the bound, so the test discriminates
    assert abs(float(np.cumsum(xs, dtype=np.float32)[-1]) - exact) > 1e-5 * exact
    res = run(g, {"x": xs})
    assert abs(float(res.values[s.id]) - exact) <= 1e-5 * exact
    halves = xs.astype(np.float64).reshape(2, -1).mean(1)
    np.testing.assert_allclose(res.values[m.id], halves, rtol=1e-5)
    # the full reduction is split into chunks plus a combining pass
    assert sum(k.name.startswith(f"%{s.id} ") for k in res.kernels) == 2


def test_large_strided_groups():
    b = GraphBuilder()
    x = b.input("x", (4096, 3))
    b.output("colsum", F.sum(x, 0))
    b.output("colmax", F.amax(x, 0, keepdim=True))
    check(b.build(), {"x": rng.standard_normal((4096, 3)).astype(np.float32)}, rtol=1e-4)


def test_amax_of_lowest_finite_values():
    b = GraphBuilder()
    x = b.input("x", (3, 70))
    b.output("m", F.amax(x, 1))
    xs = np.full((3, 70), np.finfo(np.float32).min, np.float32)
    xs[1, 69] = -1.0
    check(b.build(), {"x": xs})

"""var, logsumexp, amin, max/min, argmax/argmin and cumsum: accuracy against float64 where
the naive f32 formula fails, every kernel path (chunked reductions, serial / one-tile /
walked-tile / blocked scans), infinities, ties across chunks, type errors and WGSL text.

The op database entries (``tests/opinfo/reduce_extra.py``) run in ``tests/test_opinfo.py``.
"""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

import meganeura.codegen.wgsl as wgsl
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.reduce import scan
from meganeura.codegen.wgsl.reduce.reductions import lower_reduce
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.ops import reduce as R

from ..ids import dims_id, shape_id
from .harness import check, run

rng = np.random.default_rng(11)


def _kernels(res, node) -> int:
    return sum(k.name.startswith(f"%{node.id} ") for k in res.kernels)


# ---- accuracy ---------------------------------------------------------------------------------
@pytest.mark.gpu
def test_var_of_a_million_values_with_mean_1000():
    n = 2**20
    xs = (1000.0 + np.random.default_rng(0).standard_normal(n)).astype(np.float32)
    exact = np.var(xs.astype(np.float64), ddof=1)
    # E[x^2] - E[x]^2 in f32 misses the bound tenfold, even with float64-exact sums
    m2 = np.float32(np.mean(xs.astype(np.float64) ** 2))
    m = np.float32(np.mean(xs.astype(np.float64)))
    naive = (m2 - m * m) * np.float32(n / (n - 1))
    assert abs(naive - exact) > 10 * 1e-4 * exact
    b = GraphBuilder()
    x = b.input("x", (n,))
    v = b.output("v", R.var(x))
    s = b.output("s", R.std(x, 0, correction=0))
    res = run(b.build(), {"x": xs})
    assert abs(float(res.values[v.id]) - exact) <= 1e-4 * exact
    assert abs(float(res.values[s.id]) - np.sqrt(exact * (n - 1) / n)) <= 1e-4
    assert _kernels(res, v.node) == 2  # chunk statistics, then Chan's combination


@pytest.mark.gpu
def test_var_single_pass_rows_with_large_mean():
    xs = (-5e4 + np.random.default_rng(1).standard_normal((6, 3000))).astype(np.float32)
    b = GraphBuilder()
    x = b.input("x", xs.shape)
    v = b.output("v", R.var(x, 1))
    res = run(b.build(), {"x": xs})
    exact = np.var(xs.astype(np.float64), axis=1, ddof=1)
    np.testing.assert_allclose(res.values[v.id], exact, rtol=1e-5)
    assert _kernels(res, v.node) == 1


@pytest.mark.gpu
def test_cumsum_of_100k_elements_is_accurate():
    n = 100_000
    xs = np.random.default_rng(2).uniform(0, 1, n).astype(np.float32)
    exact = np.cumsum(xs.astype(np.float64))
    serial = np.cumsum(xs, dtype=np.float32)  # one running f32 sum, for comparison
    b = GraphBuilder()
    x = b.input("x", (n,))
    c = b.output("c", R.cumsum(x, 0))
    res = run(b.build(), {"x": xs})
    err = np.max(np.abs(res.values[c.id] - exact)) / exact[-1]
    assert err <= 1e-6 and err < np.max(np.abs(serial - exact)) / exact[-1] / 4
    assert _kernels(res, c.node) == 3  # tile sums, their scan, the tiles with offsets


# ---- kernel paths -----------------------------------------------------------------------------
CUMSUM_PATHS = [
    ((5, 64), 1, 512, 1),  # serial
    ((70, 65), 0, 512, 1),  # one tile per row, strided
    ((3, 2049), 1, 2, 1),  # one workgroup walks three tiles
    ((2, 1100, 3), 1, 2, 1),  # the same, strided
    ((2, 1100, 3), 1, 512, 3),  # blocked
    ((2, 2049 * 1024 + 5), 1, 512, 3),  # blocked, offsets scan walks three tiles
]


@pytest.mark.gpu
@pytest.mark.parametrize("reverse", [False, True], ids=["forward", "reverse"])
@pytest.mark.parametrize(
    "shape,dim,many_rows,kernels",
    CUMSUM_PATHS,
    ids=[f"{shape_id(s)}-{dims_id(d)}-many_rows{m}" for s, d, m, _ in CUMSUM_PATHS],
)
def test_cumsum_paths(monkeypatch, shape, dim, many_rows, kernels, reverse):
    monkeypatch.setattr(scan, "MANY_ROWS", many_rows)
    b = GraphBuilder()
    x = b.input("x", shape)
    c = b.output("c", b.add("cumsum", [x], {"dim": dim, "reverse": reverse}))
    xs = rng.uniform(-0.5, 1.5, shape).astype(np.float32)
    res = check(b.build(), {"x": xs}, rtol=1e-4 if xs.size > 1e5 else 1e-5)
    assert _kernels(res, c.node) == kernels


@pytest.mark.gpu
def test_integer_cumsum_wraps_and_counts():
    b = GraphBuilder()
    x = b.input("x", (4, 3000), DType.i32)
    b.output("c", R.cumsum(x, 1))
    b.output("r", b.add("cumsum", [x], {"dim": 0, "reverse": True}))
    xs = rng.integers(-(2**30), 2**30, (4, 3000)).astype(np.int32)
    check(b.build(), {"x": xs})


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,dim",
    [((3, 70000), 1), ((50000, 2), 0), ((40, 3, 600), (0, 2))],
    ids=["3x70000-dim1", "50000x2-dim0", "40x3x600-dims0_2"],
)
def test_chunked_reductions(shape, dim):
    b = GraphBuilder()
    x = b.input("x", shape)
    outs = [R.var(x, dim), R.logsumexp(x, dim), R.amin(x, dim)]
    if isinstance(dim, int):
        outs += [R.argmax(x, dim), R.argmin(x, dim), *R.max(x, dim), *R.min(x, dim)]
    for i, o in enumerate(outs):
        b.output(f"o{i}", o)
    xs = (rng.standard_normal(shape) * 4 + 3).astype(np.float32)
    res = check(b.build(), {"x": xs}, rtol=1e-4)
    assert all(_kernels(res, o.node) == 2 for o in outs)


@pytest.mark.gpu
def test_first_index_wins_ties_across_chunks():
    xs = np.zeros((2, 50000), np.float32)
    xs[1, 7], xs[1, 49999] = 1.0, 1.0
    xs[0, 30000:] = -1.0
    b = GraphBuilder()
    x = b.input("x", xs.shape)
    outs = [b.output(k, f(x, 1)) for k, f in (("mx", R.argmax), ("mn", R.argmin))]
    res = run(b.build(), {"x": xs})
    assert _kernels(res, outs[0].node) == 2
    np.testing.assert_array_equal(res.values[outs[0].id], [0, 7])
    np.testing.assert_array_equal(res.values[outs[1].id], [30000, 0])


@pytest.mark.gpu
@pytest.mark.parametrize("n", [70, 70000])
def test_logsumexp_infinities(n):
    """torch.logsumexp's rule: -inf rows give -inf, a +inf element gives +inf. WGSL lets
    implementations assume no infinities, so this holds where IEEE semantics are kept
    (lavapipe does)."""
    xs = np.random.default_rng(3).standard_normal((4, n)).astype(np.float32)
    xs[0] = -np.inf
    xs[1, : n // 2] = -np.inf  # whole chunks of -inf next to finite ones
    xs[2, 5] = np.inf
    b = GraphBuilder()
    x = b.input("x", xs.shape)
    o = b.output("o", R.logsumexp(x, 1))
    got = run(b.build(), {"x": xs}).values[o.id]
    want = torch.logsumexp(torch.from_numpy(xs.astype(np.float64)), 1).numpy()
    assert got[0] == -np.inf and got[2] == np.inf
    np.testing.assert_allclose(got[[1, 3]], want[[1, 3]], rtol=1e-5)


@pytest.mark.gpu
def test_integer_extrema():
    xs = rng.integers(-5, 5, (6, 300)).astype(np.int32)
    b = GraphBuilder()
    x = b.input("x", xs.shape, DType.i32)
    b.output("amin", R.amin(x, 1))
    b.output("argmin", R.argmin(x, 0, keepdim=True))
    b.output("argmax", R.argmax(x))
    vals, idx = R.max(x, 1)
    b.output("v", vals)
    b.output("i", idx)
    check(b.build(), {"x": xs})


# ---- no GPU -----------------------------------------------------------------------------------
def test_type_errors():
    b = GraphBuilder()
    x = b.input("x", (3, 1))
    with pytest.raises(GraphTypeError, match="degrees of freedom"):
        R.var(x, 1)
    with pytest.raises(GraphTypeError, match="floating"):
        R.var(b.input("i", (3,), DType.i32))
    with pytest.raises(GraphTypeError, match="floating"):
        R.logsumexp(b.input("j", (3,), DType.i32), 0)
    with pytest.raises(GraphTypeError, match="bool"):
        R.cumsum(b.input("b", (3,), DType.bool), 0)
    with pytest.raises(IndexError):
        R.argmax(x, 2)
    assert R.var(x, 1, correction=0).shape == (3,)
    assert R.argmax(x, keepdim=True).shape == (1, 1)
    assert R.argmin(x, 0).dtype is DType.i32
    assert R.max(x).shape == () and R.min(x, 0, keepdim=True).indices.shape == (1, 1)


def test_wgsl_has_no_infinite_literals_and_merges_its_table():
    b = GraphBuilder()
    x = b.input("x", (3, 70000))
    for f in (R.var, R.logsumexp, R.argmax, R.cumsum):
        b.output(f.__name__, f(x, 1))
    g = b.build()
    for n in g.nodes[1:]:
        for k in wgsl.lower(g, n.id, Limits()):
            code = re.sub(r"//[^\n]*", "", k.wgsl)
            assert not re.search(r"\b(inf|nan|infinity)\b", code, re.I), k.wgsl
    assert all(wgsl.LOWERINGS[op] is lower_reduce for op in ("var", "logsumexp", "argmax", "amin"))
    assert wgsl.LOWERINGS["cumsum"] is scan.lower_cumsum

"""matmul: every kernel plan (tilings, prefetch on/off, split-K, gemv) on awkward shapes, all
four operand layouts (vec4 and scalar loads), batch broadcasting, folded transposes and fused
epilogues; values against float64 NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.wgsl import reads
from meganeura.codegen.wgsl.matmul import plan as matmul
from meganeura.codegen.wgsl.matmul.plan import (
    LARGE,
    SMALL,
    Plan,
    choose_tiling,
    force_plan,
    heuristic_plan,
    parse_plan,
)
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F

from ..ids import shape_id
from .harness import check, device_limits, lower_all, run

pytestmark = pytest.mark.gpu
rng = np.random.default_rng(99)

TILED = ["64x64x16", "128x128x8", "128x64x16", "64x128x16", "128x128x8/np", "64x64x16/s3"]
TILED += ["256x128x8", "128x256x8/np", "64x64x32/s2/np", "64x64x32/np"]
TILED += ["128x128x8/d2", "64x64x16/s3/d2", "128x64x16/d2"]


def _randn(*shape):
    return rng.standard_normal(shape).astype(np.float32)


@pytest.fixture
def plan(request):
    force_plan(request.param)
    yield request.param
    force_plan(None)


def _product(m, k, n, layout, batch=()):
    """Graph y = a @ b with a stored [.., K, M] when layout[0] == "t", b [.., N, K] when
    layout[1] == "t"; returns (graph, inputs, float64 expected, y id)."""
    a_shape = (*batch, k, m) if layout[0] == "t" else (*batch, m, k)
    b_shape = (*batch, n, k) if layout[1] == "t" else (*batch, k, n)
    g = GraphBuilder()
    a, b = g.input("a", a_shape), g.input("b", b_shape)
    y = g.output("y", (a.mT if layout[0] == "t" else a) @ (b.mT if layout[1] == "t" else b))
    xa, xb = _randn(*a_shape), _randn(*b_shape)
    da, db = xa.astype(np.float64), xb.astype(np.float64)
    want = (da.swapaxes(-1, -2) if layout[0] == "t" else da) @ (
        db.swapaxes(-1, -2) if layout[1] == "t" else db
    )
    return g.build(), {"a": xa, "b": xb}, want, y.id


def _assert_close(got, want, k):
    # f32 accumulation error grows like sqrt(K) * eps * |a||b|; unit-normal operands
    tol = 1e-6 * 8 * np.sqrt(max(k, 1)) * np.sqrt(k) + 1e-6
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=0, atol=tol)


@pytest.mark.parametrize("plan", TILED, indirect=True)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(3, 7, 5), (36, 520, 68), (131, 44, 129), (300, 37, 260)])
def test_tiled_plans(m, k, n, layout, plan):
    graph, inputs, want, y = _product(m, k, n, layout)
    got = run(graph, inputs).values[y]
    _assert_close(got, want, k)


@pytest.mark.parametrize("plan", ["gemv32", "gemv4", "gemv64/s3", "gemv16/s2"], indirect=True)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (1, 576, 260), (3, 1000, 3), (8, 64, 131)])
def test_gemv_plans(m, k, n, layout, plan):
    graph, inputs, want, y = _product(m, k, n, layout)
    got = run(graph, inputs).values[y]
    _assert_close(got, want, k)


@pytest.mark.parametrize("plan", ["simd8", "simd16", "simd32", "simd64"], indirect=True)
@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize("m,k,n", [(1, 7, 5), (1, 576, 260), (36, 520, 68), (131, 44, 129)])
def test_simd_plans(m, k, n, layout, plan):
    """The CPU kernel (one subgroup per workgroup, A rows broadcast) on ragged shapes; vec4
    loads along K in "nt" where K % 4 == 0, scalar loads elsewhere."""
    graph, inputs, want, y = _product(m, k, n, layout)
    _assert_close(run(graph, inputs).values[y], want, k)


@pytest.mark.parametrize("plan", ["64x64x16/s4", "128x128x8", "gemv32/s2", "simd16"], indirect=True)
def test_batched_plans(plan):
    m = 5 if plan.startswith("gemv") else 70
    for layout in ("nn", "tt"):
        graph, inputs, want, y = _product(m, 300, 36, layout, batch=(3,))
        _assert_close(run(graph, inputs).values[y], want, 300)


def test_64_deep_k_steps_where_they_fit():
    """64x64x64 needs 34 KiB without prefetch: run it where the adapter allows, and check
    choose_plan falls back to a tile that fits where it does not (lavapipe: 32 KiB)."""
    limits = device_limits()
    need = matmul.tiled_shared_bytes(matmul.TILINGS["64x64x64"], prefetch=False)
    if need > limits.max_workgroup_storage_size:
        force_plan(None)
        matmul.TUNED[(36, 520, 68, "nt")] = "64x64x64"
        try:
            plan = matmul.choose_plan(36, 520, 68, 1, "nt", limits)
        finally:
            del matmul.TUNED[(36, 520, 68, "nt")]
        assert matmul.tiled_shared_bytes(plan.tiling, plan.prefetch) <= need
        assert plan.tiling.name == "64x64x16" and not plan.prefetch
        return
    force_plan("64x64x64/np")
    try:
        for layout in ("nn", "nt", "tn", "tt"):
            graph, inputs, want, y = _product(36, 520, 68, layout)
            _assert_close(run(graph, inputs).values[y], want, 520)
    finally:
        force_plan(None)


def test_default_plans_match_float64():
    """The heuristic's own choices (gemv, split-K, each tiling) on shapes that trigger them."""
    cases = [(1, 2048, 36, "nt"), (2, 64, 33, "nn"), (64, 2048, 64, "nn"), (64, 1024, 20, "tn")]
    cases += [(520, 16, 260, "nt")]
    for m, k, n, layout in cases:
        graph, inputs, want, y = _product(m, k, n, layout)
        _assert_close(run(graph, inputs).values[y], want, k)


def test_heuristic():
    assert heuristic_plan(4096, 4096, 4096) == Plan("tiled", LARGE, deep=True)
    assert heuristic_plan(128, 576, 576).splits == 4  # few tiles, K split in 4 (swept)
    assert heuristic_plan(1024, 1024, 1024) == Plan("tiled", SMALL)  # 256 tiles (measured)
    assert heuristic_plan(1500, 384, 1536).tiling.name == "128x64x16"
    assert heuristic_plan(512, 4096, 512).splits > 1
    assert heuristic_plan(1, 576, 49152) == Plan("gemv")
    assert heuristic_plan(1, 8192, 64).splits > 1
    assert heuristic_plan(300, 37, 260) == Plan("tiled", SMALL)
    assert choose_tiling(4096, 4096, 4096) is LARGE and choose_tiling(257, 3, 1000) is SMALL
    assert choose_tiling(1024, 1024, 64, batch=8) is LARGE


def test_cpu_plan_choice():
    """On a CPU adapter (Limits.cpu): gemv with the CPU lanes, tiles padding least, never
    split or prefetched; on a GPU the choice is the heuristic's / TUNED's as before."""
    from meganeura.codegen.kernel import Limits

    sub = Limits(max_workgroup_storage_size=32768, cpu=True, subgroups=True)
    assert matmul.choose_plan(1, 576, 49152, 1, "nt", sub).name == "gemv16"
    assert matmul.choose_plan(128, 576, 1536, 1, "nt", sub).name == "simd16"
    cpu = Limits(max_workgroup_storage_size=32768, cpu=True)
    gpu = Limits(max_workgroup_storage_size=49152, subgroups=True)  # the H200
    assert matmul.choose_plan(1, 576, 49152, 1, "nt", cpu) == Plan("gemv", lanes=16)
    assert matmul.choose_plan(4, 576, 1536, 1, "nn", cpu) == Plan("gemv", lanes=64)
    assert matmul.choose_plan(128, 576, 1536, 1, "nt", cpu).name == "128x128x8/np"
    assert matmul.choose_plan(16, 576, 1536, 1, "nt", cpu).name == "64x128x16/np"
    assert matmul.choose_plan(1500, 384, 64, 1, "nn", cpu).name == "128x64x16/np"
    assert matmul.choose_plan(512, 4096, 512, 1, "nn", cpu).name == "128x128x8/np"
    for (m, k, n, layout), name in matmul.TUNED.items():
        assert matmul.choose_plan(m, k, n, 1, layout, gpu) == parse_plan(name)
    assert matmul.choose_plan(4096, 4096, 4096, 1, "nn", gpu) == heuristic_plan(4096, 4096, 4096)


@pytest.mark.parametrize("layout", ["nn", "nt", "tn", "tt"])
@pytest.mark.parametrize(
    "m,k,n", [(1, 576, 260), (5, 37, 131), (16, 520, 68), (131, 44, 129), (300, 37, 65)]
)
def test_cpu_plans_match_float64(m, k, n, layout):
    """The plans cpu_plan picks (lavapipe's), run on the test device with Limits.cpu set."""
    import dataclasses

    for subgroups in (False, True):
        limits = dataclasses.replace(device_limits(), cpu=True, subgroups=subgroups)
        graph, inputs, want, y = _product(m, k, n, layout)
        _assert_close(run(graph, inputs, limits=limits).values[y], want, k)


def test_plan_names_round_trip():
    for name in [*TILED, "gemv32", "gemv8/s4", "128x128x16/s2/np", "simd16"]:
        assert parse_plan(name).name == name
    for bad in ["gemv3", "96x96x8", "128x128x8/x", "simd12", "simd16/s2"]:
        with pytest.raises(ValueError):
            parse_plan(bad)


def test_tuned_table_overrides_heuristic(monkeypatch):
    from meganeura.codegen.kernel import Limits

    monkeypatch.setitem(matmul.TUNED, (300, 37, 260, "nt"), "128x64x16/s2")
    plan = matmul.choose_plan(300, 37, 260, 1, "nt", Limits(max_workgroup_storage_size=49152))
    assert plan.name == "128x64x16/s2"


def test_vec4_bindings_only_where_aligned():
    from .harness import device_limits

    for (m, k, n), vec in [((36, 520, 68), 2), ((36, 37, 68), 0)]:
        graph, _, _, y = _product(m, k, n, "nt")
        ((_, ks),) = [(i, ks) for i, ks in lower_all(graph, device_limits()) if i == y]
        assert ks[0].wgsl.count("array<vec4<f32>>") == vec


@pytest.mark.parametrize(
    "plan", ["64x64x16/s3", "gemv32/s2", "128x64x16", "simd16", "simd8"], indirect=True
)
def test_fused_epilogue_with_operand_reread(plan, gpu_device):
    """A bias + relu + residual epilogue reading A itself (through the real compiler with
    fusion on): A keeps one binding; with split-K the epilogue runs in the summing dispatch."""
    from meganeura.compile import CompileOptions
    from meganeura.training import compile_for

    m = 4 if plan.startswith("gemv") or plan == "simd8" else 40
    b = GraphBuilder()
    x = b.input("x", (m, 64))
    w = b.parameter("w", (64, 64))
    bias = b.parameter("bias", (64,))
    b.output("y", F.relu(x @ w.mT + bias) + x)
    program, sess = compile_for(b.build(), CompileOptions(fuse=True), device=gpu_device)
    try:
        names = [d.name for d in program.dispatches]
        assert any("matmul" in n and "+" in n for n in names), names  # the epilogue fused
        assert len(names) == (2 if "/s" in plan else 1), names
        xv, wv, bv = _randn(m, 64), _randn(64, 64), _randn(64)
        sess.load_state_dict({"w": wv, "bias": bv})
        got = sess.run({"x": xv}, fetch=("y",))["y"]
    finally:
        sess.close()
    want = np.maximum(xv.astype(np.float64) @ wv.T.astype(np.float64) + bv, 0) + xv
    _assert_close(got, want, 64)


@pytest.fixture(params=[SMALL, LARGE], ids=["64x64", "128x128"])
def tiling(request):
    force_plan(request.param.name)
    yield request.param
    force_plan(None)


@pytest.mark.parametrize(
    "m,k,n", [(1, 1, 1), (3, 7, 5), (64, 784, 128), (257, 1000, 3), (300, 37, 260), (128, 8, 512)]
)
def test_matmul_shapes(m, k, n, tiling):
    b = GraphBuilder()
    x, w = b.input("x", (m, k)), b.input("w", (k, n))
    b.output("y", x @ w)
    check(b.build(), {"x": _randn(m, k), "w": _randn(k, n)})


@pytest.mark.parametrize(
    "sa,sb",
    [((2, 3, 5, 6), (6, 4)), ((3, 1, 5, 6), (1, 4, 6, 7)), ((4, 9, 3), (4, 3, 70)),
     ((2, 1, 65, 17), (3, 17, 66)), ((1, 5, 6), (3, 6, 7)), ((2, 4, 8), (8, 12))],
    ids=shape_id,
)  # fmt: skip
def test_batched_broadcast(sa, sb, tiling):
    b = GraphBuilder()
    x, w = b.input("x", sa), b.input("w", sb)
    b.output("y", x @ w)
    check(b.build(), {"x": _randn(*sa), "w": _randn(*sb)})


def test_batch_folds_into_rows_when_b_is_shared():
    force_plan("64x64x16")
    try:
        b = GraphBuilder()
        x, w = b.input("x", (2, 3, 65, 17)), b.parameter("w", (66, 17))
        y = b.output("y", x @ w.mT)  # a linear layer over a [2, 3, 65] batch
        res = check(b.build(), {"x": _randn(2, 3, 65, 17)}, {"w": _randn(66, 17)})
    finally:
        force_plan(None)
    (k,) = [k for k in res.kernels if k.name.startswith(f"%{y.id} ")]
    assert k.grid == (7 * 2, 1, 1)  # ceil(390 / 64) x ceil(66 / 64) tiles, not 6 x 2 x 2


def test_transposed_operands_are_folded():
    b = GraphBuilder()
    x = b.input("x", (33, 20))
    w = b.parameter("w", (70, 20))  # PyTorch layout [out, in]
    g = b.input("g", (33, 70))
    y = b.output("y", x @ w.mT)  # linear layer
    gx = b.output("gx", g @ w)
    gw = b.output("gw", g.mT @ x)  # weight gradient: transposed left operand
    both = b.output("both", F.permute(w, (1, 0)).mT @ x.mT)  # (w^T)^T @ x^T = w @ x^T
    graph = b.build()
    assert reads(graph, y.id) == (x.id, w.id)
    assert reads(graph, gw.id) == (g.id, x.id)
    res = check(graph, {"x": _randn(33, 20), "g": _randn(33, 70)}, {"w": _randn(70, 20)})
    for k in res.kernels:
        if k.name.startswith(f"%{y.id} ") or k.name.startswith(f"%{gw.id} "):
            assert all(graph[r.node].op != "permute" for r in k.bindings)
    assert res.values[both.id].shape == (70, 33)
    del gx


@pytest.mark.parametrize("plan", ["64x64x16", "gemv32"], indirect=True)
@pytest.mark.parametrize("k", [5, 8])
def test_batched_transpose_fold_and_same_operand_twice(k, plan):
    m = 4 if plan.startswith("gemv") else 9
    b = GraphBuilder()
    x = b.input("x", (2, 3, m, k))
    gram = b.output("gram", x @ x.mT)  # the same value bound once, read two ways
    graph = b.build()
    assert reads(graph, gram.id) == (x.id,)
    res = check(graph, {"x": _randn(2, 3, m, k)})
    (kern,) = [kk for kk in res.kernels if kk.name.startswith(f"%{gram.id} ")]
    assert len(kern.bindings) == 2


@pytest.mark.parametrize("mode", ["no_global", "no_shared"])
def test_benchmark_ablations_compile_and_leave_no_trace(mode):
    """bench/matmul_ablation.py's variants must stay valid WGSL (they are only timed), and
    lowering after them is the ordinary kernel again."""
    from meganeura.codegen.wgsl.matmul import tiled as matmul_tiled

    graph, inputs, want, y = _product(64, 40, 64, "nn")
    force_plan("64x64x16/d2")
    matmul_tiled.ABLATE[:] = [mode]
    try:
        ablated = run(graph, inputs).values[y]
    finally:
        matmul_tiled.ABLATE[:] = []
    try:
        _assert_close(run(graph, inputs).values[y], want, 40)
    finally:
        force_plan(None)
    assert ablated.shape == want.shape


@pytest.mark.parametrize(
    "plan", ["256x128x8/d2", "128x128x8/s5/d2", "64x64x16/s7/d2"], indirect=True
)
@pytest.mark.parametrize("layout", ["nn", "tt"])
@pytest.mark.parametrize("m,k,n", [(9, 8, 7), (257, 40, 5), (5, 250, 300)])
def test_two_deep_prefetch_on_ragged_steps(m, k, n, layout, plan):
    """One K step, split chunks of one to three steps, an odd step count: the two-deep loop's
    break and its alternating buffers."""
    graph, inputs, want, y = _product(m, k, n, layout)
    _assert_close(run(graph, inputs).values[y], want, k)


@pytest.mark.parametrize("plan", ["128x128x8/d2", "64x64x16/s3/d2"], indirect=True)
def test_batched_two_deep_prefetch(plan):
    for layout in ("nn", "tn"):
        graph, inputs, want, y = _product(70, 45, 36, layout, batch=(3,))
        _assert_close(run(graph, inputs).values[y], want, 45)

"""The conv GEMM plan table (``conv/tuned.py``): valid plans that fit the H200, chosen by
``plan_gemm`` on GPU adapters (recorded in ``Program.meta["convs"]``), ignored on CPU adapters
and under ``force_plan``, and giving the default plan's results (bit for bit, or within the
reordering of split-K sums) when run on the test adapter with GPU-style limits."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from bench.conv_table import h200_limits
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.conv import plan as gemm
from meganeura.codegen.wgsl.conv import tuned
from meganeura.codegen.wgsl.conv.plan import SMALL, Gemm, parse_plan, plan_gemm, plan_source

from .harness import run
from .test_conv import _conv_graph, _rel, _torch_conv

H200 = h200_limits()  # the limits the table was emitted for
OP = {kind: op for op, kind in tuned.KIND.items()}


def _gemm(key) -> Gemm:
    return Gemm(*key[1:])


def test_every_entry_is_a_valid_plan_that_fits_the_h200():
    assert tuned.TUNED, "the table is empty"
    for key, name in tuned.TUNED.items():
        kind, m, n, k, groups = key
        assert kind in OP and min(m, n, k, groups) > 0, key
        g = _gemm(key)
        plan = parse_plan(name, g)
        assert plan.name == name, (key, name, plan.name)  # the name round-trips
        assert plan.per * plan.splits >= k > plan.per * (plan.splits - 1), (key, plan)
        assert gemm.shared_bytes(plan.tiling, plan.prefetch) <= H200.max_workgroup_storage_size
        assert plan.splits <= min(gemm.MAX_SPLITS, gemm._scratch_cap(g, H200)), key
        # the table's plan is what the H200 gets, and it differs from the rules'
        assert plan_source(g, H200, OP[kind]) == (plan, "tuned"), key
        with gemm.force_plan():
            assert plan_gemm(g, H200, OP[kind]) != plan, (key, "no better than the rules")


@pytest.mark.parametrize(
    "bad", ["64x64x16", "64x64x16/s2", "32x32x8/pf", "64x64x16/s2/d3", "64x64x16/sx/pf"]
)
def test_parse_plan_rejects_bad_names(bad):
    with pytest.raises(ValueError, match="conv GEMM"):
        parse_plan(bad, Gemm(64, 64, 64, 1))


def test_table_is_for_gpu_adapters_without_a_forced_plan():
    key, name = next(iter(tuned.TUNED.items()))
    g, op = _gemm(key), OP[key[0]]
    assert plan_source(g, Limits(), op)[1] == "tuned"  # WebGPU's minimum limits, a GPU
    assert plan_source(g, Limits(cpu=True), op)[1] == "cpu"  # lavapipe / llvmpipe
    assert plan_source(g, H200)[1] == "heuristic"  # no op, no kind: no look-up
    # another product of the same sizes
    other = next(OP[kind] for kind in OP if (kind, *key[1:]) not in tuned.TUNED)
    assert plan_source(g, H200, other)[1] == "heuristic"
    with gemm.force_plan(deep=False):
        assert plan_source(g, H200, op)[1] == "forced"


def test_tight_workgroup_memory_drops_prefetch_then_the_entry(monkeypatch):
    g = Gemm(256, 784, 2304, 1)
    monkeypatch.setitem(tuned.TUNED, ("bwd_input", 256, 784, 2304, 1), "128x128x8/s9/pf")
    # 128x128x8 needs 8 KiB a buffer: prefetch (two) does not fit 12 KiB, one buffer does
    plan, source = plan_source(g, Limits(max_workgroup_storage_size=12288), OP["bwd_input"])
    assert (source, plan.name) == ("tuned", "128x128x8/s9/np")
    plan, source = plan_source(g, Limits(max_workgroup_storage_size=4096), OP["bwd_input"])
    assert source == "heuristic"  # the rules' own fallback then


def test_h200_lowering_of_a_resnet_shape_takes_the_table_plans():
    """ResNet-50's layer-2 3x3 convolution at batch 4 (l2_3x3_128), compiled for the H200's
    limits and never run: each of its three GEMMs is in the table."""
    graph, ids = _conv_graph((4, 128, 28, 28), (128, 128, 3, 3), padding=1)
    program = mn.compile(graph, None, H200)
    convs = program.meta["convs"]
    assert [c["op"] for c in convs] == ["conv2d", "conv2d_backward_input", "conv2d_backward_weight"]
    for c in convs:
        key = (tuned.KIND[c["op"]], c["m"], c["n"], c["k"], c["groups"])
        assert (c["source"], c["plan"]) == ("tuned", tuned.TUNED[key]), c
    # the CPU adapter's compile of the same graph ignores the table
    cpu = mn.compile(graph, None, Limits(cpu=True, max_workgroup_storage_size=32768))
    assert {c["source"] for c in cpu.meta["convs"]} == {"cpu"}
    assert [c["plan"] for c in cpu.meta["convs"]] != [c["plan"] for c in convs]


# (x shape, w shape, conv kwargs, {kind: plan}) for small shapes entered into the table
CASES = {
    # 3x3 padded, 2 x 16 x 9 x 9 -> 24: every part split K on the table's plan
    "split": ((2, 16, 9, 9), (24, 16, 3, 3), dict(padding=1),
              {"fwd": "64x64x16/s3/d2", "bwd_input": "128x128x8/s2/pf",
               "bwd_weight": "16x256x8/s4/np"}),
    # 1x1 stride 2: one stride phase's GEMM plus zeros, unsplit on the table's plan
    "pointwise_s2": ((1, 24, 8, 8), (20, 24, 1, 1), dict(stride=2),
                     {"fwd": "128x128x8/np", "bwd_input": "64x64x16/pf",
                      "bwd_weight": "64x64x16/np"}),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_table_plans_match_the_default_results(case, monkeypatch):
    x_shape, w_shape, kw, plans = CASES[case]
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    rng = np.random.default_rng(5)
    feeds = {
        "x": rng.standard_normal(x_shape).astype(np.float32),
        "w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32),
        "b": rng.standard_normal(w_shape[:1]).astype(np.float32),
    }
    feeds["g"] = rng.standard_normal(graph[ids[0]].type.shape).astype(np.float32)
    with gemm.record_choices() as rows:
        default = run(graph, feeds)
    # a strided input gradient's phases run merged on GPU-style limits and take no table plan
    rows = [r for r in rows if r["source"] != "merged"]
    assert {r["source"] for r in rows} == {"heuristic"}  # the harness: GPU-style limits
    for r in rows:
        key = (tuned.KIND[r["op"]], r["m"], r["n"], r["k"], r["groups"])
        assert r["plan"] != plans[key[0]], (case, key)  # the table really changes the plan
        monkeypatch.setitem(tuned.TUNED, key, plans[key[0]])
    with gemm.record_choices() as rows:
        got = run(graph, feeds)
    rows = [r for r in rows if r["source"] != "merged"]
    assert [(r["source"], r["plan"]) for r in rows] == [
        ("tuned", plans[tuned.KIND[r["op"]]]) for r in rows
    ]
    want = _torch_conv(feeds, **kw)
    for nid, ref in zip(ids, want, strict=True):
        a, b = default.values[nid], got.values[nid]
        # the same FMAs in the same K order unless the split changed: then 1e-5 relative
        assert _rel(b, a) <= 1e-5, (case, graph[nid].op, _rel(b, a))
        assert _rel(b, ref) <= 1e-5, (case, graph[nid].op, _rel(b, ref))


def test_a_gemm_not_in_the_table_keeps_the_rules_plan():
    g = Gemm(64, 64, 600, 1)
    assert all((kind, 64, 64, 600, 1) not in tuned.TUNED for kind in OP)
    assert plan_gemm(g, H200, "conv2d") == plan_gemm(g, H200) and plan_gemm(g, H200).tiling == SMALL


def test_merged_stride_phases_are_listed_in_the_program_meta():
    """A 3x3 stride-2 convolution compiled for the H200's limits: its input gradient's four
    phase GEMMs (one dispatch, ``conv/phases.py``) are listed with source "merged", their K
    the taps reaching each phase times the channels (4, 2, 2, 1 taps)."""
    graph, _ = _conv_graph((4, 128, 28, 28), (128, 128, 3, 3), stride=2, padding=1)
    convs = mn.compile(graph, None, H200).meta["convs"]
    merged = [c for c in convs if c["source"] == "merged"]
    assert {c["op"] for c in merged} == {"conv2d_backward_input"}
    assert sorted(c["k"] for c in merged) == [128, 256, 256, 512]
    assert {c["source"] for c in convs if c not in merged} <= {"tuned", "heuristic"}

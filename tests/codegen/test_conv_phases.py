"""The stride phases of a strided input gradient in one dispatch (``conv/phases.py``): the same
bits as the per-phase kernels (``conv.lowering.MERGE_PHASES = False``) under the same plans,
unsplit and split, and torch's float64 gradients within 1e-5; the dispatch counts and the
merged split rule.

The CPU adapter would pick its own tilings and never split, so the plans are forced
(``conv.gemm.force_plan``, as tests/codegen/test_conv_prefetch.py) and the codegen harness
runs with the adapter's GPU-style limits.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.conv import gemm, lowering, phases
from meganeura.codegen.wgsl.conv import plan as conv_plan
from meganeura.codegen.wgsl.conv.gemm import LARGE, NARROW, SMALL, Gemm, force_plan
from meganeura.codegen.wgsl.conv.phases import phase_plans

from .harness import run
from .test_conv import _conv_graph, _rel, _torch_conv
from .test_conv_prefetch import _feeds

# (x shape, w shape, conv kwargs): input gradients of strided convolutions
CASES = {
    "3x3s2p1_odd": ((2, 6, 11, 9), (10, 6, 3, 3), dict(stride=2, padding=1)),
    "3x3s2p1_even": ((1, 5, 10, 12), (20, 5, 3, 3), dict(stride=2, padding=1)),
    "7x7s2p3": ((1, 3, 19, 17), (9, 3, 7, 7), dict(stride=2, padding=3)),
    # 1x1 stride 2: three phases no tap reaches (K = 0, zeros)
    "1x1s2": ((2, 24, 9, 10), (40, 24, 1, 1), dict(stride=2)),
    "3x3s3p1": ((1, 4, 13, 14), (6, 4, 3, 3), dict(stride=3, padding=1)),
    "grouped_3x3s2": ((1, 6, 10, 9), (9, 2, 3, 3), dict(stride=2, padding=1, groups=3)),
    "depthwise_3x3s2": ((1, 8, 9, 10), (8, 1, 3, 3), dict(stride=2, padding=1, groups=8)),
    "dilated_3x2s2": ((1, 4, 9, 8), (5, 4, 3, 2), dict(stride=2, padding=1, dilation=2)),
}


PHASES = ("0,0", "0,1", "1,0", "1,1")


def _dx_kernels(graph, dx: int, limits: Limits) -> list[str]:
    return [k.name.split(" ", 2)[-1] for k in lower(graph, dx, limits)]


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
def test_merged_phases_are_bit_identical_to_per_phase_kernels(case, monkeypatch):
    """Unsplit and split 3 ways (SMALL tiles, two-deep prefetch; NARROW unsplit without
    prefetch): dx of the merged dispatch equals the per-phase kernels' bit for bit, y and dw
    are untouched, and dx is torch's float64 gradient within 1e-5."""
    x_shape, w_shape, kw = CASES[case]
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    feeds = _feeds(graph, ids[0], x_shape, w_shape)
    forces = [dict(tiling=SMALL, splits=1), dict(tiling=SMALL, splits=3),
              dict(tiling=NARROW, splits=1, prefetch=False)]  # fmt: skip
    for force in forces:
        got = {}
        for merged in (True, False):
            monkeypatch.setattr(lowering, "MERGE_PHASES", merged)
            with gemm.record_plans() as plans, force_plan(**force):
                res = run(graph, feeds)
                names = _dx_kernels(graph, ids[1], Limits())
            got[merged] = [res.values[i] for i in ids]
            if merged:
                assert names[0] == "gemm phases" and len(names) <= 2, names
                dx_plans = [p for op, p in plans if op == "conv2d_backward_input"]
                assert all(p.startswith("merged:") for p in dx_plans), dx_plans
                if force["splits"] > 1 and any("/s" in p for p in dx_plans):
                    assert names == ["gemm phases", "sum_splits phases"], names
        for nid, a, b in zip(ids, got[True], got[False], strict=True):
            diff = float(np.abs(a - b).max())
            assert np.array_equal(a, b), (graph[nid].op, force, diff)
    want = _torch_conv(feeds, **kw)
    for nid, ours, ref in zip(ids, got[True], want, strict=True):
        assert _rel(ours, ref) <= 1e-5, (graph[nid].op, _rel(ours, ref))


@pytest.mark.gpu
def test_merged_phases_with_128x128_tiles_are_bit_identical(monkeypatch):
    """The LARGE tiling (8x8 accumulators a thread), unsplit and split 2 ways."""
    x_shape, w_shape, kw = (1, 20, 9, 11), (24, 20, 3, 3), dict(stride=2, padding=1)
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    feeds = _feeds(graph, ids[0], x_shape, w_shape)
    for splits in (1, 2):
        got = {}
        for merged in (True, False):
            monkeypatch.setattr(lowering, "MERGE_PHASES", merged)
            with force_plan(LARGE, splits=splits):
                got[merged] = run(graph, feeds).values[ids[1]]
        assert np.array_equal(got[True], got[False]), splits
    assert _rel(got[True], _torch_conv(feeds, **kw)[1]) <= 1e-5


@pytest.mark.gpu
def test_merged_phases_many_splits_and_min_chunk(monkeypatch):
    """More than ``LANES_FROM_SPLITS`` splits (four threads summing an element) bit-identical
    to the per-phase kernels; the default plan with ``MIN_CHUNK`` 16 against torch."""
    x_shape, w_shape, kw = (1, 4, 9, 8), (48, 4, 3, 3), dict(stride=2, padding=1)
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    feeds = _feeds(graph, ids[0], x_shape, w_shape)
    got = {}
    for merged in (True, False):
        monkeypatch.setattr(lowering, "MERGE_PHASES", merged)
        with gemm.record_plans() as plans, force_plan(SMALL, splits=12):
            got[merged] = run(graph, feeds).values[ids[1]]
        assert any("/s12/" in p for _, p in plans), plans
    assert np.array_equal(got[True], got[False])
    monkeypatch.setattr(lowering, "MERGE_PHASES", True)
    monkeypatch.setattr(phases, "MIN_CHUNK", 16)
    with gemm.record_plans() as plans:
        dx = run(graph, feeds).values[ids[1]]
    assert any(p.startswith("merged:") and "/s" in p for _, p in plans), plans
    assert _rel(dx, _torch_conv(feeds, **kw)[1]) <= 1e-5


def test_merged_phases_dispatch_counts(monkeypatch):
    """3x3 stride 2: 4 GEMMs (+4 sums when split) become one (+1); 1x1 stride 2: the zero
    pass and the GEMM become one dispatch; not on a CPU adapter."""
    graph, ids = _conv_graph((2, 64, 16, 16), (64, 64, 3, 3), stride=2, padding=1)
    g1, ids1 = _conv_graph((2, 24, 9, 10), (40, 24, 1, 1), stride=2)
    # a CPU adapter keeps the phases apart (lowering.MERGE_PHASES: slower merged on lavapipe)
    assert _dx_kernels(graph, ids[1], Limits(cpu=True)) == [f"gemm {r}" for r in PHASES]
    with force_plan(SMALL, splits=2):
        assert len(_dx_kernels(graph, ids[1], Limits())) == 2
        monkeypatch.setattr(lowering, "MERGE_PHASES", False)
        assert len(_dx_kernels(graph, ids[1], Limits())) == 8
    with force_plan(SMALL, splits=1):
        assert _dx_kernels(g1, ids1[1], Limits()) == ["zero_phases", "gemm 0,0"]
        monkeypatch.setattr(lowering, "MERGE_PHASES", True)
        assert _dx_kernels(g1, ids1[1], Limits()) == ["gemm phases"]


def test_merged_split_rule_fills_the_gpu_across_phases(monkeypatch):
    """One chunk length for all phases (ResNet-50 b4's layer-3 3x3 stride 2: K = 256 x 1, 2,
    2, 4 taps): the longest K splits most, the one-tap phase not at all, the workgroups of all
    phases together near TARGET_GROUPS rather than each phase's; enough tiles: no split."""
    n = 4 * 14 * 14
    gs = [Gemm(256, n, 256 * taps, 1) for taps in (1, 2, 2, 4)]
    plans = phase_plans(gs, Limits())
    assert {p.tiling for p in plans} == {SMALL}
    assert [p.splits for p in plans] == [1, 2, 2, 3]
    groups = sum(gemm.gemm_groups(g, p) for g, p in zip(gs, plans, strict=True))
    per_phase = sum(gemm.gemm_groups(g, gemm.plan_gemm(g, Limits())) for g in gs)
    assert groups < per_phase and abs(groups - gemm.TARGET_GROUPS) < gemm.TARGET_GROUPS
    big = [Gemm(256, 4 * 56 * 56, 256 * taps, 1) for taps in (1, 2, 2, 4)]
    assert [p.splits for p in phase_plans(big, Limits())] == [1] * 4
    assert [p.splits for p in phase_plans(gs, Limits(cpu=True))] == [1] * 4
    with force_plan(splits=3):  # forced: each phase as plan_gemm splits it
        assert [p.splits for p in phase_plans(gs, Limits())] == [
            gemm.plan_gemm(g, Limits()).splits for g in gs
        ]
    # the U-Net's 3x3 stride 2 64 -> 64 at batch 2: K <= 256, split down to chunks of 64
    # (MIN_CHUNK), unsplit at the old floor of MIN_SPLIT_K
    small = [Gemm(64, 2 * 16 * 16, 64 * taps, 1) for taps in (1, 2, 2, 4)]
    assert [p.splits for p in phase_plans(small, Limits())] == [1, 2, 2, 4]
    monkeypatch.setattr(phases, "MIN_CHUNK", None)
    assert [p.splits for p in phase_plans(small, Limits())] == [1] * 4
    k0 = phase_plans([Gemm(64, 100, 0, 1), Gemm(64, 100, 600, 1)], Limits())
    assert k0[0].prefetch is False and k0[1].prefetch is conv_plan.PREFETCH


# The H200's limits (bench/dispatch_counts.py): GPU plans, split-K, two-deep prefetch.
H200 = Limits(max_workgroup_storage_size=49152, max_invocations_per_workgroup=1024,
              max_storage_buffer_binding_size=2**31 - 4, max_buffer_size=2**40)  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["l4_3x3s2_512", "l3_ds_1x1s2_512_1024", "unet_3x3s2_128"])
def test_h200_merged_kernels_validate(case, gpu_device):
    """ResNet-50 b4's and the U-Net's strided input gradients as the H200 compiles them (the
    phases split, one summing dispatch) are valid WGSL for naga (shader modules only, not
    run). Naga does not check that barriers sit in uniform control flow (it accepts a barrier
    under ``if (lid == 0u)``), so ``_barriers_uniform`` checks the blocks around each."""
    x_shape, w_shape, kw = {
        "l4_3x3s2_512": ((4, 512, 14, 14), (512, 512, 3, 3), dict(stride=2, padding=1)),
        "l3_ds_1x1s2_512_1024": ((4, 512, 28, 28), (1024, 512, 1, 1), dict(stride=2)),
        "unet_3x3s2_128": ((2, 128, 16, 16), (128, 128, 3, 3), dict(stride=2, padding=1)),
    }[case]
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    kernels = lower(graph, ids[1], H200)
    assert [k.name.split(" ", 2)[-1] for k in kernels] == ["gemm phases", "sum_splits phases"]
    assert kernels[0].wgsl.count("workgroupBarrier") >= 3
    with pytest.raises(AssertionError):  # the check itself
        _barriers_uniform("if (wg < 2u) {\n  if (lid == 0u) {\n    workgroupBarrier();\n  }\n}")
    for k in kernels:
        _barriers_uniform(k.wgsl)
        gpu_device.gpu.create_shader_module(code=k.wgsl)


def _barriers_uniform(wgsl: str) -> None:
    """Every ``workgroupBarrier`` of ``wgsl`` lies only in blocks whose header (``if``,
    ``for``, ``else if``) names no per-thread value (``lid`` and the names derived from it in
    these kernels: ``lane``, ``tx``, ``ty``, slots ``l*``)."""
    import re

    thread = re.compile(r"\b(lid|lane|tx|ty|l[ab]\d+_[rk])\b")
    stack: list[str] = []
    for line in wgsl.splitlines():
        code = line.strip()
        if "workgroupBarrier" in code:
            bad = [h for h in stack if thread.search(h)]
            assert not bad, (code, bad)
        opens, closes = code.count("{"), code.count("}")
        if code.startswith("}"):
            stack = stack[: len(stack) - 1]
            closes -= 1
        for _ in range(opens - closes):
            stack.append("" if code.startswith("fn ") else code)
        for _ in range(closes - opens):
            stack = stack[: len(stack) - 1]

"""The conv GEMM's register prefetch (``conv/stage.py``): bit-identical to the kernel without
it for every GEMM role, tiling and split, plus the plan rules (``conv.gemm.plan_gemm``).

The CPU adapter would pick its own tiling and never split, so the plans are forced
(``conv.gemm.force_plan``) and the codegen harness runs with the adapter's GPU-style limits.
"""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.conv import gemm
from meganeura.codegen.wgsl.conv import plan as conv_plan
from meganeura.codegen.wgsl.conv.gemm import LARGE, NARROW, SMALL, Gemm, force_plan, plan_gemm

from .harness import run
from .test_conv import _conv_graph, _rel, _torch_conv

rng = np.random.default_rng(23)

# (x shape, w shape, conv kwargs): every GEMM role, ragged M, N and K in each
CASES = {
    # 3x3 stride 2: four stride phases of the input gradient
    "stride2_3x3": ((2, 6, 11, 9), (10, 6, 3, 3), dict(stride=2, padding=1)),
    # the ResNet stem's geometry, small: 7x7, stride 2, padding 3, 3 input channels
    "stem_7x7s2p3": ((1, 3, 19, 17), (9, 3, 7, 7), dict(stride=2, padding=3)),
    # 1x1, stride 1 (K = channels, no padding conditions)
    "pointwise_1x1": ((2, 37, 7, 6), (21, 37, 1, 1), {}),
    # depthwise (groups = channels) and grouped with a bias
    "depthwise": ((2, 8, 9, 10), (8, 1, 3, 3), dict(padding=1, groups=8)),
    "grouped_dilated": ((1, 6, 12, 12), (9, 2, 3, 3), dict(padding=2, dilation=2, groups=3)),
}
TILINGS = {"small": SMALL, "large": LARGE, "narrow": NARROW}
# every shape with the 64x64 tile; the 128x128 and 16x256 tiles on a strided and an unstrided
# shape each (their kernels are the slowest to compile on lavapipe: CI's time)
PAIRS = [(c, "small") for c in CASES] + [
    ("stride2_3x3", "narrow"),
    ("stem_7x7s2p3", "narrow"),
    ("depthwise", "narrow"),
    ("pointwise_1x1", "large"),
    ("depthwise", "large"),
    ("grouped_dilated", "large"),
]


def _feeds(graph, y, x_shape, w_shape):
    feeds = {
        "x": rng.standard_normal(x_shape).astype(np.float32),
        "w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32),
        "b": rng.standard_normal(w_shape[:1]).astype(np.float32),
    }
    feeds["g"] = rng.standard_normal(graph[y].type.shape).astype(np.float32)
    return feeds


@pytest.mark.gpu
@pytest.mark.parametrize("case,tiling", PAIRS, ids=[f"{c}-{t}" for c, t in PAIRS])
def test_prefetch_is_bit_identical_to_no_prefetch(case, tiling):
    """Forward, input and weight gradients, unsplit and split 3 ways: the prefetching kernels
    (one-deep and two-deep) give the same bits as the one without (same FMAs in the same K
    order)."""
    x_shape, w_shape, kw = CASES[case]
    graph, ids = _conv_graph(x_shape, w_shape, **kw)
    feeds = _feeds(graph, ids[0], x_shape, w_shape)
    modes = {"np": dict(prefetch=False), "pf": dict(prefetch=True, deep=False),
             "d2": dict(prefetch=True, deep=True)}  # fmt: skip
    for splits in (1, 3):
        got = {}
        for mode, force in modes.items():
            with gemm.record_plans() as plans, force_plan(TILINGS[tiling], splits=splits, **force):
                res = run(graph, feeds)
            names = [name for _, name in plans]
            assert all(n.endswith("/" + mode) for n in names), names
            if splits > 1:
                assert any("/s" in n for n in names), names  # some GEMM really split
            got[mode] = [res.values[i] for i in ids]
        for mode in ("pf", "d2"):
            for nid, a, b in zip(ids, got["np"], got[mode], strict=True):
                diff = float(np.abs(a - b).max())
                assert np.array_equal(a, b), (graph[nid].op, splits, mode, diff)
    want = _torch_conv(feeds, **kw)
    for nid, ours, ref in zip(ids, got["d2"], want, strict=True):
        assert _rel(ours, ref) <= 1e-5, (graph[nid].op, _rel(ours, ref))


def test_prefetch_doubles_the_tiles_and_keeps_two_barriers():
    graph, ids = _conv_graph((2, 16, 9, 9), (32, 16, 3, 3), padding=1)
    for prefetch, deep, barriers in [(False, False, 2), (True, False, 2), (True, True, 3)]:
        with force_plan(SMALL, prefetch, deep=deep):
            kernels = [k for nid in ids for k in lower(graph, nid, Limits())]
        for k in kernels:
            if k.name.endswith("gemm"):
                size = 2 * 256 if prefetch else 256  # 16 x 64 / 4 vec4 per buffer
                assert f"As: array<vec4<f32>, {size}>" in k.wgsl
                assert ("var par" in k.wgsl) == (prefetch and not deep)
                assert ("var aw0" in k.wgsl) == deep
                assert k.wgsl.count("workgroupBarrier") == barriers


def test_plan_rules():
    g = Gemm(16, 4096, 600, 1)  # NARROW
    assert plan_gemm(Gemm(64, 64, 600, 1), Limits()).prefetch is conv_plan.PREFETCH
    assert plan_gemm(Gemm(64, 64, 600, 1), Limits(cpu=True)).prefetch is False  # CPU adapter
    # NARROW doubled needs 17408 B: above WebGPU's guaranteed 16 KiB, one buffer then
    assert gemm.shared_bytes(NARROW, True) > 16384 >= gemm.shared_bytes(NARROW, False)
    tight = Limits(max_workgroup_storage_size=16384)
    with force_plan(prefetch=True):
        assert plan_gemm(g, tight).prefetch is False
        assert plan_gemm(Gemm(64, 64, 600, 1), tight).prefetch is True
        assert plan_gemm(Gemm(64, 64, 0, 1), Limits()).prefetch is False  # empty K
    with force_plan(SMALL, splits=1):
        assert plan_gemm(Gemm(64, 147, 50176, 1), Limits()).splits == 1
    default = plan_gemm(Gemm(64, 147, 50176, 1), Limits()).splits
    with force_plan(target_groups=2 * gemm.TARGET_GROUPS):
        assert plan_gemm(Gemm(64, 147, 50176, 1), Limits()).splits > default > 1
    with force_plan(deep=True):
        assert plan_gemm(Gemm(64, 64, 600, 1), Limits()).name == "64x64x16/s2/d2"
        assert plan_gemm(Gemm(64, 64, 600, 1), Limits(cpu=True)).deep is False  # no prefetch
    with force_plan("large", False, 4):
        plan = plan_gemm(Gemm(64, 64, 1000, 1), Limits())
        assert (plan.tiling, plan.prefetch, plan.splits, plan.name) == (
            LARGE, False, 4, "128x128x8/s4/np",
        )  # fmt: skip
    for bad, match in [(dict(tiling="huge"), "tiling"), (dict(splits=0), "splits"),
                       (dict(splits=2, target_groups=8), "not both")]:  # fmt: skip
        with pytest.raises(ValueError, match=match), force_plan(**bad):
            pass

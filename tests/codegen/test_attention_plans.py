"""Forced lane plans of the flash-attention kernels (``attention.plan.LANE_OVERRIDE``): plans the
automatic choice never picks (128 and 256 threads, tiles of 64, one lane per row, one row per
workgroup) give the output and q/k/v gradients of float64 torch through the whole pipeline
(fwd+lse, dq+delta, dkv or dk and dv), and an invalid override raises an error naming the
mode, the plan and the limit it breaks."""

from __future__ import annotations

import re

import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.attention import plan as attention_plan
from meganeura.codegen.wgsl.attention.plan import Dims, Plan, check_plan, choose_plan
from meganeura.codegen.wgsl.attention.tuned import TUNED
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder

from .test_attention import _graph, _rel
from .test_attention_kv import H200, _run_fused

LANE_MODES = ("fwd", "dq", "dk", "dv", "dkv")
SMOLLM2 = Dims(1, 3, 3, 128, 128, 64, 64)

# name: (rows, lanes, tile) forced for every lane mode
PLANS = {
    "t128_tile64": (8, 16, 64),  # 128 threads, 4 entries per lane
    "t256_tile64": (4, 64, 64),  # 256 threads, one entry per lane, a 6-round merge
    "t256_lanes8": (32, 8, 64),  # 256 threads, 8 entries per lane
    "lanes1": (64, 1, 8),  # one thread per row: no merge
    "rows1": (1, 32, 64),  # one row per workgroup
}
# name: (q, k, v shapes, kwargs); head dims small enough for lavapipe's 32 KiB at tile 64
SHAPES = {
    "causal_gqa": ((1, 6, 37, 16), (1, 2, 41, 16), (1, 2, 41, 16),
                   {"is_causal": True, "enable_gqa": True}),
    "cross_gqa_odd_dv": ((2, 4, 19, 8), (2, 2, 70, 8), (2, 2, 70, 6), {"enable_gqa": True}),
}  # fmt: skip


@pytest.fixture
def lane_override():
    """Set ``LANE_OVERRIDE`` and ``FUSE_KEY_VALUE``; both restored after the test."""
    saved = dict(attention_plan.LANE_OVERRIDE), attention_plan.FUSE_KEY_VALUE

    def force(plans: dict, fuse: bool | None = None):
        attention_plan.LANE_OVERRIDE.update(plans)
        attention_plan.FUSE_KEY_VALUE = fuse

    yield force
    attention_plan.LANE_OVERRIDE.clear()
    attention_plan.LANE_OVERRIDE.update(saved[0])
    attention_plan.FUSE_KEY_VALUE = saved[1]


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False], ids=["dkv", "dk_dv"])
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("plan", PLANS)
def test_forced_plans_match_torch(plan, shape, fuse, gpu_device, lane_override):
    lane_override({m: PLANS[plan] for m in LANE_MODES}, fuse)
    qs, ks, vs, kw = SHAPES[shape]
    got, want, kernels = _run_fused(gpu_device, qs, ks, vs, seed=5, **kw)
    expect = ["scaled_dot_product_attention", "scaled_dot_product_attention_backward_query"]
    if fuse:
        expect.append("scaled_dot_product_attention_backward_key_value")
    else:
        expect += ["scaled_dot_product_attention_backward_key",
                   "scaled_dot_product_attention_backward_value"]  # fmt: skip
    assert kernels == expect
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < 2e-6, n


def test_forced_plan_sets_the_workgroup_size(lane_override):
    """The kernel's workgroup is rows * lanes threads, its tile the forced length."""
    lane_override({"fwd": (16, 16, 64)})
    graph, ids = _graph((1, 9, 128, 64), (1, 3, 128, 64), (1, 3, 128, 64), enable_gqa=True,
                        is_causal=True)  # fmt: skip
    b = GraphBuilder(graph)
    b.output("dq", b.tensor(ids["q"]))
    program = compile(b.build_unverified(), CompileOptions(), H200)
    kernels = {d.name.split()[1]: d.wgsl for d in program.dispatches if "attention" in d.name}
    fwd = kernels["scaled_dot_product_attention"]
    assert "@workgroup_size(256)" in fwd and "s0 = s0 + 64u" in fwd
    # other modes keep the automatic plan
    assert "@workgroup_size(64)" in kernels["scaled_dot_product_attention_backward_query"]


def test_default_plans_unchanged(monkeypatch):
    """An empty override and no tuned table keep the automatic plans (SmolLM2 at L=128 on
    the H200)."""
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    assert attention_plan.LANE_OVERRIDE == {}
    assert choose_plan("fwd", SMOLLM2, H200) == Plan(4, 16, 32)
    for mode in LANE_MODES:
        assert choose_plan(mode, SMOLLM2, H200).size == attention_plan.THREADS


def test_tuned_plans_on_gpu_adapters_only(monkeypatch):
    """``tuned.TUNED``'s plans are chosen for their sizes on the H200's limits; a CPU adapter,
    an adapter whose workgroup memory cannot hold the plan, other sizes and the switch off
    get the automatic rule."""
    from dataclasses import replace

    from meganeura.codegen.kernel import H200_LIMITS

    for (mode, dims), entry in TUNED.items():
        assert choose_plan(mode, dims, H200_LIMITS) == Plan(*entry), (mode, dims)
        assert choose_plan(mode, dims, replace(H200_LIMITS, cpu=True)) != Plan(*entry)
    small = replace(H200_LIMITS, max_workgroup_storage_size=32768)  # tile 64 needs 35 KiB
    assert choose_plan("dv", SMOLLM2, small) == Plan(4, 16, 32)
    assert choose_plan("fwd", replace(SMOLLM2, lq=127, lk=127), H200_LIMITS) == Plan(4, 16, 32)
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    assert choose_plan("fwd", SMOLLM2, H200_LIMITS) == Plan(4, 16, 32)


# the workload shapes of tuned.TUNED: (q, k, v shapes, kwargs)
TUNED_SHAPES = {
    "smollm2": ((1, 9, 128, 64), (1, 3, 128, 64), (1, 3, 128, 64),
                {"is_causal": True, "enable_gqa": True}),
    "smolvla_self": ((1, 15, 50, 64), (1, 5, 50, 64), (1, 5, 50, 64),
                     {"is_causal": True, "enable_gqa": True}),
    "smolvla_cross": ((1, 15, 50, 64), (1, 5, 16, 64), (1, 5, 16, 64), {"enable_gqa": True}),
}  # fmt: skip


@pytest.mark.gpu
@pytest.mark.parametrize("fuse", [True, False], ids=["dkv", "dk_dv"])
@pytest.mark.parametrize("shape", TUNED_SHAPES)
def test_tuned_plans_match_torch(shape, fuse, gpu_device, lane_override):
    """Each of the table's plans, forced at its own sizes (the test adapter is a CPU one,
    which ignores the table), gives float64 torch's output and gradients; plans the test
    adapter's workgroup memory cannot hold keep the automatic plan."""
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    qs, ks, vs, kw = TUNED_SHAPES[shape]
    dims = Dims(qs[0], ks[1], qs[1] // ks[1], qs[2], ks[2], qs[3], vs[3])
    plans = {}
    for (mode, d), entry in TUNED.items():
        if d == dims:
            try:
                check_plan(mode, dims, Plan(*entry), limits)
            except ValueError:
                continue
            plans[mode] = entry
    assert plans
    lane_override(plans, fuse)
    got, want, _ = _run_fused(gpu_device, qs, ks, vs, seed=3, **kw)
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < 2e-6, n


def test_max_tile_64_fits(monkeypatch):
    """Raising ``MAX_TILE`` lets the automatic plan take 64-entry tiles where they fit."""
    monkeypatch.setattr(attention_plan, "MAX_TILE", 64)
    monkeypatch.setattr(attention_plan, "USE_TUNED", [False])
    assert choose_plan("fwd", SMOLLM2, H200).tile == 64
    small = Limits(max_workgroup_storage_size=16384)
    plan = choose_plan("fwd", SMOLLM2, small)
    assert plan.tile < 64 and check_plan("fwd", SMOLLM2, plan, small) == plan


@pytest.mark.parametrize(
    "plan, limit",
    [((8, 16, 24), "multiple of lanes"), ((1, 3, 3), "power of two"),
     ((64, 32, 32), "max_invocations_per_workgroup 1024"), ((1, 4, 64), "MAX_PER_LANE 8"),
     ((4, 16, 128), "max_workgroup_storage_size 49152"), ((0, 16, 32), "at least 1")],
    ids=["ragged_tile", "lanes3", "threads2048", "per_lane16", "storage", "rows0"],
)  # fmt: skip
def test_invalid_override_raises(plan, limit, lane_override):
    lane_override({"dkv": plan})
    name = f"'dkv' (rows={plan[0]}, lanes={plan[1]}, tile={plan[2]})"
    with pytest.raises(ValueError, match=re.escape(name) + ".*" + re.escape(limit)):
        choose_plan("dkv", SMOLLM2, H200)
    choose_plan("dq", SMOLLM2, H200)  # other modes are not affected

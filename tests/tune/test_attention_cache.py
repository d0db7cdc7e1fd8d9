"""The tuning cache's attention table: lane plans of the flash-attention kernels per device
(round trip, bad entries dropped with a warning, files without the table), read by
``attention.plan.choose_plan`` ahead of the static H200 table (on CPU adapters too) and turned
off with ``set_tuned(False)``; ``bench/attention_plans.py --record`` writing them; a program
compiled with a cached plan on the test adapter matches float64 torch."""

from __future__ import annotations

import json
import warnings
from dataclasses import replace

import pytest

from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.attention import plan as P
from meganeura.codegen.wgsl.attention.plan import Dims, Plan, choose_plan, set_tuned
from meganeura.codegen.wgsl.attention.tuned import SMOLLM2, TUNED
from meganeura.recipes.tune import format_cache
from meganeura.training import device_limits
from meganeura.tune import cache as tc
from meganeura.tune.attention_entries import parse_attention_key, parse_lane_plan

from .test_cache import H200, LAVAPIPE, entry, fake_device

FWD_KEY = ("fwd", 1, 3, 3, 128, 128, 64, 64)  # SMOLLM2's forward: TUNED (8, 16, 32)


def att(plan: str, us: float = 10.0, default: str = "4x16x32") -> tc.AttentionEntry:
    return tc.AttentionEntry(plan, us, default, 2 * us, "timestamps", "2026-12-03")


def test_round_trip_keeps_matmul_and_attention(tmp_path):
    key = tc.device_key(H200)
    cache = tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")}, {FWD_KEY: att("16x8x16")})
    path = tc.save(cache, tmp_path)
    doc = json.loads(path.read_text())
    assert doc["attention"]["fwd,1,3,3,128,128,64,64"]["plan"] == "16x8x16"
    back = tc.load(key, tmp_path)
    assert back.matmul == cache.matmul and back.attention == cache.attention
    assert back.attention_plans() == ((FWD_KEY, (16, 8, 16)),)
    assert back.attention[FWD_KEY].gain == 2.0


def test_a_file_without_attention_loads_without_warning(tmp_path):
    key = tc.device_key(LAVAPIPE)
    doc = tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")}).to_json()
    assert "attention" not in doc  # matmul-only files are written as before
    tc.cache_path(key, tmp_path).write_text(json.dumps(doc))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        back = tc.load(key, tmp_path)
    assert back.attention == {} and back.attention_plans() == ()
    assert back.plans() == (((16, 64, 32, "nn", 1), "simd8"),)


GOOD = {"plan": "8x16x32", "gpu_us": 17.4, "default_plan": "4x16x32", "heuristic_us": 23.2,
        "timing": "timestamps", "measured": "2026-12-03"}  # fmt: skip
# name: (key text, entry)
BAD = {
    "unknown_mode": ("attn,1,3,3,128,128,64,64", GOOD),
    "seven_fields": ("fwd,1,3,3,128,128,64", GOOD),
    "zero_size": ("fwd,0,3,3,128,128,64,64", GOOD),
    "not_int": ("fwd,1,3,3,128,x,64,64", GOOD),
    "plan_two_parts": ("dq,1,3,3,128,128,64,64", {**GOOD, "plan": "8x16"}),
    "plan_zero": ("dq,1,3,3,128,128,64,64", {**GOOD, "plan": "0x16x32"}),
    "time_text": ("dk,1,3,3,128,128,64,64", {**GOOD, "gpu_us": "fast"}),
    "extra_field": ("dk,1,3,3,128,128,64,64", {**GOOD, "rows": 8}),
    "missing_field": ("dk,1,3,3,128,128,64,64", {"plan": "8x16x32"}),
    "not_an_object": ("dk,1,3,3,128,128,64,64", [8, 16, 32]),
}


@pytest.mark.parametrize("bad", BAD)
def test_a_bad_attention_entry_is_dropped_and_the_rest_kept(tmp_path, bad):
    key = tc.device_key(LAVAPIPE)
    doc = tc.TuningCache(
        key, {(16, 64, 32, "nn", 1): entry("simd8")}, {FWD_KEY: att("16x8x16")}
    ).to_json()
    text, raw = BAD[bad]
    doc["attention"][text] = raw
    tc.cache_path(key, tmp_path).write_text(json.dumps(doc))
    with pytest.warns(tc.TuningCacheWarning, match="attention entry"):
        back = tc.load(key, tmp_path)
    assert back.plans() == (((16, 64, 32, "nn", 1), "simd8"),)
    assert back.attention_plans() == ((FWD_KEY, (16, 8, 16)),)


def test_an_attention_table_that_is_not_an_object_is_dropped(tmp_path):
    key = tc.device_key(LAVAPIPE)
    doc = tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")}).to_json()
    doc["attention"] = ["fwd"]
    tc.cache_path(key, tmp_path).write_text(json.dumps(doc))
    with pytest.warns(tc.TuningCacheWarning, match="'attention' table ignored"):
        back = tc.load(key, tmp_path)
    assert back.plans() == (((16, 64, 32, "nn", 1), "simd8"),) and back.attention == {}


def test_parsers():
    assert parse_attention_key(" dkv, 2,5,3, 50,16, 64,32") == ("dkv", 2, 5, 3, 50, 16, 64, 32)
    assert parse_lane_plan("2x32x32") == (2, 32, 32)
    with pytest.raises(ValueError, match="mode must be one of fwd, stats, lse, dq, dk, dv, dkv"):
        parse_attention_key("block,1,1,1,1,1,1,1")
    with pytest.raises(ValueError, match="ROWSxLANESxTILE"):
        parse_lane_plan("8x16x")


def test_choose_plan_takes_the_device_entry_then_tuned_then_the_rule():
    """On the H200's limits: the device entry beats TUNED; an entry check_plan refuses falls
    back to TUNED; ``set_tuned(False)`` ignores both; a CPU adapter takes its own entry (not
    TUNED's); LANE_OVERRIDE still wins; other sizes and modes are untouched."""
    assert TUNED[("fwd", SMOLLM2)] == (8, 16, 32)
    rule = Plan(4, 16, 32)
    limits = replace(H200_LIMITS, attention_plans=((FWD_KEY, (16, 8, 16)),))
    assert choose_plan("fwd", SMOLLM2, limits) == Plan(16, 8, 16)
    assert choose_plan("dq", SMOLLM2, limits) == Plan(*TUNED[("dq", SMOLLM2)])
    assert choose_plan("fwd", replace(SMOLLM2, lq=127, lk=127), limits) == rule
    # 128-entry tiles need more than 48 KiB; 3 lanes cannot merge pairwise: TUNED's plan
    for refused in ((4, 16, 128), (8, 3, 24)):
        bad = replace(H200_LIMITS, attention_plans=((FWD_KEY, refused),))
        assert choose_plan("fwd", SMOLLM2, bad) == Plan(8, 16, 32), refused
    cpu = replace(limits, cpu=True)
    assert choose_plan("fwd", SMOLLM2, cpu) == Plan(16, 8, 16)  # measured on that adapter
    assert choose_plan("dq", SMOLLM2, cpu) != Plan(*TUNED[("dq", SMOLLM2)])  # TUNED: GPU only
    set_tuned(False)
    try:
        assert choose_plan("fwd", SMOLLM2, limits) == rule
        assert choose_plan("fwd", SMOLLM2, cpu) == rule
    finally:
        set_tuned(True)
    saved = dict(P.LANE_OVERRIDE)
    P.LANE_OVERRIDE["fwd"] = (2, 32, 32)
    try:
        assert choose_plan("fwd", SMOLLM2, limits) == Plan(2, 32, 32)
    finally:
        P.LANE_OVERRIDE.clear()
        P.LANE_OVERRIDE.update(saved)


def test_device_limits_reads_the_devices_attention_plans(tmp_path):
    tc.set_cache_dir(tmp_path)
    lava, h200 = fake_device(LAVAPIPE), fake_device(H200, storage=49152)
    tc.save(tc.TuningCache(tc.device_key(H200), attention={FWD_KEY: att("16x8x16")}))
    lim_h, lim_l = device_limits(h200), device_limits(lava)
    assert lim_h.attention_plans == ((FWD_KEY, (16, 8, 16)),) and lim_h.matmul_plans == ()
    assert lim_l.attention_plans == ()
    assert choose_plan("fwd", SMOLLM2, lim_h) == Plan(16, 8, 16)
    # a rewritten file is read again
    tc.save(tc.TuningCache(tc.device_key(H200), attention={FWD_KEY: att("2x32x32")}))
    assert device_limits(h200).attention_plans == ((FWD_KEY, (2, 32, 32)),)
    tc.set_cache_dir(None)
    assert device_limits(h200).attention_plans == ()


def test_list_shows_attention_entries():
    cache = tc.TuningCache(tc.device_key(H200), attention={FWD_KEY: att("16x8x16", 11.6)})
    text = format_cache(cache, "/x.json")
    assert "(no tuned matmul products)" in text
    row = next(line for line in text.splitlines() if line.startswith("fwd,1,3,3"))
    assert row.split()[:5] == ["fwd,1,3,3,128,128,64,64", "16x8x16", "11.6", "4x16x32", "23.2"]
    assert "2.00x" in row


def test_bench_record_writes_winners_and_removes_beaten_entries(tmp_path):
    from bench.attention_plans import SHAPES
    from bench.attention_plans_summary import record

    tc.set_cache_dir(tmp_path)
    dev = fake_device(H200)
    key = tc.device_key(dev)
    dq_key = ("dq", *FWD_KEY[1:])
    tc.save(tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")}, {dq_key: att("8x8x8")}))

    def k(default, d_us, best, b_us):
        return {"default_plan": default, "default_us": d_us, "best_plan": best, "best_us": b_us}

    summary = {"smollm2": {"kernels": {
        "fwd+lse": k([4, 16, 32], 23.2, [8, 16, 32], 17.4),  # recorded
        "fwd": k([4, 16, 32], 20.0, [2, 32, 32], 10.0),  # forward-only label: not consulted
        "dq+delta": k([4, 16, 32], 30.0, [4, 16, 16], 29.5),  # < 3%: old entry removed
        "dkv": k([4, 16, 32], 59.5, [4, 16, 32], 59.5),  # the default won
        "dk": k([4, 16, 32], None, [2, 32, 32], 36.0),  # default not timed: untouched
    }}}  # fmt: skip
    lines = record(summary, SHAPES, dev)
    back = tc.load(key)
    assert back.plans() == (((16, 64, 32, "nn", 1), "simd8"),)  # matmul entries kept
    assert back.attention_plans() == ((FWD_KEY, (8, 16, 32)),)
    e = back.attention[FWD_KEY]
    assert (e.gpu_us, e.default_plan, e.heuristic_us, e.timing) == (17.4, "4x16x32", 23.2, "wall")
    assert any("recorded 8x16x32" in x for x in lines)
    assert any("old entry removed" in x and "dq+delta" in x for x in lines)


# (q, k, v shapes, kwargs) and the plans cached for them; head dims small enough for
# lavapipe's 32 KiB at tile 64
CAUSAL_GQA = ((1, 6, 37, 16), (1, 2, 41, 16), (1, 2, 41, 16),
              {"is_causal": True, "enable_gqa": True})  # fmt: skip
CACHED = {"fwd": (8, 16, 64), "dq": (1, 32, 64), "dkv": (4, 64, 64)}


@pytest.mark.gpu
def test_a_cached_plan_compiles_and_matches_torch(gpu_device, tmp_path):
    """The test adapter's own cache entries (a CPU adapter: they apply there) set the lane
    kernels' workgroups, and the program gives float64 torch's output and gradients."""
    from meganeura.compile import CompileOptions, compile
    from meganeura.graph.builder import GraphBuilder

    from ..codegen.test_attention import _graph, _rel
    from ..codegen.test_attention_kv import _run_fused

    qs, ks, vs, kw = CAUSAL_GQA
    dims = Dims(qs[0], ks[1], qs[1] // ks[1], qs[2], ks[2], qs[3], vs[3])
    fields = (dims.b, dims.hkv, dims.group, dims.lq, dims.lk, dims.d, dims.dv)
    tc.set_cache_dir(tmp_path)
    attention = {(m, *fields): att("x".join(map(str, p))) for m, p in CACHED.items()}
    tc.save(tc.TuningCache(tc.device_key(gpu_device), attention=attention))
    limits = device_limits(gpu_device)
    assert dict(limits.attention_plans) == {(m, *fields): p for m, p in CACHED.items()}

    graph, ids = _graph(qs, ks, vs, **kw)
    b = GraphBuilder(graph)
    for n in "qkv":
        b.output("d" + n, b.tensor(ids[n]))
    program = compile(b.build_unverified(), CompileOptions(), limits)
    wgsl = {d.name.split()[1]: d.wgsl for d in program.dispatches if "attention" in d.name}
    size = {"": 128, "_backward_query": 32, "_backward_key_value": 256}
    for suffix, threads in size.items():
        assert f"@workgroup_size({threads})" in wgsl["scaled_dot_product_attention" + suffix]

    got, want, _ = _run_fused(gpu_device, qs, ks, vs, seed=7, **kw)
    for n in ("out", "q", "k", "v"):
        assert _rel(got[n], want[n]) < 2e-6, n

"""The per-device tuning cache (no GPU): file round trip, atomic write, bad files ignored with
a warning, and ``choose_plan`` reading a device's plans ahead of the CPU plan and TUNED."""

from __future__ import annotations

import json
import os
import warnings
from dataclasses import replace
from types import SimpleNamespace

import pytest

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl.matmul import plan as mm
from meganeura.training import device_limits
from meganeura.tune import cache as tc

LAVAPIPE = {
    "device": "llvmpipe (LLVM 15.0.6, 256 bits)",
    "description": "Mesa 22.3.6 (LLVM 15.0.6)",
    "backend_type": "Vulkan",
    "adapter_type": "CPU",
    "vendor_id": 65541,
    "device_id": 0,
}
H200 = {
    "device": "NVIDIA H200",
    "description": "580.95.05",
    "backend_type": "Vulkan",
    "adapter_type": "DiscreteGPU",
    "vendor_id": 4318,
    "device_id": 8998,
}


def fake_device(info: dict, storage: int = 32768):
    """What ``device_limits`` reads of a runtime Device, without an adapter."""
    return SimpleNamespace(
        info=dict(info),
        features=frozenset({"subgroup"}),
        max_compute_workgroups_per_dimension=65535,
        max_compute_workgroup_storage_size=storage,
        max_compute_invocations_per_workgroup=1024,
        max_storage_buffer_binding_size=1 << 27,
        min_storage_buffer_offset_alignment=32,
        max_storage_buffers_per_shader_stage=32,
        max_buffer_size=1 << 31,
    )


def entry(plan: str, us: float = 10.0, default: str = "simd16") -> tc.MatmulEntry:
    return tc.MatmulEntry(plan, us, default, 2 * us, "timestamps", "2026-12-03")


def test_round_trip_writes_atomically(tmp_path, monkeypatch):
    key = tc.device_key(LAVAPIPE)
    cache = tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")})
    path = tc.save(cache, tmp_path)
    assert path.parent == tmp_path and path.name.startswith("llvmpipe-llvm-15-0-6")
    doc = json.loads(path.read_text())
    assert doc["format"] == tc.FORMAT and doc["device"]["driver"] == LAVAPIPE["description"]
    assert doc["matmul"]["16,64,32,nn,1"]["plan"] == "simd8"
    back = tc.load(key, tmp_path)
    assert back.matmul == cache.matmul and back.plans() == (((16, 64, 32, "nn", 1), "simd8"),)
    assert os.listdir(tmp_path) == [path.name]  # no temporary file left

    # a write that fails before the rename leaves the old file whole and no temporary file
    cache.matmul[(3, 64, 48, "nt", 1)] = entry("gemv32")

    def fail(src, dst):
        raise OSError("disk full")

    monkeypatch.setattr(tc.os, "replace", fail)
    with pytest.raises(OSError, match="disk full"):
        tc.save(cache, tmp_path)
    assert os.listdir(tmp_path) == [path.name]
    assert tc.load(key, tmp_path).plans() == (((16, 64, 32, "nn", 1), "simd8"),)


def test_device_key_names_adapter_driver_and_backend():
    a, b = tc.device_key(LAVAPIPE), tc.device_key({**LAVAPIPE, "description": "Mesa 24.0.1"})
    assert (a.adapter, a.driver, a.backend) == (LAVAPIPE["device"], "Mesa 22.3.6 (LLVM 15.0.6)",
                                                "Vulkan")  # fmt: skip
    assert a.slug != b.slug  # a driver update is another device
    assert tc.device_key(LAVAPIPE).slug == a.slug  # stable


@pytest.mark.parametrize(
    "content",
    ["{not json", '{"format": 99, "device": {}, "matmul": {}}', "[1, 2]"],
    ids=["corrupt", "foreign_version", "not_an_object"],
)
def test_a_bad_file_warns_and_is_ignored(tmp_path, content):
    key = tc.device_key(LAVAPIPE)
    tc.cache_path(key, tmp_path).write_text(content)
    with pytest.warns(tc.TuningCacheWarning, match="ignored"):
        assert tc.load(key, tmp_path).matmul == {}
    tc.set_cache_dir(tmp_path)
    with pytest.warns(tc.TuningCacheWarning):
        limits = device_limits(fake_device(LAVAPIPE))
    assert limits.matmul_plans == ()
    assert mm.choose_plan(16, 64, 32, 1, "nn", limits).name == "simd16"  # the CPU plan


def test_a_bad_entry_is_dropped_and_the_rest_kept(tmp_path):
    key = tc.device_key(LAVAPIPE)
    doc = tc.TuningCache(key, {(16, 64, 32, "nn", 1): entry("simd8")}).to_json()
    doc["matmul"]["5,5,5,nn,1"] = {**doc["matmul"]["16,64,32,nn,1"], "plan": "99x99x1"}
    doc["matmul"]["5,5,nn"] = doc["matmul"]["16,64,32,nn,1"]
    tc.cache_path(key, tmp_path).write_text(json.dumps(doc))
    with pytest.warns(tc.TuningCacheWarning, match="entry"):
        assert tc.load(key, tmp_path).plans() == (((16, 64, 32, "nn", 1), "simd8"),)


def test_choose_plan_reads_the_device_entry_and_only_that_device(tmp_path):
    tc.set_cache_dir(tmp_path)
    lava, h200 = fake_device(LAVAPIPE), fake_device(H200, storage=49152)
    tc.save(tc.TuningCache(tc.device_key(LAVAPIPE), {(16, 64, 32, "nn", 1): entry("simd8")}))
    shape = (128, 576, 192, "nt", 1)  # in TUNED: 64x64x16/s8
    tc.save(tc.TuningCache(tc.device_key(H200), {shape: entry("128x64x16", default="x")}))
    lim_l, lim_h = device_limits(lava), device_limits(h200)
    assert lim_l.cpu and lim_l.matmul_plans == (((16, 64, 32, "nn", 1), "simd8"),)
    # the device entry beats the CPU plan (simd16) on lavapipe ...
    assert mm.plan_source(16, 64, 32, 1, "nn", lim_l) == (mm.parse_plan("simd8"), "device")
    # ... and TUNED on the GPU; the other device's shapes keep their own sources
    assert mm.plan_source(*shape[:3], 1, "nt", lim_h) == (mm.parse_plan("128x64x16"), "device")
    assert mm.plan_source(*shape[:3], 1, "nt", lim_l)[1] == "cpu"
    assert mm.plan_source(16, 64, 32, 1, "nn", lim_h)[1] == "heuristic"
    # another batch or layout is another product
    assert mm.plan_source(16, 64, 32, 2, "nn", lim_l)[1] == "cpu"
    assert mm.plan_source(16, 64, 32, 1, "nt", lim_l)[1] == "cpu"
    # forced plans still win; a device without a cache file gets no plans
    mm.force_plan("64x64x16")
    try:
        assert mm.plan_source(16, 64, 32, 1, "nn", lim_l)[1] == "forced"
    finally:
        mm.force_plan(None)
    assert device_limits(fake_device({**H200, "device": "NVIDIA H100"})).matmul_plans == ()
    tc.set_cache_dir(None)  # the cache off: no plans
    assert device_limits(lava).matmul_plans == ()


def test_a_device_plan_the_adapter_cannot_run_falls_back():
    plans = (((36, 520, 68, "nt", 1), "128x128x16"), ((40, 64, 32, "nn", 1), "gemv16"))
    limits = Limits(max_workgroup_storage_size=32768, cpu=True, matmul_plans=plans)
    # two 128x128x16 buffers need 33 KiB: one buffer then, still the device's plan
    assert mm.plan_source(36, 520, 68, 1, "nt", limits) == (mm.parse_plan("128x128x16/np"),
                                                             "device")  # fmt: skip
    assert mm.plan_source(40, 64, 32, 1, "nn", limits)[1] == "cpu"  # gemv for M > 8: ignored
    no_subgroups = replace(limits, matmul_plans=(((40, 64, 32, "nn", 1), "simd8"),))
    assert mm.plan_source(40, 64, 32, 1, "nn", no_subgroups)[1] == "cpu"


@pytest.mark.parametrize(
    "text", ["1,2,3", "1,2,3,xx", "0,2,3,nn", "a,2,3,nn", "1,2,3,nn,1,1"],
    ids=["three_fields", "bad_layout", "zero_m", "not_int", "six_fields"],
)  # fmt: skip
def test_parse_shape_rejects(text):
    with pytest.raises(ValueError, match="M,K,N|layout|>= 1|integers"):
        tc.parse_shape(text)


def test_parse_shape_defaults_batch_one():
    assert tc.parse_shape("128,576,192,nt") == (128, 576, 192, "nt", 1)
    assert tc.parse_shape(" 8, 16, 4, tn, 3") == (8, 16, 4, "tn", 3)


def test_no_warning_without_a_file(tmp_path):
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert tc.load(tc.device_key(LAVAPIPE), tmp_path).matmul == {}

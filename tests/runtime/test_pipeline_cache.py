"""Pipeline reuse across Sessions, and the setup/compile time records.

wgpu-py 0.32 offers no persistent pipeline cache (see meganeura/runtime/pipelines.py), so the
cache under test is the device's in-process one: a second Session of the same program compiles
nothing. Assertions are on counters and record keys, never on durations.
"""

from __future__ import annotations

import uuid

import numpy as np
import pytest

from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.models.mlp import build_mlp
from meganeura.optim import AdamW
from meganeura.schedule.program import BufferSpec, Dispatch, Program, TensorSlot

N = 256


def _program(tag: str) -> Program:
    # The tag makes the WGSL unique to this test run, so the first Session must compile it.
    def kernel(op: str) -> str:
        return (
            "@group(0) @binding(0) var<storage, read> x: array<f32>;\n"
            "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n"
            "@compute @workgroup_size(64)\n"
            "fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n"
            f"  if (g.x >= {N}u) {{ return; }}\n  y[g.x] = {op};\n}}\n// {tag}\n"
        )

    f32 = DType.f32
    return Program(
        buffers=(
            BufferSpec(0, N * 4, "input", "x"),
            BufferSpec(1, N * 4, "intermediate"),
            BufferSpec(2, N * 4, "output", "z"),
        ),
        dispatches=(
            Dispatch("%1 double", kernel("2.0 * x[g.x]"), (0, 1), (False, True), (4, 1, 1)),
            Dispatch("%2 square", kernel("x[g.x] * x[g.x]"), (1, 2), (False, True), (4, 1, 1)),
            Dispatch("%3 double", kernel("2.0 * x[g.x]"), (1, 2), (False, True), (4, 1, 1)),
        ),
        inputs={"x": TensorSlot(0, (N,), f32)},
        outputs={"z": TensorSlot(2, (N,), f32)},
        parameters={},
    )


@pytest.mark.gpu
def test_second_session_reuses_every_pipeline(gpu_device):
    from meganeura.runtime import Session

    program = _program(uuid.uuid4().hex)
    cache = gpu_device.pipelines
    compiled, hits = cache.compiled, cache.hits
    with Session(program, gpu_device) as first:
        # Two distinct kernels; the third dispatch repeats the first.
        assert (first.pipelines_compiled, first.pipelines_reused) == (2, 1)
        assert (cache.compiled, cache.hits) == (compiled + 2, hits + 1)
        assert set(first.setup_seconds) == {"buffers", "pipelines", "bind_groups", "validate"}
        assert all(v >= 0 for v in first.setup_seconds.values())
    with Session(program, gpu_device) as second:
        assert (second.pipelines_compiled, second.pipelines_reused) == (0, 3)
        assert cache.compiled == compiled + 2
        x = np.arange(N, dtype=np.float32)
        np.testing.assert_array_equal(second.run({"x": x}, ["z"])["z"], 4 * x)
    assert cache.shader_seconds > 0 and cache.pipeline_seconds > 0


def test_compile_records_every_stage():
    net = build_mlp(8, (784, 16, 10))
    options = CompileOptions(loss="loss", optimizer=AdamW(lr=1e-3))
    times = compile(net.graph, options, graph_seconds=0.25).meta["compile_seconds"]
    assert list(times) == [
        "graph",
        "autodiff",
        "passes",
        "codegen",
        "plan_memory",
        "assemble",
        "pack",
    ]
    assert times["graph"] == 0.25
    assert all(v >= 0 for v in times.values())
    inference = compile(build_mlp(8, (784, 16, 10), labels=False).graph)
    assert "graph" not in inference.meta["compile_seconds"]


@pytest.mark.gpu
def test_runtime_checks_are_part_of_the_cache_key(gpu_device):
    """The same program with naga's runtime checks on and off: both compile (separately, as
    the key includes the flag), give the same values, and the flag is restored."""
    from meganeura.runtime import Session

    program = _program(uuid.uuid4().hex)
    cache = gpu_device.pipelines
    default = cache.runtime_checks
    x = np.arange(N, dtype=np.float32) - 100
    outs = []
    try:
        for checks in (True, False):
            cache.runtime_checks = checks
            with Session(program, gpu_device) as sess:
                assert (sess.pipelines_compiled, sess.pipelines_reused) == (2, 1)
                outs.append(sess.run({"x": x}, ["z"])["z"])
    finally:
        cache.runtime_checks = default
    np.testing.assert_array_equal(outs[0], 4 * x)
    np.testing.assert_array_equal(outs[1], outs[0])


@pytest.mark.gpu
@pytest.mark.parametrize("checks", [True, False], ids=["checks", "no_checks"])
def test_bad_wgsl_names_the_kernel_either_way(gpu_device, checks):
    from meganeura.runtime.pipelines import KernelError

    cache = gpu_device.pipelines
    default = cache.runtime_checks
    cache.runtime_checks = checks
    try:
        with pytest.raises(KernelError, match="'%7 broken'.*failed to compile"):
            cache.get("%7 broken", f"fn main( {{ // {uuid.uuid4().hex}", (True,))
    finally:
        cache.runtime_checks = default


@pytest.mark.gpu
def test_cache_follows_the_module_flag_when_unset(gpu_device, monkeypatch):
    from meganeura.runtime import Session, pipelines

    cache = gpu_device.pipelines
    monkeypatch.setattr(cache, "runtime_checks", None)
    program = _program(uuid.uuid4().hex)
    for flag, compiled in ((True, 2), (False, 2), (True, 0)):
        monkeypatch.setattr(pipelines, "RUNTIME_CHECKS", flag)
        with Session(program, gpu_device) as sess:
            assert sess.pipelines_compiled == compiled


def test_runtime_checks_default_by_backend(monkeypatch):
    """Off on Vulkan (measured, and the driver bounds storage reads), on where not measured;
    the module flag overrides the backend rule and a cache's own flag overrides both."""
    from meganeura.runtime import pipelines
    from meganeura.runtime.pipelines import PipelineCache, default_runtime_checks

    assert not default_runtime_checks("Vulkan") and not default_runtime_checks("vulkan")
    assert default_runtime_checks("Metal") and default_runtime_checks("D3D12")
    assert default_runtime_checks(None)
    monkeypatch.setattr(pipelines, "RUNTIME_CHECKS", None)
    assert PipelineCache(None, backend="Metal").checks_now()
    assert not PipelineCache(None, backend="Vulkan").checks_now()
    monkeypatch.setattr(pipelines, "RUNTIME_CHECKS", True)
    assert PipelineCache(None, backend="Vulkan").checks_now()
    assert not PipelineCache(None, runtime_checks=False, backend="Metal").checks_now()


@pytest.mark.gpu
def test_device_cache_knows_its_backend(gpu_device):
    assert gpu_device.pipelines.backend == gpu_device.info.get("backend_type")


def _scaled(tag: str, i: int) -> str:
    """A distinct kernel per ``i``: y = (i + 1) * x."""
    return (
        "@group(0) @binding(0) var<storage, read> x: array<f32>;\n"
        "@group(0) @binding(1) var<storage, read_write> y: array<f32>;\n"
        "@compute @workgroup_size(64)\n"
        "fn main(@builtin(global_invocation_id) g: vec3<u32>) {\n"
        f"  if (g.x >= {N}u) {{ return; }}\n  y[g.x] = {i + 1}.0 * x[g.x];\n}}\n// {tag}\n"
    )


@pytest.mark.gpu
@pytest.mark.parametrize("threads", [1, 4], ids=["one_thread", "four_threads"])
def test_prepare_compiles_once_and_counts_as_get_would(gpu_device, monkeypatch, threads):
    """Pipelines compiled on threads run like ``get``'s: each distinct kernel compiled once,
    the first ``get`` of each no hit, later ones hits, and every pipeline computes its own
    kernel (no mix-up between threads)."""
    from meganeura.runtime import Session, pipelines

    monkeypatch.setattr(pipelines, "COMPILE_THREADS", threads)
    tag, f32 = uuid.uuid4().hex, DType.f32
    dispatches = tuple(
        Dispatch(f"%{i} scale", _scaled(tag, i % 6), (0, 1 + i), (False, True), (4, 1, 1))
        for i in range(8)
    )
    program = Program(
        buffers=(
            BufferSpec(0, N * 4, "input", "x"),
            *(BufferSpec(1 + i, N * 4, "output", f"y{i}") for i in range(8)),
        ),
        dispatches=dispatches,
        inputs={"x": TensorSlot(0, (N,), f32)},
        outputs={f"y{i}": TensorSlot(1 + i, (N,), f32) for i in range(8)},
        parameters={},
    )
    cache = gpu_device.pipelines
    compiled, hits = cache.compiled, cache.hits
    with Session(program, gpu_device) as sess:
        assert (sess.pipelines_compiled, sess.pipelines_reused) == (6, 2)
        assert (cache.compiled - compiled, cache.hits - hits) == (6, 2)
        x = np.linspace(-1.0, 1.0, N, dtype=np.float32)
        out = sess.run({"x": x}, fetch=[f"y{i}" for i in range(8)])
    for i in range(8):
        np.testing.assert_array_equal(out[f"y{i}"], np.float32(i % 6 + 1) * x)


@pytest.mark.gpu
def test_prepare_raises_the_first_broken_kernel_and_keeps_the_others(gpu_device, monkeypatch):
    from meganeura.runtime import pipelines
    from meganeura.runtime.pipelines import KernelError

    monkeypatch.setattr(pipelines, "COMPILE_THREADS", 4)
    tag = uuid.uuid4().hex
    kernels = [
        ("%1 fine", _scaled(tag, 0), (False, True)),
        ("%2 broken", f"fn main( {{ // {tag} a", (True,)),
        ("%3 fine", _scaled(tag, 1), (False, True)),
        ("%4 broken", f"fn main( {{ // {tag} b", (True,)),
    ]
    cache = gpu_device.pipelines
    compiled = cache.compiled
    with pytest.raises(KernelError, match="'%2 broken'.*failed to compile"):
        cache.prepare(kernels)
    assert cache.compiled - compiled == 2
    hits = cache.hits
    cache.get("%3 fine", _scaled(tag, 1), (False, True))  # compiled, kept: a hit
    assert (cache.compiled - compiled, cache.hits - hits) == (2, 1)

"""A minimal executor for codegen tests: lower every node, run every dispatch, read back all.

Independent of ``meganeura.runtime`` on purpose, so kernels can be tested while (and even if)
the runtime changes: one buffer per value that owns storage (views share their operand's,
constants have none), one per scratch key of each node, bind-group layouts built from each
kernel's declared bindings (read-only vs read-write, so a mismatch with the WGSL fails
validation loudly), every dispatch in one compute pass of one command encoder, one submit,
then every buffer read back. Each node's bound reads are checked against ``reads()``.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field

import numpy as np
import pytest

from meganeura.codegen.kernel import KernelSource, Limits, ScratchRef, ValueRef
from meganeura.codegen.wgsl import lower, reads
from meganeura.dtypes import DType
from meganeura.graph.ir import Graph, resolve_view

_DEVICE: list = []  # [device] once requested, or [None, reason] when there is no adapter
_PIPELINES: dict[str, object] = {}
ALL_KERNELS: list[KernelSource] = []  # every kernel any test lowered (for text checks)


def device():
    """The wgpu device for codegen tests; skips the test when no adapter exists."""
    if not _DEVICE:
        try:
            import wgpu

            adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
            if adapter is None:
                raise RuntimeError("request_adapter returned None")
            lim = adapter.limits
            keys = (
                "max-storage-buffer-binding-size",
                "max-buffer-size",
                "max-compute-workgroup-storage-size",
                "max-storage-buffers-per-shader-stage",
            )
            # subgroups when offered, so tests can run both reduction paths (Limits.subgroups)
            feats = [f for f in ("subgroup",) if f in adapter.features]
            _DEVICE.append(
                adapter.request_device_sync(
                    required_limits={k: lim[k] for k in keys}, required_features=feats
                )
            )
        except Exception as e:  # no driver / no adapter: a skip, not a failure
            _DEVICE.extend([None, f"{type(e).__name__}: {e}"])
    if _DEVICE[0] is None:
        pytest.skip(f"no WebGPU adapter available: {_DEVICE[1]}")
    return _DEVICE[0]


def has_subgroups() -> bool:
    """Whether the test device has the ``subgroup`` feature."""
    return "subgroup" in device().features


def device_limits() -> Limits:
    """The codegen Limits of the test device (``subgroups`` False: the portable path; tests
    of the subgroup path replace it)."""
    lim = device().limits
    return Limits(
        max_workgroups_per_dimension=lim["max-compute-workgroups-per-dimension"],
        max_workgroup_storage_size=lim["max-compute-workgroup-storage-size"],
        max_invocations_per_workgroup=lim["max-compute-invocations-per-workgroup"],
        max_storage_buffer_binding_size=lim["max-storage-buffer-binding-size"],
    )


@dataclass
class Result:
    """Everything a run produced: ``values[i]`` is node i's value (None for empty values
    nobody wrote), ``params``/``state`` the leaves after in-place updates."""

    values: list[np.ndarray | None]
    params: dict[str, np.ndarray]
    state: dict[str, np.ndarray]
    kernels: list[KernelSource] = field(default_factory=list)


def lower_all(graph: Graph, limits: Limits) -> list[tuple[int, list[KernelSource]]]:
    """Lower every node, checking each node's bound reads against ``reads()``."""
    out = []
    for n in graph.nodes:
        ks = lower(graph, n.id, limits)
        bound = {
            r.node
            for k in ks
            for r in k.bindings
            if isinstance(r, ValueRef) and r.node != n.id
        }  # fmt: skip
        if ks or n.op not in ("reshape", "stop_gradient"):
            assert bound == set(reads(graph, n.id)), (n, bound, reads(graph, n.id))
        for k in ks:
            refs = [r for r in k.bindings if isinstance(r, ValueRef)]
            assert len({r.node for r in refs}) == len(refs), f"{k.name}: a value bound twice"
            assert all(graph[r.node].op != "constant" for r in refs), f"{k.name} binds a constant"
        ALL_KERNELS.extend(ks)
        out.append((n.id, ks))
    return out


def _checks(dev) -> bool:
    from meganeura.runtime.pipelines import runtime_checks_for

    return runtime_checks_for(dev.adapter.info.get("backend_type"))


def _pipeline(dev, k: KernelSource):
    import wgpu

    from meganeura.runtime.fastpath import create_shader_module

    key = k.wgsl + repr([isinstance(r, ScratchRef) or r.write for r in k.bindings])
    if key not in _PIPELINES:
        try:  # as the runtime creates them: without naga's checks where that is its default
            module = create_shader_module(dev, k.name, k.wgsl, _checks(dev))
        except Exception as e:  # show the generated source next to the compiler's complaint
            raise AssertionError(f"{k.name} does not compile: {e}\n{k.wgsl}") from None
        entries = [
            {
                "binding": i,
                "visibility": wgpu.ShaderStage.COMPUTE,
                "buffer": {
                    "type": wgpu.BufferBindingType.storage
                    if isinstance(r, ScratchRef) or r.write
                    else wgpu.BufferBindingType.read_only_storage
                },
            }
            for i, r in enumerate(k.bindings)
        ]
        bgl = dev.create_bind_group_layout(entries=entries)
        layout = dev.create_pipeline_layout(bind_group_layouts=[bgl])
        pipe = dev.create_compute_pipeline(
            layout=layout, compute={"module": module, "entry_point": "main"}
        )
        _PIPELINES[key] = (pipe, bgl)
    return _PIPELINES[key]


def _to_gpu(a: np.ndarray, dtype: DType) -> bytes:
    host = np.asarray(a)
    if host.shape == () or host.size:
        host = host.astype(np.uint32 if dtype is DType.bool else dtype.numpy, copy=False)
    return np.ascontiguousarray(host).tobytes()


def run(
    graph: Graph,
    inputs: Mapping[str, np.ndarray] | None = None,
    params: Mapping[str, np.ndarray] | None = None,
    state: Mapping[str, np.ndarray] | None = None,
    limits: Limits | None = None,
) -> Result:
    """Lower and execute ``graph`` once; leaves are fed by name (state defaults to zeros).

    Raises:
        KeyError: when an input or parameter has no value.
    """
    import wgpu

    dev = device()
    limits = limits or device_limits()
    lowered = lower_all(graph, limits)
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    feeds = {**(inputs or {}), **(params or {}), **(state or {})}
    buffers = {}
    for n in graph.nodes:
        if resolve_view(graph, n.id) != n.id or n.op == "constant" or n.type.numel == 0:
            continue
        buf = dev.create_buffer(size=max(n.type.nbytes, 4), usage=usage)
        if n.op in ("input", "parameter") or (n.op == "state" and n.name in feeds):
            data = np.asarray(feeds[n.name])
            assert data.shape == n.type.shape, (n, data.shape)
            dev.queue.write_buffer(buf, 0, _to_gpu(data, n.type.dtype))
        buffers[n.id] = buf

    encoder = dev.create_command_encoder()
    cpass = encoder.begin_compute_pass()
    scratch: dict[tuple[int, str], object] = {}
    for nid, ks in lowered:
        sizes: dict[str, int] = {}
        for k in ks:
            for r in k.bindings:
                if isinstance(r, ScratchRef):
                    sizes[r.key] = max(sizes.get(r.key, 0), r.nbytes)
        for key, nbytes in sizes.items():
            scratch[nid, key] = dev.create_buffer(size=max(nbytes, 4), usage=usage)
        for k in ks:
            pipe, bgl = _pipeline(dev, k)
            res = [
                scratch[nid, r.key] if isinstance(r, ScratchRef) else buffers[r.node]
                for r in k.bindings
            ]
            entries = [
                {"binding": i, "resource": {"buffer": b, "offset": 0, "size": b.size}}
                for i, b in enumerate(res)
            ]
            group = dev.create_bind_group(layout=bgl, entries=entries)
            cpass.set_pipeline(pipe)
            cpass.set_bind_group(0, group)
            cpass.dispatch_workgroups(*k.grid)
    cpass.end()
    dev.queue.submit([encoder.finish()])

    host = {}
    for vid, buf in buffers.items():
        t = graph[vid].type
        raw = np.frombuffer(dev.queue.read_buffer(buf), _np(t.dtype))
        raw = raw[: t.numel].reshape(t.shape)
        if t.dtype is DType.bool:
            assert set(np.unique(raw)) <= {0, 1}, f"bool value %{vid} holds {np.unique(raw)}"
            raw = raw != 0
        host[vid] = raw.copy()
    values: list[np.ndarray | None] = []
    for n in graph.nodes:
        root = resolve_view(graph, n.id)
        if graph[root].op == "constant":
            values.append(
                np.asarray(graph[root].attr("value"), n.type.dtype.numpy).reshape(n.type.shape)
            )
        elif root in host:
            values.append(host[root].reshape(n.type.shape))
        else:
            values.append(np.zeros(n.type.shape, n.type.dtype.numpy) if n.type.numel == 0 else None)
    leaves = {n.name: values[n.id] for n in graph.nodes if n.op in ("parameter", "state")}
    params_out = {n.name: leaves[n.name] for n in graph.leaves("parameter")}
    state_out = {n.name: leaves[n.name] for n in graph.leaves("state")}
    return Result(values, params_out, state_out, [k for _, ks in lowered for k in ks])


def _np(dtype: DType) -> np.dtype:
    return np.dtype(np.uint32) if dtype is DType.bool else dtype.numpy


def check(
    graph: Graph,
    inputs: Mapping[str, np.ndarray] | None = None,
    params: Mapping[str, np.ndarray] | None = None,
    state: Mapping[str, np.ndarray] | None = None,
    rtol: float = 1e-5,
    limits: Limits | None = None,
) -> Result:
    """Run ``graph`` on the GPU and compare every computed value, and every updated param and
    state, with the NumPy interpreter (float32). Integer and bool values must match exactly;
    floats within ``rtol`` elementwise plus ``rtol * max|expected|`` absolute (so values that
    cancel to near zero are judged against the tensor's scale)."""
    from meganeura.graph.interpret import interpret

    got = run(graph, inputs, params, state, limits)
    want, want_params, want_state = interpret(graph, inputs or {}, params, state)
    # leaves are compared after the step, through params/state (updates write them in place)
    pairs = [
        (f"%{n.id} {n.op}", got.values[n.id], want[n.id])
        for n in graph.nodes
        if n.op not in ("input", "parameter", "state", "constant")
    ]
    pairs += [(f"param {k}", got.params[k], want_params[k]) for k in want_params]
    pairs += [(f"state {k}", got.state[k], want_state[k]) for k in want_state]
    for what, g, w in pairs:
        assert g is not None, f"{what} was never written"
        assert g.shape == w.shape and g.dtype == w.dtype, (what, g.shape, w.shape, g.dtype)
        if np.issubdtype(w.dtype, np.floating):
            scale = float(np.max(np.abs(w[np.isfinite(w)]), initial=0.0))
            np.testing.assert_allclose(g, w, rtol=rtol, atol=rtol * scale, err_msg=what)
        else:
            np.testing.assert_array_equal(g, w, err_msg=what)
    return got


def compile_both(set_enabled, graph: Graph, options, limits: Limits) -> list:
    """[program compiled with a compiler switch on, the same with it off] for A/B tests of a
    lever (``set_enabled(bool)``, e.g. ``norm.prologue.set_enabled``); the switch is left on,
    even when a compile raises."""
    from meganeura.compile import compile

    out = []
    try:
        for on in (True, False):
            set_enabled(on)
            out.append(compile(graph, options, limits))
    finally:
        set_enabled(True)
    return out


def run_identical(
    gpu_device, programs, feeds: Mapping[str, np.ndarray], fetch, state=None, strict=True
) -> dict:
    """Run each of ``programs`` once on its own Session (``state`` loaded first, with
    ``load_state_dict(state, strict)``), fetch ``fetch`` from each and assert every fetched
    value is the same bit for bit across them (the lever A/B tests: a switch on and off).

    Returns:
        The first program's ``{name: array}``.
    """
    from meganeura.runtime import Session

    got = []
    for program in programs:
        with Session(program, gpu_device) as s:
            if state is not None:
                s.load_state_dict(state, strict=strict)
            got.append(s.run(feeds, fetch))
    for other in got[1:]:
        for name, value in got[0].items():
            np.testing.assert_array_equal(value, other[name], err_msg=name)
    return got[0]


@contextmanager
def split_k_everywhere(plan: str, switch=None):
    """Force matmul plan ``plan`` (a split-K one: lavapipe's own plans never split) with split
    products kept out of tiled matmul groups (which run them unsplit); on exit the plan, the
    tiled-group setting and ``switch`` (a lever's ``set_enabled``, turned back on) are
    restored."""
    from meganeura.codegen.wgsl.matmul import tiled_group
    from meganeura.codegen.wgsl.matmul.plan import force_plan

    old = tiled_group.SPLIT_MEMBERS[0]
    tiled_group.set_split_members(False)
    force_plan(plan)
    try:
        yield plan
    finally:
        force_plan(None)
        tiled_group.set_split_members(old)
        if switch is not None:
            switch(True)

"""Compute pipelines, compiled once per device and cached by the hash of their WGSL.

wgpu-py 0.32 (wgpu-native) validates synchronously: a failing ``create_shader_module``,
``create_compute_pipeline``, ``create_bind_group`` or ``GPUCommandEncoder.finish`` raises
``wgpu.GPUValidationError`` from that very call (the native error callback fires during the call
and wgpu-py re-raises it). Error scopes are not implemented by that backend, and the
uncaptured-error handler only logs errors raised outside a call. This module turns every such
failure into a :class:`KernelError` naming the kernel, so a broken shader can never run as a
silent no-op.

Invariants:
  * layouts are explicit, one storage binding per ``Dispatch.bindings`` entry in group 0,
    ``read-only-storage`` or ``storage`` from ``Dispatch.writes``; ``layout="auto"`` is avoided
    because it drops bindings the shader never uses, which then makes bind-group creation fail;
  * the cache key is (sha256 of the WGSL, writes flags, runtime checks): identical kernels in
    one program or across programs share one pipeline;
  * on Vulkan, shader modules are created without naga's runtime checks (no index clamping,
    no loop counters; ``fastpath.create_shader_module``) unless ``RUNTIME_CHECKS`` or a
    cache's ``runtime_checks`` says otherwise; ``default_runtime_checks`` says why.

The cache lives in memory for the process. wgpu-py 0.32 bundles wgpu-native 29.0.1.1, whose C
API has no pipeline-cache objects (the ``pipeline-cache`` feature is listed, but
``wgpuDeviceCreatePipelineCache`` does not exist; gfx-rs/wgpu-native#618 adds it), so compiled
pipelines cannot be persisted from here. Drivers keep their own on-disk caches (Mesa:
``~/.cache/mesa_shader_cache``; NVIDIA: its GLCache), see docs/profiling.md.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING

import wgpu

from ..schedule.program import binding_conflict
from .fastpath import create_shader_module

if TYPE_CHECKING:
    from ..schedule.program import Dispatch, Program
    from .device import Device

_RW = wgpu.BufferBindingType.storage
_RO = wgpu.BufferBindingType.read_only_storage


class KernelError(RuntimeError):
    """A program cannot run on this device: a kernel's WGSL or bindings fail validation, or a
    kernel or buffer exceeds an adapter limit. The message names the kernel (``Dispatch.name``)
    or buffer, and carries wgpu's compile or validation message or the limit."""


def wgsl_hash(wgsl: str) -> str:
    """Hex sha256 of a WGSL source, the pipeline cache key."""
    return hashlib.sha256(wgsl.encode("utf-8")).hexdigest()


# naga's runtime checks (index clamping, loop counters) in shader modules: True or False for
# every device, or None (the default) for ``default_runtime_checks`` of each device's backend.
# Read when a pipeline is compiled; see PipelineCache.runtime_checks.
RUNTIME_CHECKS: bool | None = None
# Threads that ``PipelineCache.prepare`` compiles pipelines on at once (1: one after another,
# on the calling thread).
COMPILE_THREADS = min(8, os.cpu_count() or 1)


def default_runtime_checks(backend: str | None) -> bool:
    """Whether a device on ``backend`` (an adapter's ``backend_type``) gets runtime checks when
    nothing says otherwise: off on Vulkan, on elsewhere.

    Off, a shader is passed on as written, so an out-of-range index is undefined behaviour, as
    in CUDA. meganeura's kernels are generated for fixed shapes, guard every partial tile and
    select a zero index for the loads they discard, and the op database runs them this way in
    CI (lavapipe, Vulkan). On Vulkan, wgpu also enables the driver's robust buffer access for
    storage buffers. On the H200 the checks cost 1.46-1.64x in attention and 1-8% in matmul and
    conv (bench/runtime_checks.py, bench/results/runtime_checks_h200.json). Metal and DX12 were
    not measured, so they keep WebGPU's default there.
    """
    return str(backend or "").casefold() != "vulkan"


def runtime_checks_for(backend: str | None) -> bool:
    """``RUNTIME_CHECKS`` where it is set, else ``default_runtime_checks(backend)``."""
    return default_runtime_checks(backend) if RUNTIME_CHECKS is None else bool(RUNTIME_CHECKS)


class PipelineCache:
    """Pipelines and bind group layouts of one ``GPUDevice``.

    Attributes:
        gpu: the device they are created on.
        compiled: number of pipelines actually compiled (cache misses), for tests and reports.
        hits: number of requests answered from the cache.
        shader_seconds: wall time spent in ``create_shader_module`` (WGSL parse + validate).
        pipeline_seconds: wall time spent in ``create_compute_pipeline`` (WGSL -> SPIR-V and the
            driver's pipeline creation).
        runtime_checks: whether shader modules get naga's runtime checks (index clamping and
            loop bounding, WebGPU's default); False creates them trusted
            (``fastpath.create_shader_module``); None (the default) follows the module's
            ``RUNTIME_CHECKS``, and where that is None too, ``default_runtime_checks`` of
            ``backend``. Read when a pipeline is compiled; pipelines of either kind are cached
            apart.
        backend: the adapter's ``backend_type`` (``"Vulkan"``, ``"Metal"``, ``"D3D12"`` ...).
    """

    def __init__(
        self,
        gpu: wgpu.GPUDevice,
        runtime_checks: bool | None = None,
        backend: str | None = None,
    ):
        self.gpu = gpu
        self.runtime_checks = runtime_checks
        self.backend = backend
        self.compiled = 0
        self.hits = 0
        self.shader_seconds = 0.0
        self.pipeline_seconds = 0.0
        self._layouts: dict[tuple[bool, ...], tuple[wgpu.GPUBindGroupLayout, object]] = {}
        self._pipelines: dict[tuple[str, tuple[bool, ...], bool], wgpu.GPUComputePipeline] = {}
        self._prepared: set[tuple] = set()  # compiled by ``prepare``, not yet asked for

    def __len__(self) -> int:
        return len(self._pipelines)

    def checks_now(self) -> bool:
        """Whether a pipeline compiled now gets naga's runtime checks (see ``runtime_checks``)."""
        if self.runtime_checks is not None:
            return bool(self.runtime_checks)
        return runtime_checks_for(self.backend)

    def layout(self, writes: tuple[bool, ...]) -> wgpu.GPUBindGroupLayout:
        """The bind group layout for group 0 with one storage binding per ``writes`` flag.

        Args:
            writes: per binding, True for ``var<storage, read_write>``.
        """
        return self._layout_pair(writes)[0]

    def _layout_pair(self, writes: tuple[bool, ...]):
        pair = self._layouts.get(writes)
        if pair is None:
            entries = [
                {
                    "binding": i,
                    "visibility": wgpu.ShaderStage.COMPUTE,
                    "buffer": {"type": _RW if w else _RO},
                }
                for i, w in enumerate(writes)
            ]
            label = "rw" + "".join("w" if w else "r" for w in writes)
            bgl = self.gpu.create_bind_group_layout(label=label, entries=entries)
            pl = self.gpu.create_pipeline_layout(label=label, bind_group_layouts=[bgl])
            pair = self._layouts[writes] = (bgl, pl)
        return pair

    def get(self, name: str, wgsl: str, writes: tuple[bool, ...]) -> wgpu.GPUComputePipeline:
        """The compute pipeline for a kernel, compiling it on first request.

        Args:
            name: kernel name, used in labels and errors.
            wgsl: complete WGSL source with entry point ``main``; group 0, binding i is the
                i-th storage buffer.
            writes: per binding, whether the shader declares it ``read_write``.

        Raises:
            KernelError: the WGSL does not compile, or its declarations do not match
                ``writes`` (a binding missing from the layout, or read/write access differing).
        """
        writes = tuple(bool(w) for w in writes)
        checks = self.checks_now()
        key = (wgsl_hash(wgsl), writes, checks)
        pipeline = self._pipelines.get(key)
        if pipeline is not None:
            if key in self._prepared:  # compiled by ``prepare`` for this request: not a hit
                self._prepared.discard(key)
            else:
                self.hits += 1
            return pipeline
        _, layout = self._layout_pair(writes)
        pipeline, shader_s, pipeline_s = self._compile(name, wgsl, writes, checks, layout)
        self.shader_seconds += shader_s
        self.pipeline_seconds += pipeline_s
        self.compiled += 1
        self._pipelines[key] = pipeline
        return pipeline

    def _compile(self, name: str, wgsl: str, writes: tuple[bool, ...], checks: bool, layout):
        """(pipeline, seconds in create_shader_module, seconds in create_compute_pipeline);
        touches no attribute of the cache, so threads may run it at once (``prepare``)."""
        t0 = time.perf_counter()
        try:
            module = create_shader_module(self.gpu, name, wgsl, checks)
        except wgpu.GPUError as e:
            raise KernelError(f"kernel {name!r}: WGSL failed to compile:\n{e}") from e
        t1 = time.perf_counter()
        try:
            pipeline = self.gpu.create_compute_pipeline(
                label=name, layout=layout, compute={"module": module, "entry_point": "main"}
            )
        except wgpu.GPUError as e:
            access = ", ".join(f"{i}:{'read_write' if w else 'read'}" for i, w in enumerate(writes))
            raise KernelError(
                f"kernel {name!r}: pipeline creation failed (bindings declared by the program: "
                f"{access or 'none'}):\n{e}"
            ) from e
        return pipeline, t1 - t0, time.perf_counter() - t1

    def prepare(self, kernels: Iterable[tuple[str, str, Sequence[bool]]]) -> int:
        """Compile the pipelines of ``kernels`` (``(name, wgsl, writes)``, as ``get`` takes
        them) that are not cached yet, on up to ``COMPILE_THREADS`` threads at once, so that
        the ``get`` calls which follow are cache hits.

        The driver's compile (SPIR-V to machine code) dominates a cold Session's setup (42 ms
        a pipeline on the H200's driver, against 11 ms with its disk cache warm:
        bench/results/startup_h200.json); wgpu-native's device is thread-safe, cffi releases
        the GIL around each native call, and wgpu-py captures a call's validation error on the
        calling thread, so each thread's failures raise in that thread. Pipelines are compiled
        whatever their order; ``shader_seconds`` and ``pipeline_seconds`` add the threads'
        times (they may then exceed the wall time); ``compiled`` counts them here, and the
        first ``get`` of each is not counted in ``hits`` (as if ``get`` had compiled it).

        Returns:
            The number of pipelines compiled.

        Raises:
            KernelError: a kernel fails to compile: the first such kernel in ``kernels``'
                order. The pipelines compiled are kept (on threads, every other kernel's; on
                one, those before it), and a later ``get`` of one counts as a hit.
        """
        checks = self.checks_now()
        todo: dict[tuple, tuple] = {}
        for name, wgsl, writes in kernels:
            writes = tuple(bool(w) for w in writes)
            key = (wgsl_hash(wgsl), writes, checks)
            if key not in self._pipelines and key not in todo:
                todo[key] = (name, wgsl, writes, checks, self._layout_pair(writes)[1])
        threads = min(COMPILE_THREADS, len(todo))
        results: dict[tuple, tuple | KernelError] = {}
        if threads <= 1:
            for key, job in todo.items():
                try:
                    results[key] = self._compile(*job)
                except KernelError as e:
                    results[key] = e
                    break
        else:
            with ThreadPoolExecutor(threads, thread_name_prefix="meganeura-pipelines") as pool:
                futures = {key: pool.submit(self._compile, *job) for key, job in todo.items()}
            for key, future in futures.items():
                try:
                    results[key] = future.result()
                except KernelError as e:
                    results[key] = e
        error, done = None, []
        for key, result in results.items():  # the kernels' order: the first error is raised
            if isinstance(result, KernelError):
                error = error or result
                continue
            pipeline, shader_s, pipeline_s = result
            self.shader_seconds += shader_s
            self.pipeline_seconds += pipeline_s
            self.compiled += 1
            self._pipelines[key] = pipeline
            done.append(key)
        if error is not None:  # no Session asks for these now: a later ``get`` is a hit
            raise error
        self._prepared.update(done)
        return len(done)

    def bind_group(
        self,
        name: str,
        writes: tuple[bool, ...],
        buffers: Sequence[wgpu.GPUBuffer],
        spans: Sequence[tuple[int, int]] | None = None,
    ) -> wgpu.GPUBindGroup:
        """A bind group for group 0 binding ``buffers`` in order: whole, or the byte range
        ``(offset, size)`` of ``spans[i]`` (``Dispatch.span``) when given.

        Raises:
            KernelError: wgpu rejects it (e.g. a buffer without STORAGE usage, or an offset
                that is not a multiple of min_storage_buffer_offset_alignment).
        """
        entries = []
        for i, b in enumerate(buffers):
            res = {"buffer": b}
            if spans is not None:
                res["offset"], res["size"] = spans[i]
            entries.append({"binding": i, "resource": res})
        try:
            return self.gpu.create_bind_group(
                label=name, layout=self.layout(tuple(bool(w) for w in writes)), entries=entries
            )
        except wgpu.GPUError as e:
            raise KernelError(f"kernel {name!r}: bind group creation failed:\n{e}") from e


def check_limits(program: Program, device: Device) -> None:
    """Check a program's buffers and dispatches against the device's limits before creating
    anything, so an oversized program fails with a message naming the culprit and the limit.

    Raises:
        KernelError: a buffer over ``max_buffer_size``; a binding over
            ``max_storage_buffer_binding_size``; a grid over
            ``max_compute_workgroups_per_dimension``; more bindings than
            ``max_storage_buffers_per_shader_stage``; a binding naming no buffer; bindings and
            writes of different lengths; overlapping bindings of one buffer in one dispatch
            when either is written, or one buffer bound both read-only and writable even at
            disjoint ranges (wgpu rejects those usage conflicts); a binding range outside
            its buffer or at an offset that is not a multiple of
            ``min_storage_buffer_offset_alignment``.
        ValueError: buffer ids that are not their positions.
    """
    bufs = program.buffers
    for i, b in enumerate(bufs):
        if b.id != i:
            raise ValueError(f"buffer at position {i} has id {b.id}; ids must be positions")
        if b.size > device.max_buffer_size:
            raise KernelError(
                f"buffer {i} ({b.role} {b.name or ''}) is {b.size:,} bytes, over this "
                f"adapter's max_buffer_size of {device.max_buffer_size:,}"
            )
    lim_grid, lim_bind = (
        device.max_compute_workgroups_per_dimension,
        device.max_storage_buffer_binding_size,
    )
    align = device.min_storage_buffer_offset_alignment
    for d in program.dispatches:
        where = f"kernel {d.name!r}"
        if len(d.bindings) != len(d.writes):
            raise KernelError(f"{where}: {len(d.bindings)} bindings but {len(d.writes)} writes")
        if len(d.bindings) > device.max_storage_buffers_per_shader_stage:
            raise KernelError(
                f"{where} binds {len(d.bindings)} storage buffers, over this adapter's "
                f"max_storage_buffers_per_shader_stage of "
                f"{device.max_storage_buffers_per_shader_stage}"
            )
        if len(d.grid) != 3 or any(g < 0 or g > lim_grid for g in d.grid):
            raise KernelError(
                f"{where}: grid {tuple(d.grid)} exceeds this adapter's "
                f"max_compute_workgroups_per_dimension of {lim_grid} (or is not 3 counts)"
            )
        ranges: list[tuple[int, int, int]] = []  # (buffer, start, end) per binding
        for i, bid in enumerate(d.bindings):
            if not 0 <= bid < len(bufs):
                raise KernelError(f"{where}: binding {i} names buffer {bid}, which does not exist")
            off, size = d.span(i, max(-(-bufs[bid].size // 4) * 4, 4))  # as allocated
            if size > lim_bind:
                raise KernelError(
                    f"{where}: binding {i} (buffer {bid}, {size:,} bytes) exceeds this "
                    f"adapter's max_storage_buffer_binding_size of {lim_bind:,}"
                )
            if off % align or size <= 0 or off + size > max(-(-bufs[bid].size // 4) * 4, 4):
                raise KernelError(
                    f"{where}: binding {i} spans bytes [{off}, {off + size}) of buffer {bid} "
                    f"({bufs[bid].size:,} B); offsets must be multiples of {align}"
                )
            ranges.append((bid, off, off + size))
        i = binding_conflict(ranges, d.writes)
        if i is not None:
            raise KernelError(
                f"{where}: buffer {d.bindings[i]} is bound more than once with write access "
                f"(binding {i})"
            )


def find_invalid_dispatch(
    cache: PipelineCache,
    dispatches: Sequence[Dispatch],
    bind_groups: Sequence[wgpu.GPUBindGroup],
    err: Exception,
) -> KernelError:
    """Name the dispatch that made a recorded command buffer fail ``finish``.

    wgpu's message for a failing dispatch does not name the pipeline, so each dispatch is
    recorded alone, with an empty grid (validated as the real one), until one fails. Only used
    on the error path. Those that pass are submitted (they run nothing): a finished command
    buffer that is never submitted keeps its buffers allocated (``Session``).

    Returns:
        A KernelError naming the first failing kernel, or wrapping ``err`` if none fails alone.
    """
    for d, bg in zip(dispatches, bind_groups, strict=True):
        enc = cache.gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        cp.set_pipeline(cache.get(d.name, d.wgsl, d.writes))
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(0, 0, 0)
        cp.end()
        try:
            cb = enc.finish()
        except wgpu.GPUError as e:
            return KernelError(f"kernel {d.name!r} failed validation when recorded:\n{e}")
        cache.gpu.queue.submit([cb])
    return KernelError(f"the step's command buffer failed validation:\n{err}")

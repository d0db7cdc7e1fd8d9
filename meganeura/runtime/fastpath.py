"""Direct wgpu-native calls for the three things a step does on the host, with the public
wgpu-py API as the fallback.

Why: wgpu-py wraps every native call in Python (argument checks, an error-capture proxy, a
fresh ``uint32_t[]`` for the dynamic offsets of each ``set_bind_group``) and waits for buffer
maps through a poll thread. For a step that is nothing but replayed commands, that wrapper is
most of the host time. Measured on lavapipe (this repository's CI machine class, 1,000
dispatches of one tiny kernel, record + finish + submit): 3.4-3.9 ms through the public API,
1.4-1.6 ms through these calls; on the H200 machine see ``bench/dispatch.py``.

What is used, and why it is safe:
  * ``record``: ``wgpuComputePassEncoderSetPipeline / SetBindGroup / DispatchWorkgroups`` on the
    raw library (not wgpu-py's error-capturing ``libf``). Pass-encoder errors are deferred by
    WebGPU to ``GPUCommandEncoder.finish``, which still goes through wgpu-py and raises; and a
    Session records its whole step once at construction, so an invalid plan fails there.
  * ``write``: ``wgpuQueueWriteBuffer`` from a C-contiguous NumPy array (the call copies).
    Callers check sizes, offsets and 4-byte alignment first.
  * ``wait_idle``: ``wgpuDevicePoll(wait=True)``, which returns once every submission so far
    has completed; wgpu-py 0.32's ``on_submitted_work_done_sync`` fails in its FFI layer, and the
    public alternative (reading 4 bytes back) costs a copy, a map and a poll-thread hand-off.
  * ``map_read``: ``wgpuBufferMapAsync`` with our own callback, then ``wgpuDevicePoll(wait)`` on
    the calling thread until it fires, instead of waking wgpu-py's poll thread and waiting for
    it (a thread hand-off per read). The buffer is unmapped before returning, so wgpu-py's own
    view of it (``map_state == "unmapped"``) stays true. A failed map raises ``RuntimeError``.

If wgpu-py's private module layout changes (``AVAILABLE`` is False), every function here falls
back to the public API with the same behaviour.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import wgpu

try:  # wgpu-py's cffi handles; private, so everything below has a public fallback
    from wgpu.backends.wgpu_native._api import ffi, lib

    _SET_PIPELINE = lib.wgpuComputePassEncoderSetPipeline
    _SET_BIND_GROUP = lib.wgpuComputePassEncoderSetBindGroup
    _DISPATCH = lib.wgpuComputePassEncoderDispatchWorkgroups
    _WRITE = lib.wgpuQueueWriteBuffer
    _MAP_ASYNC = lib.wgpuBufferMapAsync
    _POLL = lib.wgpuDevicePoll
    _SUBMIT_FOR_INDEX = lib.wgpuQueueSubmitForIndex
    _MAPPED_RANGE = lib.wgpuBufferGetConstMappedRange
    _UNMAP = lib.wgpuBufferUnmap
    _MAP_READ = lib.WGPUMapMode_Read
    _MAP_SUCCESS = lib.WGPUMapAsyncStatus_Success
    _ALLOW_PROCESS_EVENTS = lib.WGPUCallbackMode_AllowProcessEvents
    from wgpu.backends.wgpu_native._api import GPUShaderModule, libf, new_struct_p, to_c_string_view

    _CREATE_TRUSTED = libf.wgpuDeviceCreateShaderModuleTrusted
    _WGSL_SOURCE = lib.WGPUSType_ShaderSourceWGSL
    AVAILABLE = True
except (ImportError, AttributeError):  # pragma: no cover - depends on the installed wgpu-py
    AVAILABLE = False

# Map requests in flight: id -> status (None until the callback fires). One module-level
# callback serves them all; userdata1 carries the id.
_pending: dict[int, int | None] = {}
_next_id = [0]

if AVAILABLE:

    @ffi.callback("void(WGPUMapAsyncStatus, WGPUStringView, void *, void *)")
    def _on_mapped(status, _message, userdata1, _userdata2):
        _pending[int(ffi.cast("intptr_t", userdata1))] = int(status)


def raw_handle(obj) -> object:
    """The native handle of a wgpu-py object (pipeline, bind group, buffer, pass, queue)."""
    return obj._internal


class Recorder:
    """Replays a prebuilt dispatch list into one command buffer, or chunk by chunk (:meth:`submit`).

    One thread encodes the whole step. Splitting a long step over threads, each encoding and
    finishing its own command buffer, was measured and dropped: on the H200 machine a
    1,000-dispatch step took 4.4 ms to encode on one thread and 10.6 ms on three (wgpu-core
    serializes them), and on lavapipe it gained nothing once the CPU was busy.

    Args:
        plan: ``(pipeline, bind_group, x, y, z)`` per dispatch. The wgpu-py objects must
            outlive the Recorder (the Session holds them).
    """

    def __init__(self, plan: Sequence[tuple]):
        self._plan = tuple(plan)
        self._raw = (
            tuple((raw_handle(p), raw_handle(bg), x, y, z) for p, bg, x, y, z in plan)
            if AVAILABLE
            else None
        )

    def __len__(self) -> int:
        return len(self._plan)

    def record(
        self,
        compute_pass: wgpu.GPUComputePassEncoder,
        dry: bool = False,
        start: int = 0,
        stop: int | None = None,
    ) -> None:
        """Encode dispatches ``[start, stop)`` (default: all) into ``compute_pass``; consecutive
        dispatches of one pipeline set it once. ``dry``: every grid is (0, 0, 0) (see
        :meth:`encode`)."""
        last = None
        if self._raw is None:
            for pipeline, bg, x, y, z in self._plan[start:stop]:
                if pipeline is not last:
                    compute_pass.set_pipeline(pipeline)
                    last = pipeline
                compute_pass.set_bind_group(0, bg)
                if dry:
                    x = y = z = 0
                compute_pass.dispatch_workgroups(x, y, z)
            return
        cp, null = raw_handle(compute_pass), ffi.NULL
        set_pipeline, set_bind_group, dispatch = _SET_PIPELINE, _SET_BIND_GROUP, _DISPATCH
        for pipeline, bg, x, y, z in self._raw[start:stop]:
            if pipeline != last:
                set_pipeline(cp, pipeline)
                last = pipeline
            set_bind_group(cp, 0, bg, 0, null)
            if dry:
                x = y = z = 0
            dispatch(cp, x, y, z)

    def encode(self, gpu: wgpu.GPUDevice, tail=None, dry: bool = False) -> wgpu.GPUCommandBuffer:
        """The step as one command buffer: one compute pass holding every dispatch, then
        ``tail(encoder)`` (copies that must follow every dispatch).

        ``dry``: every dispatch is encoded with a (0, 0, 0) grid. wgpu validates a dispatch
        when it is encoded, whatever its size (pipeline and bind group compatibility, bindings
        smaller than the shader's fixed-size arrays), so ``finish`` accepts or rejects it as it
        would the real step; submitted, it runs no kernel.

        Raises:
            wgpu.GPUError: ``finish`` rejected the recording.
        """
        return self._encode_range(gpu, 0, len(self._plan), tail, dry)

    def _encode_range(self, gpu, start: int, stop: int, tail, dry: bool) -> wgpu.GPUCommandBuffer:
        return _finish(*self._open(gpu, start, stop, dry), tail)

    def _open(self, gpu, start: int, stop: int, dry: bool = False) -> tuple:
        """(encoder, its compute pass holding dispatches ``[start, stop)``, left open)."""
        enc = gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        self.record(cp, dry, start, stop)
        return enc, cp

    def submit(
        self,
        gpu: wgpu.GPUDevice,
        queue: wgpu.GPUQueue,
        chunks: Sequence[tuple[int, int]],
        tail=None,
        dry: bool = False,
    ) -> None:
        """Encode and submit the step one chunk of dispatches at a time, so that the GPU runs
        chunk k while the host encodes chunk k + 1 (a single command buffer keeps the GPU idle
        for the whole encoding: ~4.6 us per dispatch on the H200 machine, ``bench/dispatch.py``).
        ``chunks``: ``(start, stop)`` ranges covering the plan in order (:func:`chunk_bounds`);
        ``tail(encoder)`` is encoded after the last chunk. Submissions to one queue run in
        order, each seeing every earlier one's writes (WebGPU's queue timeline).

        Raises:
            wgpu.GPUError: ``finish`` rejected a chunk; the chunks before it were submitted.
                The Session records its step once at construction with the same chunks, so
                only a plan that failed there could fail here.
        """
        last = len(chunks) - 1
        for i, (start, stop) in enumerate(chunks):
            buf = self._encode_range(gpu, start, stop, tail if i == last else None, dry)
            queue.submit([buf])

    def prepare(self, gpu: wgpu.GPUDevice, chunks: Sequence[tuple[int, int]]) -> list[tuple]:
        """Record the step ahead of its submission: per chunk of ``chunks`` a new command
        encoder whose compute pass holds the chunk's dispatches and is left open.

        :meth:`submit_prepared` ends, finishes and submits them; until then nothing runs.
        Dropping them unsubmitted frees everything they reference (an open encoder, unlike a
        finished command buffer, does not pin its buffers in wgpu-native; measured on
        lavapipe, ``tests/runtime/test_prepared_steps.py``). Why: recording is most of a
        step's host time (1,000 dispatches on lavapipe: create and record 2.4 ms, end and
        finish 1.6, submit 0.13), and recorded while the GPU runs the step before, it leaves
        only end, finish and submit between a call and the GPU's start.
        """
        return [self._open(gpu, start, stop) for start, stop in chunks]

    @staticmethod
    def submit_prepared(queue: wgpu.GPUQueue, parts: Sequence[tuple], tail=None) -> None:
        """End, finish and submit the chunks :meth:`prepare` recorded, in order, with
        ``tail(encoder)`` encoded after the last chunk's pass.

        Raises:
            wgpu.GPUError: ``finish`` rejected a chunk; the chunks before it were submitted.
        """
        last = len(parts) - 1
        for i, (enc, cp) in enumerate(parts):
            queue.submit([_finish(enc, cp, tail if i == last else None)])


def _finish(enc, cp, tail) -> wgpu.GPUCommandBuffer:
    """End the open pass ``cp`` of ``enc``, encode ``tail(enc)`` (when given), finish."""
    cp.end()
    if tail is not None:
        tail(enc)
    return enc.finish()


def chunk_bounds(
    n: int, first: int, size: int, split_short: bool = False
) -> tuple[tuple[int, int], ...]:
    """``(start, stop)`` ranges covering ``n`` dispatches: ``first`` dispatches (none when 0),
    then ``size`` at a time (the last chunk takes the remainder, merged into the previous one
    when it would be shorter than ``first``). ``size`` <= 0 or ``n`` <= ``first + size``: one
    chunk, except with ``split_short``, where a step of ``2 * first`` to ``first + size``
    dispatches is ``first`` and the rest.

    A small first chunk starts the GPU soon; later chunks are long enough that encoding one
    (host) takes less than running the one before it (GPU), so the GPU never waits again.
    ``split_short`` is for steps recorded ahead (``prepare``): what is left of a call's host
    work is ending and finishing each chunk, ~3 us a dispatch on the H200
    (``bench/call_phases.py``), so a short step too starts sooner as two.
    """
    if size > 0 and split_short and first > 0 and 2 * first <= n <= first + size:
        return ((0, first), (first, n))
    if size <= 0 or n <= first + size:
        return ((0, n),)
    bounds = [(0, first)] if first > 0 else []
    start = first
    while start < n:
        stop = min(start + size, n)
        if n - stop < max(first, 1):
            stop = n
        bounds.append((start, stop))
        start = stop
    return tuple(bounds)


def write(queue: wgpu.GPUQueue, buffer: wgpu.GPUBuffer, offset: int, data: np.ndarray) -> None:
    """Copy the bytes of ``data`` into ``buffer`` at ``offset`` (queued before the next submit).

    The caller guarantees ``offset`` and ``data.nbytes`` are multiples of 4 and in range.
    """
    if not AVAILABLE:
        queue.write_buffer(buffer, offset, data)
        return
    data = np.ascontiguousarray(data)
    _WRITE(
        raw_handle(queue),
        raw_handle(buffer),
        offset,
        ffi.cast("void *", data.ctypes.data),
        data.nbytes,
    )


def map_read(device: wgpu.GPUDevice, buffer: wgpu.GPUBuffer, offset: int, size: int) -> bytes:
    """Map ``buffer[offset : offset + size]`` for reading after all submitted work, copy it
    out and unmap. ``offset`` must be a multiple of 8 and ``size`` of 4 (WebGPU's rules).

    Raises:
        RuntimeError: the map failed (the message gives wgpu's status code).
    """
    if not AVAILABLE:
        buffer.map_async(wgpu.MapMode.READ, offset, size).sync_wait()
        try:
            return bytes(buffer.read_mapped(offset, size, copy=False))
        finally:
            buffer.unmap()
    key = map_async(buffer, offset, size)
    dev = raw_handle(device)
    try:
        while _pending[key] is None:
            _POLL(dev, True, ffi.NULL)  # blocks until the queue is idle, then fires callbacks
    except BaseException:
        _pending.pop(key, None)
        raise
    return mapped_copy(key, buffer, offset, size)


def create_shader_module(gpu: wgpu.GPUDevice, label: str, wgsl: str, checks: bool):
    """A shader module from WGSL, with or without the runtime checks naga adds when it
    translates to the backend's language.

    With ``checks`` (WebGPU's default), naga clamps dynamically indexed arrays into bounds (and
    storage accesses, where the backend's driver does not bound them itself) and gives every
    loop a counter that breaks it after 2^64 iterations.
    Without them (``wgpuDeviceCreateShaderModuleTrusted`` with no ``WGPUShaderRuntimeChecks``),
    the shader is passed on as written: an out-of-range index is undefined behaviour, as in
    CUDA. meganeura's kernels are generated for fixed shapes and guard every partial tile; see
    ``pipelines.default_runtime_checks`` for where this is the default.

    Raises:
        wgpu.GPUError: the WGSL fails to parse or validate (as ``create_shader_module``).
    """
    if checks or not AVAILABLE:
        return gpu.create_shader_module(label=label, code=wgsl)
    source = new_struct_p("WGPUShaderSourceWGSL *", code=to_c_string_view(wgsl))
    source[0].chain.next = ffi.NULL
    source[0].chain.sType = _WGSL_SOURCE
    desc = new_struct_p(
        "WGPUShaderModuleDescriptor *",
        nextInChain=ffi.cast("WGPUChainedStruct *", source),
        label=to_c_string_view(label),
    )
    handle = _CREATE_TRUSTED(raw_handle(gpu), desc, 0)  # 0: WGPUShaderRuntimeChecks_None
    if handle == ffi.NULL:
        raise RuntimeError(f"shader module {label!r}: creation failed")
    return GPUShaderModule(label, handle, gpu)


def wait_idle(device: wgpu.GPUDevice, fallback) -> None:
    """Block until every submission to ``device`` so far has completed.

    Args:
        fallback: called instead when the native call is unavailable (it must wait the same way).
    """
    if not AVAILABLE:
        fallback()
        return
    _POLL(raw_handle(device), True, ffi.NULL)


# ---------------------------------------------------------------- segmented steps (segments.py)


def submit_for_index(queue: wgpu.GPUQueue, command_buffers: Sequence) -> int | None:
    """Submit ``command_buffers``; returns the submission index (None on the public fallback,
    where :func:`poll` then waits for all work)."""
    if not AVAILABLE:
        queue.submit(list(command_buffers))
        return None
    handles = ffi.new("WGPUCommandBuffer[]", [raw_handle(cb) for cb in command_buffers])
    return int(_SUBMIT_FOR_INDEX(raw_handle(queue), len(command_buffers), handles))


def map_async(buffer: wgpu.GPUBuffer, offset: int, size: int):
    """Request a read map of ``buffer[offset : offset + size]`` (after all submitted work);
    returns a key for :func:`map_done` and :func:`mapped_copy`. The callback fires inside a
    :func:`poll`."""
    if not AVAILABLE:
        return buffer.map_async(wgpu.MapMode.READ, offset, size)
    key = _next_id[0] = _next_id[0] + 1
    _pending[key] = None
    info = ffi.new(
        "WGPUBufferMapCallbackInfo *",
        {
            "mode": _ALLOW_PROCESS_EVENTS,
            "callback": _on_mapped,
            "userdata1": ffi.cast("void *", key),
        },
    )
    _MAP_ASYNC(raw_handle(buffer), _MAP_READ, offset, size, info[0])
    return key


def map_done(key) -> bool:
    """Whether the map requested by :func:`map_async` has completed (successfully or not)."""
    if not AVAILABLE:
        return key.done() if hasattr(key, "done") else True
    return _pending.get(key) is not None


def poll(device: wgpu.GPUDevice, wait: bool, index: int | None = None) -> None:
    """``wgpuDevicePoll``: fire completed callbacks; with ``wait``, first block until
    submission ``index`` (None: every submission) has completed."""
    if not AVAILABLE:
        return
    idx = ffi.NULL if index is None else ffi.new("uint64_t *", index)
    _POLL(raw_handle(device), bool(wait), idx)


def _take_mapped(key, buffer: wgpu.GPUBuffer, offset: int, size: int, take):
    """``take(view)`` of a completed :func:`map_async` map's ``size`` bytes from ``offset``
    (a read-only buffer-protocol view, valid during the call); the buffer is then unmapped.

    Raises:
        RuntimeError: the map failed (the message gives wgpu's status code).
    """
    if not AVAILABLE:
        key.sync_wait()
        try:
            return take(buffer.read_mapped(offset, size, copy=False))
        finally:
            buffer.unmap()
    status = _pending.pop(key, None)
    if status != _MAP_SUCCESS:
        raise RuntimeError(f"mapping {buffer.label!r} for reading failed (wgpu status {status})")
    buf = raw_handle(buffer)
    try:
        return take(ffi.buffer(_MAPPED_RANGE(buf, offset, size), size))
    finally:
        _UNMAP(buf)


def mapped_into(key, buffer: wgpu.GPUBuffer, offset: int, out: np.ndarray) -> np.ndarray:
    """Copy a completed :func:`map_async` map's first ``out.nbytes`` bytes from ``offset``
    straight into ``out`` (C-contiguous, writable; no intermediate bytes object); the buffer
    is unmapped. Returns ``out``.

    Raises:
        RuntimeError: the map failed (the message gives wgpu's status code).
        ValueError: ``out`` is not C-contiguous and writable.
    """
    if not (out.flags.c_contiguous and out.flags.writeable):
        raise ValueError("mapped_into: out must be a C-contiguous, writable array")

    def take(view):
        np.copyto(out.reshape(-1).view(np.uint8), np.frombuffer(view, np.uint8))
        return out

    return _take_mapped(key, buffer, offset, out.nbytes, take)


def mapped_copy(key, buffer: wgpu.GPUBuffer, offset: int, size: int) -> bytes:
    """The bytes of a completed :func:`map_async` map, copied out; the buffer is unmapped.

    Raises:
        RuntimeError: the map failed (the message gives wgpu's status code).
    """
    return _take_mapped(key, buffer, offset, size, bytes)

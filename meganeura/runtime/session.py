"""Session: the GPU objects of one Program, and the step that replays it.

A Session creates every buffer, pipeline and bind group once. ``run`` validates every feed on the
host, uploads the inputs, replays the prebuilt dispatch list (:class:`.fastpath.Recorder`)
followed by copies of the fetched outputs into a persistent staging buffer, and maps the staging
buffer to read the outputs. A long step is submitted in chunks, so the GPU starts on the first
dispatches while the host still encodes the rest, and each step's chunks are recorded right
after the step before is submitted, so a call only ends, finishes and submits them (the
settings: :mod:`.stepping`). The host side goes through direct wgpu-native calls
(:mod:`.fastpath`).
Host-side checks of feeds live in :mod:`.slots`; ``profile`` checks and uploads the feeds as
``run`` does, then times the dispatches with :mod:`.profiler`, and leaves ``run`` uninstrumented.

Invariants:
  * nothing reaches the GPU before every feed (names, shapes, exact dtypes, label ranges) has
    been checked, so a rejected step leaves parameters and state untouched;
  * every validation failure raises: compile and binding errors at construction
    (:class:`KernelError`), command-recording errors at ``finish`` before submission (wgpu-native
    aborts the process on an invalid submit, so nothing invalid is ever submitted); the step is
    recorded once at construction with the chunks ``run`` uses, so a chunk that ``finish``
    rejects is found there, before any real step has run part of the program;
  * ``bool`` slots are ``u32`` (0/1) on the GPU and ``np.bool_`` on the host;
  * reads always follow a submit, so they never return stale data.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np
import wgpu

from ..schedule.program import Program
from . import fastpath, stepping
from .device import Device, get_device
from .pipelines import check_limits, find_invalid_dispatch
from .profiler import Method, Profile, choose_method, profile_dispatches
from .slots import BoundSlot, InputError, bind_slots, ceil_to, check_labels, checked, decode
from .stepping import SUBMIT_CHUNKS, set_pre_encode, set_split_short, submit_chunks

__all__ = [
    "SUBMIT_CHUNKS",
    "InputError",
    "Session",
    "set_pre_encode",
    "set_split_short",
    "submit_chunks",
]

_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
_STAGING_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST


class Session:
    """Runs one Program on one device.

    Attributes:
        program: the Program (read-only).
        device: the Device it runs on.
        setup_seconds: wall time of construction by part: ``buffers`` (creation and slot
            binding), ``pipelines`` (compiling or fetching from the device's cache),
            ``bind_groups``, ``validate`` (limit checks and one step recorded and submitted with
            empty grids).
        pipelines_compiled: pipelines this Session compiled (misses of the device's cache).
        pipelines_reused: pipelines it found already compiled on the device.
    """

    def __init__(
        self,
        program: Program,
        device: Device | None = None,
        external: Mapping[int, tuple[wgpu.GPUBuffer, int]] | None = None,
    ):
        """Create buffers, pipelines and bind groups.

        Args:
            program: the compiled step.
            device: defaults to :func:`get_device` ``()``.
            external: program buffer id -> (GPU buffer, byte offset): buffers this Session binds
                instead of creating them, e.g. parameters shared with other programs
                (``meganeura.runtime.shared``). The caller keeps them alive; ``close`` leaves
                them alone. Offsets must be multiples of the adapter's storage offset alignment.

        Raises:
            KernelError: a kernel fails to compile or bind, a grid or binding exceeds the
                adapter's limits (the message names the kernel, buffer and limit), or a
                writable buffer is bound twice in one dispatch.
            ValueError: the program is inconsistent (slot outside its buffer, unknown label
                check input).
        """
        self.program = program
        self.device = device if device is not None else get_device()
        self._closed = False
        gpu = self.device.gpu
        self._gpu, self._queue = gpu, gpu.queue
        self._sync_buffer = None
        t0 = time.perf_counter()
        check_limits(program, self.device)
        t1 = time.perf_counter()
        external = dict(external or {})
        for i, (buf, base) in external.items():
            if not 0 <= i < len(program.buffers):
                raise ValueError(f"external buffer for program buffer {i}, which does not exist")
            if base % self.device.min_storage_buffer_offset_alignment or (
                base + program.buffers[i].size > buf.size
            ):
                raise ValueError(
                    f"external buffer for program buffer {i}: offset {base} and size "
                    f"{program.buffers[i].size} do not fit a {buf.size}-byte buffer at the "
                    f"adapter's offset alignment {self.device.min_storage_buffer_offset_alignment}"
                )
        self._own = [i for i in range(len(program.buffers)) if i not in external]
        self._buffers = [
            external[b.id][0]
            if b.id in external
            else gpu.create_buffer(
                label=f"b{b.id} {b.role}{' ' + b.name if b.name else ''}",
                size=ceil_to(max(b.size, 4), 4),
                usage=_USAGE,
            )
            for b in program.buffers
        ]
        self._bases = [external[b.id][1] if b.id in external else 0 for b in program.buffers]
        self._bound = bind_slots(program, self._buffers, self._bases)
        self._resident: set[str] = set()  # inputs written with ``write``: feeds may omit them
        for lc in program.label_checks:
            if lc.name not in program.inputs or not program.inputs[lc.name].dtype.is_integer:
                raise ValueError(f"label check names {lc.name!r}, which is not an integer input")
        self._staging, self._stage_at = self._build_staging()
        t2 = time.perf_counter()
        cache = self.device.pipelines
        compiled, hits = cache.compiled, cache.hits
        self._plan = fastpath.Recorder(self._build_plan())
        self._pre_encode = stepping.PRE_ENCODE
        self._split_short = stepping.PRE_ENCODE and stepping.SPLIT_SHORT
        self._chunks = fastpath.chunk_bounds(len(self._plan), *submit_chunks(), self._split_short)
        self._ready: list[tuple] | None = None  # the next step, recorded (PRE_ENCODE)
        self.pipelines_compiled = cache.compiled - compiled
        self.pipelines_reused = cache.hits - hits
        t3 = time.perf_counter()
        # Record one step now, so draw-time validation (a buffer smaller than a fixed-size array
        # the shader declares) fails here rather than at the first run. Recorded dry (no
        # workgroups) and submitted, not dropped: wgpu-native 29 never frees a buffer that a
        # finished but never submitted command buffer references, which kept every buffer of
        # every Session allocated after close (issue 11, item 8).
        self._submit(tuple(program.outputs), dry=True)
        t4 = time.perf_counter()
        self.setup_seconds = {
            "buffers": t2 - t1,
            "pipelines": t3 - t2 - self._bind_group_seconds,
            "bind_groups": self._bind_group_seconds,
            "validate": (t1 - t0) + (t4 - t3),
        }

    # ----------------------------------------------------------------------------- setup

    def _build_plan(self):
        cache, plan = self.device.pipelines, []
        self._bind_groups, self._pipelines, self._bind_group_seconds = [], [], 0.0
        cache.prepare((d.name, d.wgsl, d.writes) for d in self.program.dispatches)
        for d in self.program.dispatches:
            pipeline = cache.get(d.name, d.wgsl, d.writes)
            t = time.perf_counter()
            bufs = [self._buffers[i] for i in d.bindings]
            spans = None
            if d.offsets or d.sizes or any(self._bases[i] for i in d.bindings):
                spans = []
                for k, i in enumerate(d.bindings):
                    off, size = d.span(k, self.program.buffers[i].size)
                    spans.append((self._bases[i] + off, size))
            bg = cache.bind_group(d.name, d.writes, bufs, spans)
            self._bind_group_seconds += time.perf_counter() - t
            self._bind_groups.append(bg)
            self._pipelines.append(pipeline)
            if 0 in d.grid:
                continue  # an empty grid is a valid no-op; skip it rather than encode it
            plan.append((pipeline, bg, *d.grid))
        return tuple(plan)

    def _build_staging(self):
        # All outputs share staging buffers (each under max_buffer_size), each at an 8-aligned
        # offset (map_async's granularity), so fetching several outputs costs one map.
        chunks, at, used = [], {}, 0
        for name in self.program.outputs:
            b = self._bound[name]
            if used + b.length > self.device.max_buffer_size or not chunks:
                chunks.append(0)
                used = 0
            at[name] = (len(chunks) - 1, used)
            used = ceil_to(used + b.length, 8)
            chunks[-1] = max(used, 8)
        staging = [
            self._gpu.create_buffer(label=f"staging {i}", size=s, usage=_STAGING_USAGE)
            for i, s in enumerate(chunks)
        ]
        return staging, at

    def _upload(self, b: BoundSlot, data: np.ndarray) -> None:
        raw = data.reshape(-1).view(np.uint8)
        if raw.size == 0:
            return
        if b.start == b.at and b.length == raw.size:
            fastpath.write(self._queue, b.buffer, b.start, raw)
            return
        # Unaligned (odd-length f16, 2-byte offset): pad to 4 bytes, keeping neighbours' bytes.
        if b.pad_free:
            block = np.zeros(b.length, np.uint8)
        else:
            block = np.frombuffer(self._queue.read_buffer(b.buffer, b.start, b.length), np.uint8)
            block = block.copy()
        head = b.at - b.start
        block[head : head + raw.size] = raw
        fastpath.write(self._queue, b.buffer, b.start, block)

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("this Session is closed")

    def _slot(self, name: str, kinds: tuple[str, ...]) -> BoundSlot:
        b = self._bound.get(name)
        if b is None or not set(b.kinds) & set(kinds):
            names = sorted(n for n, x in self._bound.items() if set(x.kinds) & set(kinds))
            raise InputError(f"no {'/'.join(kinds)} named {name!r}; known: {names}")
        return b

    # ----------------------------------------------------------------------------- public API

    def run(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] = ()) -> dict:
        """Run one step: upload ``feeds``, replay every dispatch, read back ``fetch``.

        Args:
            feeds: every input by name, each an array of the slot's exact shape and NumPy dtype
                (``np.bool_`` for bool inputs); int64 arrays are accepted for int32 inputs
                when every value fits int32 (InputError otherwise). Inputs written with
                :meth:`write` may be left out: they keep the written value.
            fetch: output names to read back after the step (a single name may be a str).

        Returns:
            ``{name: array}`` for each fetched output, in the slot's shape and dtype.

        Raises:
            InputError: an unknown, missing or mistyped feed, an int64 value outside the
                int32 range, an out-of-range index (class index, token id, gather or
                index_copy_ index), or an unknown fetch name; raised before anything is
                uploaded.
            KernelError: the recorded step fails validation (names the kernel when it can).
        """
        self._live()
        fetch = (fetch,) if isinstance(fetch, str) else tuple(dict.fromkeys(fetch))
        for name in fetch:
            self._slot(name, ("output",))
        self._feed(feeds)
        self._submit(fetch)
        return self._read_staged(fetch)

    def check(self, feeds: Mapping[str, np.ndarray]) -> list[tuple[BoundSlot, np.ndarray]]:
        """Check ``feeds`` as :meth:`run` does, uploading nothing (a caller running several
        programs in a row checks them all first).

        Returns:
            (slot, array as uploaded) per feed.

        Raises:
            InputError: as :meth:`run`.
            RuntimeError: the Session is closed.
        """
        self._live()
        inputs = self.program.inputs
        unknown = sorted(set(feeds) - set(inputs))
        missing = sorted(set(inputs) - set(feeds) - self._resident)
        if unknown or missing:
            raise InputError(
                f"feeds do not match the program's inputs: missing {missing}, "
                f"unknown {unknown} (inputs: {sorted(inputs)})"
            )
        ready = [(self._bound[n], checked(self._bound[n], v)) for n, v in feeds.items()]
        check_labels(self.program, feeds)
        return ready

    def _feed(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Check every feed, then upload them (nothing is uploaded if one is rejected)."""
        for b, data in self.check(feeds):
            self._upload(b, data)

    def profile(
        self,
        feeds: Mapping[str, np.ndarray],
        repeats: int = 1,
        warmup: int = 1,
        method: Method = "auto",
        replays: int = 1,
    ) -> Profile:
        """Time every dispatch of the step on the GPU with timestamp queries.

        Runs ``warmup`` ordinary steps, then ``repeats`` profiled steps with timestamps around
        each dispatch. Each step changes parameters and state exactly as :meth:`run` does.
        :meth:`run` itself is not instrumented.

        Args:
            feeds: as for :meth:`run`.
            repeats: profiled steps (at least 1).
            warmup: ordinary steps first (drivers compile lazily on first dispatch).
            method: ``"inside"`` (timestamps inside the step's one pass), ``"passes"`` (a pass
                per dispatch) or ``"auto"`` (inside when the device allows it).
            replays: steps per profiled submission, back to back with no host round trip
                between them, as a loop of steps runs (the Profile then counts ``repeats *
                replays`` repeats; ``meganeura.tune.matmul`` times its one-matmul programs so).

        Returns:
            A :class:`~meganeura.runtime.profiler.Profile`: per-dispatch GPU times, a table and a
            Chrome trace.

        Raises:
            ProfilerError: the device lacks ``timestamp-query`` (or, for ``"inside"``,
                ``timestamp-query-inside-passes``).
            InputError: as :meth:`run`; raised before anything runs.
            ValueError: ``repeats`` or ``replays`` < 1, ``warmup`` < 0 or an unknown
                ``method``.
            RuntimeError: the Session is closed.
        """
        if repeats < 1 or warmup < 0 or replays < 1:
            raise ValueError(
                f"need repeats >= 1, warmup >= 0 and replays >= 1, got {repeats}, {warmup} "
                f"and {replays}"
            )
        chosen = choose_method(self.device, method)
        self._live()
        self._feed(feeds)
        for _ in range(warmup):
            self.run(feeds)
        return profile_dispatches(
            self.device,
            self.program.dispatches,
            self._pipelines,
            self._bind_groups,
            repeats=repeats,
            method=chosen,
            replays=replays,
        )

    def recorder(self, dispatches: Sequence[int]) -> fastpath.Recorder:
        """A Recorder replaying ``program.dispatches[i]`` for each ``i`` given, in that order
        (empty grids left out), with this Session's pipelines and bind groups: a part of the
        step (``runtime.segments``). Valid while the Session is open."""
        self._live()
        grids = [self.program.dispatches[i].grid for i in dispatches]
        return fastpath.Recorder(
            [
                (self._pipelines[i], self._bind_groups[i], *g)
                for i, g in zip(dispatches, grids, strict=True)
                if 0 not in g
            ]
        )

    def _record_with(self, recorder: fastpath.Recorder, tail) -> wgpu.GPUCommandBuffer:
        """``recorder``'s dispatches then ``tail(encoder)``, as one command buffer."""
        try:
            return recorder.encode(self._gpu, tail)
        except wgpu.GPUError as e:
            raise find_invalid_dispatch(
                self.device.pipelines, self.program.dispatches, self._bind_groups, e
            ) from e

    @property
    def submissions(self) -> int:
        """Command buffers one step is submitted as (:data:`.stepping.SUBMIT_CHUNKS`)."""
        return len(self._chunks)

    def set_submit_chunks(self, first: int, size: int) -> None:
        """Submit later steps as ``first`` dispatches, then ``size`` at a time (``size`` 0: one
        command buffer); see :data:`.stepping.SUBMIT_CHUNKS`. Results do not depend on it.

        Raises:
            ValueError: a negative ``first`` or ``size``.
        """
        if first < 0 or size < 0:
            raise ValueError(f"need first >= 0 and size >= 0, got {first} and {size}")
        self._chunks = fastpath.chunk_bounds(len(self._plan), first, size, self._split_short)
        self._ready = None  # recorded with the old chunks; dropping it frees nothing needed

    def _submit(self, fetch: tuple[str, ...], dry: bool = False) -> None:
        def copy_outputs(enc: wgpu.GPUCommandEncoder) -> None:
            for name in fetch:
                b = self._bound[name]
                if not b.length:
                    continue  # an empty tensor has nothing to copy (wgpu maps no 0-byte range)
                chunk, off = self._stage_at[name]
                enc.copy_buffer_to_buffer(b.buffer, b.start, self._staging[chunk], off, b.length)

        ready = None
        if not dry:
            ready, self._ready = self._ready, None
        try:
            if ready is not None:
                self._plan.submit_prepared(self._queue, ready, copy_outputs)
            else:
                self._plan.submit(self._gpu, self._queue, self._chunks, copy_outputs, dry)
        except wgpu.GPUError as e:
            raise find_invalid_dispatch(
                self.device.pipelines, self.program.dispatches, self._bind_groups, e
            ) from e
        if self._pre_encode and not dry:
            # the next step, recorded while the GPU runs this one (before any read-back wait);
            # this step is submitted, so a failure here must not fail the call: the next call
            # records its step itself (and raises there if recording really fails)
            try:
                self._ready = self._plan.prepare(self._gpu, self._chunks)
            except Exception:  # noqa: BLE001
                self._ready = None

    def _read_staged(self, fetch: tuple[str, ...]) -> dict:
        out: dict[str, np.ndarray] = {}
        by_chunk: dict[int, list[str]] = {}
        for name in fetch:
            b = self._bound[name]
            if b.length:
                by_chunk.setdefault(self._stage_at[name][0], []).append(name)
            else:
                out[name] = np.zeros(b.slot.shape, b.slot.host.numpy)
        for chunk, names in by_chunk.items():
            lo = min(self._stage_at[n][1] for n in names)
            hi = max(self._stage_at[n][1] + self._bound[n].length for n in names)
            raw = fastpath.map_read(self._gpu, self._staging[chunk], lo, hi - lo)
            for n in names:
                b = self._bound[n]
                head = self._stage_at[n][1] - lo + b.at - b.start
                out[n] = decode(b, raw, head)
        return out

    def read(self, name: str) -> np.ndarray:
        """Copy any named slot (input, output, parameter or state) back to the host.

        Returns:
            A new array of the slot's shape and NumPy dtype (``np.bool_`` for bool slots).

        Raises:
            InputError: no slot has that name.
        """
        self._live()
        b = self._slot(name, ("output", "input", "parameter", "state"))
        if b.length == 0:
            return np.zeros(b.slot.shape, b.slot.host.numpy)
        raw = self._queue.read_buffer(b.buffer, b.start, b.length)
        return decode(b, raw, b.at - b.start)

    def write(self, name: str, value: np.ndarray) -> None:
        """Overwrite an input, parameter or state slot; checked as strictly as ``run`` feeds.

        An input written here stays on the GPU: later :meth:`run` calls may leave it out of
        their feeds and read this value (inputs own their buffers; no step writes them), until
        a feed or another ``write`` replaces it. What a PyTorch user gets by keeping a batch
        on the device.

        Raises:
            InputError: unknown name, an output, wrong shape/dtype, or an index input with a
                value out of its reader's range (as ``run`` feeds).
        """
        self._live()
        b = self._slot(name, ("input", "parameter", "state"))
        data = checked(b, value)
        if "input" in b.kinds:
            check_labels(self.program, {name: value})
        self._upload(b, data)
        if "input" in b.kinds:
            self._resident.add(name)

    @property
    def resident_inputs(self) -> tuple[str, ...]:
        """Inputs written with :meth:`write`, which feeds may leave out (a value fed to
        :meth:`run` is not kept for later calls' missing feeds)."""
        return tuple(sorted(self._resident))

    def state_dict(self) -> dict[str, np.ndarray]:
        """Parameters and optimizer state by name, as host copies."""
        return {n: self.read(n) for n in self._persistent()}

    def _persistent(self) -> list[str]:
        return [n for n, b in self._bound.items() if {"parameter", "state"} & set(b.kinds)]

    def load_state_dict(self, state: Mapping[str, np.ndarray], strict: bool = True):
        """Write parameters and state from ``state``; everything is checked before any write.

        Args:
            state: arrays by name, each of the slot's exact shape and dtype.
            strict: when True, keys must match the parameters and state exactly; when False,
                unknown keys are ignored and missing slots keep their values.

        Returns:
            ``(missing, unexpected)``: sorted key lists (both empty when strict).

        Raises:
            InputError: missing or unknown keys (strict), or a shape/dtype mismatch; names the key.
        """
        self._live()
        known = set(self._persistent())
        missing, unexpected = sorted(known - set(state)), sorted(set(state) - known)
        if strict and (missing or unexpected):
            raise InputError(
                f"state dict does not match the program: missing keys {missing}, "
                f"unexpected keys {unexpected}"
            )
        ready = [
            (self._bound[n], checked(self._bound[n], v)) for n, v in state.items() if n in known
        ]
        for b, data in ready:
            self._upload(b, data)
        return missing, unexpected

    def synchronize(self) -> None:
        """Block until all work submitted to this device has finished (for timing).

        Uses ``wgpuDevicePoll(wait=True)`` (:func:`.fastpath.wait_idle`); without it, reads
        4 bytes back, which waits for every earlier submission.
        """
        fastpath.wait_idle(self._gpu, self._read_sync_word)

    def _read_sync_word(self) -> None:
        if self._sync_buffer is None:
            self._sync_buffer = self._gpu.create_buffer(
                size=4, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            )
        self._queue.read_buffer(self._sync_buffer, 0, 4)

    def close(self) -> None:
        """Free the GPU buffers now; the Session cannot be used afterwards (RuntimeError).

        External buffers are left alone. The wgpu objects that reference buffers (bind groups,
        the recorded plan) are dropped too, so a closed Session that is still referenced pins
        nothing."""
        if not self._closed:
            self._closed = True
            self._ready = None  # a recorded step must not outlive the buffers it binds
            for buf in (*(self._buffers[i] for i in self._own), *self._staging):
                buf.destroy()
            self._buffers, self._staging, self._bound = [], [], {}
            self._bind_groups, self._pipelines, self._plan = [], [], fastpath.Recorder(())
            self._chunks = fastpath.chunk_bounds(0, 0, 0)
            self._sync_buffer = None

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        p = self.program
        return (
            f"<Session {len(p.dispatches)} dispatches, {len(p.buffers)} buffers "
            f"on {self.device.name}>"
        )

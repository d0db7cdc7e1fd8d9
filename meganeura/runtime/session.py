"""Session: the GPU objects of one Program, and the step that replays it.

A Session creates every buffer, pipeline and bind group once. ``run`` validates every feed on the
host, uploads the inputs, records one command encoder holding one compute pass with every
dispatch in order plus copies of the fetched outputs into a persistent staging buffer, submits
once, and maps the staging buffer to read the outputs.

Invariants:
  * nothing reaches the GPU before every feed (names, shapes, exact dtypes, label ranges) has
    been checked, so a rejected step leaves parameters and state untouched;
  * every validation failure raises: compile and binding errors at construction
    (:class:`KernelError`), command-recording errors at ``finish`` before submission (wgpu-native
    aborts the process on an invalid submit, so nothing invalid is ever submitted);
  * ``bool`` slots are ``u32`` (0/1) on the GPU and ``np.bool_`` on the host;
  * reads always follow a submit, so they never return stale data.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import wgpu

from ..dtypes import DType
from ..schedule.program import Program, TensorSlot
from .device import Device, get_device
from .pipelines import check_limits, find_invalid_dispatch

_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
_STAGING_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
# "READ_NOSYNC" skips the empty submit wgpu-py adds before every read-map (a workaround for data
# written through a mapping, wgpu-native#305); our staging buffers are only written by copies in
# the step's own submit. Measured on lavapipe: 124 us vs 148 us for a 4-byte fetch.
_map_mode: object = "READ_NOSYNC"


class InputError(ValueError):
    """A feed, write or state dict does not match the program; nothing was uploaded."""


def _ceil(n: int, k: int) -> int:
    return -(-n // k) * k


def _map_read(buf: wgpu.GPUBuffer, offset: int, size: int) -> None:
    global _map_mode
    try:
        buf.map_async(_map_mode, offset, size).sync_wait()
    except (ValueError, KeyError, TypeError):
        if _map_mode == wgpu.MapMode.READ:
            raise
        _map_mode = wgpu.MapMode.READ  # a later wgpu-py dropped the private mode
        buf.map_async(_map_mode, offset, size).sync_wait()


@dataclass(frozen=True)
class _Bound:
    """A named slot resolved against its GPU buffer, with 4-byte-aligned copy bounds."""

    name: str
    kinds: tuple[str, ...]  # of "parameter", "state", "input", "output"; usually one
    slot: TensorSlot
    buffer: wgpu.GPUBuffer
    start: int  # aligned down to 4: copies and writes need 4-byte granularity
    length: int  # aligned up to 4
    pad_free: bool  # no other named slot shares [start, start + length)

    def what(self) -> str:
        return f"{self.kinds[0]} {self.name!r}"


class Session:
    """Runs one Program on one device.

    Attributes:
        program: the Program (read-only).
        device: the Device it runs on.
    """

    def __init__(self, program: Program, device: Device | None = None):
        """Create buffers, pipelines and bind groups.

        Args:
            program: the compiled step.
            device: defaults to :func:`get_device` ``()``.

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
        check_limits(program, self.device)
        self._buffers = [
            gpu.create_buffer(
                label=f"b{b.id} {b.role}{' ' + b.name if b.name else ''}",
                size=_ceil(max(b.size, 4), 4),
                usage=_USAGE,
            )
            for b in program.buffers
        ]
        self._bound = self._bind_slots()
        for lc in program.label_checks:
            if lc.name not in program.inputs or not program.inputs[lc.name].dtype.is_integer:
                raise ValueError(f"label check names {lc.name!r}, which is not an integer input")
        self._plan = self._build_plan()
        self._staging, self._stage_at = self._build_staging()
        # Record (never submit) one step now: draw-time validation, such as a buffer smaller than
        # a fixed-size array the shader declares, then fails here rather than at the first run.
        self._record(tuple(program.outputs))

    # ----------------------------------------------------------------------------- setup

    def _bind_slots(self) -> dict[str, _Bound]:
        p = self.program
        named: dict[str, tuple[TensorSlot, list[str]]] = {}
        groups = {"parameter": p.parameters, "state": p.state, "input": p.inputs}
        for kind, slots in {**groups, "output": p.outputs}.items():
            for name, s in slots.items():
                if not 0 <= s.buffer < len(p.buffers):
                    raise ValueError(
                        f"{kind} {name!r} lives in buffer {s.buffer}, which does not exist"
                    )
                if s.offset < 0 or s.offset + s.nbytes > p.buffers[s.buffer].size:
                    raise ValueError(
                        f"{kind} {name!r} ({s.offset}+{s.nbytes} bytes) lies "
                        f"outside buffer {s.buffer} ({p.buffers[s.buffer].size} B)"
                    )
                if name in named and named[name][0] != s:
                    raise ValueError(
                        f"{name!r} names two different slots ({named[name][1][0]} and {kind})"
                    )
                named.setdefault(name, (s, []))[1].append(kind)
        bound: dict[str, _Bound] = {}
        for name, (s, kinds) in named.items():
            start = s.offset - s.offset % 4
            length = _ceil(s.offset + s.nbytes, 4) - start
            pad_free = not any(
                o.buffer == s.buffer
                and other != name
                and o.offset < start + length
                and o.offset + o.nbytes > start
                for other, (o, _) in named.items()
            )
            bound[name] = _Bound(
                name, tuple(kinds), s, self._buffers[s.buffer], start, length, pad_free
            )
        return bound

    def _build_plan(self):
        cache, plan, last = self.device.pipelines, [], None
        self._bind_groups = []
        for d in self.program.dispatches:
            pipeline = cache.get(d.name, d.wgsl, d.writes)
            bg = cache.bind_group(d.name, d.writes, [self._buffers[i] for i in d.bindings])
            self._bind_groups.append(bg)
            if 0 in d.grid:
                continue  # an empty grid is a valid no-op; skip it rather than encode it
            # set_pipeline is skipped when consecutive dispatches share a pipeline.
            plan.append((None if pipeline is last else pipeline, bg, *d.grid))
            last = pipeline
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
            used = _ceil(used + b.length, 8)
            chunks[-1] = max(used, 8)
        staging = [
            self._gpu.create_buffer(label=f"staging {i}", size=s, usage=_STAGING_USAGE)
            for i, s in enumerate(chunks)
        ]
        return staging, at

    # ----------------------------------------------------------------------------- host checks

    def _checked(self, b: _Bound, value) -> np.ndarray:
        """The array as it will be uploaded (u32 for bool), after strict checks."""
        s, want = b.slot, b.slot.dtype.numpy
        if not isinstance(value, (np.ndarray, np.generic)):
            raise InputError(
                f"{b.what()}: expected a NumPy array of shape {s.shape} and dtype "
                f"{want}, got {type(value).__name__} (use np.asarray(x, "
                f"dtype=np.{want}))"
            )
        if value.dtype != want:
            raise InputError(
                f"{b.what()}: expected dtype {want}, got {value.dtype} (convert "
                f"with .astype(np.{want}))"
            )
        if value.shape != s.shape:
            raise InputError(f"{b.what()}: expected shape {s.shape}, got {value.shape}")
        if s.dtype is DType.bool:
            return np.asarray(value, dtype=np.uint32)
        return np.ascontiguousarray(value)

    def _check_labels(self, feeds: Mapping[str, np.ndarray]) -> None:
        for lc in self.program.label_checks:
            x = feeds[lc.name]
            bad = (x < 0) | (x >= lc.num_classes)
            if lc.ignore_index is not None:
                bad &= x != lc.ignore_index
            if bad.any():
                flat = int(np.argmax(bad.reshape(-1)))
                idx = np.unravel_index(flat, x.shape) if x.ndim else ()
                allowed = f"[0, {lc.num_classes})"
                if lc.ignore_index is not None:
                    allowed += f" or {lc.ignore_index} (ignore_index)"
                raise InputError(
                    f"input {lc.name!r}: class index {x.reshape(-1)[flat]} at index "
                    f"{tuple(int(i) for i in idx)} is outside {allowed}; "
                    f"{int(bad.sum())} value(s) out of range"
                )

    def _upload(self, b: _Bound, data: np.ndarray) -> None:
        raw = data.reshape(-1).view(np.uint8)
        if raw.size == 0:
            return
        if b.start == b.slot.offset and b.length == raw.size:
            self._queue.write_buffer(b.buffer, b.start, raw)
            return
        # Unaligned (odd-length f16, 2-byte offset): pad to 4 bytes, keeping neighbours' bytes.
        if b.pad_free:
            block = np.zeros(b.length, np.uint8)
        else:
            block = np.frombuffer(self._queue.read_buffer(b.buffer, b.start, b.length), np.uint8)
            block = block.copy()
        head = b.slot.offset - b.start
        block[head : head + raw.size] = raw
        self._queue.write_buffer(b.buffer, b.start, block)

    @staticmethod
    def _decode(b: _Bound, raw, head: int) -> np.ndarray:
        s = b.slot
        n = int(np.prod(s.shape, dtype=np.int64))
        store = np.dtype(np.uint32) if s.dtype is DType.bool else s.dtype.numpy
        out = np.frombuffer(raw, dtype=store, count=n, offset=head).reshape(s.shape)
        return out != 0 if s.dtype is DType.bool else out.copy()

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError("this Session is closed")

    def _slot(self, name: str, kinds: tuple[str, ...]) -> _Bound:
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
                (``np.bool_`` for bool inputs).
            fetch: output names to read back after the step (a single name may be a str).

        Returns:
            ``{name: array}`` for each fetched output, in the slot's shape and dtype.

        Raises:
            InputError: an unknown, missing or mistyped feed, an out-of-range class index, or an
                unknown fetch name; raised before anything is uploaded.
            KernelError: the recorded step fails validation (names the kernel when it can).
        """
        self._live()
        fetch = (fetch,) if isinstance(fetch, str) else tuple(dict.fromkeys(fetch))
        for name in fetch:
            self._slot(name, ("output",))
        inputs = self.program.inputs
        unknown = sorted(set(feeds) - set(inputs))
        missing = sorted(set(inputs) - set(feeds))
        if unknown or missing:
            raise InputError(
                f"feeds do not match the program's inputs: missing {missing}, "
                f"unknown {unknown} (inputs: {sorted(inputs)})"
            )
        ready = [(self._bound[n], self._checked(self._bound[n], v)) for n, v in feeds.items()]
        self._check_labels(feeds)
        for b, data in ready:
            self._upload(b, data)

        commands = self._record(fetch)
        self._queue.submit([commands])
        return self._read_staged(fetch)

    def _record(self, fetch: tuple[str, ...]) -> wgpu.GPUCommandBuffer:
        enc = self._gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        for pipeline, bg, x, y, z in self._plan:
            if pipeline is not None:
                cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(x, y, z)
        cp.end()
        for name in fetch:
            b = self._bound[name]
            if not b.length:
                continue  # an empty tensor has nothing to copy (and wgpu maps no 0-byte range)
            chunk, off = self._stage_at[name]
            enc.copy_buffer_to_buffer(b.buffer, b.start, self._staging[chunk], off, b.length)
        try:
            return enc.finish()
        except wgpu.GPUError as e:
            raise find_invalid_dispatch(
                self.device.pipelines, self.program.dispatches, self._bind_groups, e
            ) from e

    def _read_staged(self, fetch: tuple[str, ...]) -> dict:
        out: dict[str, np.ndarray] = {}
        by_chunk: dict[int, list[str]] = {}
        for name in fetch:
            b = self._bound[name]
            if b.length:
                by_chunk.setdefault(self._stage_at[name][0], []).append(name)
            else:
                out[name] = np.zeros(b.slot.shape, b.slot.dtype.numpy)
        for chunk, names in by_chunk.items():
            lo = min(self._stage_at[n][1] for n in names)
            hi = max(self._stage_at[n][1] + self._bound[n].length for n in names)
            buf = self._staging[chunk]
            _map_read(buf, lo, hi - lo)
            try:
                raw = buf.read_mapped(lo, hi - lo, copy=False)
                for n in names:
                    b = self._bound[n]
                    head = self._stage_at[n][1] - lo + b.slot.offset - b.start
                    out[n] = self._decode(b, raw, head)
            finally:
                buf.unmap()
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
            return np.zeros(b.slot.shape, b.slot.dtype.numpy)
        raw = self._queue.read_buffer(b.buffer, b.start, b.length)
        return self._decode(b, raw, b.slot.offset - b.start)

    def write(self, name: str, value: np.ndarray) -> None:
        """Overwrite an input, parameter or state slot; checked as strictly as ``run`` feeds.

        Raises:
            InputError: unknown name, an output, or wrong shape/dtype.
        """
        self._live()
        b = self._slot(name, ("input", "parameter", "state"))
        self._upload(b, self._checked(b, value))

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
            (self._bound[n], self._checked(self._bound[n], v))
            for n, v in state.items()
            if n in known
        ]
        for b, data in ready:
            self._upload(b, data)
        return missing, unexpected

    def synchronize(self) -> None:
        """Block until all work submitted to this device has finished (for timing).

        wgpu-py 0.32's ``on_submitted_work_done_sync`` fails in its FFI layer, so this reads
        4 bytes back instead: a read waits for every earlier submission.
        """
        if self._sync_buffer is None:
            self._sync_buffer = self._gpu.create_buffer(
                size=4, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
            )
        self._queue.read_buffer(self._sync_buffer, 0, 4)

    def close(self) -> None:
        """Free the GPU buffers now; the Session cannot be used afterwards."""
        if not self._closed:
            self._closed = True
            for buf in (*self._buffers, *self._staging):
                buf.destroy()

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

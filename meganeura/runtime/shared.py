"""Tensors that live on the GPU once and are bound by every program that uses them.

A model compiled for several signatures (batch sizes, train and eval) gets one Program per
signature; its parameters and buffers must not be copied per program, or a training step
would leave the eval program reading stale weights. A :class:`SharedStore` keeps, per device,
where each shared tensor resides: a byte offset in a GPU buffer the store owns. Tensors are
identified by caller-given keys (``meganeura.nn`` uses the Parameter objects themselves).

Opening a program (:meth:`SharedStore.external`) looks at each of its parameter and state
buffers whose every slot names a key:
  * if every member already resides in one store buffer at the same relative offsets (a
    dedicated buffer inside an optimizer arena, or an arena of the same layout), the program
    binds that range: no copy;
  * otherwise the store allocates a buffer of the program's layout, fills it from the current
    residencies (GPU copies) or from ``initial`` values, and moves the members there. Programs
    bound to the buffers they left are *stale* (:meth:`is_stale`) and must be reopened before
    they run again; their other state is theirs to carry over.

Invariants: a key resides in exactly one place, so a value written by any program is the value
every other (non-stale) program reads; nothing the store owns is freed while a key lives in it.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Hashable, Mapping
from dataclasses import dataclass

import numpy as np
import wgpu

from ..dtypes import DType
from ..schedule.program import Program, TensorSlot
from . import fastpath
from .device import Device
from .slots import ceil_to

_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST


@dataclass
class _Block:
    """A GPU buffer owned by the store and the keys residing in it."""

    buffer: wgpu.GPUBuffer
    size: int
    members: dict[int, int]  # id(key) -> byte offset
    generation: int = 0  # bumped whenever a member leaves


@dataclass(frozen=True)
class _Residency:
    block: _Block
    offset: int
    shape: tuple[int, ...]
    dtype: DType


class SharedStore:
    """Where each shared tensor of one device resides (see the module docstring)."""

    def __init__(self, device: Device) -> None:
        self.device = device
        self._where: dict[int, _Residency] = {}
        self._keys: dict[int, weakref.ref] = {}

    # ------------------------------------------------------------------------- residency
    def resident(self, key: Hashable) -> bool:
        return id(key) in self._where

    def _track(self, key) -> None:
        k = id(key)
        if k not in self._keys:
            self._keys[k] = weakref.ref(key, lambda _r, k=k: self._forget(k))

    def _forget(self, k: int) -> None:
        self._keys.pop(k, None)
        r = self._where.pop(k, None)
        if r is not None:
            r.block.members.pop(k, None)

    def read(self, key: Hashable) -> np.ndarray:
        """The current value of a resident key (a host copy)."""
        r = self._where[id(key)]
        n = int(np.prod(r.shape, dtype=np.int64))
        nbytes = n * r.dtype.itemsize
        if nbytes == 0:
            return np.zeros(r.shape, r.dtype.numpy)
        start = r.offset - r.offset % 4
        raw = self.device.gpu.queue.read_buffer(
            r.block.buffer, start, ceil_to(r.offset + nbytes, 4) - start
        )
        out = np.frombuffer(raw, r.dtype.numpy, n, r.offset - start)
        return out.reshape(r.shape).copy()

    def read_many(self, keys: list) -> list[np.ndarray]:
        """The current values of resident keys (host copies), read with one copy per key into
        staging buffers of at most ``max_buffer_size`` bytes and one map per staging buffer,
        instead of one ``read_buffer`` round trip per key (:meth:`read`).

        Raises:
            KeyError: a key that is not resident.
            ValueError: one key larger than the adapter's ``max_buffer_size``.
        """
        gpu, limit = self.device.gpu, self.device.max_buffer_size
        spans, chunks, at = [], [[]], 0
        for key in keys:
            r = self._where[id(key)]
            n = int(np.prod(r.shape, dtype=np.int64))
            start = r.offset - r.offset % 4
            length = ceil_to(r.offset + n * r.dtype.itemsize, 4) - start
            if length > limit:
                raise ValueError(f"a {length}-byte tensor exceeds max_buffer_size ({limit})")
            if at + length > limit:
                chunks.append([])
                at = 0
            spans.append((r, n, len(chunks) - 1, at, start, length))
            chunks[-1].append(at + length)
            at = ceil_to(at + length, 8)
        sizes = [max(8, ceil_to(max(c, default=0), 8)) for c in chunks]
        staging = [
            gpu.create_buffer(size=s, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST)
            for s in sizes
        ]
        enc = gpu.create_command_encoder()
        for r, n, c, at, start, length in spans:
            if n:
                enc.copy_buffer_to_buffer(r.block.buffer, start, staging[c], at, length)
        gpu.queue.submit([enc.finish()])
        raws = [fastpath.map_read(gpu, b, 0, s) for b, s in zip(staging, sizes, strict=True)]
        for b in staging:
            b.destroy()
        return [
            np.frombuffer(raws[c], r.dtype.numpy, n, at + r.offset - start).reshape(r.shape).copy()
            for r, n, c, at, start, _ in spans
        ]

    def write(self, key: Hashable, value: np.ndarray) -> None:
        """Overwrite a resident key's value (``value`` already has its shape and dtype)."""
        r = self._where[id(key)]
        raw = np.ascontiguousarray(value, r.dtype.numpy).reshape(-1).view(np.uint8)
        if raw.size:
            fastpath.write(self.device.gpu.queue, r.block.buffer, r.offset, raw)

    # ------------------------------------------------------------------------- programs
    def external(
        self,
        program: Program,
        keys: Mapping[str, Hashable],
        initial: Callable[[Hashable], np.ndarray],
    ) -> tuple[dict[int, tuple[wgpu.GPUBuffer, int]], tuple]:
        """Place every shared buffer of ``program`` and return (external map, token).

        Args:
            program: the program about to get a Session.
            keys: slot name -> key, for the parameter and state slots that are shared.
            initial: key -> host value, for keys not resident yet (shape and dtype of the slot).

        Returns:
            ``external`` for :class:`~meganeura.runtime.Session` and a token for
            :meth:`is_stale`.

        Raises:
            ValueError: a shared slot whose buffer also holds unshared slots, or a key given
                for slots of different shapes or dtypes.
        """
        by_buffer: dict[int, list[tuple[str, TensorSlot]]] = {}
        for kind in (program.parameters, program.state):
            for name, s in kind.items():
                by_buffer.setdefault(s.buffer, []).append((name, s))
        external: dict[int, tuple[wgpu.GPUBuffer, int]] = {}
        used: list[_Block] = []
        for b, slots in by_buffer.items():
            shared = [(n, s) for n, s in slots if n in keys]
            if not shared:
                continue
            if len(shared) != len(slots):
                raise ValueError(
                    f"program buffer {b} holds shared slots {[n for n, _ in shared]} and "
                    f"private ones {[n for n, _ in slots if n not in keys]}"
                )
            for n, s in shared:
                if s.host is not s.dtype:
                    raise ValueError(f"shared slot {n!r} is stored as {s.dtype}, not {s.host}")
            block, base = self._find(shared, keys)
            if block is None:
                block, base = self._place(program.buffers[b].size, shared, keys, initial), 0
            external[b] = (block.buffer, base)
            used.append(block)
        return external, tuple((blk, blk.generation) for blk in used)

    def is_stale(self, token: tuple) -> bool:
        """True when a key left one of the buffers a program was opened with."""
        return any(blk.generation != gen for blk, gen in token)

    def _find(self, shared, keys) -> tuple[_Block | None, int]:
        base = None
        block = None
        for n, s in shared:
            r = self._where.get(id(keys[n]))
            if r is None or r.shape != s.shape or r.dtype is not s.dtype:
                return None, 0
            if block is None:
                block, base = r.block, r.offset - s.offset
            elif r.block is not block or r.offset - s.offset != base:
                return None, 0
        align = self.device.min_storage_buffer_offset_alignment
        if base < 0 or base % align:
            return None, 0
        return block, base

    def _place(self, size: int, shared, keys, initial) -> _Block:
        gpu = self.device.gpu
        buf = gpu.create_buffer(label="shared", size=ceil_to(max(size, 4), 4), usage=_USAGE)
        block = _Block(buf, size, {})
        enc = None
        for n, s in shared:
            key = keys[n]
            old = self._where.get(id(key))
            if old is not None and old.shape == s.shape and old.dtype is s.dtype:
                if s.nbytes:
                    enc = enc or gpu.create_command_encoder()
                    enc.copy_buffer_to_buffer(
                        old.block.buffer, old.offset, buf, s.offset, ceil_to(s.nbytes, 4)
                    )
            else:
                value = np.require(initial(key), s.dtype.numpy, "C")
                if value.shape != s.shape:
                    raise ValueError(
                        f"initial value of {n!r} has shape {value.shape}, not {s.shape}"
                    )
                raw = value.reshape(-1).view(np.uint8)
                if raw.size:
                    fastpath.write(gpu.queue, buf, s.offset, raw)
        if enc is not None:
            gpu.queue.submit([enc.finish()])
        for n, s in shared:
            key = keys[n]
            self._track(key)
            old = self._where.get(id(key))
            if old is not None:
                old.block.members.pop(id(key), None)
                old.block.generation += 1
            self._where[id(key)] = _Residency(block, s.offset, s.shape, s.dtype)
            block.members[id(key)] = s.offset
        return block


_STORES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def shared_store(device: Device) -> SharedStore:
    """The store of ``device`` (one per device)."""
    store = _STORES.get(device)
    if store is None:
        store = _STORES[device] = SharedStore(device)
    return store

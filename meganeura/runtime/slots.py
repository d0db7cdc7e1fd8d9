"""Named slots of a Program resolved against GPU buffers, and the host-side checks of data
written to them.

Invariants:
  * every feed, write and state-dict entry is checked (exact shape and NumPy dtype, ranges of
    class indices, token ids and gather indices) before anything is uploaded, so a rejected
    call changes nothing on the GPU;
  * copy bounds are 4-byte aligned (``start`` down, ``length`` up), as copies and writes need;
  * ``bool`` slots are ``u32`` (0/1) on the GPU and ``np.bool_`` on the host;
  * an int32 slot also takes int64 arrays whose values all fit int32 (narrowed on upload);
  * a slot whose ``host_dtype`` differs from its storage dtype (a parameter stored as f16 in
    the fast mode) is fed and read in ``host_dtype``: rounded to nearest on upload (a finite
    value beyond f16's range is rejected, never stored as inf) and widened exactly on read.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import wgpu

from ..dtypes import DType
from ..schedule.program import Program, TensorSlot


class InputError(ValueError):
    """A feed, write or state dict does not match the program; nothing was uploaded."""


def ceil_to(n: int, k: int) -> int:
    return -(-n // k) * k


@dataclass(frozen=True)
class BoundSlot:
    """A named slot resolved against its GPU buffer, with 4-byte-aligned copy bounds."""

    name: str
    kinds: tuple[str, ...]  # of "parameter", "state", "input", "output"; usually one
    slot: TensorSlot
    buffer: wgpu.GPUBuffer
    start: int  # aligned down to 4: copies and writes need 4-byte granularity
    length: int  # aligned up to 4
    pad_free: bool  # no other named slot shares [start, start + length)
    base: int = 0  # byte offset of the program's buffer inside ``buffer`` (a shared buffer)

    @property
    def at(self) -> int:
        """Byte offset of the slot's first element inside ``buffer``."""
        return self.base + self.slot.offset

    def what(self) -> str:
        return f"{self.kinds[0]} {self.name!r}"


def bind_slots(
    p: Program, buffers: Sequence[wgpu.GPUBuffer], bases: Sequence[int] | None = None
) -> dict[str, BoundSlot]:
    """Resolve every named slot of ``p`` against its buffer.

    ``bases[i]`` is the byte offset at which program buffer ``i`` starts inside
    ``buffers[i]`` (non-zero for a sub-range of a buffer shared between programs).

    Raises:
        ValueError: a slot outside its buffer, or one name naming two different slots.
    """
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
    bound: dict[str, BoundSlot] = {}
    for name, (s, kinds) in named.items():
        base = bases[s.buffer] if bases is not None else 0
        start = base + s.offset - (base + s.offset) % 4
        length = ceil_to(base + s.offset + s.nbytes, 4) - start
        pad_free = not any(
            o.buffer == s.buffer
            and other != name
            and o.offset < start + length
            and o.offset + o.nbytes > start
            for other, (o, _) in named.items()
        )
        pad_free = pad_free and base == 0  # a shared buffer may hold other programs' slots
        bound[name] = BoundSlot(
            name, tuple(kinds), s, buffers[s.buffer], start, length, pad_free, base
        )
    return bound


def checked(b: BoundSlot, value) -> np.ndarray:
    """The array as it will be uploaded (u32 for bool), after strict checks."""
    s, want = b.slot, b.slot.host.numpy
    if not isinstance(value, (np.ndarray, np.generic)):
        raise InputError(
            f"{b.what()}: expected a NumPy array of shape {s.shape} and dtype "
            f"{want}, got {type(value).__name__} (use np.asarray(x, "
            f"dtype=np.{want}))"
        )
    if value.dtype == np.int64 and want == np.int32:
        value = narrow_int64(b, value)
    if value.dtype != want:
        raise InputError(
            f"{b.what()}: expected dtype {want}, got {value.dtype} (convert "
            f"with .astype(np.{want}))"
        )
    if value.shape != s.shape:
        raise InputError(f"{b.what()}: expected shape {s.shape}, got {value.shape}")
    if s.dtype is DType.bool:
        return np.asarray(value, dtype=np.uint32)
    if s.host is not s.dtype:
        with np.errstate(over="ignore"):
            stored = np.ascontiguousarray(value, dtype=s.dtype.numpy)
        if (np.isinf(stored) & np.isfinite(value)).any():
            raise InputError(
                f"{b.what()}: is stored as {s.dtype}; a finite value of magnitude "
                f"{float(np.abs(value[np.isfinite(value)]).max()):g} exceeds its range"
            )
        return stored
    return np.ascontiguousarray(value)


INT32 = np.iinfo(np.int32)


def narrow_int64(b: BoundSlot, value: np.ndarray) -> np.ndarray:
    """An int64 array fed to an i32 slot, as int32 (NumPy's default integer, what
    ``np.arange`` gives, as ``nn.compiled`` accepts it), when every value fits.

    Raises:
        InputError: naming the slot and the first value outside the int32 range.
    """
    bad = (value < INT32.min) | (value > INT32.max)
    if bad.any():
        flat = int(np.argmax(bad.reshape(-1)))
        raise InputError(
            f"{b.what()}: int64 value {value.reshape(-1)[flat]} at flat position {flat} does "
            f"not fit the slot's int32 (range [{INT32.min}, {INT32.max}])"
        )
    return value.astype(np.int32)


def check_labels(program: Program, feeds: Mapping[str, np.ndarray]) -> None:
    """Raise InputError if an index input (class indices, token ids, gather indices) among
    ``feeds`` holds a value out of its reader's range; the message names the input, the first
    bad value as its reader sees it (``LabelCheck.what``), its position, the bound and the
    reader."""
    for lc in program.label_checks:
        if lc.name not in feeds:
            continue  # a resident input, checked when it was written
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
            reader = f" ({lc.consumer} reads it)" if lc.consumer else ""
            raise InputError(
                f"input {lc.name!r}: {lc.what} {x.reshape(-1)[flat]} at position "
                f"{tuple(int(i) for i in idx)} is outside {allowed}{reader}; "
                f"{int(bad.sum())} value(s) out of range"
            )


def decode(b: BoundSlot, raw, head: int) -> np.ndarray:
    s = b.slot
    n = int(np.prod(s.shape, dtype=np.int64))
    store = np.dtype(np.uint32) if s.dtype is DType.bool else s.dtype.numpy
    out = np.frombuffer(raw, dtype=store, count=n, offset=head).reshape(s.shape)
    if s.dtype is DType.bool:
        return out != 0
    return out.astype(s.host.numpy)  # a copy, widened when the host type is wider

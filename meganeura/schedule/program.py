"""The compiled artifact: a plain, serializable description of buffers and dispatches.

A Program is what every stage before the runtime produces and the only thing the runtime
consumes. It holds no GPU objects: buffers are sizes and roles, dispatches are WGSL sources
with bindings (buffer ids in binding order) and grids. The runtime creates each buffer once,
each pipeline once (cached by source hash) and each bind group once, then replays the
dispatch list in one command encoder per step.

Invariants:
  * every ``Dispatch.bindings[i]`` names a buffer in ``buffers``; binding ``i`` of group 0 in
    the WGSL source is that buffer, read-only when ``Dispatch.writes[i]`` is False;
  * no two bindings of one dispatch overlap in one buffer when either is written
    (bindings may be sub-ranges, ``Dispatch.offsets``/``sizes``);
  * grids are at most the adapter's workgroups-per-dimension limit (codegen folds them).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Literal

from ..dtypes import DType

BufferRole = Literal["input", "parameter", "state", "output", "intermediate", "gradient"]


@dataclass(frozen=True)
class BufferSpec:
    """One GPU storage buffer.

    Attributes:
        id: index into Program.buffers.
        size: bytes (a multiple of 4, at least 4).
        role: what lives there. ``parameter`` and ``state`` persist across steps; ``input`` is
            written by the host before each step; ``output`` is read back on request;
            ``intermediate`` buffers are shared by values with disjoint lifetimes;
            ``gradient`` is an optimizer group's arena of parameter gradients, written by the
            backward pass and read by the group's update each step. ``parameter`` and
            ``state`` buffers may also be group arenas holding several named slots.
        name: the user-visible name for pinned buffers, else None.
    """

    id: int
    size: int
    role: BufferRole
    name: str | None = None


@dataclass(frozen=True)
class Dispatch:
    """One compute dispatch.

    Attributes:
        name: kernel name for errors and profiles (``"%12 matmul"``).
        wgsl: complete WGSL source with entry point ``main``; shapes are baked in.
        bindings: buffer ids, binding index i -> bindings[i], all in group 0.
        writes: for each binding, whether the shader writes it (storage read_write).
        grid: workgroup counts (x, y, z).
        flops: arithmetic operations, for profiles (0 when unknown).
        bytes: bytes read + written, for profiles (0 when unknown).
        offsets: byte offset of each binding in its buffer (a multiple of the adapter's
            min_storage_buffer_offset_alignment); empty: every binding starts at 0.
        sizes: bytes each binding spans; empty, or an entry 0: the rest of the buffer.
    """

    name: str
    wgsl: str
    bindings: tuple[int, ...]
    writes: tuple[bool, ...]
    grid: tuple[int, int, int]
    flops: int = 0
    bytes: int = 0
    offsets: tuple[int, ...] = ()
    sizes: tuple[int, ...] = ()

    def span(self, i: int, buffer_size: int) -> tuple[int, int]:
        """(offset, size) in bytes of binding ``i`` in a buffer of ``buffer_size`` bytes."""
        off = self.offsets[i] if self.offsets else 0
        size = self.sizes[i] if self.sizes and self.sizes[i] else buffer_size - off
        return off, size


def binding_conflict(ranges: Sequence[tuple[int, int, int]], writes: Sequence[bool]) -> int | None:
    """The first binding of one dispatch that conflicts with an earlier one, else None.

    ``ranges[i]`` is ``(buffer id, start byte, end byte)`` of binding ``i``. Two bindings of one
    buffer conflict when their ranges overlap and either is written, or when one is read-only
    and the other writable even at disjoint ranges: wgpu tracks usage per buffer, not per range.
    """
    for i, ((buf, start, end), w) in enumerate(zip(ranges, writes, strict=True)):
        for (b2, s2, e2), w2 in zip(ranges[:i], writes[:i], strict=True):
            if b2 == buf and ((w or w2) and s2 < end and start < e2 or w != w2):
                return i
    return None


def read_write_ranges(program: Program, d: Dispatch) -> tuple[list, list]:
    """(read ranges, written ranges) of dispatch ``d`` of ``program``: ``(buffer id, start
    byte, end byte)`` of each binding it only reads, and of each it writes."""
    reads, writes = [], []
    for k, (b, w) in enumerate(zip(d.bindings, d.writes, strict=True)):
        off, size = d.span(k, program.buffers[b].size)
        (writes if w else reads).append((b, off, off + size))
    return reads, writes


def overlapping(a: Sequence[tuple[int, int, int]], b: Sequence[tuple[int, int, int]]) -> bool:
    """Whether a range of ``a`` and one of ``b`` share a byte of one buffer."""
    return any(x == y and s < e2 and s2 < e for x, s, e in a for y, s2, e2 in b)


def commute(a: tuple[list, list], b: tuple[list, list]) -> bool:
    """Whether two dispatches, as their :func:`read_write_ranges`, may run in either order
    with the same results: neither writes a byte the other reads or writes."""
    (ra, wa), (rb, wb) = a, b
    return not (overlapping(wa, rb) or overlapping(wa, wb) or overlapping(ra, wb))


@dataclass(frozen=True)
class TensorSlot:
    """Where a named tensor lives: buffer id, byte offset, shape and dtype.

    ``dtype`` is the storage type; ``host_dtype``, when set, is the type the host reads and
    writes instead (a parameter stored as f16 by the fast mode is f32 to the host: the
    Session rounds it on upload and widens it on read). ``host`` gives the effective one.
    """

    buffer: int
    shape: tuple[int, ...]
    dtype: DType
    offset: int = 0
    host_dtype: DType | None = None

    @property
    def host(self) -> DType:
        """The dtype the host feeds and reads."""
        return self.host_dtype or self.dtype

    @property
    def nbytes(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n * self.dtype.itemsize


@dataclass(frozen=True)
class LabelCheck:
    """A host-side check run before each step: input ``name`` holds indices that must lie in
    [0, num_classes) or equal ``ignore_index``. An input read by several index ops gets one
    check per distinct bound; ``consumer`` names the op as the user called it, with its node
    and line (``"embedding %4 at model.py:12"``), and ``what`` the values as that op reads
    them: ``"class index"`` (cross_entropy), ``"token id"`` (embedding) or ``"index"``
    (gather, index_select)."""

    name: str
    num_classes: int
    ignore_index: int | None
    consumer: str = ""
    what: str = "class index"


@dataclass(frozen=True)
class MemoryReport:
    """Bytes of intermediate storage: planned (after buffer sharing) and naive (one buffer
    per value), plus pinned bytes (parameters, optimizer state, inputs, outputs)."""

    planned_bytes: int
    naive_bytes: int
    pinned_bytes: int


@dataclass(frozen=True)
class Program:
    """Everything the runtime needs to run one step.

    Attributes:
        buffers: all storage buffers.
        dispatches: the step, in order.
        inputs: fed by the host each step, by name.
        outputs: readable after a step, by name (``"loss"``, ``"logits"`` ...).
        parameters: trainable tensors, by name; persistent.
        state: optimizer state (``"fc1.weight.exp_avg"`` ...), persistent, zero-initialized.
        label_checks: host-side range checks of integer index inputs (class indices, token
            ids, gather indices).
        memory: planner report.
        meta: free-form JSON-serializable facts (optimizer config, compile timings ...).
    """

    buffers: tuple[BufferSpec, ...]
    dispatches: tuple[Dispatch, ...]
    inputs: dict[str, TensorSlot]
    outputs: dict[str, TensorSlot]
    parameters: dict[str, TensorSlot]
    state: dict[str, TensorSlot] = field(default_factory=dict)
    label_checks: tuple[LabelCheck, ...] = ()
    memory: MemoryReport | None = None
    meta: dict = field(default_factory=dict)

    def replace(self, **changes) -> Program:
        return dataclasses.replace(self, **changes)

"""A step submitted in segments, each followed by a copy of some slots into its own mappable
buffer, so the host can read the slots a segment finished while the GPU runs the next one.

Used by ``meganeura.distributed`` to read gradient buckets back while the backward pass still
runs (issue 17 item 2). Two parts:

  * :func:`plan_segments` (pure Python, no GPU): the program's dispatches reordered so that each
    dispatch writing only the slots asked for (an ``accumulate`` into a gradient accumulator)
    runs as early as its inputs allow, and the cut points after which each group of slots is
    final. A dispatch moves ahead of another only when neither writes a byte range the other
    binds (the read/write hazards of ``schedule.program.binding_conflict``), so every kernel
    reads the same bytes as in program order: results are bit-identical to ``Session.run``.
  * :class:`SegmentedRun`: uploads the feeds, records each segment as its own command buffer
    (one compute pass, then copies of the group's slots into the group's staging buffer),
    submits them all at once (``wgpuQueueSubmitForIndex``), requests every map, and hands the
    groups back in order (:meth:`SegmentedRun.wait`). ``progress`` is called while it waits for
    the GPU, for the caller's own asynchronous work (MPI's ``Testall``).

Why the reordering: the accumulate program appends the accumulate ops after the whole backward
pass (``optim.accumulate.add_to_accumulators``), so in program order no gradient is final
before the last dispatch; hoisted, the last layer's accumulator is written right after its
gradient is computed, at the start of the backward pass.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np
import wgpu

from ..schedule.program import Program, commute, overlapping, read_write_ranges
from . import fastpath
from .slots import ceil_to

_STAGING_USAGE = wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST


@dataclass(frozen=True)
class SegmentPlan:
    """Dispatch order and cuts of a segmented step.

    Attributes:
        order: every dispatch index of ``program.dispatches``, in the order to run them.
        final: slot name -> position in ``order`` of the last dispatch writing it (-1: none
            writes it).
        groups: the slot names of each segment's readback, in order.
        cuts: ``order[cuts[k-1]:cuts[k]]`` is segment ``k`` (``cuts[-1] == len(order)``).
    """

    order: tuple[int, ...]
    final: dict[str, int]
    groups: tuple[tuple[str, ...], ...]
    cuts: tuple[int, ...]


def _slot_range(program: Program, name: str) -> tuple[int, int, int]:
    s = program.state.get(name) or program.parameters.get(name) or program.outputs[name]
    return (s.buffer, s.offset, s.offset + s.nbytes)


def plan_segments(
    program: Program, slots: Sequence[str], cap_bytes: int, sizes: Mapping[str, int]
) -> SegmentPlan:
    """Reorder ``program``'s dispatches so each writer of ``slots`` runs early, then group the
    slots into buckets of about ``cap_bytes`` in the order they become final.

    Args:
        program: the compiled step.
        slots: state/parameter/output names whose final values are read back.
        cap_bytes: a bucket closes once its ``sizes`` sum reaches this (PyTorch DDP's
            ``bucket_cap_mb`` in bytes); 0 or less: one bucket per slot.
        sizes: bytes counted per slot (the gradient's float32 size).

    Returns:
        A :class:`SegmentPlan`.

    Raises:
        KeyError: a slot name the program does not have.
    """
    n = len(program.dispatches)
    want = {name: _slot_range(program, name) for name in slots}
    rw = [read_write_ranges(program, program.dispatches[i]) for i in range(n)]
    # a dispatch that writes nothing but asked-for slots is hoisted (the accumulates)
    ranges = list(want.values())
    movable = {i for i in range(n) if rw[i][1] and all(overlapping([w], ranges) for w in rw[i][1])}
    order: list[int] = []
    for i in range(n):
        if i not in movable:
            order.append(i)
            continue
        reads, writes = rw[i]
        at = len(order)
        while at > 0:
            if not commute((reads, writes), rw[order[at - 1]]):
                break
            at -= 1
        order.insert(at, i)
    final = {}
    for name, rng in want.items():
        final[name] = max(
            (p for p, i in enumerate(order) if overlapping(rw[i][1], [rng])), default=-1
        )
    by_final = sorted(slots, key=lambda s: (final[s], list(slots).index(s)))
    groups, cuts, current, used = [], [], [], 0
    for s in by_final:
        current.append(s)
        used += sizes.get(s, 0)
        if used >= cap_bytes:
            groups.append(tuple(current))
            cuts.append(final[s] + 1)
            current, used = [], 0
    if current:
        groups.append(tuple(current))
        cuts.append(final[current[-1]] + 1)
    cuts[-1] = n
    # buckets whose slots are final at the same point share a cut: keep the cuts increasing
    for k in range(len(cuts) - 2, -1, -1):
        cuts[k] = min(cuts[k], cuts[k + 1])
    return SegmentPlan(tuple(order), final, tuple(groups), tuple(cuts))


class SegmentedRun:
    """Runs a Session's step as the segments of a :class:`SegmentPlan` (module docstring).

    Args:
        session: the Session of the plan's program.
        plan: :func:`plan_segments`'s plan for ``session.program``.

    The staging buffers (one per group, float32 bytes of its slots back to back) are created
    once; :meth:`close` frees them (the Session's own buffers are the Session's).

    Raises:
        ValueError: a slot not on a 4-byte boundary, or a group larger than the adapter's
            ``max_buffer_size``.
    """

    def __init__(self, session, plan: SegmentPlan):
        self.session, self.plan = session, plan
        bound = session._bound
        self._layout = []  # per group: [(name, offset in staging, length)]
        self._staging = []
        for k, names in enumerate(plan.groups):
            at, layout = 0, []
            for name in names:
                b = bound[name]
                if b.start != b.at:
                    raise ValueError(f"slot {name!r} does not start on a 4-byte boundary")
                layout.append((name, at, b.length))
                at = ceil_to(at + b.length, 8)
            if at > session.device.max_buffer_size:
                raise ValueError(
                    f"bucket {k} ({', '.join(names)}) needs a {at}-byte staging buffer, over the "
                    f"adapter's max_buffer_size ({session.device.max_buffer_size}); use a "
                    "smaller bucket_cap_mb"
                )
            self._layout.append(layout)
            self._staging.append(
                session._gpu.create_buffer(
                    label=f"segment {k} staging", size=max(at, 8), usage=_STAGING_USAGE
                )
            )
        starts = (0, *plan.cuts[:-1])
        self._recorders = [
            session.recorder([plan.order[p] for p in range(a, b)])
            for a, b in zip(starts, plan.cuts, strict=True)
        ]
        self._keys: list[int] = []
        self._indices: list[int] = []
        # host copies of the staging buffers, allocated at the first wait and reused: the
        # arrays ``wait`` returns are views into them, valid until the next ``start``
        self._own: list[np.ndarray | None] = [None] * len(self._staging)
        self._host: list[np.ndarray | None] = [None] * len(self._staging)  # the last wait's
        self.gpu_wait_seconds = 0.0

    def start(self, feeds: Mapping[str, np.ndarray]) -> None:
        """Check and upload ``feeds`` (``Session.run``'s checks), then submit every segment
        with its copies and request every group's map.

        Raises:
            InputError: as ``Session.run``; nothing was submitted.
        """
        s = self.session
        s._live()
        s._feed(feeds)
        buffers = []
        for k, rec in enumerate(self._recorders):

            def copies(enc, k=k):
                for name, at, length in self._layout[k]:
                    b = s._bound[name]
                    enc.copy_buffer_to_buffer(b.buffer, b.start, self._staging[k], at, length)

            buffers.append(s._record_with(rec, copies))
        self._indices = [fastpath.submit_for_index(s._queue, [cb]) for cb in buffers]
        self._keys = [fastpath.map_async(st, 0, st.size) for st in self._staging]
        self.gpu_wait_seconds = 0.0

    def staging_bytes(self, k: int) -> int:
        """Bytes of group ``k``'s staging buffer: what :meth:`wait` copies into the host (its
        slots at their offsets, 8-byte aligned, zeros between them)."""
        return self._staging[k].size

    @property
    def max_staging_bytes(self) -> int:
        """The largest group's :meth:`staging_bytes`."""
        return max(st.size for st in self._staging)

    def wait(
        self,
        k: int,
        progress: Callable[[], bool] | None = None,
        into: np.ndarray | None = None,
    ) -> dict[str, np.ndarray]:
        """Group ``k``'s slots (float32 arrays of their shapes) once segment ``k`` finished.

        ``progress()`` is called between non-blocking polls while it returns True (work of the
        caller still in flight); once it returns False the wait blocks on the GPU.

        ``into``: a C-contiguous, writable array of at least :meth:`staging_bytes` bytes that
        the mapped bucket is copied into (its first bytes; e.g. a shared-memory segment), in
        place of the run's own host copy; the arrays returned and :meth:`bucket` are then
        views into it.

        Raises:
            RuntimeError: the map failed.
            ValueError: ``into`` too small, not C-contiguous or not writable.
        """
        s = self.session
        if into is not None:
            size = self._staging[k].size
            if into.nbytes < size or not (into.flags.c_contiguous and into.flags.writeable):
                raise ValueError(
                    f"wait({k}): into must be a C-contiguous, writable array of at least "
                    f"{size} bytes, got {into.nbytes} bytes"
                )
        t0 = time.perf_counter()
        key = self._keys[k]
        while not fastpath.map_done(key):
            if progress is not None and progress():
                fastpath.poll(s._gpu, False)
                time.sleep(2e-5)
            else:
                fastpath.poll(s._gpu, True, self._indices[k])
        self.gpu_wait_seconds += time.perf_counter() - t0
        st = self._staging[k]
        if into is not None:
            self._host[k] = into.reshape(-1).view(np.uint8)[: st.size]
        else:
            if self._own[k] is None:
                self._own[k] = np.zeros(st.size, np.uint8)
            self._host[k] = self._own[k]
        raw = fastpath.mapped_into(key, st, 0, self._host[k])
        out = {}
        for name, at, _ in self._layout[k]:
            b = s._bound[name]
            out[name] = np.frombuffer(
                raw, b.slot.dtype.numpy, b.slot.nbytes // b.slot.dtype.itemsize, at
            ).reshape(b.slot.shape)
        return out

    def bucket(self, k: int) -> tuple[np.ndarray, list[tuple[str, int, int]]]:
        """Group ``k``'s host copy from the last :meth:`wait` as one float32 vector (its
        slots at their staging offsets, zeros between them) and the layout: (slot name,
        first element, elements) per slot. The vector is a view, valid until the next
        ``start`` (or, with ``wait(into=...)``, while ``into`` holds it).

        Raises:
            ValueError: a slot of the group is not float32, or ``wait(k)`` has not run.
        """
        s = self.session
        if self._host[k] is None:
            raise ValueError(f"bucket {k} has not been read back (call wait({k}) first)")
        layout = []
        for name, at, length in self._layout[k]:
            dt = s._bound[name].slot.dtype.numpy
            if np.dtype(dt) != np.float32:
                raise ValueError(f"slot {name!r} of bucket {k} is {np.dtype(dt)}, not float32")
            layout.append((name, at // 4, length // 4))
        return self._host[k].view(np.float32), layout

    def close(self) -> None:
        for st in self._staging:
            st.destroy()
        self._staging, self._recorders = [], []

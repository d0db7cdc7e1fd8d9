"""Memory planning: assign every intermediate value to a shared buffer by liveness.

A pure function over lifetime intervals measured in kernel positions. Two values may share a
buffer only if their closed intervals ``[start, end]`` are disjoint: a kernel that reads one
value while writing another keeps both alive at that position, so they never alias. Pinned
values (parameters, optimizer state, inputs, outputs) are not planned here; they own their
buffers for the whole program.

Algorithm: intervals in order of start; buffers whose occupant ended are released; the
smallest free buffer that fits is reused (best fit), else the largest free buffer grows,
else a new buffer is made. Greedy interval allocation of this kind is the standard approach
(e.g. TFLite's and XLA's buffer assignment use variants of it).
"""

from __future__ import annotations

import heapq
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Interval:
    """Lifetime of one value: defined by kernel ``start``, last read by kernel ``end``."""

    key: Hashable
    size: int
    start: int
    end: int

    def __post_init__(self) -> None:
        if self.end < self.start or self.size < 0:
            raise ValueError(f"invalid interval {self}")


@dataclass(frozen=True)
class MemoryPlan:
    """Result of planning.

    Attributes:
        assignment: value key -> buffer index.
        buffer_sizes: bytes of each shared buffer.
        naive_bytes: sum of all value sizes (one buffer per value).
    """

    assignment: dict
    buffer_sizes: tuple[int, ...]
    naive_bytes: int

    @property
    def planned_bytes(self) -> int:
        return sum(self.buffer_sizes)


def _align(n: int) -> int:
    return max(4, (n + 3) // 4 * 4)


def plan_memory(intervals: Sequence[Interval]) -> MemoryPlan:
    """Assign intervals to buffers so that no two overlapping intervals share one.

    Args:
        intervals: one per value; keys must be unique.

    Returns:
        The MemoryPlan; every buffer is at least as large as every value assigned to it.

    Raises:
        ValueError: on duplicate keys.
    """
    keys = [iv.key for iv in intervals]
    if len(set(keys)) != len(keys):
        raise ValueError("duplicate interval keys")
    order = sorted(intervals, key=lambda iv: (iv.start, -iv.size))
    sizes: list[int] = []
    busy: list[tuple[int, int]] = []  # heap of (end, buffer)
    free: set[int] = set()
    assignment: dict = {}
    for iv in order:
        while busy and busy[0][0] < iv.start:
            free.add(heapq.heappop(busy)[1])
        need = _align(iv.size)
        fitting = [b for b in free if sizes[b] >= need]
        if fitting:
            buf = min(fitting, key=lambda b: (sizes[b], b))
        elif free:
            buf = max(free, key=lambda b: (sizes[b], -b))
            sizes[buf] = need
        else:
            buf = len(sizes)
            sizes.append(need)
        free.discard(buf)
        heapq.heappush(busy, (iv.end, buf))
        assignment[iv.key] = buf
    return MemoryPlan(assignment, tuple(sizes), sum(_align(iv.size) for iv in intervals))

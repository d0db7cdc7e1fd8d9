"""Work decomposition of the flash-attention kernels (``attention_flash``): how many rows a
workgroup owns, how many threads share a row, how long a workgroup-memory tile is, and where
each tile segment lives in workgroup memory.

Invariants: ``rows * lanes <= THREADS``; ``tile`` is a multiple of ``lanes`` with at most
``MAX_PER_LANE`` entries per lane (each becomes named registers); the tile segments and the
lanes' merge area both fit the adapter's workgroup memory.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..kernel import Limits
from .common import next_pow2

# Measured on the H200 (Vulkan), f32 forward over B=4, H=16, L=2048, D=64, causal: 2.3 ms
# (14.6 TFLOP/s) with these values; 16 entries per lane took 12.6 ms (register spills), and
# 128-thread workgroups or 1024 target groups were no better across the workloads' shapes.
THREADS = 64
TARGET_GROUPS = 256  # shrink row tiles until this many workgroups (or 4-row tiles) exist
MAX_PER_LANE = 8  # stream entries per lane per tile (each a named score register)
QUERY_ROW_MODES = ("fwd", "stats", "dq")  # rows are queries; the others (dk, dv) rows are keys


@dataclass(frozen=True)
class Dims:
    """Problem sizes: batch, kv heads, query heads per kv head, lengths and head dims."""

    b: int
    hkv: int
    group: int
    lq: int
    lk: int
    d: int
    dv: int

    @property
    def d4(self) -> int:
        return -(-self.d // 4)

    @property
    def dv4(self) -> int:
        return -(-self.dv // 4)


@dataclass(frozen=True)
class Plan:
    """``rows`` rows per workgroup, ``lanes`` threads per row, ``tile`` stream entries per
    workgroup-memory tile."""

    rows: int
    lanes: int
    tile: int

    @property
    def size(self) -> int:
        return self.rows * self.lanes

    @property
    def per_lane(self) -> int:
        return self.tile // self.lanes


def extents(mode: str, dims: Dims) -> tuple[int, int]:
    """(rows per (batch, kv head), stream entries per row and query head)."""
    if mode in QUERY_ROW_MODES:
        return dims.group * dims.lq, dims.lk
    return dims.lk, dims.lq


def segments(mode: str, dims: Dims) -> list[tuple[str, int]]:
    """Workgroup-memory segments of one stream entry: (name, vec4 count)."""
    if mode in ("fwd", "dq"):
        return [("k", dims.d4), ("v", dims.dv4)]
    if mode == "stats":
        return [("k", dims.d4)]
    return [("q", dims.d4), ("g", dims.dv4), ("st", 1)]


def merge_slot(mode: str, dims: Dims) -> int:
    """vec4s of one lane's partial state in a merge round."""
    return {"fwd": dims.dv4 + 1, "stats": 1, "dq": dims.d4, "dk": dims.d4, "dv": dims.dv4}[mode]


def shared_layout(mode: str, dims: Dims, plan: Plan) -> tuple[int, dict[str, tuple[int, int]]]:
    """(vec4s of workgroup memory, {segment: (offset, stride in vec4s)}).

    With several lanes per row, the lanes of a row read different entries at once; an odd
    stride spreads them over the memory banks (one lane: every thread reads the same entry).
    """
    layout, off = {}, 0
    for name, n in segments(mode, dims):
        stride = n | 1 if plan.lanes > 1 and n > 1 else n
        layout[name] = (off, stride)
        off += plan.tile * stride
    merge = plan.rows * (plan.lanes // 2) * merge_slot(mode, dims)
    return max(off, merge, 1), layout


def choose_plan(mode: str, dims: Dims, limits: Limits) -> Plan:
    """Rows per workgroup, lanes per row and tile length for ``mode`` on this adapter.

    Rows shrink (down to 4) until there are ``TARGET_GROUPS`` workgroups, lanes take the
    threads left, up to the stream's length, and rows take back what a short stream cannot
    use; tiles are as long as workgroup memory allows (at most 32, at most the stream).

    Raises:
        ValueError: when even one entry per tile does not fit workgroup memory.
    """
    n_rows, n_stream = extents(mode, dims)
    rows = min(THREADS, next_pow2(n_rows))
    while rows > 4 and dims.b * dims.hkv * -(-n_rows // rows) < TARGET_GROUPS:
        rows //= 2
    lanes = min(THREADS // rows, next_pow2(n_stream))
    rows = min(THREADS // lanes, next_pow2(n_rows))
    while True:
        for tile in (32, 16, 8, 4, 2, 1):
            if tile < lanes or tile // lanes > MAX_PER_LANE:
                continue
            if tile > max(lanes, next_pow2(n_stream)):
                continue
            plan = Plan(rows, lanes, tile)
            if 16 * shared_layout(mode, dims, plan)[0] <= limits.max_workgroup_storage_size:
                return plan
        if lanes == 1:
            raise ValueError(
                f"attention head dims D={dims.d}, Dv={dims.dv} need more workgroup memory "
                f"than the adapter's {limits.max_workgroup_storage_size} bytes"
            )
        lanes //= 2

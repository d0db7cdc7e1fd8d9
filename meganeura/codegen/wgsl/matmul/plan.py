"""Matmul plan choice: tilings, kernel (tiled or gemv), split-K, prefetch depth.

A ``Plan`` names one way to run a product (``"128x128x8/d2"``, ``"64x64x16/s8"``,
``"gemv16"``; ``parse_plan`` gives the grammar). ``choose_plan`` picks it per shape:
``force_plan`` (benchmark sweeps) overrides everything; then the plan measured on this very
adapter (``Limits.matmul_plans``, from the per-device tuning cache that ``meganeura.tune``
writes: docs/tuning.md); on a CPU adapter (``Limits.cpu``: llvmpipe, CI's lavapipe)
``cpu_plan``; then ``tuned.TUNED``, the measured best plan per (M, K, N, layout) on the H200,
which ``bench/matmul_sweep.py`` prints for pasting there (the seed for adapters without a
cache); then ``heuristic_plan``, documented on the function. A device entry overrides the CPU
plan: it was measured on that adapter, the CPU plan is a rule. A tiled plan that needs more
workgroup memory than the adapter has falls back to one buffer, then to the small tile.
"""

from __future__ import annotations

import functools
import re
from dataclasses import dataclass, replace

from ...kernel import Limits
from .tuned import TUNED

THREADS = 16  # threads per tile side in the tiled kernel; 256 per workgroup
WG = THREADS * THREADS


@dataclass(frozen=True)
class Tiling:
    """Per-thread outputs ``tm`` x ``tn`` (4, 8 or 16) and K step ``bk``; 16 x 16 threads."""

    tm: int
    tn: int
    bk: int

    @property
    def bm(self) -> int:
        return THREADS * self.tm

    @property
    def bn(self) -> int:
        return THREADS * self.tn

    @property
    def name(self) -> str:
        return f"{self.bm}x{self.bn}x{self.bk}"


SMALL = Tiling(4, 4, 16)
LARGE = Tiling(8, 8, 8)
# Each operand tile is a whole number of 256-thread vec4 loads: bk * bm and bk * bn are
# multiples of 1024.
# 256x128 and 128x256 (16 x 8 outputs per thread, 128 accumulators) are for very large
# products; 64x64 with K steps of 32 or 64 keeps more loads in flight per step, for small
# products whose time is a chain of K steps; see TUNED for where each won.
TILINGS = {
    t.name: t
    for t in (
        LARGE,
        Tiling(8, 8, 16),
        Tiling(8, 4, 16),
        Tiling(4, 8, 16),
        SMALL,
        Tiling(16, 8, 8),
        Tiling(8, 16, 8),
        Tiling(4, 4, 32),
        Tiling(4, 4, 64),
    )
}


@dataclass(frozen=True)
class Plan:
    """How one matmul runs.

    Attributes:
        kernel: ``"tiled"``, ``"gemv"`` or ``"simd"`` (CPU adapters, ``simd.py``).
        tiling: the tiled kernel's tiling (None for gemv).
        splits: K chunks (1: no split-K).
        lanes: gemv: threads sharing one output column's K (W stored [N, K]) or the
            number of K slices per workgroup (W stored [K, N]); simd: rows per workgroup.
        prefetch: tiled only: register prefetch + double-buffered workgroup tiles.
        deep: tiled with prefetch only: two register sets, so each K step's loads are issued
            two steps before they are stored (in flight over two multiplies instead of one).
    """

    kernel: str
    tiling: Tiling | None = None
    splits: int = 1
    lanes: int = 32
    prefetch: bool = True
    deep: bool = False

    @property
    def name(self) -> str:
        base = self.tiling.name if self.kernel == "tiled" else f"{self.kernel}{self.lanes}"
        return (
            base
            + (f"/s{self.splits}" if self.splits > 1 else "")
            + ("" if self.prefetch else "/np")
            + ("/d2" if self.deep and self.prefetch else "")
        )


def parse_plan(name: str) -> Plan:
    """``"128x128x8"``, ``"64x64x16/s4"``, ``"128x128x8/np"`` (no prefetch), ``"128x128x8/d2"``
    (two-deep prefetch), ``"gemv32/s2"``, ``"simd16"`` (CPU kernel, 16 rows per workgroup).

    Raises:
        ValueError: for a name outside that grammar or a tiling not in ``TILINGS``.
    """
    m = re.fullmatch(r"(gemv(\d+)|\d+x\d+x\d+)(?:/s(\d+))?(/np|/d2)?", name)
    simd = re.fullmatch(r"simd(\d+)", name)
    if simd is not None:
        if int(simd.group(1)) not in (8, 16, 32, 64):
            raise ValueError(f"simd rows must be 8, 16, 32 or 64: {name!r}")
        return Plan("simd", None, lanes=int(simd.group(1)))
    if m is None:
        raise ValueError(f"bad matmul plan name {name!r}")
    splits = int(m.group(3) or 1)
    if m.group(2):
        lanes = int(m.group(2))
        if lanes not in (4, 8, 16, 32, 64):
            raise ValueError(f"gemv lanes must be 4..64, a power of two: {name!r}")
        return Plan("gemv", None, splits, lanes)
    if m.group(1) not in TILINGS:
        raise ValueError(f"unknown tiling {m.group(1)!r}; known: {sorted(TILINGS)}")
    suffix = m.group(4)
    return Plan(
        "tiled", TILINGS[m.group(1)], splits, prefetch=suffix != "/np", deep=suffix == "/d2"
    )


SMS = 132  # multiprocessors of the H200 the heuristic was written for
# 128x128 tiles need this many workgroups to pay off; with fewer, smaller tiles spread the
# work over more multiprocessors. Measured on the H200 (132 SMs), f32 TFLOP/s for 128x128 vs
# 64x64 tiles: 4096^3 30.1 vs 12.8 (1024 large tiles), 2048^3 27.7 vs 22.2 (256), 1024^3
# 11.4 vs 15.6 (64).
LARGE_MIN_TILES = 256
HALF_MIN_TILES = 2 * SMS  # 128x64 / 64x128: about two workgroups per multiprocessor
GEMV_MAX_M = 8
# Split K while fewer than SPLIT_BELOW workgroups would run and K is at least SPLIT_MIN_K,
# aiming at TARGET_GROUPS workgroups with at least MIN_CHUNK of K each.
# The sweep (see TUNED) favoured splitting far more than the first guesses (below 132
# workgroups, K >= 1024, towards 264 workgroups of K >= 256 each): K of 576-720 over 12-18
# tiles ran 1.4-1.95x faster split 4 ways, and 144 tiles with K of 1500 1.3-1.46x split 8 ways.
SPLIT_BELOW = 160  # 144 tiles gained from splitting; 256 (1024^3 in 64x64) did not
SPLIT_MIN_K = 512
GEMV_SPLIT_MIN_K = 2048
TARGET_GROUPS = 8 * SMS
MIN_CHUNK = 128
# Below this many multiply-adds a tiled product is not split: the partial-sum dispatch costs
# a launch (2-5 us of host and GPU time on the H200) that a kernel of a few us cannot win back
# (the MNIST MLP's 64 x 784 x 128 layer stays one dispatch).
SPLIT_MIN_WORK = 1 << 24
MAX_SPLITS = 32
MAX_SCRATCH = 64 << 20

_forced: list[str] = []


def force_plan(name: str | None) -> None:
    """Make every matmul lowered from now on use plan ``name`` (None: back to the default).
    For benchmark sweeps; a plan that cannot run a shape raises ValueError when lowered."""
    if name is not None:
        parse_plan(name)
    _forced[:] = [] if name is None else [name]


def groups_of(plan: Plan, m: int, n: int, batch: int = 1) -> int:
    """Workgroups of the plan's main dispatch."""
    if plan.kernel == "simd":
        return -(-m // plan.lanes) * -(-n // 16) * batch
    if plan.kernel == "gemv":
        return -(-n // gemv_cols(plan.lanes, True)) * batch * plan.splits
    t = plan.tiling
    return -(-m // t.bm) * -(-n // t.bn) * batch * plan.splits


def gemv_cols(lanes: int, b_along_k: bool) -> int:
    """Output columns per gemv workgroup: 256 / lanes, times 4 when W is stored [K, N]."""
    return WG // lanes * (1 if b_along_k else 4)


def split_for(groups: int, k: int, min_k: int = SPLIT_MIN_K) -> int:
    """Splits lifting ``groups`` workgroups towards TARGET_GROUPS, K >= MIN_CHUNK each."""
    if groups >= SPLIT_BELOW or k < min_k:
        return 1
    return max(1, min(-(-TARGET_GROUPS // groups), k // MIN_CHUNK, MAX_SPLITS))


def heuristic_plan(m: int, k: int, n: int, batch: int = 1) -> Plan:
    """The default plan of shapes not in ``TUNED``.

    M <= 8: gemv (32 lanes per column), split K when it has few workgroups and K >= 2048.
    Otherwise the largest tile that still gives enough workgroups to fill the GPU (wave
    quantization over ``SMS`` multiprocessors): 128x128 from LARGE_MIN_TILES tiles,
    128x64 or 64x128 (the one wasting less of a ragged edge) from HALF_MIN_TILES, else
    64x64; then split K when fewer than SPLIT_BELOW workgroups remain, K >= SPLIT_MIN_K and
    the product has at least SPLIT_MIN_WORK multiply-adds.
    """
    if m <= GEMV_MAX_M:
        plan = Plan("gemv")
        return replace(plan, splits=split_for(groups_of(plan, m, n, batch), k, GEMV_SPLIT_MIN_K))

    def tiles(t: Tiling) -> int:
        return -(-m // t.bm) * -(-n // t.bn) * batch

    if m >= 128 and n >= 128 and tiles(LARGE) >= LARGE_MIN_TILES:
        # with naga's runtime checks prefetch cost this tile 5-9%; without them it gains
        # 6-15% at 2048^3 and 4096^3 and 36% on SmolLM2's LM head, and two-deep prefetch
        # another 6-11% (bench/results/sweeps/matmul_sweep_d2_h200.json: 4096^3 36.2 -> 39.1-39.9
        # TFLOP/s, the LM head 29.3 -> 32.5)
        return Plan("tiled", LARGE, deep=True)
    tall, wide = TILINGS["128x64x16"], TILINGS["64x128x16"]
    halves = [t for t in (tall, wide) if tiles(t) >= HALF_MIN_TILES and m >= t.bm and n >= t.bn]
    if halves:
        t = min(halves, key=lambda t: (tiles(t) * t.bm * t.bn, t is wide))
        return Plan("tiled", t)
    if m * n * k * batch < SPLIT_MIN_WORK:
        return Plan("tiled", SMALL)  # too small for a second dispatch to pay for itself
    return Plan("tiled", SMALL, split_for(tiles(SMALL), k))


# CPU adapters (llvmpipe): see cpu_plan. Gemv lanes per column when B is stored [N, K]
# (layouts "nt", "tt"), K slices per workgroup when it is stored [K, N].
CPU_GEMV_LANES = {"nt": 16, "tt": 16, "nn": 64, "tn": 64}
CPU_SIMD_ROWS = 16
CPU_TILINGS = (LARGE, TILINGS["64x128x16"], TILINGS["128x64x16"])


def cpu_plan(m: int, k: int, n: int, layout: str = "nn", subgroups: bool = False) -> Plan:
    """The plan on a CPU adapter (``Limits.cpu``: Mesa's llvmpipe, which CI's lavapipe is).

    llvmpipe runs a workgroup on one CPU thread, its invocations as 8-wide SIMD lanes in a
    loop; every storage or workgroup-memory load is a per-lane scalar loop (Mesa 22.3) and a
    barrier switches coroutines per 8 lanes, while a handful of threads (one per core) share
    the workgroups. So what counts is the work, not how many workgroups fill a GPU: no split-K
    (its partial sums and second dispatch are pure overhead), no register prefetch (a second
    workgroup buffer and more live registers), and of the tiles with the most outputs per
    thread (128x128x8, 64x128x16, 128x64x16) the one padding M x N least (ties: 128x128).
    M <= 8: gemv with ``CPU_GEMV_LANES[layout]`` lanes (``simd8`` ran the decode products 2-4x
    faster on lavapipe, but horizontal matmul fusion, ``horizontal.py``, joins gemv plans only).
    Larger products with subgroups: the ``simd`` kernel (``simd.py``: no workgroup memory, no
    barrier; 2.5-20x faster there than the tiled kernel), ``CPU_SIMD_ROWS`` rows per workgroup;
    without subgroups the tiled kernel as above. Measured with bench/cpu_matmul.py (lavapipe,
    Mesa 22.3, LLVM 15, 2 cores).
    """
    if m <= GEMV_MAX_M:
        return Plan("gemv", lanes=CPU_GEMV_LANES.get(layout, 32))
    if subgroups:
        return Plan("simd", lanes=CPU_SIMD_ROWS)

    def padded(t: Tiling) -> int:
        return -(-m // t.bm) * t.bm * -(-n // t.bn) * t.bn

    return Plan("tiled", min(CPU_TILINGS, key=padded), prefetch=False)


def choose_plan(m: int, k: int, n: int, batch: int, layout: str, limits: Limits) -> Plan:
    """The plan for one product (see the module docstring for the order of sources)."""
    return plan_source(m, k, n, batch, layout, limits)[0]


# Where a plan came from (``plan_source``), as the compiled Program records it.
SOURCES = ("forced", "device", "cpu", "tuned", "heuristic")


def plan_source(
    m: int, k: int, n: int, batch: int, layout: str, limits: Limits
) -> tuple[Plan, str]:
    """``choose_plan``'s plan and its source, one of ``SOURCES``: ``"device"`` for an entry of
    ``limits.matmul_plans`` (measured on the adapter), ``"tuned"`` for ``TUNED``."""
    if _forced:
        return parse_plan(_forced[0]), "forced"
    plan = device_plan(m, k, n, batch, layout, limits)
    if plan is not None:
        source = "device"
    elif limits.cpu:
        plan, source = cpu_plan(m, k, n, layout, limits.subgroups), "cpu"
    else:
        name = TUNED.get((m, k, n, layout)) if batch == 1 else None
        plan = parse_plan(name) if name else heuristic_plan(m, k, n, batch)
        source = "tuned" if name else "heuristic"
    if plan.kernel == "tiled":
        # WebGPU guarantees only 16 KiB of workgroup memory: drop the second buffer, then
        # fall back to the small tile, where the adapter has less.
        for fallback in (
            plan,
            replace(plan, prefetch=False),
            Plan("tiled", SMALL, plan.splits, prefetch=False),
        ):
            if (
                tiled_shared_bytes(fallback.tiling, fallback.prefetch)
                <= limits.max_workgroup_storage_size
            ):
                return fallback, source
    return plan, source


def device_plan(m: int, k: int, n: int, batch: int, layout: str, limits: Limits) -> Plan | None:
    """The plan ``limits.matmul_plans`` holds for this product, or None: none recorded, or one
    this adapter cannot run whatever the tile (gemv for M > ``GEMV_MAX_M``, simd without
    subgroups), or a name this version cannot parse (the cache is checked when loaded)."""
    if not limits.matmul_plans:
        return None
    name = _plan_table(limits.matmul_plans).get((m, k, n, layout, batch))
    if name is None:
        return None
    try:
        plan = parse_plan(name)
    except ValueError:
        return None
    if (plan.kernel == "gemv" and m > GEMV_MAX_M) or (
        plan.kernel == "simd" and not limits.subgroups
    ):
        return None
    return plan


@functools.lru_cache(maxsize=16)
def _plan_table(plans: tuple) -> dict:
    return dict(plans)


def choose_tiling(m: int, n: int, k: int, batch: int = 1) -> Tiling:
    """The tiling ``heuristic_plan`` picks for the tiled kernel (SMALL for gemv shapes)."""
    plan = heuristic_plan(max(m, GEMV_MAX_M + 1), k, n, batch)
    return plan.tiling


def tiled_shared_bytes(t: Tiling, prefetch: bool = True) -> int:
    """Upper bound of the tiled kernel's workgroup memory: one buffer per operand (two with
    prefetch), one vec4 of padding per K row."""
    return (2 if prefetch else 1) * 16 * t.bk * (t.bm // 4 + t.bn // 4 + 2)

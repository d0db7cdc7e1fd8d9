"""Work decomposition of the flash-attention kernels (``lane``): how many rows a
workgroup owns, how many threads share a row, how long a workgroup-memory tile is, and where
each tile segment lives in workgroup memory.

Invariants (``check_plan``): ``rows * lanes`` threads (``THREADS`` in the automatic plan, up
to the adapter's limit in a forced one) with ``lanes`` a power of two; ``tile`` is a multiple of
``lanes`` with at most ``MAX_PER_LANE`` entries per lane (each becomes named registers); the
tile segments and the lanes' merge area both fit the adapter's workgroup memory.
``LANE_OVERRIDE`` forces a plan per mode (benchmarks: bench/attention_plans.py).

Where a plan comes from (``choose_plan``), first match wins: ``LANE_OVERRIDE``; the plans
measured on this very adapter (``Limits.attention_plans``: the per-device tuning cache that
``bench/attention_plans.py --record`` writes, ``meganeura.tune.cache``), on any adapter, CPU
ones included; the static table measured on the H200 (``tuned.TUNED``), GPU adapters only; the
automatic rule. A measured plan the adapter cannot run (``check_plan``) is passed over.
``set_tuned(False)`` turns off both measured sources (a benchmark's "default" is the rule).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from ...kernel import Limits
from ..core.layout import next_pow2

# Measured on the H200 (Vulkan), f32 forward over B=4, H=16, L=2048, D=64, causal: 2.3 ms
# (14.6 TFLOP/s) with these values; 16 entries per lane took 12.6 ms (register spills), and
# 128-thread workgroups or 1024 target groups were no better across the workloads' shapes.
# ``choose_plan`` reads these module globals on every call, so a benchmark may patch them
# (bench/attention_plans.py sweeps explicit plans through ``LANE_OVERRIDE`` instead).
THREADS = 64  # threads per workgroup the automatic plan fills (rows * lanes)
TARGET_GROUPS = 256  # shrink row tiles until this many workgroups (or MIN_ROWS-row tiles) exist
MIN_ROWS = 4  # the fewest rows per workgroup the shrinking goes down to
MAX_PER_LANE = 8  # stream entries per lane per tile (each a named score register)
# The longest tile (stream entries, a power of two) the automatic plan tries first. A choice,
# not a limit of the kernel: any tile that is a multiple of the lanes, with at most
# MAX_PER_LANE entries per lane and fitting workgroup memory, generates a correct kernel
# (tests/codegen/test_attention_plans.py runs tiles of 64).
MAX_TILE = 32
# mode -> (rows, lanes, tile) forcing that lane plan (validated by ``check_plan``) for every
# lane kernel of that mode: "fwd" (with or without its log-sum-exp store, split or not),
# "stats", "lse", "dq" (with or without delta), "dk", "dv", "dkv". Modes not listed choose
# automatically. For benchmarks and tests (bench/attention_plans.py); empty by default.
LANE_OVERRIDE: dict[str, tuple[int, int, int]] = {}
# Limits.attention_plans (any adapter) and tuned.TUNED (GPU adapters): ``set_tuned``, bench A/B
USE_TUNED = [True]
LANE_MODES = ("fwd", "stats", "lse", "dq", "dk", "dv", "dkv")  # the lane kernels' modes
QUERY_ROW_MODES = ("fwd", "stats", "lse", "dq")  # rows are queries; dk, dv, dkv: keys
SOFTMAX_MODES = ("fwd", "stats", "lse")  # an online softmax (running max and sum) per row


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
    if mode in ("stats", "lse"):
        return [("k", dims.d4)]
    return [("q", dims.d4), ("g", dims.dv4), ("st", 1)]


def merge_slot(mode: str, dims: Dims) -> int:
    """vec4s of one lane's partial state in a merge round."""
    return accumulators(mode, dims) + (1 if mode in SOFTMAX_MODES else 0)


def accumulators(mode: str, dims: Dims) -> int:
    """vec4 accumulators a row keeps: its output row (``dkv``: the dk row and the dv row)."""
    return {"fwd": dims.dv4, "stats": 0, "lse": 0, "dq": dims.d4, "dk": dims.d4, "dv": dims.dv4,
            "dkv": dims.d4 + dims.dv4}[mode]  # fmt: skip


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


def check_plan(mode: str, dims: Dims, plan: Plan, limits: Limits) -> Plan:
    """``plan`` if the lane kernel in ``mode`` can run it on this adapter.

    Raises:
        ValueError: naming the mode, the plan and the limit it breaks: rows, lanes or tile
            below 1; lanes not a power of two (the lanes merge pairwise); rows * lanes above
            the adapter's ``max_invocations_per_workgroup``; a tile that is not a multiple of
            the lanes or gives a lane more than ``MAX_PER_LANE`` entries; tile segments or
            merge area above ``max_workgroup_storage_size`` bytes.
    """
    what = f"lane plan for {mode!r} (rows={plan.rows}, lanes={plan.lanes}, tile={plan.tile})"
    if min(plan.rows, plan.lanes, plan.tile) < 1:
        raise ValueError(f"{what}: rows, lanes and tile must be at least 1")
    if plan.lanes & (plan.lanes - 1):
        raise ValueError(f"{what}: lanes must be a power of two (pairwise merge)")
    if plan.size > limits.max_invocations_per_workgroup:
        raise ValueError(
            f"{what}: rows * lanes = {plan.size} threads exceeds the adapter's "
            f"max_invocations_per_workgroup {limits.max_invocations_per_workgroup}"
        )
    if plan.tile % plan.lanes:
        raise ValueError(f"{what}: tile must be a multiple of lanes")
    if plan.per_lane > MAX_PER_LANE:
        raise ValueError(
            f"{what}: {plan.per_lane} entries per lane exceeds MAX_PER_LANE {MAX_PER_LANE}"
        )
    need = 16 * shared_layout(mode, dims, plan)[0]
    if need > limits.max_workgroup_storage_size:
        raise ValueError(
            f"{what}: needs {need} bytes of workgroup memory at D={dims.d}, Dv={dims.dv}, "
            f"above the adapter's max_workgroup_storage_size {limits.max_workgroup_storage_size}"
        )
    return plan


@functools.lru_cache(maxsize=16)
def _device_table(plans: tuple) -> dict:
    return dict(plans)


def device_plan(mode: str, dims: Dims, limits: Limits) -> Plan | None:
    """The plan measured on this adapter for (``mode``, ``dims``) (``limits.attention_plans``,
    from its tuning cache), on any adapter, CPU ones included, else None (``USE_TUNED`` off,
    no entry, or an entry ``check_plan`` refuses)."""
    if not (USE_TUNED[0] and limits.attention_plans):
        return None
    key = (mode, dims.b, dims.hkv, dims.group, dims.lq, dims.lk, dims.d, dims.dv)
    entry = _device_table(limits.attention_plans).get(key)
    if entry is None:
        return None
    try:
        return check_plan(mode, dims, Plan(*entry), limits)
    except (TypeError, ValueError):
        return None


def tuned_plan(mode: str, dims: Dims, limits: Limits) -> Plan | None:
    """The H200-measured plan of ``tuned.TUNED`` for (``mode``, ``dims``) on a GPU adapter
    that can run it, else None (``USE_TUNED`` off, a CPU adapter, no entry, or an entry
    ``check_plan`` refuses)."""
    from .tuned import TUNED

    entry = TUNED.get((mode, dims)) if USE_TUNED[0] and not limits.cpu else None
    if entry is None:
        return None
    try:
        return check_plan(mode, dims, Plan(*entry), limits)
    except ValueError:
        return None


def set_tuned(on: bool) -> None:
    """Let ``choose_plan`` take measured plans, the adapter's own (``limits.attention_plans``)
    and ``tuned.TUNED``'s (on, the default), or only the automatic rule (off), for programs
    compiled from now on (a bench A/B switch: bench/attention_plans.py times the rule)."""
    USE_TUNED[:] = [bool(on)]


def choose_plan(mode: str, dims: Dims, limits: Limits) -> Plan:
    """Rows per workgroup, lanes per row and tile length for ``mode`` on this adapter.

    ``LANE_OVERRIDE[mode]`` wins (checked by ``check_plan``), then the plan measured on this
    adapter for these sizes (``device_plan``: ``limits.attention_plans``, any adapter), then the
    H200-measured plan of ``tuned.TUNED`` on a GPU adapter (``tuned_plan``); a measured plan
    ``check_plan`` refuses is passed over. Else rows shrink (down to
    ``MIN_ROWS``) until there are ``TARGET_GROUPS`` workgroups of ``THREADS`` threads, lanes
    take the threads left, up to the stream's length, and rows take back what a short stream
    cannot use; tiles are as long as workgroup memory allows (at most ``MAX_TILE``, at most
    the stream).

    Raises:
        ValueError: when even one entry per tile does not fit workgroup memory, or the
            override does not pass ``check_plan``.
    """
    forced = LANE_OVERRIDE.get(mode)
    if forced is not None:
        return check_plan(mode, dims, Plan(*forced), limits)
    tuned = device_plan(mode, dims, limits) or tuned_plan(mode, dims, limits)
    if tuned is not None:
        return tuned
    n_rows, n_stream = extents(mode, dims)
    rows = min(THREADS, next_pow2(n_rows))
    while rows > MIN_ROWS and dims.b * dims.hkv * -(-n_rows // rows) < TARGET_GROUPS:
        rows //= 2
    lanes = min(THREADS // rows, next_pow2(n_stream))
    rows = min(THREADS // lanes, next_pow2(n_rows))
    tiles = [MAX_TILE >> i for i in range(MAX_TILE.bit_length())]  # MAX_TILE, ..., 2, 1
    while True:
        for tile in tiles:
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


# ---- register-tiled ("block") kernels: block.py ------------------------------------------
# (rows, tile, row_threads, lanes) in order of preference. Each thread owns 4 rows
# (rows = 4 * row_threads) and tile / lanes stream entries of the score tile, and 4 rows by
# every lanes-th vec4 column of the accumulator. Larger tiles reuse each workgroup-memory read
# in more FMAs; smaller ones give more workgroups on short problems. bench/attention_sweep.py
# times each of them (see AUTO_BLOCK for what it measured).
BLOCK_PLANS: tuple[tuple[int, int, int, int], ...] = (
    (64, 32, 16, 8),
    (32, 32, 8, 8),
    (64, 64, 16, 16),
    (32, 16, 8, 4),
    (16, 16, 4, 4),
    (8, 8, 2, 4),
)
BLOCK_MIN_GROUPS = 128  # prefer the first plan giving at least this many workgroups
# mode -> a BLOCK_PLANS-style tuple forcing that plan, or None forcing the lane kernel
# (attention_flash); modes not listed choose automatically. Benchmarks sweep through this.
BLOCK_OVERRIDE: dict[str, tuple[int, int, int, int] | None] = {}
# The automatic choice, from bench/attention_sweep.py on the H200 (2026-11-30, us per kernel,
# trusted shader modules): the lane kernel was the fastest, or within 3%, for every kernel at
# Whisper (6 x 1500 x 64) and SmolLM2 (9/3 x 128 x 64, causal) sizes. (With naga's runtime
# checks, block 32x32x8x8 had won dk at Whisper, 1233 us against 1364; without them the lane
# dk takes 657 us against the block's 851, and the fused block dkv 1041 us against lane dk +
# dv's 955.) So the automatic choice is the lane kernel, except the modes listed here:
# mode -> (plan, fewest rows per (batch, kv head)); none today.
AUTO_BLOCK: dict[str, tuple[tuple[int, int, int, int], int]] = {}


@dataclass(frozen=True)
class BlockPlan:
    """``rows`` rows per workgroup split over ``row_threads`` x 4, ``tile`` stream entries
    per tile split over ``lanes`` threads."""

    rows: int
    tile: int
    row_threads: int
    lanes: int

    @property
    def size(self) -> int:
        return self.row_threads * self.lanes

    @property
    def per_lane(self) -> int:
        return self.tile // self.lanes


def _pad(n4: int) -> int:
    """Row stride in vec4s: odd, so lanes reading different rows hit different banks."""
    return n4 | 1 if n4 > 1 else n4


def block_layout(mode: str, dims: Dims, plan: BlockPlan) -> tuple[int, dict[str, tuple[int, int]]]:
    """(vec4s of workgroup memory, {segment: (offset, row stride in vec4s)}) of a block
    kernel. Segments: ``a`` (the rows' q or k), ``a2`` (their dO or v), ``b``/``b2`` (the
    stream tile's counterparts), ``c`` (the tile multiplied into the accumulator when it is
    not ``b``), ``st`` (the tile's lse and delta), ``p`` (probabilities or score gradients,
    transposed: 4 rows per vec4), ``ds`` (``dkv``: the score gradients, ``p`` holding the
    probabilities) and ``red`` (per-lane row partials)."""
    d4, dv4 = dims.d4, dims.dv4
    R, T = plan.rows, plan.tile
    segs = {
        "fwd": [("a", R, _pad(d4)), ("b", T, _pad(d4)), ("c", T, dv4)],
        "stats": [("a", R, _pad(d4)), ("b", T, _pad(d4))],
        "dq": [("a", R, _pad(d4)), ("a2", R, _pad(dv4)), ("b", T, _pad(d4)), ("b2", T, _pad(dv4))],
        "dk": [("a", R, _pad(d4)), ("a2", R, _pad(dv4)), ("b", T, _pad(d4)), ("b2", T, _pad(dv4))],
        "dv": [("a", R, _pad(d4)), ("b", T, _pad(d4)), ("c", T, dv4)],
    }[mode if mode != "dkv" else "dk"]
    if mode in ("dk", "dv", "dkv"):
        segs.append(("st", T, 1))
    if mode != "stats":
        segs.append(("p", T, R // 4))
    if mode == "dkv":  # probabilities (into dv) and score gradients (into dk) side by side
        segs.append(("ds", T, R // 4))
    segs.append(("red", plan.lanes * (3 if mode == "stats" else 1), R // 4))
    layout, off = {}, 0
    for name, n, stride in segs:
        layout[name] = (off, stride)
        off += n * stride
    return off, layout


def choose_block_plan(
    mode: str, dims: Dims, limits: Limits, by_groups: bool = False
) -> BlockPlan | None:
    """The register-tiled plan for ``mode``, or None when the lane kernel should run.

    ``BLOCK_OVERRIDE`` wins; else ``AUTO_BLOCK`` (the measured choice: the lane kernel except
    where a block plan was faster), or with ``by_groups`` the first ``BLOCK_PLANS`` entry that
    fits the adapter and gives ``BLOCK_MIN_GROUPS`` workgroups, else the fitting entry giving
    the most.
    """
    n_rows, _ = extents(mode, dims)
    groups_per_row_tile = dims.b * dims.hkv

    def fits(p: BlockPlan) -> bool:
        return (
            p.size <= limits.max_invocations_per_workgroup
            and 16 * block_layout(mode, dims, p)[0] <= limits.max_workgroup_storage_size
        )

    if mode in BLOCK_OVERRIDE:
        forced = BLOCK_OVERRIDE[mode]
        if forced is None:
            return None
        plan = BlockPlan(*forced)
        return plan if fits(plan) else None
    if not by_groups:
        auto = AUTO_BLOCK.get(mode)
        if auto is None or n_rows < auto[1]:
            return None
        plan = BlockPlan(*auto[0])
        return plan if fits(plan) else None
    best = None
    for cand in BLOCK_PLANS:
        plan = BlockPlan(*cand)
        if not fits(plan):
            continue
        groups = groups_per_row_tile * -(-n_rows // plan.rows)
        if groups >= BLOCK_MIN_GROUPS:
            return plan
        if best is None or groups > best[0]:
            best = (groups, plan)
    return best[1] if best else None


# ---- the forward writing its log-sum-exp -------------------------------------------------------
# True: where ``lowering.lse_fusible`` allows, the forward's kernel also writes the rows'
# log-sum-exp that the backward reads (``passes.fuse.plan_attention_lse``); False: the backward
# computes it in its own pass over the keys (the programs before; benchmarks compare both).
SAVE_LSE = True


# ---- rotary embeddings in the forward without a cache ----------------------------------------
# True: a forward without a KV cache whose queries and keys are rotary embeddings read by
# nothing else rotates them as the lane kernel loads them (``rope_prefill``,
# ``passes.rope_cache.attach_prefill_attention``); False: rope_cache's kernel, then the
# attention (the programs before; benchmarks compare both).
ROPE_PREFILL = True


# ---- dk and dv in one pass ("dkv") -----------------------------------------------------------
# The lane kernel in dkv mode keeps the key row's k and v and both accumulators in registers:
# 2 (D4 + Dv4) vec4s per thread, where dk alone keeps 2 D4 + Dv4: 48 vec4s at D = Dv = 64.
# Within that budget (D = Dv <= 48) it always runs fused. Beyond it the kernel spills, which
# costs in proportion to the query rows each key row streams over (Lq x query heads per kv
# head). Measured on the H200 (bench/attention_sweep.py, D = 64): at SmolLM2, 384 streamed rows,
# fused 59.6 us against dk + dv's 71.8; at Whisper, 1500 rows, fused 1319 us against 955. So
# larger heads fuse up to LANE_KV_MAX_STREAM streamed rows and keep separate dk and dv kernels
# beyond.
LANE_KV_MAX_VEC4 = 48
LANE_KV_MAX_STREAM = 512
# True forces the dkv kernel wherever a graph has both gradients, False forbids it; None
# chooses by ``fuses_key_value``'s rule. Benchmarks compare both ways through this.
FUSE_KEY_VALUE: bool | None = None
# The "dkv half" kernel (``dkv_half``: each key row over two threads by head dim, 32 vec4
# registers at D = 64, so no spills): True runs every fused pair on it where it fits the
# adapter; None (auto) only the pairs the lane dkv would spill on (Whisper), which then fuse
# instead of running dk and dv apart; False never. None since the H200 timed it
# (bench/results/attention_sweep_h200.txt, docs/attention.md): at Whisper dkv half 688 us
# against dk + dv 953, the backward 1310 against 1571; at SmolLM2 the lane dkv stays (59.6
# against dkv half's 95.4), which None keeps.
DKV_HALF: bool | None = None


def _lane_fuses(dims: Dims) -> bool:
    """The lane dkv's rule: its registers fit, or the query stream is short."""
    fits = 2 * (dims.d4 + dims.dv4) <= LANE_KV_MAX_VEC4
    return fits or dims.lq * dims.group <= LANE_KV_MAX_STREAM


def uses_dkv_half(dims: Dims, limits: Limits) -> bool:
    """Whether a fused dk + dv pair without a block plan runs the ``dkv_half`` kernel
    (``DKV_HALF``): where the lane kernel would not fuse them, or where a query split was
    measured faster than the lane kernel (``dkv_half.measured_query_split``)."""
    if DKV_HALF is False:
        return False
    from .dkv_half import half_fits, measured_query_split  # dkv_half imports this module

    if not half_fits(dims, limits):
        return False
    return (
        DKV_HALF is True or not _lane_fuses(dims) or measured_query_split(dims, limits) is not None
    )


def fuses_key_value(dims: Dims, limits: Limits) -> bool:
    """Whether one ``dkv`` kernel should compute dk and dv (else a dk and a dv kernel): with a
    block plan, with the ``dkv_half`` kernel (``uses_dkv_half``), or with the lane kernel when
    its registers fit ``LANE_KV_MAX_VEC4`` or each key row streams over at most
    ``LANE_KV_MAX_STREAM`` query rows."""
    if FUSE_KEY_VALUE is not None:
        return FUSE_KEY_VALUE
    if choose_block_plan("dkv", dims, limits) is not None:
        return True
    return uses_dkv_half(dims, limits) or _lane_fuses(dims)

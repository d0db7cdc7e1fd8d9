"""Which attention kernels split their stream over workgroups, and how (the chunking of
``plan``'s lane plans): one workgroup per (row tile, chunk), each writing a partial result,
then a kernel combining the chunks in chunk order.

- Short query blocks (decoding: ``choose_split``): the forward's keys, partial softmax
  states merged by ``decode.lower_merge`` (flash-decoding).
- Long query blocks with too few threads to fill the GPU (``choose_long_split``): the
  forward's keys (the same two kernels; a training forward's merge also writes the
  log-sum-exp) and the query gradient's keys (``dq_split``). ``dkv_half.choose_query_split``
  splits dk and dv's query stream by the same thread rule.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ...kernel import Limits
from . import plan as lane_plans  # its switches read at each call (tests patch them)
from .plan import Dims, Plan, check_plan, choose_plan, extents

# ---- split keys for short query blocks (flash-decoding): decode.py ----------------------------
# A decode step has G * Lq query rows per kv head: one row tile, so the plain lane kernel runs
# B * Hkv workgroups (3 for SmolLM2), each streaming every key. Splitting the keys into chunks,
# one workgroup per chunk, then merging the chunks' partial softmax states in a second kernel
# (Dao et al. 2023, "Flash-Decoding for long-context inference") fills the GPU.
SPLIT_MAX_LQ = 8  # query rows per head up to which the forward may split its keys
SPLIT_BELOW_GROUPS = 64  # split only when the plain kernel has fewer workgroups than this
SPLIT_TARGET_GROUPS = 256  # chunks per row tile: about this many workgroups in all
SPLIT_MAX_CHUNKS = 64  # the merge reads every chunk's state per output element
# True forces the split wherever it can run (at least two chunks), False forbids it; None
# chooses by ``choose_split``'s rule. Tests and benchmarks compare both ways through this.
SPLIT_OVERRIDE: bool | None = None
# Keys (the cache length, kv_length being a runtime value) from which a split pays. Measured on
# the H200 (bench/llm.py, SmolLM2-135M greedy decode, 512-slot cache, ~45 keys attended): 1.55
# ms/token split (the merge kernel 39 us a layer) against 1.30 unsplit. Until the merge is
# cheaper, only very long caches split.
SPLIT_MIN_KEYS = 8192


@dataclass(frozen=True)
class Split:
    """A stream cut into ``chunks`` chunks of ``length`` entries (a multiple of the plan's
    tile), one workgroup per (row tile, chunk), with the kernel's ``plan``: the keys of a
    forward or dq lane kernel, or the query rows of each head for dkv half;
    ``prefetch``: the chunks' key loops may prefetch (``tile_loads.SPLIT_PREFETCH`` too)."""

    plan: Plan
    chunks: int
    length: int
    prefetch: bool = True


def choose_split(dims: Dims, limits: Limits) -> Split | None:
    """The key split of a forward (``fwd``) with short query blocks, or None for the plain
    lane kernel: when Lq <= ``SPLIT_MAX_LQ``, the plain kernel has fewer than
    ``SPLIT_BELOW_GROUPS`` workgroups, there are at least ``SPLIT_MIN_KEYS`` keys and they fill
    at least two tiles
    (``SPLIT_OVERRIDE`` forces or forbids it). Chunks are whole tiles, about
    ``SPLIT_TARGET_GROUPS`` workgroups in all, at most ``SPLIT_MAX_CHUNKS``."""
    if SPLIT_OVERRIDE is False:
        return None
    plan = choose_plan("fwd", dims, limits)
    n_rows, lk = extents("fwd", dims)
    groups = dims.b * dims.hkv * -(-n_rows // plan.rows)
    tiles = -(-lk // plan.tile)
    if tiles < 2:
        return None
    if SPLIT_OVERRIDE is None and (
        dims.lq > SPLIT_MAX_LQ or groups >= SPLIT_BELOW_GROUPS or lk < SPLIT_MIN_KEYS
    ):
        return None
    return _chunked(plan, lk, max(2, -(-SPLIT_TARGET_GROUPS // groups)))


def _chunked(plan: Plan, lk: int, chunks: int) -> Split | None:
    """``lk`` keys in about ``chunks`` chunks of whole tiles (at most ``SPLIT_MAX_CHUNKS``,
    at most one a tile; fewer where the rounded length covers the keys sooner), or None below
    two chunks."""
    tiles = -(-lk // plan.tile)
    chunks = min(tiles, SPLIT_MAX_CHUNKS, chunks)
    if chunks < 2:
        return None
    length = -(-tiles // chunks) * plan.tile
    return Split(plan, -(-lk // length), length)


# ---- split keys for long query blocks: the same two kernels -----------------------------------
# The lane forward's best plans at Whisper (B1 x 6 heads x 1500 x 64: 2 lanes a row, more were
# slower) run 18,000 threads, about 4 warps an H200 SM: too few to hide latency. Cutting the keys
# into chunks multiplies the threads, each keeping its reads and registers, for one merge (~11 us).
# Measured on the H200 (bench/attention_split.py, attention_split_h200.json, us, partial + merge):
# 32x2x16: 283 unsplit, 280 / 248 / 272 / 261 in 2 / 3 / 4 / 6 chunks; 32x1x8: 296 unsplit, 225
# in 3. A training forward splits too: its merge writes the rows' log-sum-exp (``fwd+lse``).
# The query gradient (``dq``, rows are queries too, 18,000 threads at Whisper on its 32x2x16
# plan) splits the same way: each chunk sums its keys' part of dq, a second kernel adds the
# chunks' parts in chunk order (``dq_split``).
LONG_SPLIT_MODES = ("fwd", "dq")  # the lane modes whose keys a long query block may split
LONG_SPLIT_THREADS = 54_000  # split while the plain kernel runs fewer threads than this
LONG_SPLIT_MIN_KEYS = 1024  # keys from which a long query block may split
# True forces the split wherever it can run, False forbids it; None: GPU adapters, by the rule
LONG_SPLIT_OVERRIDE: bool | None = None
# mode -> chunk count forcing that many chunks (1: unsplit) on the mode's plan (``choose_plan``)
# for every long query block, ahead of the override, the table and the rule. For benchmarks
# (bench/attention_split.py); empty by default.
LONG_SPLIT_CHUNKS: dict[str, int] = {}


def set_long_split(on: bool) -> None:
    """Let long forwards and query gradients split their keys by the rule (on, the default)
    or never (off), for programs compiled from now on (bench/lever_ab.py's
    ``attention_long_split``)."""
    global LONG_SPLIT_OVERRIDE
    LONG_SPLIT_OVERRIDE = None if on else False


def set_dq_split(on: bool) -> None:
    """Let long query gradients split their keys as ``choose_long_split`` says (on, the
    default) or never (off: ``LONG_SPLIT_CHUNKS["dq"] = 1``), forwards unchanged, for programs
    compiled from now on (bench/lever_ab.py's ``attention_dq_split``)."""
    if on:
        LONG_SPLIT_CHUNKS.pop("dq", None)
    else:
        LONG_SPLIT_CHUNKS["dq"] = 1


def choose_long_split(dims: Dims, limits: Limits, mode: str = "fwd") -> Split | None:
    """The key split of a ``mode`` kernel (``LONG_SPLIT_MODES``: a forward, with or without
    its log-sum-exp, which the merge then writes; or a query gradient) with a long query block
    (more than ``SPLIT_MAX_LQ`` query rows a head), or None for the plain lane kernel.
    ``LONG_SPLIT_CHUNKS`` (benchmarks) comes first; then ``tuned.TUNED_SPLIT`` (plan, chunks
    and whether the chunks prefetch, measured on the H200 per mode and size) on a GPU
    adapter; else the rule: on a GPU adapter, with at least ``LONG_SPLIT_MIN_KEYS`` keys,
    when the plain kernel runs fewer than ``LONG_SPLIT_THREADS`` threads, chunks of whole
    tiles (at most ``SPLIT_MAX_CHUNKS``) bring the threads up to about that many.
    ``LONG_SPLIT_OVERRIDE`` True forces the rule's split on any adapter (tests), False
    forbids any.

    Raises:
        ValueError: for a mode outside ``LONG_SPLIT_MODES``.
    """
    if mode not in LONG_SPLIT_MODES:
        raise ValueError(f"long split: mode {mode!r} is not one of {LONG_SPLIT_MODES}")
    if dims.lq <= SPLIT_MAX_LQ:
        return None
    n_rows, lk = extents(mode, dims)
    if mode in LONG_SPLIT_CHUNKS:
        return _chunked(choose_plan(mode, dims, limits), lk, LONG_SPLIT_CHUNKS[mode])
    if LONG_SPLIT_OVERRIDE is False:
        return None
    from .tuned import TUNED_SPLIT

    measured = TUNED_SPLIT.get((mode, dims)) if lane_plans.USE_TUNED[0] and not limits.cpu else None
    if measured is not None and lane_plans.LANE_OVERRIDE.get(mode) is None:
        (rows, lanes, tile), chunks, fetching = measured
        try:
            plan = check_plan(mode, dims, Plan(rows, lanes, tile), limits)
        except ValueError:  # an adapter that cannot run the measured plan: the rule
            pass
        else:
            split = _chunked(plan, lk, chunks)
            return None if split is None else replace(split, prefetch=fetching)
    plan = choose_plan(mode, dims, limits)
    threads = dims.b * dims.hkv * -(-n_rows // plan.rows) * plan.size
    return split_by_rule(plan, lk, threads, limits)


def split_by_rule(plan: Plan, stream: int, threads: int, limits: Limits) -> Split | None:
    """The long split's thread rule, for a kernel on ``plan`` streaming ``stream`` entries
    with ``threads`` threads unsplit (``choose_long_split``; ``dkv_half.choose_query_split``):
    chunks of whole tiles bringing the threads up to about ``LONG_SPLIT_THREADS``, on a GPU
    adapter with at least ``LONG_SPLIT_MIN_KEYS`` entries while the kernel runs fewer
    threads than that; ``LONG_SPLIT_OVERRIDE`` True splits anyway, False never."""
    if LONG_SPLIT_OVERRIDE is False:
        return None
    if LONG_SPLIT_OVERRIDE is None and (
        limits.cpu or stream < LONG_SPLIT_MIN_KEYS or threads >= LONG_SPLIT_THREADS
    ):
        return None
    return _chunked(plan, stream, max(2, -(-LONG_SPLIT_THREADS // threads)))

"""``matmul`` ``[..., M, K] @ [..., K, N]``: operand layout, kernel choice, split-K, dispatch.

Every matmul lowers to one of two kernels, chosen per shape by a ``Plan``:
  * ``tiled`` (``matmul_tiled.py``): 256 threads register-tile a BM x BN output block
    (``TILINGS``: 128x128, 128x64, 64x128, 64x64 with K steps of 16, 32 or 64, 256x128,
    128x256), vec4 global loads where the layout allows,
    the next K tile prefetched into registers while the current one is multiplied out of
    double-buffered workgroup memory (one barrier per K step), or two tiles ahead through two
    register sets (``Plan.deep``, the default on 128x128);
  * ``gemv`` (``matmul_gemv.py``): M <= 8 (decode), threads split K and reduce in workgroup
    memory, each warp reading neighbouring addresses of the weight.
Either can split K (``Plan.splits`` > 1): chunk s of K writes its partial product to scratch
``[split][batch][M][N]``, and a second dispatch sums the chunks in a fixed order
(deterministic) and applies the store (or the fused epilogue).

Operands are read through baked strides: batch dims broadcast with stride 0, and an operand
that is a ``permute`` swapping only its last two dims is not materialized: the permute's input
is bound with its matrix strides swapped (``x @ w.mT`` reads ``w``). ``matmul_operands``
reports the values actually bound, for ``reads``. An operand whose contiguous dim is a
multiple of 4 (and whose batch offsets are too) is bound as ``array<vec4<T>>``; a value read
both as A and B (``x @ x.mT``) shares one binding. Loads past M, N or K read zero; stores past
M or N are skipped.

Plan choice (``choose_plan``): ``force_plan`` (benchmark sweeps) overrides everything; then
``TUNED``, the measured best plan per (M, K, N, layout), which ``bench/matmul_sweep.py``
prints for pasting here; then ``heuristic_plan``, documented on the function.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Protocol

from ...dtypes import DType
from ...graph.ir import Graph
from ..kernel import KernelSource, Limits
from .common import (
    PER_THREAD,
    KernelBuilder,
    Src,
    broadcast_strides,
    coalesce,
    contiguous_strides,
    element_slots,
    is_constant,
    u,
)
from .common import strided_index as _index
from .elementwise import lower_fill

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
        kernel: ``"tiled"`` or ``"gemv"``.
        tiling: the tiled kernel's tiling (None for gemv).
        splits: K chunks (1: no split-K).
        lanes: gemv only: threads sharing one output column's K (W stored [N, K]) or the
            number of K slices per workgroup (W stored [K, N]).
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
        base = self.tiling.name if self.kernel == "tiled" else f"gemv{self.lanes}"
        return (
            base
            + (f"/s{self.splits}" if self.splits > 1 else "")
            + ("" if self.prefetch else "/np")
            + ("/d2" if self.deep and self.prefetch else "")
        )


def parse_plan(name: str) -> Plan:
    """``"128x128x8"``, ``"64x64x16/s4"``, ``"128x128x8/np"`` (no prefetch), ``"128x128x8/d2"``
    (two-deep prefetch), ``"gemv32/s2"``.

    Raises:
        ValueError: for a name outside that grammar or a tiling not in ``TILINGS``.
    """
    m = re.fullmatch(r"(gemv(\d+)|\d+x\d+x\d+)(?:/s(\d+))?(/np|/d2)?", name)
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


# ---- plan choice ------------------------------------------------------------------------------
# Measured best plan per (M, K, N, layout) of 2-D products (batch folded into M), layout
# "nn", "nt" (B stored [N, K]), "tn" (A stored [K, M]) or "tt". Paste the dict that
# ``bench/matmul_sweep.py`` prints. Shapes not listed fall back to ``heuristic_plan``.
# Measured best plans (bench/matmul_sweep.py on the H200, 2026-11-30; plans >= 3% faster than
# the heuristic's choice at the time; the gain over that choice in the comment). Re-swept with
# naga's runtime checks off (bench/results/sweeps/): 128x128x8 with prefetch became the best
# large plan (1.06-1.36x over /np), now the heuristic's, so the two square /np entries went;
# the small projections moved to 8-way splits ("re-swept"); the rest still held.
TUNED: dict[tuple[int, int, int, str], str] = {
    (512, 4096, 512, "nn"): "128x128x8/s8",  # long_k x1.15
    (128, 576, 576, "nt"): "64x64x16/s8",  # smollm2_q_o x1.04 (re-swept)
    (128, 576, 192, "nt"): "64x64x16/s8",  # smollm2_k_v x1.11 (re-swept)
    (128, 576, 1536, "nt"): "64x64x16/s4",  # smollm2_gate_up x1.11
    (1, 576, 192, "nt"): "gemv16",  # smollm2_dec_k_v x1.09
    (1, 576, 49152, "nt"): "gemv16",  # smollm2_dec_head x1.04
    (50, 720, 960, "nt"): "64x64x32/s8",  # smolvla_q x1.21 (re-swept)
    (50, 720, 320, "nt"): "64x64x32/s8",  # smolvla_k_v x1.21 (re-swept)
    (50, 960, 720, "nt"): "64x64x16/s8",  # smolvla_o x1.22 (re-swept)
    (50, 720, 2048, "nt"): "64x64x16/s8",  # smolvla_gate_up x1.08 (re-swept)
    (50, 2048, 720, "nt"): "64x64x16/s16",  # smolvla_down x1.06
    (16, 320, 320, "nt"): "64x64x16/s8",  # smolvla_cross_kv x1.21 (re-swept)
    (50, 720, 32, "nt"): "64x64x16/s8",  # smolvla_action_out x1.21 (re-swept)
    (1500, 384, 1152, "nt"): "128x128x16",  # whisper_qkv_fused x1.12
    (1500, 384, 1536, "nt"): "64x64x16",  # whisper_fc1 x1.17
    (1500, 1536, 384, "nt"): "64x64x16/s8",  # whisper_fc2 x1.29
    (1500, 384, 64, "nt"): "64x64x16/s8",  # whisper_train_head x1.25 (re-swept)
    (384, 1500, 1536, "tn"): "64x64x16/s8",  # whisper_dw_fc1 x1.46
    # the same projections written x @ W (W stored [K, N]), swept with --layout nn
    # (bench/results/sweeps/matmul_sweep_nn_h200.json): split-K pays even below SPLIT_MIN_WORK
    (128, 576, 576, "nn"): "64x64x16/s8",  # smollm2_q_o x1.05
    (128, 576, 192, "nn"): "64x64x16/s8",  # smollm2_k_v x1.62
    (50, 720, 960, "nn"): "64x64x32/s8",  # smolvla_q x1.09
    (50, 720, 320, "nn"): "64x64x16/s8",  # smolvla_k_v x2.06
    (50, 720, 2048, "nn"): "64x64x16/s8",  # smolvla_gate_up x1.13
    (50, 2048, 720, "nn"): "64x64x32/s8",  # smolvla_down x1.08
    (16, 320, 320, "nn"): "64x64x16/s8",  # smolvla_cross_kv x1.31
    (50, 720, 32, "nn"): "64x64x32/s8",  # smolvla_action_out x2.08
    (1500, 384, 64, "nn"): "64x64x16/s8/d2",  # whisper_train_head x1.27
}

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


def choose_plan(m: int, k: int, n: int, batch: int, layout: str, limits: Limits) -> Plan:
    """The plan for one product (see the module docstring for the order of sources)."""
    if _forced:
        return parse_plan(_forced[0])
    name = TUNED.get((m, k, n, layout)) if batch == 1 else None
    plan = parse_plan(name) if name else heuristic_plan(m, k, n, batch)
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
                return fallback
    return plan


def choose_tiling(m: int, n: int, k: int, batch: int = 1) -> Tiling:
    """The tiling ``heuristic_plan`` picks for the tiled kernel (SMALL for gemv shapes)."""
    plan = heuristic_plan(max(m, GEMV_MAX_M + 1), k, n, batch)
    return plan.tiling


def tiled_shared_bytes(t: Tiling, prefetch: bool = True) -> int:
    """Upper bound of the tiled kernel's workgroup memory: one buffer per operand (two with
    prefetch), one vec4 of padding per K row."""
    return (2 if prefetch else 1) * 16 * t.bk * (t.bm // 4 + t.bn // 4 + 2)


# ---- operands ---------------------------------------------------------------------------------
def _is_last_two_swap(dims: tuple[int, ...]) -> bool:
    n = len(dims)
    return n >= 2 and dims == tuple(range(n - 2)) + (n - 1, n - 2)


def fold_transpose(graph: Graph, vid: int) -> tuple[int, bool]:
    """(value to bind, whether its last two dims are swapped relative to the operand)."""
    src = vid
    while graph[src].op == "stop_gradient":
        src = graph[src].inputs[0]
    node = graph[src]
    if node.op == "permute" and _is_last_two_swap(tuple(node.attr("dims"))):
        return node.inputs[0], True
    return vid, False


def matmul_operands(graph: Graph, node_id: int) -> tuple[int, ...]:
    """The value ids a matmul kernel binds for reading (after transpose folding)."""
    node = graph[node_id]
    if node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return ()
    return tuple(dict.fromkeys(fold_transpose(graph, v)[0] for v in node.inputs))


class Epilogue(Protocol):
    """Elementwise work done in the store stage instead of a plain store of the product.

    ``bind`` binds what the epilogue reads and writes (before A and B, so an operand the
    epilogue also reads keeps a scalar binding); ``store(value, flat, col)`` returns the
    statements for one in-range output element, given WGSL expressions of the product, its
    flat row-major index in the output and its column. With split-K, ``bind`` and ``store``
    are called for the second (summing) dispatch.
    """

    helpers: str
    flops: int
    nbytes: int

    def bind(self, kb: KernelBuilder) -> None: ...

    def store(self, value: str, flat: str, col: str) -> str: ...


@dataclass(frozen=True)
class Operand:
    """How a kernel reads A or B.

    Attributes:
        src: the bound value (``src.name`` its binding, or a literal for constants).
        value: the bound value's id (after transpose folding).
        batch: strides over the output's batch dims.
        rows: stride along the operand's second-to-last logical dim (M for A, K for B).
        cols: stride along its last logical dim (K for A, N for B).
        vec: the binding is ``array<vec4<T>>`` (scalar reads go through ``scalar``).
    """

    src: Src
    value: int
    batch: tuple[int, ...]
    rows: int
    cols: int
    vec: bool = False

    def scalar(self, kb: KernelBuilder, index: str) -> str:
        """f32 expression of element ``index`` (works on vec4 bindings too)."""
        if not self.vec:
            return self.src.at(index)
        i = index if index.isidentifier() else f"({index})"
        return _widen(kb, self.src.name, f"{self.src.name}[{i} / 4u][{i} % 4u]", 1)

    def vec4(self, kb: KernelBuilder, index: str) -> str:
        """vec4<f32> expression of elements ``index .. index + 3`` (``index`` % 4 == 0)."""
        i = index if index.isidentifier() else f"({index})"
        return _widen(kb, self.src.name, f"{self.src.name}[{i} / 4u]", 4)


def _widen(kb: KernelBuilder, var: str, expr: str, lanes: int) -> str:
    """f32 (vec4<f32> for lanes 4) of a load from binding ``var``, widening f16 storage."""
    if "f16" in kb.element_type(var):
        return f"f32({expr})" if lanes == 1 else f"vec4<f32>({expr})"
    return expr


def vec_ok(op: Operand, contiguous_extent: int, other_stride: int) -> bool:
    """Whether 4-element runs along the operand's contiguous dim start at multiples of 4."""
    aligned = other_stride % 4 == 0 and all(s % 4 == 0 for s in op.batch)
    return contiguous_extent % 4 == 0 and aligned


@dataclass(frozen=True)
class Problem:
    """One matmul after batch folding: ``nb`` products [m, k] @ [k, n] over ``bshape``."""

    m: int
    n: int
    k: int
    nb: int
    bshape: tuple[int, ...]
    a: Operand
    b: Operand

    @property
    def layout(self) -> str:
        return ("t" if self.a.cols != 1 else "n") + ("t" if self.b.cols != 1 else "n")

    def k_range(self, groups: int, splits: int, chunk: int) -> list[str]:
        """Statements defining this workgroup's ``k_begin`` and ``k_end``: chunk ``wg /
        groups`` of ``chunk`` when K is split, else all of K (``groups``: the workgroups of one
        split)."""
        if splits == 1:
            return ["  let k_begin = 0u;", f"  let k_end = {u(self.k)};"]
        return [
            f"  let split = wg / {u(groups)};",
            f"  let k_begin = split * {u(chunk)};",
            f"  let k_end = min(k_begin + {u(chunk)}, {u(self.k)});",
        ]

    def offsets(self) -> list[str]:
        """Statements defining ``a_off``, ``b_off``, ``c_off`` from batch index ``bi``."""
        shape, (bs_a, bs_b) = coalesce(self.bshape, [self.a.batch, self.b.batch])
        return [
            f"  let a_off = {_index('bi', shape, bs_a)};",
            f"  let b_off = {_index('bi', shape, bs_b)};",
            f"  let c_off = bi * {u(self.m * self.n)};",
        ]


def _layout(graph: Graph, vid: int, out_batch: tuple[int, ...]):
    bound, swapped = fold_transpose(graph, vid)
    stored = graph[bound].type.shape
    st = contiguous_strides(stored)
    rows, cols = (st[-1], st[-2]) if swapped else (st[-2], st[-1])
    # broadcast_strides assumes a contiguous batch block; scale to the matrix size.
    mat = stored[-1] * stored[-2]
    batch = tuple(s * mat for s in broadcast_strides(stored[:-2], out_batch))
    return bound, batch, rows, cols


def _problem(graph: Graph, node_id: int) -> Problem:
    """Strides of both operands, with [..., M, K] @ [K, N] folded into one [nb * M, K] @ [K, N]
    when A is row-major and B shared (bigger tiles stay full; the output layout is the same).
    Operands are not bound yet (``src`` is a placeholder)."""
    node = graph[node_id]
    *out_batch, m, n = node.type.shape
    out_batch = tuple(out_batch)
    k = graph[node.inputs[0]].type.shape[-1]
    ops = []
    for vid in node.inputs:
        bound, batch, rows, cols = _layout(graph, vid, out_batch)
        ops.append(Operand(Src(graph[bound].type), bound, batch, rows, cols))
    a, b = ops
    nb = math.prod(out_batch)
    if nb > 1 and not any(b.batch) and a.cols == 1 and a.rows == k:
        full = tuple(s * m * k for s in contiguous_strides(out_batch))
        if tuple(s for s, d in zip(a.batch, out_batch, strict=True) if d > 1) == tuple(
            s for s, d in zip(full, out_batch, strict=True) if d > 1
        ):
            m, nb, out_batch = m * nb, 1, ()
            a, b = replace(a, batch=()), replace(b, batch=())
    return Problem(m, n, k, nb, out_batch, a, b)


def _bind(kb: KernelBuilder, p: Problem, vec_a: bool, vec_b: bool) -> Problem:
    """Bind A then B; ``vec_*`` asks for a vec4 binding, given only if the value is unbound
    (a value read as both A and B, or also by the epilogue, keeps its first binding)."""
    out = []
    for op, want, name in ((p.a, vec_a, "a"), (p.b, vec_b, "b")):
        if want and not kb.is_bound(op.value) and not is_constant(kb.graph, op.value):
            var = kb.read_vec4(op.value, name)
            out.append(replace(op, src=Src(op.src.type, name=var), vec=True))
            continue
        src = kb.read(op.value, name)
        vec = src.name is not None and kb.element_type(src.name).startswith("vec4")
        out.append(replace(op, src=src, vec=vec))
    return replace(p, a=out[0], b=out[1])


# ---- lowering ---------------------------------------------------------------------------------
Store = Callable[[str, str, str], str]


def lower_matmul(
    graph: Graph, node_id: int, limits: Limits, epilogue: Epilogue | None = None
) -> list[KernelSource]:
    """Batched, broadcast matmul: one dispatch, or two with split-K.

    Args:
        epilogue: computes and stores the values derived from the product (a fusion group
            anchored here); None stores the product itself. The caller excludes K = 0.

    Raises:
        ValueError: when a forced plan cannot run this shape (gemv for M > 8, a tile over
            the workgroup-memory limit) or a bound value is too large (``common``).
    """
    from .matmul_gemv import emit_gemv
    from .matmul_tiled import emit_tiled

    node = graph[node_id]
    if node.type.numel == 0:
        return []
    if graph[node.inputs[0]].type.shape[-1] == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    p = _problem(graph, node_id)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel == "gemv" and p.m > GEMV_MAX_M:
        raise ValueError(f"gemv plan for M = {p.m} > {GEMV_MAX_M} (%{node_id})")
    step = plan.tiling.bk if plan.kernel == "tiled" else 16
    splits, chunk = _splits(plan.splits, p, step, limits)
    emit = emit_gemv if plan.kernel == "gemv" else emit_tiled
    kb = KernelBuilder(graph, node, limits)
    total = p.nb * p.m * p.n
    if splits == 1:
        store = _output_store(kb, node_id, epilogue)
    else:
        part = kb.scratch("splitk", splits * total, DType.f32, "part")

        def store(value: str, flat: str, col: str) -> str:
            return kb.store(part, f"split * {u(total)} + {flat}", value)

    body, helpers, groups = emit(kb, p, plan, splits, chunk, store)
    nbytes = p.a.src.type.nbytes + p.b.src.type.nbytes
    flops = 2 * total * p.k
    if splits > 1:
        nbytes += 4 * splits * total
    elif epilogue is None:
        nbytes += node.type.nbytes
    else:
        helpers += epilogue.helpers
        nbytes, flops = nbytes + epilogue.nbytes, flops + epilogue.flops
    main = kb.finish("", body, WG, groups, helpers, flops=flops, nbytes=nbytes)
    if splits == 1:
        return [main]
    return [main, _sum_splits(graph, node_id, limits, splits, total, p.n, epilogue)]


def _output_store(kb: KernelBuilder, node_id: int, epilogue: Epilogue | None) -> Store:
    """``store(value, flat, col)`` writing the product's element ``flat`` (column ``col``):
    straight to the output, or through the fused epilogue (bound to ``kb`` here)."""
    if epilogue is not None:
        epilogue.bind(kb)
        return epilogue.store
    out = kb.write(node_id, "c")

    def store(value: str, flat: str, col: str) -> str:
        return kb.store(out, flat, value)

    return store


def _splits(want: int, p: Problem, step: int, limits: Limits) -> tuple[int, int]:
    """(splits, K per split: a multiple of ``step``), the partials within MAX_SCRATCH and
    the binding limit."""
    if want <= 1:
        return 1, p.k
    cap = min(MAX_SCRATCH, limits.max_storage_buffer_binding_size) // (4 * p.nb * p.m * p.n)
    splits = max(1, min(want, cap, -(-p.k // step)))
    chunk = -(-p.k // splits)
    chunk = -(-chunk // step) * step
    splits = -(-p.k // chunk)
    return (1, p.k) if splits == 1 else (splits, chunk)


def _sum_splits(
    graph: Graph, node_id: int, limits: Limits, splits: int, total: int, n: int,
    epilogue: Epilogue | None,
) -> KernelSource:  # fmt: skip
    """Second split-K dispatch: each element sums its ``splits`` partials in split order (a
    deterministic result), then is stored (or run through the epilogue)."""
    kb = KernelBuilder(graph, graph[node_id], limits)
    part = kb.scratch("splitk", splits * total, DType.f32, "part")
    store = _output_store(kb, node_id, epilogue)
    slots, groups, guard = element_slots(total)
    lines = [slots.rstrip()]
    per = PER_THREAD
    for e in range(per):
        lines.append(f"  var s{e} = 0.0;")
    lines.append(f"  for (var t = 0u; t < {u(splits)}; t = t + 1u) {{")
    lines += [f"    s{e} += {kb.load(part, f't * {u(total)} + j{e}')};" for e in range(per)]
    lines.append("  }")
    for e in range(per):
        col = f"i{e} % {u(n)}" if n > 1 else "0u"
        lines.append(f"  {{ let col = {col}; {guard(e, store(f's{e}', f'i{e}', 'col'))} }}")
    helpers, flops, nbytes = "", splits * total, 4 * splits * total
    if epilogue is None:
        nbytes += graph[node_id].type.nbytes
    else:
        helpers = epilogue.helpers
        flops, nbytes = flops + epilogue.flops, nbytes + epilogue.nbytes
    return kb.finish("sum_splits", "\n".join(lines), 256, groups, helpers, flops, nbytes)

"""A register-tiled GEMM whose operands are gathered by generated index math (implicit GEMM).

``C[grp][m, n] = sum_k A[grp][m, k] * B[grp][k, n]`` for every group ``grp``, with A and B
never materialized: each ``Operand`` says, as WGSL text, how the element at (line, k) of this
thread is addressed and when it reads zero (padding, stride gaps, ragged edges). The
convolution lowerings (``lowering.py``) describe im2col, its transpose and the weight-gradient
products this way. The kernel is ``matmul/tiled.py``'s design: 256 threads, each keeping a
``tm x tn`` block in named vec4 accumulators, operands staged per K step of ``bk`` in
workgroup memory as vec4 along M and N, the ``bk`` inner steps unrolled at generation. Three
tilings: 64x64 (16x16 threads, 4x4 outputs each), 128x128 (8x8 each) when there are enough
such tiles to fill a large GPU, and 16x256 (4x64 threads) when M <= 16 (depthwise and
few-channel convolutions), which would waste most of a 64-row tile.

Split-K: when the M x N tiles are too few to fill a GPU and K is long (weight gradients:
K = N * OH * OW), K is cut into ``splits`` chunks of whole K steps, each chunk writes its
partial C densely to scratch (``[split][grp][m][n]``), and a second dispatch sums the chunks
in a fixed order (deterministic), then stores through the output mapping and adds the bias.
An ``Epilogue`` (a fusion group anchored on a forward conv, ``epilogue.py``) takes each
element, bias added, in place of the store: in the GEMM's store stage, or in that sum.

Prefetch (``plan.PREFETCH``, GPU adapters): the next K step's operands are gathered into
registers before the current step multiplies and stored into the other half of
double-buffered workgroup tiles after it, one barrier per step; ``plan.DEEP`` keeps two steps
in flight. The staging and the K loop are ``stage.py``'s; the results are bit-identical
either way. The tiling, splits and prefetch of each GEMM are ``plan.py``'s (``plan_gemm``,
re-exported here with the plan types, as ``force_plan`` and ``record_plans``). ``gemm_lines`` and
``sum_lines`` emit one GEMM's body and one sum pass's; ``phases.py`` places several of them
(the stride phases of an input gradient) in one dispatch.

Every thread of a workgroup runs every barrier; loads past M, N or K are zero by ``select``,
and their index is selected to 0 as well, so no read leaves its binding (shader modules are
created without naga's bounds checks, ``runtime/pipelines.py``); stores past M or N are
skipped. All index math is u32 and may wrap below zero on purpose: ``u32(h - p) < H`` is
the test ``0 <= h - p < H`` for values far below 2^31.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from ....dtypes import DType
from ...kernel import KernelSource
from ..core.builder import KernelBuilder, Src
from ..core.literals import u
from . import plan as _plan
from .plan import (  # noqa: F401 - re-exported: the plan of a GEMM is asked for here too
    LARGE,
    MAX_SCRATCH,
    MAX_SPLITS,
    MIN_SPLIT_K,
    NARROW,
    SMALL,
    SOURCES,
    TARGET_GROUPS,
    TILINGS,
    Gemm,
    Plan,
    Tiling,
    choose_tiling,
    force_plan,
    parse_plan,
    plan_gemm,
    plan_source,
    plan_splits,
    record_choices,
    record_plans,
    shared_bytes,
)
from .stage import THREADS, Stage, k_loop


@dataclass(frozen=True)
class Operand:
    """How the GEMM reads one operand. Statement names carry the given ids, so one thread can
    stage several lines and K positions.

    Attributes:
        src: the bound value.
        along_k: whether consecutive threads should walk k (else the line index: M for A,
            N for B), chosen so each warp's load instruction reads neighbouring addresses.
        line: ``line(j, expr)`` -> statements fixing this thread's line ``j``, run once.
        kstep: ``kstep(s, k)`` -> statements for position ``k`` (names suffixed ``s``),
            shared by the lines staged at that k.
        element: ``element(j, s)`` -> (statements, flat index of line ``j`` at the k of
            ``kstep`` ``s``, conditions under which it is a real element; empty when always).
    """

    src: Src
    along_k: bool
    line: Callable[[int, str], list[str]]
    kstep: Callable[[str, str], list[str]]
    element: Callable[[int, str], tuple[list[str], str, list[str]]]


class Epilogue(Protocol):
    """Per-element code run where C is stored, in place of the store (a fusion group anchored
    on the conv: ``conv.epilogue``). ``bind`` is called once, on the kernel that stores C (the
    GEMM's, or with split-K the summing dispatch's), before ``store``."""

    helpers: str
    flops: int
    nbytes: int

    def bind(self, kb: KernelBuilder) -> None: ...

    def row(self, channel: str) -> str:
        """Statements run once per output row (one channel) before its ``store``s: what
        depends on the channel alone (``channel``: a WGSL u32 expression)."""
        ...

    def store(self, value: str, flat: str, channel: str) -> str:
        """Statements consuming C's element ``value`` (f32, bias added) at flat output index
        ``flat`` of output channel ``channel`` (WGSL u32 expressions), in the scope of the
        row's ``row`` statements."""
        ...


@dataclass(frozen=True)
class Output:
    """Where C[grp][m, n] goes: flat index ``col(n) + row(m)`` (``grp`` is in scope).

    Attributes:
        col: expression of a column's part of the flat index (may divide by constants).
        row: expression of a row's part.
        bias: optional per-row addend, ``(value id, index_of_row)``: the bias element for
            row ``m`` of group ``grp``.
        epilogue: optional code consuming each element instead of storing it.
        channel: the output channel of row ``m`` of group ``grp`` (the epilogue's).
    """

    col: Callable[[str], str]
    row: Callable[[str], str]
    bias: tuple[int, Callable[[str], str]] | None = None
    epilogue: Epilogue | None = None
    channel: Callable[[str], str] | None = None

    def sink(self, kb: KernelBuilder) -> str | None:
        """Bind where C goes in ``kb``: the node's output (returns its variable), or the
        epilogue's operands and outputs (returns None)."""
        if self.epilogue is None:
            return kb.write(kb.node.id, "out")
        self.epilogue.bind(kb)
        return None

    def put(self, kb: KernelBuilder, target: str | None, index: str, value: str) -> str:
        """Statement storing ``value`` at flat ``index`` into ``target`` (``sink``'s), or the
        epilogue's code for it (``oc_ch``, the row's channel, in scope)."""
        if self.epilogue is None:
            return kb.store(target, index, value)
        return self.epilogue.store(value, index, "oc_ch")

    def channel_line(self, row: str) -> str:
        """The statements defining ``oc_ch`` for ``put``, and the epilogue's per-row ones
        (empty without an epilogue)."""
        if self.epilogue is None:
            return ""
        return f"let oc_ch = {self.channel(row)}; {self.epilogue.row('oc_ch')}".rstrip()


def emit_gemm(
    kb: KernelBuilder,
    g: Gemm,
    a: Operand,
    b: Operand,
    out: Output,
    suffix: str = "",
    defer_sum: bool = False,
) -> list[KernelSource]:
    """The dispatch(es) computing C into the node's output. ``kb`` holds A's and B's
    bindings; this binds the output (or split-K scratch, keyed by ``suffix``) and the bias.
    Kernel names end in ``gemm{suffix}`` and ``sum_splits{suffix}``. ``defer_sum``: with
    split-K, the first dispatch alone (the readers sum the partials, ``matmul.deferred``).

    Raises:
        ValueError: when even one buffer of the tile exceeds the adapter's workgroup memory.
    """
    plan, source = plan_source(g, kb.limits, kb.node.op)
    for names in _plan._record:
        names.append((kb.node.op, plan.name))
    for rows in _plan._choices:
        rows.append({"node": kb.node.id, "op": kb.node.op, "m": g.m, "n": g.n, "k": g.k,
                     "groups": g.groups, "plan": plan.name, "source": source})  # fmt: skip
    t, splits = plan.tiling, plan.splits
    key = f"partials{suffix}"
    if splits > 1:
        target = kb.scratch(key, splits * g.m * g.n * g.groups, DType.f32, "partials")
        bias = None
    else:
        target = out.sink(kb)
        bias = None if out.bias is None else kb.read(out.bias[0], "bias")
    lines, slots = gemm_lines(g, a, b, out, plan, kb, target, bias)
    flops = 2 * g.m * g.n * g.k * g.groups
    helpers = workgroup_tiles(slots, plan.prefetch)
    if splits == 1 and out.epilogue is not None:
        helpers += out.epilogue.helpers
        flops += out.epilogue.flops
    check_shared(t, plan.prefetch, kb.limits)
    groups = gemm_groups(g, plan)
    body = "\n".join(s for s in lines if s)
    main = kb.finish(f"gemm{suffix}", body, THREADS, groups, helpers, flops=flops)
    if splits == 1 or defer_sum:
        return [main]
    return [main, _sum_splits(kb, g, out, splits, key, suffix)]


def gemm_groups(g: Gemm, plan: Plan) -> int:
    """Workgroups of the GEMM dispatch: M x N tiles x groups x splits."""
    t = plan.tiling
    return -(-g.m // t.bm) * -(-g.n // t.bn) * g.groups * plan.splits


def workgroup_tiles(slots: tuple[int, int], prefetch: bool) -> str:
    """Declarations of the workgroup tiles ``As`` and ``Bs`` of ``slots`` vec4 per buffer
    (two buffers with prefetch)."""
    buffers = 2 if prefetch else 1
    return (
        f"var<workgroup> As: array<vec4<f32>, {buffers * slots[0]}>;\n"
        f"var<workgroup> Bs: array<vec4<f32>, {buffers * slots[1]}>;\n"
    )


def check_shared(t: Tiling, prefetch: bool, limits) -> None:
    """Raises ValueError when the tiles exceed the adapter's workgroup memory."""
    shared = shared_bytes(t, prefetch)
    if shared > limits.max_workgroup_storage_size:
        raise ValueError(
            f"conv GEMM tile {t.bm}x{t.bn}x{t.bk} needs {shared} B of workgroup memory; the "
            f"limit is {limits.max_workgroup_storage_size}"
        )


def gemm_lines(
    g: Gemm,
    a: Operand,
    b: Operand,
    out: Output,
    plan: Plan,
    kb: KernelBuilder,
    target: str | None,
    bias: Src | None,
    offset: int = 0,
) -> tuple[list[str], tuple[int, int]]:
    """(body statements, vec4 slots of one buffer of ``As`` and ``Bs``) of the GEMM's
    workgroup ``wg`` (in scope, numbered from 0 for this GEMM): its tile, its K loop (none
    when K = 0: the tile stores zeros) and its stores into ``target`` (the output through
    ``out``, or its epilogue when None, or with split-K the partials, at element ``offset``
    of the scratch)."""
    t, splits, per = plan.tiling, plan.splits, plan.per
    tiles_m, tiles_n = -(-g.m // t.bm), -(-g.n // t.bn)
    lines = [
        f"  let tile_n = wg % {u(tiles_n)};",
        f"  let tile_m = (wg / {u(tiles_n)}) % {u(tiles_m)};",
        f"  let bi = wg / {u(tiles_n * tiles_m)};",
        f"  let grp = bi % {u(g.groups)};" if g.groups > 1 else "  let grp = 0u;",
        f"  let split = bi / {u(g.groups)};" if splits > 1 else "",
        f"  let tx = lid % {u(t.tx)};",
        f"  let ty = lid / {u(t.tx)};",
    ]
    stage_a = Stage(a, "a", "As", t.bm, t.bk, g.m, g.k, "tile_m")
    stage_b = Stage(b, "b", "Bs", t.bn, t.bk, g.n, g.k, "tile_n")
    if g.k:
        lines += stage_a.setup(plan.prefetch, plan.deep)
        lines += stage_b.setup(plan.prefetch, plan.deep)
    acc = [(gi, i, h) for gi in range(t.tm // 4) for i in range(4) for h in range(t.tn // 4)]
    lines += [f"  var acc{gi}{i}{h} = vec4<f32>(0.0);" for gi, i, h in acc]

    def multiply(cur_a: str, cur_b: str) -> list[str]:
        step = []
        for kk in range(t.bk):
            step.append("    {")
            step += [
                f"      let a{gi} = As[{cur_a}{u(kk * t.bm // 4 + gi * t.ty)} + ty];"
                for gi in range(t.tm // 4)
            ]
            step += [
                f"      let b{h} = Bs[{cur_b}{u(kk * t.bn // 4 + h * t.tx)} + tx];"
                for h in range(t.tn // 4)
            ]
            step += [f"      acc{gi}{i}{h} += a{gi}.{'xyzw'[i]} * b{h};" for gi, i, h in acc]
            step.append("    }")
        return step

    if splits > 1:
        lines.append(f"  let k_begin = split * {u(per)};")
        lines.append(f"  let k_end = min(k_begin + {u(per)}, {u(g.k)});")
        k_begin, k_end = "k_begin", "k_end"
    else:
        k_begin, k_end = "0u", u(g.k)
    if g.k:
        lines += k_loop(stage_a, stage_b, t.bk, k_begin, k_end, multiply, plan.prefetch, plan.deep)
    lines += _store(kb, out, t, g, acc, target, splits > 1, bias, offset)
    return lines, (stage_a.slots, stage_b.slots)


# Above this many splits, four threads share each element's partials (more loads in flight);
# below it one thread sums them all, 256 elements per workgroup.
LANES_FROM_SPLITS = 8


def _sum_splits(
    kb0: KernelBuilder, g: Gemm, out: Output, splits: int, key: str, suffix: str
) -> KernelSource:
    """Sum the split-K partials into the output (plus the bias): ``sum_lines``."""
    kb = KernelBuilder(kb0.graph, kb0.node, kb0.limits, kb0.deferred)
    total = g.m * g.n * g.groups
    part = kb.scratch(key, splits * total, DType.f32, "partials")
    dst = out.sink(kb)
    bias = None if out.bias is None else kb.read(out.bias[0], "bias")
    body, lanes = sum_lines(kb, g, out, splits, part, dst, bias)
    helpers = f"var<workgroup> red: array<f32, {THREADS}>;\n" if lanes > 1 else ""
    flops = splits * total
    if out.epilogue is not None:
        helpers += out.epilogue.helpers
        flops += out.epilogue.flops
    groups = sum_groups(g, splits)
    return kb.finish(f"sum_splits{suffix}", body, THREADS, groups, helpers, flops=flops)


def sum_groups(g: Gemm, splits: int) -> int:
    """Workgroups of ``sum_lines``' pass over the GEMM's elements."""
    lanes = 4 if splits > LANES_FROM_SPLITS else 1
    return -(-g.m * g.n * g.groups // (THREADS // lanes))


def sum_lines(
    kb: KernelBuilder,
    g: Gemm,
    out: Output,
    splits: int,
    part: str,
    dst: str | None,
    bias: Src | None,
    offset: int = 0,
) -> tuple[str, int]:
    """(body, lanes) of workgroup ``wg`` (numbered from 0 for this GEMM) of the pass summing
    the ``splits`` partials (at element ``offset`` of scratch ``part``) into ``dst`` through
    ``out`` (plus the bias; ``dst`` None: into ``out``'s epilogue). With ``lanes`` threads
    per element (4 above ``LANES_FROM_SPLITS``, using the workgroup array ``red`` of
    ``THREADS`` f32), lane l sums chunks l, l + lanes, ... into two alternating accumulators;
    lanes combine in lane order, so the result is deterministic
    (``matmul.deferred.SplitPartials`` repeats this order for readers summing partials
    themselves)."""
    total = g.m * g.n * g.groups
    lanes = 4 if splits > LANES_FROM_SPLITS else 1
    per = THREADS // lanes
    base = f" + {u(offset)}" if offset else ""
    body = (
        f"  let e = wg * {u(per)} + lid % {u(per)};\n"
        f"  let lane = lid / {u(per)};\n"
        f"  let ec = min(e, {u(total - 1)}){base};\n"
        "  var s0 = 0.0;\n  var s1 = 0.0;\n"
        f"  for (var t = lane; t < {u(splits)}; t = t + {u(2 * lanes)}) {{\n"
        f"    s0 += {part}[t * {u(total)} + ec];\n"
        f"    let t1 = t + {u(lanes)};\n"
        f"    if (t1 < {u(splits)}) {{ s1 += {part}[t1 * {u(total)} + ec]; }}\n"
        "  }\n"
    )
    if lanes > 1:
        body += "  red[lid] = s0 + s1;\n  workgroupBarrier();\n"
        terms = " + ".join(f"red[lid + {u(i * per)}]" for i in range(1, lanes))
        value = f"(red[lid] + {terms})"
    else:
        value = "(s0 + s1)"
    if bias is not None:
        value += f" + {bias.at(out.bias[1]('row'))}"
    index = f"{out.col('col')} + {out.row('row')}"
    body += (
        f"  if (lane == 0u && e < {u(total)}) {{\n"
        f"    let grp = e / {u(g.m * g.n)};\n"
        f"    let row = (e / {u(g.n)}) % {u(g.m)};\n"
        f"    let col = e % {u(g.n)};\n"
        f"    {' '.join(filter(None, [out.channel_line('row'), out.put(kb, dst, index, value)]))}"
        "\n  }\n"
    )
    return body, lanes


def _store(
    kb: KernelBuilder,
    out: Output,
    t: Tiling,
    g: Gemm,
    acc,
    target: str | None,
    partial: bool,
    bias: Src | None,
    offset: int = 0,
):
    """Stores of this thread's block: through ``out``'s mapping, or densely into the split's
    slice of the partials (which start at element ``offset`` of the scratch)."""
    lines = []
    for h in range(t.tn // 4):
        for c in range(4):
            col = f"tile_n * {u(t.bn)} + {u(h * 4 * t.tx + c)} + tx * 4u"
            lines.append(f"  let col{h}{c} = {col};")
            lines.append(f"  let cb{h}{c} = {f'col{h}{c}' if partial else out.col(f'col{h}{c}')};")
    for gi in range(t.tm // 4):
        for i in range(4):
            lines.append("  {")
            lines.append(f"    let row = tile_m * {u(t.bm)} + {u(gi * 4 * t.ty + i)} + ty * 4u;")
            if partial:
                slab = f"(split * {u(g.groups)} + grp) * {u(g.m)} + row"
                base = f" + {u(offset)}" if offset else ""
                lines.append(f"    let rb = ({slab}) * {u(g.n)}{base};")
            else:
                lines.append(f"    let rb = {out.row('row')};")
            extra, bias_line = "", []
            if bias is not None:  # read under the row guard below (rows past M read nothing)
                bias_line = [f"let bias = {bias.at(out.bias[1]('row'))};"]
                extra = " + bias"
            stores = []
            for h in range(t.tn // 4):
                for c in range(4):
                    value = f"acc{gi}{i}{h}.{'xyzw'[c]}{extra}"
                    if partial:
                        st = kb.store(target, f"cb{h}{c} + rb", value)
                    else:
                        st = out.put(kb, target, f"cb{h}{c} + rb", value)
                    stores.append(f"if (col{h}{c} < {u(g.n)}) {{ {st} }}" if g.n % t.bn else st)
            # the epilogue's per-row loads stay under the row guard (rows past M read nothing)
            head = bias_line + (
                [] if partial or out.epilogue is None else [out.channel_line("row")]
            )
            body = " ".join(head + stores)
            lines.append(f"    if (row < {u(g.m)}) {{ {body} }}" if g.m % t.bm else f"    {body}")
            lines.append("  }")
    return lines

"""The row-reduction archetype: a team of ``T`` threads per row, team reductions through
subgroup shuffles (a workgroup-memory tree without them), and the row either held in registers
or streamed through them in chunks.

Used by softmax / log_softmax along the last dim (below) and by every normalization
(``norm.team``); other layouts keep the general ``rows`` kernels.

Rows. ``rows`` rows of ``n`` elements, read as ``n / 4`` vec4 units when the layout allows
(``width`` 4), else as ``n`` scalar units. A row is contiguous, or (``seg`` > 0) made of
segments of ``seg`` consecutive units ``stride`` units apart, row r starting at unit ``r *
seg``: batch_norm's channel ``c`` of ``x [N, C, H*W]`` is N segments of H*W. Unit ``j`` of
row ``r`` lives at ``r * step + (j / seg) * stride + j % seg``.

Register mode. ``T`` (a power of two, at most the adapter's invocations per workgroup) is
chosen so each thread holds about ``TARGET_UNITS`` units: rows of 64-576 elements get 4-64
threads (one subgroup on NVIDIA), rows of 1500-49152 get 128-1024. Thread ``y`` of the team
holds units ``y, y + T, ...`` (each load instruction of a warp reads consecutive 16-byte
words) in named registers: every element is read from global memory once and written once. A
workgroup runs ``wg / T`` rows side by side.

Chunked mode (rows that would need more than ``MAX_UNITS`` units per thread, so, by default,
rows of more than 65536 elements read as vec4, 16384 read as scalars, given 1024-thread
teams; only for callers that pass
``chunked=True``, whose statistics merge per chunk): the same team walks the row in chunks of
``T * min(TARGET_UNITS, MAX_UNITS)`` units, thread ``y`` taking units ``c + y + i * T`` of
chunk ``c``: a loop over the full chunks (no bounds checks), then one partial chunk. Each
chunk's units are named registers, never an array indexed by the loop variable; a pass that
needs the row again reads it again (from cache, usually).

Team reductions. With subgroups, a butterfly of ``subgroupShuffleXor`` over ``min(T,
subgroup_size)`` lanes, then (only when the subgroup is smaller than the team) one value per
subgroup through workgroup memory. This is correct for any subgroup size given that subgroups
are consecutive ranges of ``local_invocation_index`` (``subgroup_invocation_id == lid %
subgroup_size``), as Vulkan drivers form them for one-dimensional workgroups. Without subgroups,
a pairwise tree in workgroup memory. Both leave the total in every thread of the team. Barriers
are outside any branch and loop, so they stay in uniform control flow.

Softmax is max-subtracted (``exp((x - max) - lse)``), f32 accumulation; each thread sums at
most ``4 * MAX_UNITS`` elements before the pairwise combine. Units past the row end are loaded
clamped (a real element of the row, so maxima need no mask) and dropped from sums by
``select``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ...kernel import Limits
from ..core.builder import KernelBuilder, Src
from ..core.layout import next_pow2
from ..core.literals import f32_literal, u

TARGET_UNITS = 4  # units (vec4s) per thread the team size aims at; also the chunk depth
MAX_UNITS = 16  # more than this per thread: chunked mode where allowed, else the rows kernels
MAX_TEAM = 1024
ROWS_WG = 256  # threads per workgroup when teams are small (several rows per workgroup)
# Benchmarks set these to measure the alternatives on a device with subgroups / long rows.
USE_SUBGROUPS = True
CHUNKED = True
SUBGROUP_ARGS = ", @builtin(subgroup_size) sgs: u32, @builtin(subgroup_invocation_id) sid: u32"


@dataclass(frozen=True)
class TeamPlan:
    """``rows`` rows of ``n`` elements; ``team`` threads per row; ``wg`` threads per workgroup;
    each thread holds ``k`` units of ``width`` (4 or 1) elements at once (in chunked mode, per
    chunk); ``seg``/``stride`` (in units) describe segmented rows (0: contiguous)."""

    rows: int
    n: int
    width: int
    team: int
    wg: int
    k: int
    subgroups: bool
    chunked: bool = False
    seg: int = 0
    stride: int = 0

    @property
    def units(self) -> int:
        return self.n // self.width

    @property
    def per_wg(self) -> int:
        return self.wg // self.team

    @property
    def groups(self) -> int:
        return -(-self.rows // self.per_wg)

    @property
    def vty(self) -> str:
        return "vec4<f32>" if self.width == 4 else "f32"

    @property
    def segmented(self) -> bool:
        return 0 < self.seg < self.units


def plan_team(
    rows: int,
    n: int,
    limits: Limits,
    *,
    align: int | None = None,
    seg: int = 0,
    stride: int = 0,
    chunked: bool = False,
) -> TeamPlan | None:
    """The team layout for ``rows`` rows of ``n`` elements, or None when a row is empty or too
    long to hold in registers and ``chunked`` is not allowed.

    Args:
        align: units must not straddle a multiple of this many elements (a weight or segment
            boundary); vec4 units need it divisible by 4. Default ``n``.
        seg, stride: segmented rows, in elements (0: contiguous rows).
        chunked: whether the caller handles chunked mode.
    """
    if rows == 0 or n == 0:
        return None
    align = n if align is None else align
    width = 4 if align % 4 == 0 and seg % 4 == 0 and stride % 4 == 0 else 1
    units = n // width
    sg = limits.subgroups and USE_SUBGROUPS
    cap = min(MAX_TEAM, limits.max_invocations_per_workgroup)
    team = min(cap, next_pow2(-(-units // TARGET_UNITS)))
    k = -(-units // team)
    chunk = k > MAX_UNITS
    if chunk:
        if not (chunked and CHUNKED):
            return None
        k = max(1, min(TARGET_UNITS, MAX_UNITS))
    wg = max(team, min(ROWS_WG, team * next_pow2(rows)))
    return TeamPlan(rows, n, width, team, wg, k, sg, chunk, seg // width, stride // width)


@dataclass(frozen=True)
class Chunk:
    """``m`` units of this thread: unit i is ``base + y + i * T``. ``base`` is a constant, or
    the loop variable ``cb`` of full chunks (whose units all lie in the row)."""

    plan: TeamPlan
    base: int | str
    m: int

    @property
    def full(self) -> bool:
        return isinstance(self.base, str) or self.base + self.m * self.plan.team <= self.plan.units

    def raw(self, i: int) -> str:
        """Unit index of unit i (may lie past the row end in a partial chunk)."""
        off = i * self.plan.team
        if isinstance(self.base, str):
            return f"{self.base} + y + {u(off)}" if off else f"{self.base} + y"
        off += self.base
        return f"y + {u(off)}" if off else "y"

    def unit(self, i: int) -> str:
        """Unit index of unit i, clamped into the row (safe to read)."""
        if self.ok(i) == "true":
            return self.raw(i)
        return f"min({self.raw(i)}, {u(self.plan.units - 1)})"

    def ok(self, i: int) -> str:
        """WGSL bool: whether unit i lies inside the row."""
        if self.full:
            return "true"
        first = self.base + i * self.plan.team
        if first + self.plan.team <= self.plan.units:
            return "true"
        return f"(y < {u(self.plan.units - first)})"

    def count(self) -> str:
        """f32 expression: the number of elements this thread holds in the chunk."""
        w = self.plan.width
        if self.full:
            return f32_literal(self.m * w)
        lit = f32_literal(w)
        oks = [self.ok(i) for i in range(self.m)]
        parts = [lit if ok == "true" else f"select(0.0, {lit}, {ok})" for ok in oks]
        return "(" + " + ".join(parts) + ")"

    def sum(self, term: Callable[[int], str]) -> str:
        """f32 expression: the sum over the in-row units of ``hsum(term(i))``."""
        parts = []
        for i in range(self.m):
            t = f"hsum({term(i)})"
            ok = self.ok(i)
            parts.append(t if ok == "true" else f"select(0.0, {t}, {ok})")
        return " + ".join(parts)


class RowKernel:
    """Statements of one team kernel, built up in order.

    Defines ``y`` (the thread's place in its team), ``row`` (may be past the end), ``live``,
    ``rowc`` (clamped, safe to read) and ``rbase`` (the row's first unit).
    """

    def __init__(self, kb: KernelBuilder, plan: TeamPlan) -> None:
        self.kb, self.plan = kb, plan
        p = plan
        step = p.seg if p.segmented else p.units
        self.src = (
            f"  let y = lid % {u(p.team)};\n"
            f"  let row = wg * {u(p.per_wg)} + lid / {u(p.team)};\n"
            f"  let live = row < {u(p.rows)};\n"
            f"  let rowc = min(row, {u(p.rows - 1)});\n"
            f"  let rbase = rowc * {u(step)};\n"
        )
        self.shared: dict[str, str] = {}
        self.extra_helpers = ""  # WGSL functions the caller's expressions use
        self._pad = "  "

    def line(self, stmt: str) -> None:
        self.src += f"{self._pad}{stmt}\n"

    def at(self, j: str) -> str:
        """Unit offset in memory of unit ``j`` of row ``rowc``."""
        p = self.plan
        if not p.segmented:
            return f"rbase + {j}"
        return f"rbase + ({j}) / {u(p.seg)} * {u(p.stride)} + ({j}) % {u(p.seg)}"

    def bind(self, src: Src) -> str:
        """Make a row-shaped binding unit-addressable (vec4 when ``width`` is 4)."""
        if self.plan.width == 4:
            self.kb.vectorize(src.name)
        return src.name

    # ---- walking the row ------------------------------------------------------------------
    def registers(self) -> Chunk:
        """The whole row as one chunk, in register mode: statements emitted for it stay in
        scope for the rest of the kernel."""
        assert not self.plan.chunked
        return Chunk(self.plan, 0, self.plan.k)

    def each_chunk(self, body: Callable[[Chunk], None]) -> None:
        """Emit ``body`` for every chunk of the row: in register mode once, inline; in chunked
        mode inside a loop over the full chunks, then (when the row has a partial chunk) once
        more in a block of its own."""
        p = self.plan
        if not p.chunked:
            body(self.registers())
            return
        span = p.team * p.k
        full, tail = divmod(p.units, span)
        pad = self._pad
        if full:
            self.line(f"for (var cb = 0u; cb < {u(full * span)}; cb = cb + {u(span)}) {{")
            self._pad = pad + "  "
            body(Chunk(p, "cb", p.k))
            self._pad = pad
            self.line("}")
        if tail:
            self.line("{")
            self._pad = pad + "  "
            body(Chunk(p, full * span, -(-tail // p.team)))
            self._pad = pad
            self.line("}")

    def load(self, ch: Chunk, var: str, prefix: str) -> None:
        """Registers ``{prefix}{i}`` with this thread's units of ``ch`` of row ``rowc``."""
        for i in range(ch.m):
            self.line(f"let {prefix}{i} = {self.kb.load(var, self.at(ch.unit(i)))};")

    def store(self, ch: Chunk, var: str, value: Callable[[int], str]) -> None:
        """Write ``value(i)`` to this thread's in-row units of ``ch`` of row ``row`` of ``var``
        (live rows only)."""
        if self.plan.width == 4:
            self.kb.vectorize(var)
        lines = []
        for i in range(ch.m):
            st = self.kb.store(var, self.at(ch.raw(i)), value(i))
            ok = ch.ok(i)
            lines.append(st if ok == "true" else f"if ({ok}) {{ {st} }}")
        self.line("if (live) {")
        for s in lines:
            self.line(f"  {s}")
        self.line("}")

    # ---- team reductions ------------------------------------------------------------------
    def reduce(self, value: str, op: str, result: str, ty: str = "f32") -> None:
        """``let result`` = ``op`` (``"+"`` or ``"max"``) of ``value`` over the team, in every
        thread of the team (``ty``: f32 or an f32 vector, summed lane by lane)."""
        p = self.plan

        def comb(a: str, b: str) -> str:
            return f"({a} + {b})" if op == "+" else f"max({a}, {b})"

        v = f"{result}_v"
        self.line(f"var {v} = {value};")
        if p.team == 1:
            self.line(f"let {result} = {v};")
            return
        sh = self.shared.setdefault(ty, f"red_{len(self.shared)}")
        if p.subgroups:
            # Butterfly within the subgroup: afterwards every lane holds the total of its
            # aligned block of min(T, sgs) lanes (the team, or this subgroup's part of it).
            span = u(p.team)
            self.line(f"for (var m = 1u; m < min({span}, sgs); m = m << 1u) {{")
            self.line(f"  {v} = {comb(v, f'subgroupShuffleXor({v}, m)')};")
            self.line("}")
            self.line(f"if (sgs < {span} && sid == 0u) {{ {sh}[lid / sgs] = {v}; }}")
            self.line("workgroupBarrier();")
            self.line(f"if (sgs < {span}) {{")
            self.line("  let first = (lid - y) / sgs;")
            self.line(f"  {v} = {sh}[first];")
            self.line(f"  for (var s = 1u; s < {span} / sgs; s = s + 1u) {{")
            self.line(f"    {v} = {comb(v, f'{sh}[first + s]')};")
            self.line("  }")
            self.line("}")
            self.line("workgroupBarrier();")
        else:
            self.line(f"{sh}[lid] = {v};")
            self.line("workgroupBarrier();")
            s = p.team // 2
            while s >= 1:
                other = f"{sh}[lid + {u(s)}]"
                self.line(f"if (y < {u(s)}) {{ {sh}[lid] = {comb(f'{sh}[lid]', other)}; }}")
                self.line("workgroupBarrier();")
                s //= 2
            self.line(f"{v} = {sh}[lid - y];")
            self.line("workgroupBarrier();")
        self.line(f"let {result} = {v};")

    def reduce_sums(self, values: list[str], results: list[str]) -> None:
        """``let results[i]`` = the team sum of ``values[i]``: one reduction of a vector."""
        if len(values) == 1:
            self.reduce(values[0], "+", results[0])
            return
        vty = f"vec{len(values)}<f32>"
        tag = "_".join(results)
        self.reduce(f"{vty}({', '.join(values)})", "+", f"{tag}_s", vty)
        for r, lane in zip(results, "xyzw", strict=False):
            self.line(f"let {r} = {tag}_s.{lane};")

    # ---- assembly -------------------------------------------------------------------------
    def helpers(self) -> str:
        p = self.plan
        if p.width == 4:
            h = (
                "fn hsum(v: vec4<f32>) -> f32 { return (v.x + v.y) + (v.z + v.w); }\n"
                "fn hmax(v: vec4<f32>) -> f32 { return max(max(v.x, v.y), max(v.z, v.w)); }\n"
                "fn sqv(v: vec4<f32>) -> vec4<f32> { return v * v; }\n"
            )
        else:
            h = (
                "fn hsum(v: f32) -> f32 { return v; }\nfn hmax(v: f32) -> f32 { return v; }\n"
                "fn sqv(v: f32) -> f32 { return v * v; }\n"
            )
        for ty, name in self.shared.items():
            h += f"var<workgroup> {name}: array<{ty}, {p.wg}>;\n"
        return h + self.extra_helpers

    def finish(self, suffix: str, flops: int = 0, nbytes: int = 0):
        p = self.plan
        extra = SUBGROUP_ARGS if p.subgroups and p.team > 1 else ""
        return self.kb.finish(
            suffix, self.src, p.wg, p.groups, self.helpers(), flops, nbytes, extra_args=extra
        )


def sources_bound(*srcs: Src) -> bool:
    return all(s.literal is None for s in srcs)


# ---- softmax ------------------------------------------------------------------------------------
def lower_softmax_rows(graph, node_id: int, limits: Limits):
    """softmax / log_softmax as one team kernel, for a ``dim`` followed only by size-1 dims
    (so each row is contiguous: ``shape[dim]`` elements), or None when the rows do not fit in
    registers (``plan_team``) or the input is a constant.

    Row statistics: ``mx`` (max), ``lse = log(sum exp(x - mx))``; softmax stores
    ``exp((x - mx) - lse)``, log_softmax ``(x - mx) - lse`` (the NumPy reference's formulas).
    """
    node = graph[node_id]
    n = node.type.shape[node.attr("dim")]  # not shape[-1]: trailing dims may be ones
    plan = plan_team(node.type.numel // max(n, 1), n, limits)
    if plan is None:
        return None
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    if not sources_bound(x):
        return None
    rk = RowKernel(kb, plan)
    out = kb.write(node_id, "out")
    ch = rk.registers()
    rk.load(ch, rk.bind(x), "a")
    m_t = "hmax(a0)"
    for i in range(1, plan.k):
        m_t = f"max({m_t}, hmax(a{i}))"
    rk.line(f"let m_t = {m_t};")
    rk.reduce("m_t", "max", "mx")
    rk.line(f"var s_t = {ch.sum(lambda i: f'exp(a{i} - mx)')};")
    rk.reduce("s_t", "+", "total")
    rk.line("let lse = log(total);")
    if node.op == "log_softmax":
        rk.store(ch, out, lambda i: f"(a{i} - mx) - lse")
    else:
        rk.store(ch, out, lambda i: f"exp((a{i} - mx) - lse)")
    return [rk.finish("", 5 * node.type.numel, 2 * node.type.nbytes)]

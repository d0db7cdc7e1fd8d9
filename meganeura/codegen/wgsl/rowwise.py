"""The row-reduction archetype for contiguous rows (reductions along the last dim): a team of
``T`` threads per row, the row held in registers, team reductions through subgroup shuffles.

Used by softmax / log_softmax along the last dim and by layer_norm / rms_norm forward and
backward (``nn.py``, ``norm.py``); other layouts keep the general ``rows`` kernels.

Layout. A row of ``n`` elements is ``n / 4`` vec4 units when 4 divides ``n`` (else ``n``
scalar units). ``T`` (a power of two, at most the adapter's invocations per workgroup) is chosen
so each thread holds about ``TARGET_UNITS`` units: rows of 64-576 elements get 4-64 threads (one
subgroup on NVIDIA), rows of 1500-49152 get 128-1024. Thread ``y`` of the team holds units
``y, y + T, ...`` (so each load instruction of a warp reads consecutive 16-byte words) in named
registers: every element is read from global memory once, and the output written once. A
workgroup runs ``wg / T`` rows side by side. Rows that would need more than ``MAX_UNITS`` units
per thread are left to the ``rows`` kernels (``plan_team`` returns None).

Team reductions. With subgroups, a butterfly of ``subgroupShuffleXor`` over ``min(T,
subgroup_size)`` lanes, then (only when the subgroup is smaller than the team) one value per
subgroup through workgroup memory. This is correct for any subgroup size given that subgroups
are consecutive ranges of ``local_invocation_index`` (``subgroup_invocation_id == lid %
subgroup_size``), as Vulkan drivers form them for one-dimensional workgroups. Without subgroups,
a pairwise tree in workgroup memory. Both leave the total in every thread of the team. Barriers
are outside any branch, so they stay in uniform control flow.

Numerics are those of the general kernels: max-subtracted softmax (``exp((x - max) - lse)``),
norm statistics two-pass over ``x - first element`` (the shifted-data algorithm), f32
accumulation; each thread sums at most ``4 * MAX_UNITS`` elements before the pairwise combine.
Units past the row end are loaded clamped (a real element of the row, so maxima need no mask)
and dropped from sums by ``select``.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from ..kernel import Limits
from .common import KernelBuilder, Src, f32_literal, next_pow2, u

TARGET_UNITS = 4  # units (vec4s) per thread the team size aims at
MAX_UNITS = 16  # more than this per thread and the row is left to the ``rows`` kernels
MAX_TEAM = 1024
ROWS_WG = 256  # threads per workgroup when teams are small (several rows per workgroup)
# Benchmarks set this False to measure the workgroup-memory tree on a device with subgroups.
USE_SUBGROUPS = True
SUBGROUP_ARGS = ", @builtin(subgroup_size) sgs: u32, @builtin(subgroup_invocation_id) sid: u32"


@dataclass(frozen=True)
class TeamPlan:
    """``rows`` rows of ``n`` elements; ``team`` threads per row; ``wg`` threads per workgroup;
    each thread holds ``k`` units of ``width`` (4 or 1) elements."""

    rows: int
    n: int
    width: int
    team: int
    wg: int
    k: int
    subgroups: bool

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


def plan_team(rows: int, n: int, limits: Limits) -> TeamPlan | None:
    """The team layout for ``rows`` contiguous rows of ``n`` elements, or None when a row is
    too long to hold in registers (or empty)."""
    if rows == 0 or n == 0:
        return None
    width = 4 if n % 4 == 0 else 1
    units = n // width
    cap = min(MAX_TEAM, limits.max_invocations_per_workgroup)
    team = min(cap, next_pow2(-(-units // TARGET_UNITS)))
    k = -(-units // team)
    if k > MAX_UNITS:
        return None
    wg = max(team, min(ROWS_WG, team * next_pow2(rows)))
    return TeamPlan(rows, n, width, team, wg, k, limits.subgroups and USE_SUBGROUPS)


class RowKernel:
    """Statements of one team kernel, built up in order.

    Defines ``y`` (the thread's place in its team), ``row`` (may be past the end), ``live``,
    ``rowc`` (clamped, safe to read) and ``rbase`` (the row's first unit).
    """

    def __init__(self, kb: KernelBuilder, plan: TeamPlan) -> None:
        self.kb, self.plan = kb, plan
        p = plan
        self.src = (
            f"  let y = lid % {u(p.team)};\n"
            f"  let row = wg * {u(p.per_wg)} + lid / {u(p.team)};\n"
            f"  let live = row < {u(p.rows)};\n"
            f"  let rowc = min(row, {u(p.rows - 1)});\n"
            f"  let rbase = rowc * {u(p.units)};\n"
        )
        self.shared: dict[str, str] = {}

    @property
    def exact(self) -> bool:
        """Whether every unit slot of every thread lies inside the row."""
        return self.plan.units == self.plan.k * self.plan.team

    def line(self, stmt: str) -> None:
        self.src += f"  {stmt}\n"

    def unit(self, i: int) -> str:
        """Unit index (within the row) of this thread's i-th unit, clamped into the row."""
        j = f"y + {u(i * self.plan.team)}" if i else "y"
        return j if self.exact else f"min({j}, {u(self.plan.units - 1)})"

    def ok(self, i: int) -> str:
        """WGSL bool: whether unit i of this thread is inside the row."""
        if self.exact or (i + 1) * self.plan.team <= self.plan.units:
            return "true"
        return f"(y + {u(i * self.plan.team)} < {u(self.plan.units)})"

    def bind(self, src: Src) -> str:
        """Make a row-shaped binding unit-addressable (vec4 when ``width`` is 4)."""
        if self.plan.width == 4:
            self.kb.vectorize(src.name)
        return src.name

    def load_row(self, var: str, prefix: str) -> None:
        """Registers ``{prefix}{i}`` with this thread's units of row ``rowc`` of ``var``."""
        for i in range(self.plan.k):
            self.line(f"let {prefix}{i} = {self.kb.load(var, f'rbase + {self.unit(i)}')};")

    def load_vec(self, var: str, prefix: str) -> None:
        """Registers ``{prefix}{i}`` with this thread's units of a row-length vector."""
        for i in range(self.plan.k):
            self.line(f"let {prefix}{i} = {self.kb.load(var, self.unit(i))};")

    def thread_sum(self, name: str, term: Callable[[int], str]) -> None:
        """``var name`` = the sum over this thread's in-row units of ``hsum(term(i))``."""
        parts = []
        for i in range(self.plan.k):
            ok = self.ok(i)
            t = f"hsum({term(i)})"
            parts.append(t if ok == "true" else f"select(0.0, {t}, {ok})")
        self.line(f"var {name} = {' + '.join(parts)};")

    def reduce(self, value: str, op: str, result: str, ty: str = "f32") -> None:
        """``let result`` = ``op`` (``"+"`` or ``"max"``) of ``value`` over the team, in every
        thread of the team."""
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

    def store_row(self, var: str, value: Callable[[int], str]) -> None:
        """Write ``value(i)`` to this thread's units of row ``row`` of ``var`` (live rows,
        in-row units only)."""
        if self.plan.width == 4:
            self.kb.vectorize(var)
        lines = []
        for i in range(self.plan.k):
            st = self.kb.store(var, f"rbase + y + {u(i * self.plan.team)}", value(i))
            ok = self.ok(i)
            lines.append(st if ok == "true" else f"if ({ok}) {{ {st} }}")
        self.src += "  if (live) {\n" + "".join(f"    {s}\n" for s in lines) + "  }\n"

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
        return h

    def finish(self, suffix: str, flops: int, nbytes: int):
        p = self.plan
        extra = SUBGROUP_ARGS if p.subgroups and p.team > 1 else ""
        return self.kb.finish(
            suffix, self.src, p.wg, p.groups, self.helpers(), flops, nbytes, extra_args=extra
        )


# ---- the ops ------------------------------------------------------------------------------------
def _sources_bound(*srcs: Src) -> bool:
    return all(s.literal is None for s in srcs)


def lower_softmax_rows(graph, node_id: int, limits: Limits):
    """softmax / log_softmax along the last dim as one team kernel, or None when the rows do
    not fit (``plan_team``) or the input is a constant.

    Row statistics: ``mx`` (max), ``lse = log(sum exp(x - mx))``; softmax stores
    ``exp((x - mx) - lse)``, log_softmax ``(x - mx) - lse`` (the NumPy reference's formulas).
    """
    node = graph[node_id]
    n = node.type.shape[-1]
    plan = plan_team(node.type.numel // max(n, 1), n, limits)
    if plan is None:
        return None
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    if not _sources_bound(x):
        return None
    rk = RowKernel(kb, plan)
    out = kb.write(node_id, "out")
    rk.load_row(rk.bind(x), "a")
    m_t = "hmax(a0)"
    for i in range(1, plan.k):
        m_t = f"max({m_t}, hmax(a{i}))"
    rk.line(f"let m_t = {m_t};")
    rk.reduce("m_t", "max", "mx")
    rk.thread_sum("s_t", lambda i: f"exp(a{i} - mx)")
    rk.reduce("s_t", "+", "total")
    rk.line("let lse = log(total);")
    if node.op == "log_softmax":
        rk.store_row(out, lambda i: f"(a{i} - mx) - lse")
    else:
        rk.store_row(out, lambda i: f"exp((a{i} - mx) - lse)")
    return [rk.finish("", 5 * node.type.numel, 2 * node.type.nbytes)]


def _norm_stats(rk: RowKernel, x: str, rms: bool, eps: float) -> None:
    """``shift``, ``mean``, ``ssd`` and ``rstd`` of row ``rowc`` from registers ``a*`` (as
    ``norm._stats``: rms_norm has shift = mean = 0; ``(a - shift) - mean`` is centred)."""
    n = rk.plan.n
    if rms:
        rk.line("let shift = 0.0;")
        rk.line("let mean = 0.0;")
    else:
        # The row's first element (held by thread 0 of the team): every thread reads it again,
        # from cache, rather than waiting on a broadcast.
        lane = ".x" if rk.plan.width == 4 else ""
        rk.line(f"let shift = {rk.kb.load(x, 'rbase')}{lane};")
        rk.thread_sum("s_t", lambda i: f"(a{i} - shift)")
        rk.reduce("s_t", "+", "s_tot")
        rk.line(f"let mean = s_tot / {f32_literal(n)};")
    rk.thread_sum("q_t", lambda i: f"sqv((a{i} - shift) - mean)")
    rk.reduce("q_t", "+", "ssd")
    rk.line(f"let rstd = inverseSqrt(ssd / {f32_literal(n)} + {f32_literal(eps)});")


def _vector(rk: RowKernel, src: Src, prefix: str) -> Callable[[int], str]:
    """Unit i of a row-length operand (weight, bias): registers, or its literal."""
    if src.literal is not None:
        return lambda i: src.literal
    rk.load_vec(rk.bind(src), prefix)
    return lambda i: f"{prefix}{i}"


def lower_norm_rows(graph, node_id: int, limits: Limits, rows: int, n: int):
    """layer_norm / rms_norm forward over ``rows`` contiguous groups of ``n`` elements whose
    weight index is the element's place in the group, as one team kernel; None when the
    rows do not fit. ``out = ((x - shift) - mean) * rstd * w + b`` (``norm.lower_norm``)."""
    node = graph[node_id]
    plan = plan_team(rows, n, limits)
    if plan is None:
        return None
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    w = kb.read(node.inputs[1], "weight")
    b = kb.read(node.inputs[2], "bias") if len(node.inputs) > 2 else None
    if not _sources_bound(x):
        return None
    out = kb.write(node_id, "out")
    rk = RowKernel(kb, plan)
    xv = rk.bind(x)
    rk.load_row(xv, "a")
    _norm_stats(rk, xv, node.op == "rms_norm", node.attr("eps"))
    wv = _vector(rk, w, "w")
    bv = _vector(rk, b, "b") if b is not None else None
    plus = (lambda i: f" + {bv(i)}") if bv is not None else (lambda i: "")
    rk.store_row(out, lambda i: f"((a{i} - shift) - mean) * rstd * {wv(i)}{plus(i)}")
    return [rk.finish("", 8 * node.type.numel, 2 * node.type.nbytes)]


def lower_norm_backward_rows(graph, node_id: int, limits: Limits, rows: int, n: int):
    """layer_norm / rms_norm input gradient as one team kernel (x and g held in registers);
    None when the rows do not fit. ``dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))``
    with ``gw = g * w`` (rms_norm: no ``mean(gw)`` term), as ``norm.lower_norm_backward``."""
    node = graph[node_id]
    plan = plan_team(rows, n, limits)
    if plan is None:
        return None
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    w = kb.read(node.inputs[1], "weight")
    g = kb.read(node.inputs[2], "g")
    if not _sources_bound(x, g):
        return None
    out = kb.write(node_id, "dx")
    rms = node.op.startswith("rms_norm")
    rk = RowKernel(kb, plan)
    xv = rk.bind(x)
    rk.load_row(xv, "a")
    rk.load_row(rk.bind(g), "g")
    _norm_stats(rk, xv, rms, node.attr("eps"))
    wv = _vector(rk, w, "w")
    for i in range(plan.k):
        rk.line(f"let gw{i} = g{i} * {wv(i)};")
        rk.line(f"let xh{i} = ((a{i} - shift) - mean) * rstd;")
    inv_m = f32_literal(1.0 / n)
    centre = ""
    if not rms:
        rk.thread_sum("d1_t", lambda i: f"gw{i}")
        rk.reduce("d1_t", "+", "d1")
        centre = f" - d1 * {inv_m}"
    rk.thread_sum("d2_t", lambda i: f"gw{i} * xh{i}")
    rk.reduce("d2_t", "+", "d2")
    rk.store_row(out, lambda i: f"rstd * (gw{i}{centre} - xh{i} * (d2 * {inv_m}))")
    return [rk.finish("", 14 * node.type.numel, 3 * node.type.nbytes)]

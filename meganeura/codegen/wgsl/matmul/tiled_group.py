"""One tiled dispatch for a ``passes.fuse_matmul.MatmulGroup`` of M > 8 rows (prefill, training
forwards): matmuls sharing the left operand ``x`` [M, K], each weight stored [N, K]
(``x @ W.mT``) or [K, N], optionally with the ``rms_norm`` / ``layer_norm`` producing ``x`` as
a prologue; the gemv counterpart (M <= 8) is ``horizontal.py``.

Layout. The group runs one plan (``group_plan``), so one BM x BN tile for every segment.
Workgroup ``wg`` takes row tile ``wg / NT`` and column tile ``wg % NT`` of the ``NT`` column
tiles of all segments laid side by side: segment s owns a contiguous range of ``ceil(N_s /
BN)`` of them, and a workgroup branches on its id (uniform control flow, so the barriers
inside stay valid) into its segment's copy of ``tiled.emit_tiled``. A segment of several
matmuls (equal N: ``silu(x @ Wg.mT) * (x @ Wu.mT)``) keeps one accumulator set per matmul in
the same threads (``emit_tiled``'s ``extra_b``), so its epilogue (``GroupBody``, the code of a
``plan_fusion`` epilogue) sees every product of an output element and the gate activation is
never stored. Per product the f32 operations and their K order are the unsplit tiled kernel's,
whatever the tile (each output sums K in order), so without a prologue values equal the
unfused program's whenever its plans do not split K.

Plan (``group_plan``). ``choose_plan`` for (M, K, sum of the members' N): the group fills the
GPU as one product that wide would. Split-K is dropped: the group runs unsplit (the partials
of several products and a prologue in one pass would need a summing dispatch per product
again), so by default a product whose own plan splits K stays out of groups (it keeps
``split_group``'s shared partials dispatch and deferred sums): timed on the H200 (2026-12-03,
``bench/llm_profile.py --parts prefill``, two runs each), SmolLM2's prefill took 5.48-5.73 ms
with such products joined (249 dispatches) against 4.26-4.33 ms apart (429): the unsplit
products' K chains cost more than the dispatches saved. ``set_split_members(True)`` lets them
join when K <= ``SPLIT_MEMBERS_MAX_K``. A group
with a segment of two or more products takes the largest tiling of at most
``MAX_ACCUMULATORS`` accumulators per thread over all its products (8x8 per thread with two
products would be 128), the same BM preferred; a segment of five or more products has none,
and its matmuls stay apart. A plan whose workgroup memory exceeds the adapter's drops its
second buffer, then falls back to 64x64x16.

Prologue. Before branching, every workgroup computes the statistics of its BM rows of the
norm's input: ``WG / BM`` threads per row stride it (vec4 loads when K % 4 == 0) and their
sums combine in workgroup memory in thread order; rms_norm ``rstd = inverseSqrt(sum(x^2) / K +
eps)``; layer_norm, as the norm kernels, two passes about ``shift`` (the row's first element):
``mean`` of x - shift, then the squared deviations. A tile load then reads ``((x - shift) -
mean) * rstd * w + b`` (rms_norm: ``x * rstd * w``) in place of the normalized value, which is
never stored. The statistics' summation order differs from the norm kernel's, so results
differ from the unfused program by f32 rounding of ``rstd`` only. Each workgroup re-reads its
BM rows (``horizontal.NORM_MAX_K`` bounds their length).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace

from ....graph.ir import Graph, resolve_view
from ....passes.fuse_matmul import MatmulGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent, is_constant
from ..core.literals import f32_literal, u
from ..core.mathlib import helper_source
from ..elementwise.fused import GroupBody
from .horizontal import check_bindings, norm_operands
from .plan import SMALL, TILINGS, WG, Plan, Tiling, choose_plan
from .problem import Operand, Problem, bind_operand, problem_of, vec_ok
from .tiled import emit_tiled

SPLIT_MEMBERS = [False]  # products whose own plan splits K join groups (``set_split_members``)
# The longest K of a product whose own plan splits K that still joins a group (run unsplit).
# The H200 sweep (bench/results/sweeps/matmul_sweep_small_h200.json, 128 rows, 64x64x16) has
# unsplit products latency-bound by their chain of K steps, about the same time whatever the
# grid: K = 576 31-32 us against 19-22 us split 8 ways (two dispatches, timed together), a gap
# the group wins back by the dispatches it removes (the norm, the partials' sums); K = 1536
# 68 us against 31 us, so longer K stays split (``split_group``, deferred sums).
SPLIT_MEMBERS_MAX_K = 1024
MAX_ACCUMULATORS = 64  # per thread, over the products of a segment


def set_split_members(on: bool) -> None:
    """Let products whose own plan splits K join tiled groups (run unsplit there), or keep them
    out (``split_group`` and deferred sums handle them), for programs compiled from now on
    (benchmark A/B and the split-K tests)."""
    SPLIT_MEMBERS[:] = [bool(on)]


def tiled_problem(graph: Graph, node_id: int, limits: Limits) -> tuple[Problem, Plan] | None:
    """(problem, plan) of an unbatched matmul with a non-empty K, no constant operand and a
    tiled plan (the candidates of this kernel's and ``tiled_rgroup``'s groups), or None."""
    node = graph[node_id]
    if node.op != "matmul" or node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return None
    p = problem_of(graph, node_id)
    if p.nb != 1 or is_constant(graph, p.a.value) or is_constant(graph, p.b.value):
        return None
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    return None if plan.kernel != "tiled" else (p, plan)


def _member(graph: Graph, node_id: int, limits: Limits) -> Problem | None:
    """The problem of a matmul the tiled group kernel can join, or None."""
    found = tiled_problem(graph, node_id, limits)
    if found is None:
        return None
    p, plan = found
    if plan.splits > 1 and (not SPLIT_MEMBERS[0] or p.k > SPLIT_MEMBERS_MAX_K):
        return None
    return p


def tiled_key(graph: Graph, node_id: int, limits: Limits) -> tuple | None:
    """``plan_matmul_groups``'s key for a matmul this kernel can join: (left operand's value,
    its row and column strides, M, K, ``"tiled"``), else None (gemv, simd or batched
    products, constant operands; products whose plan splits K over more than
    ``SPLIT_MEMBERS_MAX_K``, or at all with ``set_split_members(False)``)."""
    p = _member(graph, node_id, limits)
    if p is None:
        return None
    return (resolve_view(graph, p.a.value), p.a.rows, p.a.cols, p.m, p.k, "tiled")


def is_tiled_group(group: MatmulGroup, graph: Graph, limits: Limits) -> bool:
    """Whether ``group`` (planned with ``tiled_key``) is this kernel's."""
    return tiled_key(graph, group.anchor, limits) is not None


def _shared_bytes(t: Tiling, prefetch: bool, products: int, norm: bool) -> int:
    """Upper bound of the kernel's workgroup memory (``plan.tiled_shared_bytes`` with
    ``products`` B tiles, plus the prologue's statistics and partial sums)."""
    tiles = (2 if prefetch else 1) * 16 * t.bk * (t.bm // 4 + 1 + products * (t.bn // 4 + 1))
    return tiles + ((16 * t.bm + 4 * WG) if norm else 0)


def group_plan(graph: Graph, group: MatmulGroup, limits: Limits) -> Plan | None:
    """The group's plan (module docstring), or None when even 64x64x16 without prefetch
    exceeds the adapter's workgroup memory, or a segment's products exceed
    ``MAX_ACCUMULATORS`` with every tiling."""
    probs = [problem_of(graph, a) for seg in group.segments for a in seg.anchors]
    p = probs[0]
    plan = choose_plan(p.m, p.k, sum(q.n for q in probs), 1, p.layout, limits)
    if plan.kernel != "tiled":  # a device entry for the group's shape: the first product's
        plan = choose_plan(p.m, p.k, p.n, 1, p.layout, limits)
    plan = replace(plan, splits=1)
    products = max(len(seg.anchors) for seg in group.segments)
    t = plan.tiling
    if products > 1 and t.tm * t.tn * products > MAX_ACCUMULATORS:
        fits = [s for s in TILINGS.values() if s.tm * s.tn * products <= MAX_ACCUMULATORS]
        if not fits:  # five or more products in one segment: left apart
            return None
        t = max(fits, key=lambda s: (s.bm == t.bm, s.tm * s.tn, s.bn == t.bn, s.bk))
        plan = replace(plan, tiling=t)
    norm = group.norm is not None
    for fallback in (plan, replace(plan, prefetch=False), Plan("tiled", SMALL, prefetch=False)):
        need = _shared_bytes(fallback.tiling, fallback.prefetch, products, norm)
        if need <= limits.max_workgroup_storage_size:
            return fallback
    return None


def tiled_group_fits(graph: Graph, group: MatmulGroup, limits: Limits) -> bool:
    """Whether the group's kernel fits the adapter's workgroup memory and registers
    (``group_plan``)."""
    return group_plan(graph, group, limits) is not None


@dataclass(frozen=True)
class _NormA:
    """The left operand as the norm's output, computed as loaded (duck-types ``Operand``:
    ``emit_tiled`` reads ``rows``, ``cols``, ``batch``, ``vec``, ``scalar`` and ``vec4``).
    Statistics of local row r are ``nst[r]``: (shift, mean, rstd, 0)."""

    x: Operand
    w: Operand
    b: Operand | None
    k: int
    bm: int
    vec: bool
    batch: tuple = ()
    cols: int = 1

    @property
    def rows(self) -> int:
        return self.k

    def _stat(self, i: str, field: str) -> str:
        return f"nst[({i} / {u(self.k)}) % {u(self.bm)}].{field}"

    def _value(self, i: str, xv: str, wv: str, bv: str | None) -> str:
        rstd = self._stat(i, "z")
        if self.b is None:
            return f"({xv} * {rstd} * {wv})"
        xc = f"(({xv} - {self._stat(i, 'x')}) - {self._stat(i, 'y')})"
        return f"({xc} * {rstd} * {wv} + {bv})"

    def scalar(self, kb: KernelBuilder, index: str) -> str:
        i, col = f"({index})", f"(({index}) % {u(self.k)})"
        bv = None if self.b is None else _elem(kb, self.b, col)
        return self._value(i, _elem(kb, self.x, i), _elem(kb, self.w, col), bv)

    def vec4(self, kb: KernelBuilder, index: str) -> str:
        i, col = f"({index})", f"(({index}) % {u(self.k)})"
        bv = None if self.b is None else _vec4(kb, self.b, col)
        return self._value(i, _vec4(kb, self.x, i), _vec4(kb, self.w, col), bv)


def _elem(kb: KernelBuilder, op: Operand, i: str) -> str:
    return op.src.literal if op.src.literal is not None else op.scalar(kb, i)


def _vec4(kb: KernelBuilder, op: Operand, i: str) -> str:
    if op.src.literal is not None:
        return f"vec4<f32>({op.src.literal})"
    if op.vec:
        return op.vec4(kb, i)
    return "vec4<f32>(" + ", ".join(op.scalar(kb, f"{i} + {u(c)}") for c in range(4)) + ")"


def _norm_prologue(
    kb: KernelBuilder, norm: int, m: int, k: int, bm: int, lines: list[str]
) -> _NormA:
    """Bind the norm's operands, append the statistics of this workgroup's BM rows (row tile
    ``tile_mg``) to ``lines`` and return the left operand reading the normalized rows."""
    node = kb.graph[norm]
    rms, x, w, b = norm_operands(kb, norm, k)
    vec = k % 4 == 0  # as norm_operands bound x
    per = WG // bm  # threads per row
    n, eps = f32_literal(k), f32_literal(node.attr("eps"))
    lines += [
        "  {",
        f"    let nr = lid / {u(per)};",
        f"    let nl = lid % {u(per)};",
        f"    let base = min(tile_mg * {u(bm)} + nr, {u(m - 1)}) * {u(k)};",
    ]

    def pass_(acc: str, term) -> None:
        """Sum ``term(value)`` over this thread's share of the row into ``acc``, then over the
        row's threads (in thread order) into ``{acc}_t``."""
        if vec:
            lines.append(f"    var {acc}4 = vec4<f32>(0.0);")
            lines.append(f"    for (var q = nl; q < {u(k // 4)}; q = q + {u(per)}) {{")
            lines.append(f"      {acc}4 = {acc}4 + {term(_vec4(kb, x, 'base + q * 4u'))};")
            lines.append("    }")
            lines.append(f"    npart[lid] = {acc}4.x + {acc}4.y + {acc}4.z + {acc}4.w;")
        else:
            lines.append(f"    var {acc} = 0.0;")
            lines.append(f"    for (var i = nl; i < {u(k)}; i = i + {u(per)}) {{")
            lines.append(f"      {acc} = {acc} + {term(_elem(kb, x, 'base + i'))};")
            lines.append("    }")
            lines.append(f"    npart[lid] = {acc};")
        lines.append("    workgroupBarrier();")
        terms = " + ".join(f"npart[nr * {u(per)} + {u(j)}]" for j in range(per))
        lines.append(f"    let {acc}_t = {terms};")
        lines.append("    workgroupBarrier();")

    if rms:
        lines += ["    let shift = 0.0;", "    let mean = 0.0;"]
        pass_("sq", lambda v: f"({v} * {v})")
    else:
        lines.append(f"    let shift = {_elem(kb, x, 'base')};")
        pass_("s", lambda v: f"({v} - shift)")
        lines.append(f"    let mean = s_t / {n};")
        pass_("sq", lambda v: f"((({v} - shift) - mean) * (({v} - shift) - mean))")
    lines += [
        f"    if (nl == 0u) {{ nst[nr] = vec4<f32>(shift, mean, "
        f"inverseSqrt(sq_t / {n} + {eps}), 0.0); }}",
        "    workgroupBarrier();",
        "  }",
    ]
    return _NormA(x, w, b, k, bm, vec)


_SHARED = re.compile(r"var<workgroup> (\w+): array<vec4<f32>, (\d+)>;")


def lower_tiled_group(graph: Graph, group: MatmulGroup, limits: Limits) -> list[KernelSource]:
    """The one dispatch computing every member of ``group`` (see the module docstring).

    Raises:
        ValueError: as the members' own lowerings would, for a value too large to bind, or
            when no plan fits (``group_plan`` None: ``tiled_group_fits`` was not asked).
    """
    check_bindings(graph, group, limits)
    plan = group_plan(graph, group, limits)
    if plan is None:
        raise ValueError(
            f"matmul group {group.members}: no tiling fits the workgroup memory "
            f"({limits.max_workgroup_storage_size} B) and {MAX_ACCUMULATORS} accumulators"
        )
    t = plan.tiling
    kb = KernelBuilder(graph, graph[group.anchor], limits)
    bodies = []
    for seg in group.segments:
        body = GroupBody(graph, seg.as_fusion_group(graph[seg.anchors[0]].type.shape), seg.anchors)
        body.bind(kb)
        bodies.append(body)
    first = problem_of(graph, group.anchor)
    m, k = first.m, first.k
    probs = [[problem_of(graph, a) for a in seg.anchors] for seg in group.segments]
    tiles = [-(-ps[0].n // t.bn) for ps in probs]
    total = sum(tiles)
    lines = [f"  let tile_mg = wg / {u(total)};", f"  let tile_ng = wg % {u(total)};"]
    if group.norm is not None:
        a = _norm_prologue(kb, group.norm, m, k, t.bm, lines)
    else:
        along_k = first.a.cols == 1
        want = vec_ok(first.a, k if along_k else m, first.a.rows if along_k else first.a.cols)
        a = bind_operand(kb, first.a, want, "a")
    shared: dict[str, int] = {}
    flops = nbytes = start = 0
    for s, (ps, body) in enumerate(zip(probs, bodies, strict=True)):

        def store(value, flat: str, col: str, body=body) -> str:
            values = value if isinstance(value, list) else [value]
            loads = [
                src.literal if src.literal is not None else src.at(body.index(i, flat, col))
                for i, src in enumerate(body.srcs)
            ]
            return f"{{ {body.compute(loads, anchor=values)} {body.stores(flat, kb)} }}"

        p = replace(ps[0], a=a)
        extra = [q.b for q in ps[1:]]
        text, decls, _ = emit_tiled(kb, p, plan, 1, k, store, extra, a_bound=True)  # type: ignore[arg-type]
        for name, size in _SHARED.findall(decls):
            shared[name] = max(shared.get(name, 0), int(size))
        lines.append(f"  {'if' if s == 0 else 'else if'} (tile_ng < {u(start + tiles[s])}) {{")
        lines.append(f"    let wg = tile_mg * {u(tiles[s])} + tile_ng - {u(start)};")
        lines.append(indent(text))
        lines.append("  }")
        start += tiles[s]
        flops += 2 * m * ps[0].n * k * len(ps) + body.flops
        nbytes += sum(q.b.src.type.nbytes for q in ps) + body.nbytes
    if group.norm is not None:
        norm = graph[group.norm]
        nbytes += sum(graph[i].type.nbytes for i in norm.inputs if not is_constant(graph, i))
    else:
        nbytes += first.a.src.type.nbytes
    decls = "".join(f"var<workgroup> {n}: array<vec4<f32>, {z}>;\n" for n, z in shared.items())
    need = 16 * sum(shared.values())
    if group.norm is not None:
        decls += f"var<workgroup> nst: array<vec4<f32>, {t.bm}>;\n"
        decls += f"var<workgroup> npart: array<f32, {WG}>;\n"
        need += 16 * t.bm + 4 * WG
    if need > limits.max_workgroup_storage_size:  # pragma: no cover - group_plan bounds it
        raise ValueError(
            f"matmul group {group.members} needs {need} B of workgroup memory; the limit is "
            f"{limits.max_workgroup_storage_size}"
        )
    helpers = decls + helper_source(dict.fromkeys(h for b in bodies for h in b.helper_names))
    groups = -(-m // t.bm) * total
    ks = kb.finish("", "\n".join(lines), WG, groups, helpers, flops=flops, nbytes=nbytes)
    ids = "+".join(str(i) for i in group.members)
    return [replace(ks, name=f"%{ids} matmul")]

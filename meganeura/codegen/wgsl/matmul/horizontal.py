"""One gemv dispatch for a ``passes.fuse_matmul.MatmulGroup``: matmuls sharing the left operand
``x`` ([M <= 8, K], decode), each weight stored [N, K] (``x @ W.mT``), optionally with the
``rms_norm`` / ``layer_norm`` producing ``x`` as a prologue.

Layout. Segment s owns a contiguous range of workgroups (``ceil(N_s / cols)``, cols = 256 /
lanes); a workgroup branches on its id (uniform control flow, so barriers inside stay valid)
into its segment's copy of ``gemv._rows_of_b``: ``lanes`` threads share one output column,
reading a weight row with vec4 loads, and combine their sums in workgroup memory in lane order.
A segment of several matmuls (equal N: ``silu(x @ Wg.mT) * (x @ Wu.mT)``) keeps one
accumulator per matmul and row in the same threads, so its epilogue (``GroupBody``, the code of
a ``plan_fusion`` epilogue) sees every product of an output element. Per product the f32
operations and their order are those of the unfused gemv with the same lanes.

Prologue. Every workgroup first computes the statistics of the M rows of the norm's input
(256 threads stride the row, then a pairwise tree in workgroup memory): rms_norm ``rstd =
inverseSqrt(sum(x^2) / K + eps)``; layer_norm, as the norm kernels, two passes about
``shift`` (the row's first element): ``mean`` of x - shift, then the squared deviations.
The K loop then reads ``((x - shift) - mean) * rstd * w + b`` (rms_norm: ``x * rstd * w``)
in place of the normalized value, which is never stored. The statistics' summation order
differs from the norm kernel's, so results differ from the unfused program by f32 rounding
of ``rstd`` only. Each workgroup re-reads the M rows (``NORM_MAX_K`` bounds their length).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace

from ....graph.ir import Graph, resolve_view
from ....passes.fuse_matmul import MatmulGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src, check_numel, is_constant
from ..core.literals import f32_literal, u
from ..core.mathlib import helper_source
from ..elementwise.fused import GroupBody
from .plan import GEMV_MAX_M, WG, choose_plan
from .problem import Operand, Problem, bind_operand, problem_of

NORM_MAX_K = 8192  # longest norm row recomputed by every workgroup of a prologue


def _plan(graph: Graph, node_id: int, limits: Limits) -> tuple[Problem, int] | None:
    """(problem, lanes) of a matmul run as one gemv dispatch over W stored [N, K], or None."""
    node = graph[node_id]
    if node.op != "matmul" or node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return None
    p = problem_of(graph, node_id)
    if p.nb != 1 or p.m > GEMV_MAX_M or p.n == 1 or not (p.b.rows == 1 and p.b.cols != 1):
        return None
    if is_constant(graph, p.a.value) or is_constant(graph, p.b.value):
        return None
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel != "gemv" or plan.splits > 1:
        return None
    return p, plan.lanes


def gemv_key(graph: Graph, node_id: int, limits: Limits) -> tuple | None:
    """``plan_matmul_groups``'s key: (left operand's value, its row and column strides, M, K)
    for a matmul this kernel can join, else None (split-K, tiled plans, batched products,
    weights stored [K, N])."""
    planned = _plan(graph, node_id, limits)
    if planned is None:
        return None
    p, _ = planned
    return (resolve_view(graph, p.a.value), p.a.rows, p.a.cols, p.m, p.k)


def _shared_floats(graph: Graph, group: MatmulGroup, limits: Limits) -> int:
    red = 0
    for seg in group.segments:
        p, lanes = _plan(graph, seg.anchors[0], limits)  # type: ignore[misc]
        red = max(red, len(seg.anchors) * p.m * (WG // lanes) * (lanes + 1))
    return red + (WG if group.norm is not None else 0)


def group_fits(graph: Graph, group: MatmulGroup, limits: Limits) -> bool:
    """Whether the group's kernel fits the adapter's workgroup memory."""
    return 4 * _shared_floats(graph, group, limits) <= limits.max_workgroup_storage_size


@dataclass
class _Rows:
    """How the K loop reads x: element (row m, k) and vec4 (row m, elements 4q .. 4q + 3)."""

    scalar: Callable[[int, str], str]
    vec4: Callable[[int, str], str] | None


def _vec4_of(scalar: Callable[[int, str], str]) -> Callable[[int, str], str]:
    return lambda m, q: "vec4<f32>(" + ", ".join(
        scalar(m, f"({q} * 4u + {u(c)})") for c in range(4)
    ) + ")"  # fmt: skip


def _plain_rows(kb: KernelBuilder, a: Operand, k: int) -> _Rows:
    a = bind_operand(kb, a, a.cols == 1 and k % 4 == 0 and a.rows % 4 == 0, "a")

    def scalar(m: int, kk: str) -> str:
        col = kk if a.cols == 1 else f"({kk}) * {u(a.cols)}"
        return a.scalar(kb, f"{u(m * a.rows)} + {col}")

    if a.vec and a.cols == 1:
        return _Rows(scalar, lambda m, q: a.vec4(kb, f"{u(m * a.rows)} + {q} * 4u"))
    return _Rows(scalar, None)


def norm_operands(kb: KernelBuilder, norm: int, k: int):
    """(rms, x, weight, bias or None) of a norm prologue over rows of ``k``: the norm's
    operands bound (vec4 when ``k % 4 == 0``); ``rms`` for an rms_norm (no bias)."""
    g = kb.graph
    node = g[norm]
    rms = node.op == "rms_norm"
    vec = k % 4 == 0

    def operand(vid: int, name: str, rows: int) -> Operand:
        return bind_operand(kb, Operand(Src(g[vid].type), vid, (), rows, 1), vec, name)

    x = operand(node.inputs[0], "x", k)
    w = operand(node.inputs[1], "weight", 0)
    b = None if rms else operand(node.inputs[2], "bias", 0)
    return rms, x, w, b


def _norm_prologue(kb: KernelBuilder, norm: int, m: int, k: int, lines: list[str]) -> _Rows:
    """Bind the norm's operands, append the statistics of its ``m`` rows to ``lines`` and
    return how the K loop reads the normalized rows."""
    node = kb.graph[norm]
    rms, x, w, b = norm_operands(kb, norm, k)
    vec = k % 4 == 0  # as norm_operands bound x

    def elem(op: Operand, i: str) -> str:
        return op.src.literal if op.src.literal is not None else op.scalar(kb, i)

    def vec4(op: Operand, i: str) -> str:
        if op.src.literal is not None:
            return f"vec4<f32>({op.src.literal})"
        if op.vec:
            return op.vec4(kb, i)
        return "vec4<f32>(" + ", ".join(op.scalar(kb, f"{i} + {u(c)}") for c in range(4)) + ")"

    eps = f32_literal(node.attr("eps"))
    n = f32_literal(k)

    def reduce(acc: str, total: str) -> None:
        lines.append(f"    nrm[lid] = {acc};")
        lines.append("    workgroupBarrier();")
        s = WG // 2
        while s >= 1:
            lines.append(f"    if (lid < {u(s)}) {{ nrm[lid] = nrm[lid] + nrm[lid + {u(s)}]; }}")
            lines.append("    workgroupBarrier();")
            s //= 2
        lines.append(f"    {total} = nrm[0];")
        lines.append("    workgroupBarrier();")

    for r in range(m):
        at = lambda i, r=r: elem(x, f"{u(r * k)} + {i}")  # noqa: E731
        lines.append(f"  var rstd{r} = 0.0;")
        if not rms:
            lines.append(f"  var shift{r} = 0.0;\n  var mean{r} = 0.0;")
        lines.append("  {")
        lines.append("    var tot = 0.0;")
        if not rms:
            lines.append(f"    shift{r} = {at('0u')};")
            lines.append("    var s = 0.0;")
            lines.append(f"    for (var i = lid; i < {u(k)}; i = i + {u(WG)}) {{")
            lines.append(f"      s = s + ({at('i')} - shift{r});")
            lines.append("    }")
            reduce("s", "tot")
            lines.append(f"    mean{r} = tot / {n};")
        lines.append("    var q = 0.0;")
        lines.append(f"    for (var i = lid; i < {u(k)}; i = i + {u(WG)}) {{")
        centred = f"({at('i')} - shift{r}) - mean{r}"
        lines.append(f"      let d = {at('i') if rms else centred};")
        lines.append("      q = q + d * d;")
        lines.append("    }")
        reduce("q", "tot")
        lines.append(f"    rstd{r} = inverseSqrt(tot / {n} + {eps});")
        lines.append("  }")

    def scalar(r: int, kk: str) -> str:
        if rms:
            return f"({elem(x, f'{u(r * k)} + {kk}')} * rstd{r} * {elem(w, kk)})"
        xc = f"(({elem(x, f'{u(r * k)} + {kk}')} - shift{r}) - mean{r})"
        return f"({xc} * rstd{r} * {elem(w, kk)} + {elem(b, kk)})"  # type: ignore[arg-type]

    if not vec:
        return _Rows(scalar, None)

    def rows4(r: int, q: str) -> str:
        xv = vec4(x, f"{u(r * k)} + {q} * 4u")
        wv = vec4(w, f"{q} * 4u")
        if rms:
            return f"({xv} * rstd{r} * {wv})"
        return f"((({xv} - shift{r}) - mean{r}) * rstd{r} * {wv} + {vec4(b, f'{q} * 4u')})"  # type: ignore[arg-type]

    return _Rows(scalar, rows4)


def check_bindings(graph: Graph, group: MatmulGroup, limits: Limits) -> None:
    """Raise as the members' own lowerings would for a value the group's kernel binds (an
    external input or a member's value; the norm of a prologue is never stored) that is too
    large to bind (``check_numel``)."""
    members = set(group.members)
    for mid in group.members:
        for i in graph[mid].inputs:
            if i not in members and not is_constant(graph, i):
                check_numel(graph, resolve_view(graph, i), limits)
        if mid != group.norm:
            check_numel(graph, mid, limits)


def lower_matmul_group(graph: Graph, group: MatmulGroup, limits: Limits) -> list[KernelSource]:
    """The one dispatch computing every member of ``group`` (see the module docstring).

    Raises:
        ValueError: as the members' own lowerings would, for a value too large to bind.
    """
    check_bindings(graph, group, limits)
    kb = KernelBuilder(graph, graph[group.anchor], limits)
    bodies = []
    for seg in group.segments:
        shape = graph[seg.anchors[0]].type.shape
        body = GroupBody(graph, seg.as_fusion_group(shape), seg.anchors)
        body.bind(kb)
        bodies.append(body)
    first, _ = _plan(graph, group.anchor, limits)  # type: ignore[misc]
    m, k = first.m, first.k
    lines: list[str] = []
    if group.norm is not None:
        rows = _norm_prologue(kb, group.norm, m, k, lines)
    else:
        rows = _plain_rows(kb, first.a, k)
    flops = nbytes = 0
    start = 0
    for s, (seg, body) in enumerate(zip(group.segments, bodies, strict=True)):
        planned = [_plan(graph, a, limits) for a in seg.anchors]
        lanes = planned[0][1]  # type: ignore[index]
        bs = [
            bind_operand(kb, p.b, k % 4 == 0 and p.b.cols % 4 == 0, f"b{s}_{j}")
            for j, (p, _) in enumerate(planned)  # type: ignore[misc]
        ]
        n = planned[0][0].n  # type: ignore[index]
        cols = WG // lanes
        blocks = -(-n // cols)
        cond = f"wg < {u(start + blocks)}"
        lines.append(f"  {'if' if s == 0 else 'else if'} ({cond}) {{")
        lines += _segment(kb, body, rows, bs, m, k, n, lanes, start)
        lines.append("  }")
        start += blocks
        flops += 2 * m * n * k * len(bs) + body.flops
        nbytes += sum(p.b.src.type.nbytes for p, _ in planned) + body.nbytes  # type: ignore[misc]
    if group.norm is not None:
        norm = graph[group.norm]
        nbytes += sum(graph[i].type.nbytes for i in norm.inputs if not is_constant(graph, i))
    else:
        nbytes += first.a.src.type.nbytes
    helpers = helper_source(dict.fromkeys(h for b in bodies for h in b.helper_names))
    red = _shared_floats(graph, group, limits) - (WG if group.norm is not None else 0)
    helpers = f"var<workgroup> red: array<f32, {red}>;\n" + helpers
    if group.norm is not None:
        helpers = f"var<workgroup> nrm: array<f32, {WG}>;\n" + helpers
    ks = kb.finish("", "\n".join(lines), WG, start, helpers, flops=flops, nbytes=nbytes)
    ids = "+".join(str(i) for i in group.members)
    return [_renamed(ks, f"%{ids} matmul")]


def _renamed(ks: KernelSource, name: str) -> KernelSource:
    return replace(ks, name=name)


def _segment(
    kb: KernelBuilder,
    body: GroupBody,
    rows: _Rows,
    bs: list[Operand],
    m: int,
    k: int,
    n: int,
    lanes: int,
    start: int,
) -> list[str]:
    """One segment's branch: ``gemv._rows_of_b`` over several weights sharing the rows."""
    cols = WG // lanes
    row = lanes + 1
    lines = [
        f"    let cb = wg - {u(start)};",
        f"    let lane = lid % {u(lanes)};",
        f"    let cl = lid / {u(lanes)};",
        f"    let colc = min(cb * {u(cols)} + cl, {u(n - 1)});",
    ]
    lines += [f"    let wrow{j} = colc * {u(b.cols)};" for j, b in enumerate(bs)]
    js = range(len(bs))
    vec = rows.vec4 is not None and k % 4 == 0 and all(b.vec for b in bs)
    if vec:
        lines += [f"    var acc{j}_{r} = vec4<f32>(0.0);" for j in js for r in range(m)]
        lines.append(f"    for (var q = lane; q < {u(k // 4)}; q = q + {u(lanes)}) {{")
        lines += [f"      let w{j} = {b.vec4(kb, f'wrow{j} + q * 4u')};" for j, b in enumerate(bs)]
        lines += [f"      let av{r} = {rows.vec4(r, 'q')};" for r in range(m)]
        lines += [f"      acc{j}_{r} += av{r} * w{j};" for j in js for r in range(m)]
        lines.append("    }")
        sums = {
            (j, r): f"acc{j}_{r}.x + acc{j}_{r}.y + acc{j}_{r}.z + acc{j}_{r}.w"
            for j in js
            for r in range(m)
        }
    else:
        lines += [f"    var acc{j}_{r} = 0.0;" for j in js for r in range(m)]
        lines.append(f"    for (var kk = lane; kk < {u(k)}; kk = kk + {u(lanes)}) {{")
        lines += [f"      let w{j} = {b.scalar(kb, f'wrow{j} + kk')};" for j, b in enumerate(bs)]
        lines += [f"      let av{r} = {rows.scalar(r, 'kk')};" for r in range(m)]
        lines += [f"      acc{j}_{r} += av{r} * w{j};" for j in js for r in range(m)]
        lines.append("    }")
        sums = {(j, r): f"acc{j}_{r}" for j in js for r in range(m)}
    for (j, r), s in sums.items():
        lines.append(f"    red[{u((j * m + r) * cols * row)} + cl * {u(row)} + lane] = {s};")
    lines += [
        "    workgroupBarrier();",
        f"    for (var t = lid; t < {u(m * cols)}; t = t + {u(WG)}) {{",
        f"      let row = t / {u(cols)};",
        f"      let col = cb * {u(cols)} + t % {u(cols)};",
        f"      if (col < {u(n)}) {{",
    ]
    for j in js:
        lines.append(f"        var s{j} = 0.0;")
        lines.append(
            f"        for (var l = 0u; l < {u(lanes)}; l = l + 1u) {{ "
            f"s{j} += red[({u(j * m * cols)} + t) * {u(row)} + l]; }}"
        )
    lines.append(f"        let o = row * {u(n)} + col;")
    loads = [
        s.literal if s.literal is not None else s.at(body.index(i, "o", "col"))
        for i, s in enumerate(body.srcs)
    ]
    values = [f"s{j}" for j in js]
    lines.append(f"        {{ {body.compute(loads, anchor=values)} {body.stores('o', kb)} }}")
    lines += ["      }", "    }"]
    return lines

"""Lowerings with their own row kernels: softmax, log_softmax, cross_entropy and its backward.

Every one of them is max-subtracted (``z = x - max``, ``lse = log(sum(exp(z)))``), so logits
of any magnitude are safe, and mirrors its NumPy reference's formula: softmax is
``exp(z - lse)``, a cross-entropy row loss is ``lse - z[target]``. Rows are scheduled by
``rows.plan_rows``: softmax views its input as [outer, n, inner] and treats each
(outer, inner) pair as a row with stride ``inner``.

cross_entropy takes two dispatches: per-row losses and valid flags into scratch, then one
workgroup sums both (pairwise) and divides by max(count, 1) for ``mean`` (``"none"``: one
dispatch writing the row losses). With label smoothing e a row loss is
``lse - (1 - e) * z[target] - e * mean(z)`` (one more row sum). Its backward first counts
valid rows (only when rows can be ignored and the reduction is ``mean``), then writes
``(softmax - (1 - e) * onehot - e / C) * g / divisor`` per row, 0 on ignored rows; targets are
clamped into [0, C) so a bad label can never read out of bounds (the host rejects them before
a step).
"""

from __future__ import annotations

from collections.abc import Callable

from ....dtypes import DType
from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.literals import f32_literal, int_literal, u
from ..elementwise.maps import lower_fill
from .rows import RowPlan, for_each, plan_rows, shared_decl, strided_loop, thread_coords, tree
from .team import lower_softmax_rows

_MAX = lambda a, b: f"max({a}, {b})"  # noqa: E731
_ADD = lambda a, b: f"{a} + {b}"  # noqa: E731


def _max_sum(plan: RowPlan, read: Callable[[str], str], n: int) -> str:
    """Statements leaving the row's ``mx`` and ``lse`` (log of the sum of exp(x - mx)) in
    every thread of the row; ``read(j)`` is element j of the row."""
    per_thread = -(-n // plan.ry)
    body = f"  var m_acc = {read(f'min(y, {u(n - 1)})')};\n"
    body += strided_loop(plan, "0u", u(n), read, _MAX, per_thread, acc="m_acc")
    body += tree(plan, "red", "m_acc", _MAX, "mx")
    body += "  var s_acc = 0.0;\n"
    body += strided_loop(
        plan, "0u", u(n), lambda r: f"exp({read(r)} - mx)", _ADD, per_thread, "0.0", "s_acc"
    )
    body += tree(plan, "red", "s_acc", _ADD, "total")
    return body + "  let lse = log(total);\n"


def lower_softmax(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``softmax`` / ``log_softmax`` along attr ``dim``: one row per (outer, inner) pair."""
    node = graph[node_id]
    shape = node.type.shape
    if node.type.numel == 0:
        return []
    dim = node.attr("dim")
    n = shape[dim]
    inner = 1
    for s in shape[dim + 1 :]:
        inner *= s
    rows = node.type.numel // n
    if inner == 1:
        ks = lower_softmax_rows(graph, node_id, limits)
        if ks is not None:
            return ks
    plan = plan_rows(rows, n, inner == 1)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    out = kb.write(node_id, "out")
    base = (
        "rowc * " + u(n)
        if inner == 1
        else f"(rowc / {u(inner)}) * {u(n * inner)} + rowc % {u(inner)}"
    )

    def idx(j: str) -> str:
        return f"base + {j}" if inner == 1 else f"base + ({j}) * {u(inner)}"

    body = thread_coords(plan, "wg", rows) + f"  let base = {base};\n"
    body += _max_sum(plan, lambda j: x.at(idx(j)), n)
    value = "(v - mx) - lse" if node.op == "log_softmax" else "exp((v - mx) - lse)"
    write = f"let v = {x.at(idx('r'))};\n{kb.store(out, idx('r'), value)}\n"
    body += "  if (live) {\n" + indent(for_each(plan, "0u", u(n), write), 1)
    body += "  }\n"
    groups = -(-rows // plan.ox)
    helpers = shared_decl(plan, "red", "f32")
    flops, nbytes = 5 * node.type.numel, 2 * node.type.nbytes
    return [kb.finish("", body, plan.size, groups, helpers, flops, nbytes)]


def _ce_dims(graph: Graph, node_id: int) -> tuple[int, int, int | None, str]:
    node = graph[node_id]
    n, c = graph[node.inputs[0]].type.shape
    return n, c, node.attr("ignore_index"), node.attr("reduction")


def _valid_expr(t: str, ignore: int | None) -> str:
    return "true" if ignore is None else f"({t} != {int_literal(ignore, DType.i32)})"


def _smoothing(node) -> float:
    return float(node.attr("label_smoothing", 0.0) or 0.0)


def lower_cross_entropy(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Cross-entropy over rows not ignored: row losses (into the output for ``"none"``, else
    into scratch, then one workgroup sums them and divides by max(count, 1) for ``mean``)."""
    node = graph[node_id]
    n, c, ignore, reduction = _ce_dims(graph, node_id)
    if n == 0 or c == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    ls = _smoothing(node)
    plan = plan_rows(n, c, True)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "logits")
    tgt = kb.read(node.inputs[1], "labels")
    if reduction == "none":
        loss, cnt = kb.write(node_id, "out"), None
    else:
        loss = kb.scratch("rows", n, node.type.dtype, "row_loss")
        cnt = kb.scratch("valid", n, node.type.dtype, "row_valid")
    body = thread_coords(plan, "wg", n) + f"  let base = rowc * {u(c)};\n"
    body += _max_sum(plan, lambda j: x.at(f"base + {j}"), c)
    picked = f"({x.at('base + tc')} - mx)"
    if ls:
        # label smoothing: lse - (1 - e) * z[t] - e * mean(z), z = x - mx
        z = lambda j: f"({x.at(f'base + {j}')} - mx)"  # noqa: E731
        body += "  var z_acc = 0.0;\n"
        body += strided_loop(plan, "0u", u(c), z, _ADD, -(-c // plan.ry), "0.0", "z_acc")
        body += tree(plan, "red", "z_acc", _ADD, "zsum")
        row = f"lse - {f32_literal(1.0 - ls)} * {picked} - {f32_literal(ls / c)} * zsum"
    else:
        row = f"lse - {picked}"
    body += (
        "  if (live && y == 0u) {\n"
        f"    let t = {tgt.at('rowc')};\n"
        f"    let valid = {_valid_expr('t', ignore)};\n"
        f"    let tc = u32(clamp(t, 0i, {int_literal(c - 1, DType.i32)}));\n"
        f"    {kb.store(loss, 'row', f'select(0.0, {row}, valid)')}\n"
        + (f"    {kb.store(cnt, 'row', 'select(0.0, 1.0, valid)')}\n" if cnt else "")
        + "  }\n"
    )
    groups = -(-n // plan.ox)
    rows_k = kb.finish(
        "rows", body, plan.size, groups, shared_decl(plan, "red", "f32"), flops=4 * n * c
    )
    if reduction == "none":
        return [rows_k]

    kb2 = KernelBuilder(graph, node, limits)
    loss2 = kb2.scratch("rows", n, node.type.dtype, "row_loss")
    cnt2 = kb2.scratch("valid", n, node.type.dtype, "row_valid")
    out = kb2.write(node_id, "out")
    one = RowPlan(1, 256)
    body = thread_coords(one, "wg", 1) + "  var acc = vec2<f32>(0.0, 0.0);\n"
    pair = lambda r: f"vec2<f32>({loss2}[{r}], {cnt2}[{r}])"  # noqa: E731
    body += strided_loop(one, "0u", u(n), pair, _ADD, -(-n // 256), "vec2<f32>(0.0, 0.0)")
    body += tree(one, "red", "acc", _ADD, "total")
    result = "total.x / max(total.y, 1.0)" if reduction == "mean" else "total.x"
    body += f"  if (lid == 0u) {{ {kb2.store(out, '0u', result)} }}\n"
    sum_k = kb2.finish("reduce", body, one.size, 1, shared_decl(one, "red", "vec2<f32>"))
    return [rows_k, sum_k]


def lower_cross_entropy_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``(softmax(logits) - (1 - e) * onehot(target) - e / C) * g / divisor`` per row (e the
    label smoothing; g per row for ``"none"``); 0 on ignored rows."""
    node = graph[node_id]
    n, c, ignore, reduction = _ce_dims(graph, node_id)
    if n == 0 or c == 0:
        return []
    ls = _smoothing(node)
    kernels = []
    counted = ignore is not None and reduction == "mean"
    if counted:
        kb = KernelBuilder(graph, node, limits)
        tgt = kb.read(node.inputs[1], "labels")
        div = kb.scratch("divisor", 1, node.type.dtype, "divisor")
        one = RowPlan(1, 256)
        body = thread_coords(one, "wg", 1) + "  var acc = 0u;\n"
        flag = lambda r: f"select(0u, 1u, {_valid_expr(tgt.at(r), ignore)})"  # noqa: E731
        body += strided_loop(one, "0u", u(n), flag, _ADD, -(-n // 256))
        body += tree(one, "red", "acc", _ADD, "total")
        body += f"  if (lid == 0u) {{ {div}[0] = max(f32(total), 1.0); }}\n"
        kernels.append(kb.finish("count", body, 256, 1, shared_decl(one, "red", "u32")))

    plan = plan_rows(n, c, True)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "logits")
    tgt = kb.read(node.inputs[1], "labels")
    g = kb.read(node.inputs[2], "g")
    out = kb.write(node_id, "out")
    if counted:
        divisor = kb.scratch("divisor", 1, node.type.dtype, "divisor") + "[0]"
    else:
        divisor = f32_literal(float(n) if reduction == "mean" else 1.0)
    body = thread_coords(plan, "wg", n) + f"  let base = rowc * {u(c)};\n"
    body += _max_sum(plan, lambda j: x.at(f"base + {j}"), c)
    body += (
        f"  let t = {tgt.at('rowc')};\n"
        f"  let valid = {_valid_expr('t', ignore)};\n"
        f"  let tc = u32(clamp(t, 0i, {int_literal(c - 1, DType.i32)}));\n"
        f"  let scale = {g.at('rowc' if reduction == 'none' else '0u')} / {divisor};\n"
    )
    onehot = f"select(0.0, {f32_literal(1.0 - ls)}, r == tc)"
    if ls:
        onehot += f" - {f32_literal(ls / c)}"
    write = (
        f"let d = exp(({x.at('base + r')} - mx) - lse) - {onehot};\n"
        f"{kb.store(out, 'base + r', 'select(0.0, d * scale, valid)')}\n"
    )
    body += "  if (live) {\n" + indent(for_each(plan, "0u", u(c), write), 1)
    body += "  }\n"
    groups = -(-n // plan.ox)
    helpers = shared_decl(plan, "red", "f32")
    kernels.append(kb.finish("rows", body, plan.size, groups, helpers, flops=6 * n * c))
    return kernels

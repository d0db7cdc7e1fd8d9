"""WGSL lowerings of the normalization family (layer_norm, rms_norm, group_norm, batch_norm,
their backward ops and the running-statistics update).

Every norm kernel is first asked of the row archetype (``team``: one team per group,
vec4 loads, subgroup reductions, the group in registers or walked in chunks). What it declines
is lowered here by the general kernels: constant inputs, batch_norm channels and group_norm
weight-gradient channel sums whose contiguous runs are shorter than ``team.MIN_SEG``
(batch_norm of [N, C], say), and the channel sums of layer_norm / rms_norm weight gradients
(one strided column per weight element). These walk the index maps of ``layout`` and
schedule their sequences with ``rowwise.rows.plan_rows``: one workgroup per long contiguous
group, 32 neighbouring groups per workgroup when a group is strided, one thread per group
below 64 elements. Statistics are f32 and two-pass over ``x - shift`` (shift = the group's first
element, so a large common offset cancels exactly): the group sum (blocked partial sums, then
a pairwise tree) gives the mean, a second pass sums squared deviations (rms_norm: squares, no
shift); ``rstd = inverseSqrt(var + eps)``. Backward kernels recompute the statistics from x
(the group is read again, usually from cache) rather than saving them; the weight gradient
first writes (shift, mean, rstd) per group to scratch, then sums ``g * xhat`` over each
channel. batch_norm in eval mode is one elementwise map with the running statistics.

A large group_norm with few groups is first asked of ``split`` (each group over several
workgroups, two dispatches), and ``passes.fuse_norm``'s groups (group_norm + silu; the input
gradient with the SiLU gradient, the weight gradient's statistics and the bias sum) come
through ``lower_norm_act`` / ``lower_norm_backward_act`` (``activation``), as do its
layer_norm / rms_norm pairs (the input gradient's team kernel storing the row statistics, then
the weight gradient's column sums, ``_channel_sums``, with layer_norm's bias sum).
"""

from __future__ import annotations

import math

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src, indent
from ..core.layout import PER_THREAD, WG, contiguous_strides, element_slots
from ..core.literals import f32_literal, u
from ..elementwise.maps import emit_map, lower_fill
from ..optim import is_nonfinite
from ..rowwise.rows import (
    RowPlan,
    for_each,
    narrowed,
    plan_rows,
    shared_decl,
    strided_loop,
    thread_coords,
    tree,
)
from .layout import Layout, channel_layout, group_layout
from .split import lower_group_norm_backward_split, lower_group_norm_split
from .team import (
    _plan_channels,
    kind_of,
    lower_norm_backward_team,
    lower_norm_team,
    plan_groups,
    stats_team,
    update_stats_stores,
    update_stats_team,
    weight_backward_team,
)

_ADD = lambda a, b: f"{a} + {b}"  # noqa: E731
_ZERO2 = "vec2<f32>(0.0, 0.0)"


def _plan(lay: Layout) -> RowPlan:
    return plan_rows(lay.count, lay.length, lay.contiguous)


def _stats(plan: RowPlan, lay: Layout, x: Src, rms: bool, eps: float) -> str:
    """Statements leaving, in every thread of group ``rowc``: ``shift`` (its first element),
    ``mean`` (the mean of x - shift), ``ssd`` (the sum of squared deviations) and ``rstd``, so
    that ``(x - shift) - mean`` is the centred value; rms_norm has shift = mean = 0.

    Subtracting the first element before summing (the shifted-data algorithm) cancels a large
    common offset exactly, so f32 statistics stay accurate when |mean| >> std.
    """
    m = lay.length
    per = -(-m // plan.ry)

    def xv(k: str) -> str:
        return f"({x.at(f'g_off(rowc, {k})')} - shift)"

    if rms:
        body = "  let shift = 0.0;\n  let mean = 0.0;\n"
    else:
        body = f"  let shift = {x.at('g_off(rowc, 0u)')};\n  var s_acc = 0.0;\n"
        body += strided_loop(plan, "0u", u(m), xv, _ADD, per, "0.0", "s_acc")
        body += tree(plan, "red", "s_acc", _ADD, "s_tot")
        body += f"  let mean = s_tot / {f32_literal(m)};\n"
    body += "  var q_acc = 0.0;\n"
    body += strided_loop(
        plan, "0u", u(m), lambda k: f"sq({xv(k)} - mean)", _ADD, per, "0.0", "q_acc"
    )
    body += tree(plan, "red", "q_acc", _ADD, "ssd")
    body += f"  let rstd = inverseSqrt(ssd / {f32_literal(m)} + {f32_literal(eps)});\n"
    return body


_SQ = "fn sq(v: f32) -> f32 { return v * v; }\n"


def lower_norm_act(
    graph: Graph, node_id: int, act: int, store: bool, limits: Limits
) -> list[KernelSource] | None:
    """group_norm (``node_id``) with the SiLU node ``act`` reading it as one kernel (two when
    split), y stored only with ``store``; None when only the general kernels serve it (the
    pair then stays two dispatches: ``norm_act_fusible``)."""
    ks = lower_group_norm_split(graph, node_id, limits, act, store)
    return ks or lower_norm_team(graph, node_id, limits, act, store)


def lower_norm_backward_act(
    graph: Graph,
    node_id: int,
    pro: int | None,
    store: bool,
    wgrad: int | None,
    limits: Limits,
    bias: int | None = None,
    residual: int | None = None,
) -> list[KernelSource] | None:
    """group_norm_backward (``node_id``) whose g is computed from the ``silu_backward`` node
    ``pro``'s operands (None: g read as usual), g stored only with ``store``; with ``wgrad``
    (its group_norm_weight_backward) the kernel also leaves the group statistics, and the
    weight gradient's channel sums follow, reading them (and with ``bias``, the bias
    gradient's ``sum`` node, summing g too). One kernel (two when split), plus the channel
    sums; None when a part has no such lowering. layer_norm_backward / rms_norm_backward
    (``pro`` None) likewise: the team kernel, then ``_channel_sums`` (one strided column per
    weight element); with ``residual`` (the ``add`` reading their input gradient) the team
    kernel stores the add's value instead (``team.lower_norm_backward_team``)."""
    kind = kind_of(graph[node_id].op)
    ks = None
    if kind == "group_norm":
        ks = lower_group_norm_backward_split(graph, node_id, limits, pro, store, wgrad is not None)
    ks = ks or lower_norm_backward_team(
        graph, node_id, limits, pro, store, wgrad is not None, residual
    )
    if ks is None or wgrad is None:
        return ks
    if kind == "group_norm":
        sums = weight_backward_team(graph, wgrad, limits, with_stats=False, bias=bias)
    else:
        sums = [_channel_sums(graph, wgrad, limits, bias)]
    return None if sums is None else ks + sums


def norm_act_fusible(graph: Graph, node_id: int, others: tuple[int, ...], limits: Limits) -> bool:
    """Whether ``lower_norm_act`` (a group_norm, ``others`` its silu) or
    ``lower_norm_backward_act`` (a group_norm_backward, ``others`` its silu_backward and / or
    group_norm_weight_backward; a layer_norm_backward / rms_norm_backward, ``others`` its
    weight gradient and / or the residual ``add`` reading it) serves ``node_id``
    (``passes.fuse_norm``): the team kernels plan its groups (and group_norm's weight gradient
    channels), the groups are longer than one element and the weight gradient's channels not
    empty, and x, g, the SiLU gradient's operands or the
    residual are not constants."""
    node = graph[node_id]
    pairs = ("group_norm", "group_norm_backward", "layer_norm_backward", "rms_norm_backward")
    if node.op not in pairs or node.type.numel == 0:
        return False
    kind = kind_of(node.op)
    kb = KernelBuilder(graph, node, limits)
    shape = graph[node.inputs[0]].type.shape
    reads = [node.inputs[0]]
    for o in others:
        if graph[o].op == "silu_backward":
            if kind != "group_norm":
                return False
            reads += list(graph[o].inputs)
        elif graph[o].op == "add":  # passes.fuse_norm.residual_add
            if kind == "group_norm":
                return False
            reads += [v for v in graph[o].inputs if v != node_id]
        elif graph[o].op == f"{kind}_weight_backward":
            if kind == "group_norm":
                n, c, s = shape[0], shape[1], math.prod(shape[2:])
                if _plan_channels(n, c, s, limits) is None:
                    return False
            if channel_layout(shape, kind, node.attr_dict).length == 0:
                return False
            reads.append(node.inputs[2])
    if any(kb.read(v, f"v{k}").literal is not None for k, v in enumerate(reads)):
        return False
    if plan_groups(shape, kind, node.attr_dict, limits) is None:
        return False
    if node.op.endswith("_backward"):
        return group_layout(shape, kind, node.attr_dict).length > 1  # else a fill
    return True


def lower_norm(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """layer_norm / rms_norm / group_norm / batch_norm (training): one kernel per group."""
    node = graph[node_id]
    kind = kind_of(node.op)
    if kind == "batch_norm" and not node.attr("training"):
        return _lower_batch_norm_eval(graph, node_id, limits)
    ks = lower_group_norm_split(graph, node_id, limits) if kind == "group_norm" else None
    ks = ks or lower_norm_team(graph, node_id, limits)
    if ks is not None:
        return ks
    lay = group_layout(node.type.shape, kind, node.attr_dict)
    plan = _plan(lay)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    w = kb.read(node.inputs[1], "weight")
    b = kb.read(node.inputs[2], "bias") if len(node.inputs) > 2 else Src(w.type, literal="0.0")
    out = kb.write(node_id, "out")
    body = thread_coords(plan, "wg", lay.count)
    body += _stats(plan, lay, x, kind == "rms_norm", node.attr("eps"))
    write = (
        "let o = g_off(rowc, r);\nlet c = g_aux(rowc, r);\n"
        f"let y_o = (({x.at('o')} - shift) - mean) * rstd * {w.at('c')} + {b.at('c')};\n"
        f"{kb.store(out, 'o', 'y_o')}\n"
    )
    body += "  if (live) {\n" + indent(for_each(plan, "0u", u(lay.length), write)) + "  }\n"
    helpers = shared_decl(plan, "red", "f32") + _SQ + lay.helpers("g")
    n = node.type.numel
    groups = -(-lay.count // plan.ox)
    return [kb.finish("", body, plan.size, groups, helpers, 8 * n, 2 * node.type.nbytes)]


def lower_norm_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``dx = rstd * (gw - mean(gw) - xhat * mean(gw * xhat))`` per group, ``gw = g * w``."""
    node = graph[node_id]
    kind = kind_of(node.op)
    rms = kind == "rms_norm"
    lay = group_layout(node.type.shape, kind, node.attr_dict)
    if lay.length == 1 and not rms:
        # A one-element group normalizes to 0 whatever x is: dx is exactly 0. Computing it
        # as gw - mean(gw) leaves FMA rounding times rstd = 1/sqrt(eps) on some GPUs.
        return lower_fill(graph, node_id, limits, 0.0)
    ks = lower_group_norm_backward_split(graph, node_id, limits) if kind == "group_norm" else None
    ks = ks or lower_norm_backward_team(graph, node_id, limits)
    if ks is not None:
        return ks
    plan = _plan(lay)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    w = kb.read(node.inputs[1], "weight")
    g = kb.read(node.inputs[2], "g")
    out = kb.write(node_id, "dx")
    m = lay.length
    inv_m = f32_literal(1.0 / m)
    body = thread_coords(plan, "wg", lay.count)
    body += _stats(plan, lay, x, rms, node.attr("eps"))
    body += f"  var a_acc = {_ZERO2};\n"
    term = lambda k: f"dterm(rowc, {k}, shift, mean, rstd)"  # noqa: E731
    body += strided_loop(plan, "0u", u(m), term, _ADD, -(-m // plan.ry), _ZERO2, "a_acc")
    body += tree(plan, "red2", "a_acc", _ADD, "a_tot")
    centre = "" if rms else f" - a_tot.x * {inv_m}"
    write = (
        "let o = g_off(rowc, r);\n"
        f"let gw = {g.at('o')} * {w.at('g_aux(rowc, r)')};\n"
        f"let xh = (({x.at('o')} - shift) - mean) * rstd;\n"
        f"{kb.store(out, 'o', f'rstd * (gw{centre} - xh * (a_tot.y * {inv_m}))')}\n"
    )
    body += "  if (live) {\n" + indent(for_each(plan, "0u", u(m), write)) + "  }\n"
    dterm = (
        "fn dterm(grp: u32, k: u32, shift: f32, mean: f32, rstd: f32) -> vec2<f32> {\n"
        "  let o = g_off(grp, k);\n"
        f"  let gw = {g.at('o')} * {w.at('g_aux(grp, k)')};\n"
        f"  return vec2<f32>(gw, gw * ((({x.at('o')} - shift) - mean) * rstd));\n"
        "}\n"
    )
    helpers = (
        shared_decl(plan, "red", "f32")
        + shared_decl(plan, "red2", "vec2<f32>")
        + _SQ
        + lay.helpers("g")
        + dterm
    )
    n = node.type.numel
    groups = -(-lay.count // plan.ox)
    return [kb.finish("", body, plan.size, groups, helpers, 14 * n, 3 * node.type.nbytes)]


def _stats_kernel(graph: Graph, node_id: int, limits: Limits) -> KernelSource:
    """(shift, mean, rstd) per group into scratch ``stats``, with the rows kernels."""
    node = graph[node_id]
    kind = kind_of(node.op)
    x_id = node.inputs[0]
    lay = group_layout(graph[x_id].type.shape, kind, node.attr_dict)
    plan = _plan(lay)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(x_id, "x")
    st = kb.scratch("stats", 3 * lay.count, node.type.dtype, "stats")
    body = thread_coords(plan, "wg", lay.count)
    body += _stats(plan, lay, x, kind == "rms_norm", node.attr("eps"))
    body += (
        f"  if (live && y == 0u) {{\n    {st}[3u * row] = shift;\n"
        f"    {st}[3u * row + 1u] = mean;\n    {st}[3u * row + 2u] = rstd;\n  }}\n"
    )
    helpers = shared_decl(plan, "red", "f32") + _SQ + lay.helpers("g")
    return kb.finish("stats", body, plan.size, -(-lay.count // plan.ox), helpers)


def _weight_layouts(graph: Graph, node_id: int):
    """(x, its group layout, its channel layout) of a ``*_weight_backward`` node."""
    node = graph[node_id]
    kind = kind_of(node.op)
    x_id = node.inputs[0]
    shape = graph[x_id].type.shape
    return (
        x_id,
        group_layout(shape, kind, node.attr_dict),
        channel_layout(shape, kind, node.attr_dict),
    )


def lower_norm_weight_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``dweight[c] = sum g * xhat`` over channel c: (mean, rstd) per group into scratch, then
    one reduction per channel."""
    x_id, lay, chan = _weight_layouts(graph, node_id)
    if chan.length == 0 or lay.length == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    ks = weight_backward_team(graph, node_id, limits)
    if ks is not None:
        return ks
    stats_k = stats_team(graph, node_id, limits, x_id) or _stats_kernel(graph, node_id, limits)
    return [stats_k, _channel_sums(graph, node_id, limits)]


def _channel_sums(
    graph: Graph, node_id: int, limits: Limits, bias: int | None = None
) -> KernelSource:
    """The weight gradient's ``dweight[c] = sum g * xhat`` over channel c, with the group
    statistics (shift, mean, rstd) read from scratch ``stats`` (left by ``_stats_kernel``,
    ``team.stats_team`` or the input gradient's team kernel: ``team.stats_store``). With
    ``bias`` (the bias gradient's ``sum`` node over the same channels) the kernel also stores
    ``sum g`` there, from the same walk (a vec2 accumulator: the weight sums keep their
    order)."""
    node = graph[node_id]
    x_id, lay, chan = _weight_layouts(graph, node_id)
    g_id = node.inputs[1]
    cplan = narrowed(_plan(chan), chan.count, chan.length)  # few long channels: more threads
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(x_id, "x")
    g = kb.read(g_id, "g")
    st = kb.scratch("stats", 3 * lay.count, node.type.dtype, "stats")
    out = kb.write(node_id, "dweight")
    wterm = (
        "fn wterm(c: u32, k: u32) -> f32 {\n"
        "  let o = c_off(c, k);\n  let s = 3u * c_aux(c, k);\n"
        f"  return {g.at('o')} * ((({x.at('o')} - {st}[s]) - {st}[s + 1u]) * {st}[s + 2u]);\n"
        "}\n"
    )
    per = -(-chan.length // cplan.ry)
    body = thread_coords(cplan, "wg", chan.count)
    if bias is None:
        body += "  var acc = 0.0;\n"
        body += strided_loop(
            cplan, "0u", u(chan.length), lambda k: f"wterm(rowc, {k})", _ADD, per, "0.0"
        )
        body += tree(cplan, "red", "acc", _ADD, "total")
        stores = kb.store(out, "row", "total")
        helpers = shared_decl(cplan, "red", "f32")
    else:
        # One walk, (g * xhat, g) per element: the weight sums keep their order, the bias
        # sums are the sum kernel's in another.
        bout = kb.write(bias, "dbias")
        body += f"  var acc = {_ZERO2};\n"
        term = lambda k: f"vec2<f32>(wterm(rowc, {k}), {g.at(f'c_off(rowc, {k})')})"  # noqa: E731
        body += strided_loop(cplan, "0u", u(chan.length), term, _ADD, per, _ZERO2)
        body += tree(cplan, "red2", "acc", _ADD, "total")
        stores = f"{kb.store(out, 'row', 'total.x')} {kb.store(bout, 'row', 'total.y')}"
        helpers = shared_decl(cplan, "red2", "vec2<f32>")
    body += f"  if (live && y == 0u) {{ {stores} }}\n"
    helpers += chan.helpers("c") + wterm
    return kb.finish("reduce", body, cplan.size, -(-chan.count // cplan.ox), helpers)


def lower_update_stats(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Running mean / unbiased variance update of batch_norm, in place, one group per
    channel: ``running = momentum * stat + (1 - momentum) * running``; nothing is written when
    the optional guard clip operand is non-finite. Also ``batch_norm_stats``, which stores
    the statistics themselves (``ops/norm.py``; ``team.update_stats_stores``)."""
    node = graph[node_id]
    x_id = node.inputs[0]
    shape = graph[x_id].type.shape
    lay = group_layout(shape, "batch_norm", {})
    if lay.count == 0:
        return []
    ks = update_stats_team(graph, node_id, limits)
    if ks is not None:
        return ks
    plan = _plan(lay)
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(x_id, "x")
    kept, stores = update_stats_stores(kb, node, lay.length)
    body = thread_coords(plan, "wg", lay.count) + _stats(plan, lay, x, False, 0.0)
    body += f"  if (live && y == 0u{kept}) {{\n" + "".join(f"    {s}\n" for s in stores)
    body += "  }\n"
    helpers = shared_decl(plan, "red", "f32") + _SQ + lay.helpers("g")
    return [kb.finish("", body, plan.size, -(-lay.count // plan.ox), helpers)]


def lower_update_stats_into(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``batch_norm_update_stats_into(stats, src_mean, src_var, mean, var, take_src, clip)``
    (``ops/norm.py``), one channel per element slot: ``mean = momentum * stats[0] + (1 -
    momentum) * (src_mean if take_src else mean)``, likewise ``var`` from ``stats[1]``. A
    non-finite ``clip`` (the guard skipped the step) returns before any load or store, as the
    optimizer updates do (no barrier follows, so the early return is safe)."""
    node = graph[node_id]
    st_id, sm_id, sv_id, m_id, v_id, t_id, c_id = node.inputs
    c = graph[m_id].type.numel
    if c == 0:
        return []
    kb = KernelBuilder(graph, node, limits)
    stats = kb.read(st_id, "stats")
    sm, sv = kb.read(sm_id, "src_mean"), kb.read(sv_id, "src_var")
    rm, rv = kb.write(m_id, "running_mean"), kb.write(v_id, "running_var")
    take, clip = kb.read(t_id, "take_src"), kb.read(c_id, "clip")
    mom = node.attr("momentum")
    a, b = f32_literal(mom), f32_literal(1.0 - mom)
    slots, groups, guard = element_slots(c)
    lines = [slots.rstrip(), f"  let take = {take.at('0u')} != 0.0;"]
    if clip.literal is None:
        lines.append(f"  if {is_nonfinite(clip.at('0u'))} {{ return; }}")
    for e in range(PER_THREAD):
        j = f"j{e}"
        base_m = f"select({kb.load(rm, j)}, {sm.at(j)}, take)"
        base_v = f"select({kb.load(rv, j)}, {sv.at(j)}, take)"
        lines.append(f"  let m{e} = {a} * {stats.at(j)} + {b} * {base_m};")
        lines.append(f"  let v{e} = {a} * {stats.at(f'{u(c)} + {j}')} + {b} * {base_v};")
    for e in range(PER_THREAD):
        stores = f"{kb.store(rm, f'i{e}', f'm{e}')} {kb.store(rv, f'i{e}', f'v{e}')}"
        lines.append("  " + guard(e, stores))
    return [kb.finish("", "\n".join(lines), WG, groups, flops=6 * c, nbytes=28 * c)]


def _lower_batch_norm_eval(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``(x - running_mean) * inverseSqrt(running_var + eps) * w + b``, elementwise."""
    node = graph[node_id]
    shape = node.type.shape
    kb = KernelBuilder(graph, node, limits)
    names = ("x", "running_mean", "running_var", "weight", "bias")
    srcs = [kb.read(i, name) for i, name in zip(node.inputs, names, strict=True)]
    per_channel = tuple(1 if d == 1 else 0 for d in range(len(shape)))
    strides = [contiguous_strides(shape)] + [
        per_channel if s.type.shape else (0,) * len(shape) for s in srcs[1:]
    ]
    eps = f32_literal(node.attr("eps"))
    expr = f"(v0 - v1) * inverseSqrt(v2 + {eps}) * v3 + v4"
    return [emit_map(kb, node_id, list(zip(srcs, strides)), expr)]

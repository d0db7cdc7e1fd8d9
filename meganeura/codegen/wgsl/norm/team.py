"""The normalizations on the row archetype (``rowwise.team``): layer_norm, rms_norm, group_norm and
batch_norm (training) forward, input gradient, weight gradient and batch_norm's running
statistics, one team per group.

Rows. A group is a team row (``norm_ref.group_dims``): layer_norm / rms_norm a contiguous row
whose weight is shaped like it; group_norm a contiguous run of C/G channels x H*W whose unit
``j`` has weight ``channel = (row % G) * C/G + j / (H*W / width)`` (vec4 units when 4 divides
H*W, so a unit never straddles two channels); batch_norm channel c: N segments of H*W,
``stride = C*H*W``, weight ``c``. Segmented rows of fewer than ``MIN_SEG`` elements per segment
(batch_norm of [N, C], say) read too scattered for a team and are left to the general kernels
(the lowerings return None), as are constant inputs.

Statistics (f32). Both modes subtract ``shift``, the group's first element, before anything
else, so a large common offset cancels exactly (the shifted-data algorithm; rms_norm: shift =
mean = 0, ``ssd = sum x^2``).
  * Register mode: two passes over the registers: ``mean`` of x - shift (team sum), then
    ``ssd = sum ((x - shift) - mean)^2`` (team sum), so exactly the general kernels' two-pass
    statistics.
  * Chunked mode: one pass over the row. Each chunk's own mean and squared deviations come from
    its registers (two-pass, exact), and merge into the thread's running (count, sum, M2) by
    Chan et al.'s update ``M2 += M2_c + d^2 n n_c / (n + n_c)`` (d: the difference of the two
    means). Then the team sums the sums (the mean) and each thread's ``M2 + n (m_t - mean)^2``
    (``ssd``): the exact decomposition of the group's squared deviations, so no E[x^2] - E[x]^2
    cancellation anywhere. ``rstd = inverseSqrt(ssd / n + eps)``.

Input gradient, with ``gw = g * w`` and ``xc = (x - shift) - mean``: ``dx = rstd * (gw -
mean(gw) - xc rstd * rstd mean(gw xc))`` (rms_norm: no ``mean(gw)``), the statistics pass also
summing ``gw`` and ``gw * xc`` (one team reduction of a vector with ``ssd``); in chunked mode
``sum gw (x - shift - m)`` is carried per thread about its running mean ``m`` and moved to the
group mean like M2 (``P += (m_old - m_new) * sum gw``), then the row is read again to write dx.

Weight gradient ``sum g * xhat`` per channel: batch_norm's channel is its group, so one kernel
(the statistics pass with w = 1: ``rstd * sum g xc``); group_norm writes (shift, mean, rstd) per
group to scratch, then sums over channel rows (batch_norm's segmented layout) reading them.
"""

from __future__ import annotations

import math
from collections.abc import Callable

from ....dtypes import DType
from ....graph.ir import Graph
from ....ops.norm_ref import group_dims
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src
from ..core.literals import f32_literal, u
from ..optim import is_nonfinite
from ..rowwise.team import Chunk, RowKernel, TeamPlan, plan_team, sources_bound
from .activation import GradIn, act_helpers, as_stored, bind_outputs, store_normalized

MIN_SEG = 16  # elements per segment below which a segmented row is left to the rows kernels

Index = Callable[[str], str]  # unit index expression -> channel index expression


def kind_of(op: str) -> str:
    """The norm an op belongs to (``group_norm_backward`` -> ``group_norm``).

    Raises:
        KeyError: for an op of no norm.
    """
    for kind in ("layer_norm", "rms_norm", "group_norm", "batch_norm"):
        if op.startswith(kind):
            return kind
    raise KeyError(op)


def _segments(shape: tuple[int, ...]) -> tuple[int, int, int]:
    """(N, C, H*W) of an input [N, C, *]."""
    return shape[0], shape[1], math.prod(shape[2:])


def plan_groups(shape, kind: str, attrs, limits: Limits) -> TeamPlan | None:
    """The team plan over the groups of ``kind`` on ``shape``, or None (rows kernels)."""
    count, length, _ = group_dims(shape, kind, attrs)
    if kind in ("layer_norm", "rms_norm"):
        return plan_team(count, length, limits, chunked=True)
    n, c, s = _segments(shape)
    if kind == "group_norm":
        return plan_team(count, length, limits, align=s, chunked=True)
    return _plan_channels(n, c, s, limits)


def _plan_channels(n: int, c: int, s: int, limits: Limits) -> TeamPlan | None:
    """C rows, row c the N segments of channel c (batch_norm's groups)."""
    if n == 1:
        return plan_team(c, s, limits, chunked=True)
    if s < MIN_SEG:
        return None
    return plan_team(c, n * s, limits, align=s, seg=s, stride=c * s, chunked=True)


def _channel(rk: RowKernel, kind: str, shape, attrs) -> Index | None:
    """The weight index of a unit of the current row (None: the weight is shaped like the
    row, unit-addressable)."""
    if kind in ("layer_norm", "rms_norm"):
        return None
    if kind == "batch_norm":
        return lambda j: "rowc"
    _, c, s = _segments(shape)
    g = attrs["num_groups"]
    segu = s // rk.plan.width
    first = "0u" if g == 1 else f"(rowc % {u(g)}) * {u(c // g)}"
    rk.line(f"let gch = {first};")
    return lambda j: f"gch + {j}" if segu == 1 else f"gch + ({j}) / {u(segu)}"


def _param(rk: RowKernel, src: Src | None, prefix: str, chan: Index | None):
    """How a chunk reads a per-channel operand: ``param(ch)`` emits any loads and returns
    unit i's expression (a literal for a constant; registers for row-shaped weights)."""
    if src is None:
        return lambda ch: lambda i: ""
    if src.literal is not None:
        return lambda ch: lambda i: src.literal
    if chan is None:
        var = rk.bind(src)

        def rowshaped(ch: Chunk):
            for i in range(ch.m):
                rk.line(f"let {prefix}{i} = {rk.kb.load(var, ch.unit(i))};")
            return lambda i: f"{prefix}{i}"

        return rowshaped
    return lambda ch: lambda i: src.at(chan(ch.unit(i)))


def _stats(
    rk: RowKernel, xv: str, rms: bool, eps: float, grad=None, shift_unit: str = "rbase"
) -> Chunk | None:
    """Statements leaving ``shift``, ``mean``, ``ssd`` and ``rstd`` of row ``rowc`` (and with
    ``grad = (g var, weight param)`` also ``d1 = sum gw`` and ``pg = sum gw * xc``). Register
    mode returns its chunk, whose registers ``a*`` (``g*``, ``gw*``, ``xc*``) stay live.
    ``shift`` is the first element of unit ``shift_unit`` (default the row's first unit; the
    split group_norm, ``norm.split``, shifts every chunk of a group by the group's first).
    ``xv``: the binding of x, or (register mode) a callable emitting a chunk's ``a*`` registers
    whose ``first(unit)`` is the expression of that unit's first element (``norm.prologue``:
    x computed from a split-K matmul's partials)."""
    p = rk.plan
    n = f32_literal(p.n)

    def loads(ch: Chunk) -> None:
        xv(ch) if callable(xv) else rk.load(ch, xv, "a")
        if grad is not None:
            gv, wparam = grad
            gv(ch) if callable(gv) else rk.load(ch, gv, "g")
            w = wparam(ch)
            for i in range(ch.m):
                rk.line(f"let gw{i} = g{i} * {w(i)};")

    if rms:
        rk.line("let shift = 0.0;")
        rk.line("let mean = 0.0;")
    else:
        lane = ".x" if p.width == 4 else ""
        # The group's first element: every thread reads it (from cache) rather than wait for
        # a broadcast.
        first = xv.first(shift_unit) if callable(xv) else f"{rk.kb.load(xv, shift_unit)}{lane}"
        rk.line(f"let shift = {first};")
    names = ["ssd"] + (["d1"] if grad is not None and not rms else []) + (["pg"] if grad else [])
    if not p.chunked:
        ch = rk.registers()
        loads(ch)
        if not rms:
            rk.line(f"var s_t = {ch.sum(lambda i: f'(a{i} - shift)')};")
            rk.reduce("s_t", "+", "s_tot")
            rk.line(f"let mean = s_tot / {n};")
        for i in range(ch.m):
            rk.line(f"let xc{i} = (a{i} - shift) - mean;")
        sums = [ch.sum(lambda i: f"sqv(xc{i})")]
        if grad is not None:
            sums += [] if rms else [ch.sum(lambda i: f"gw{i}")]
            sums.append(ch.sum(lambda i: f"gw{i} * xc{i}"))
        rk.reduce_sums(sums, names)
        rk.line(f"let rstd = inverseSqrt(ssd / {n} + {f32_literal(eps)});")
        return ch
    if rms:
        rk.line("var tq = 0.0;")
        rk.line("var tp = 0.0;")

        def body(ch: Chunk) -> None:
            loads(ch)
            rk.line(f"tq = tq + {ch.sum(lambda i: f'sqv(a{i})')};")
            if grad is not None:
                rk.line(f"tp = tp + {ch.sum(lambda i: f'gw{i} * a{i}')};")

        rk.each_chunk(body)
        rk.reduce_sums(["tq", "tp"] if grad is not None else ["tq"], names)
    else:
        for v in ("tn", "ts", "tq", "tb", "tp"):
            rk.line(f"var {v} = 0.0;")
        rk.each_chunk(lambda ch: _merge_chunk(rk, ch, loads, grad is not None))
        rk.reduce("ts", "+", "s_tot")
        rk.line(f"let mean = s_tot / {n};")
        rk.line("let t_d = ts / max(tn, 1.0) - mean;")
        sums = ["tq + tn * t_d * t_d"]
        if grad is not None:
            sums += ["tb", "tp + t_d * tb"]
        rk.reduce_sums(sums, names)
    rk.line(f"let rstd = inverseSqrt(ssd / {n} + {f32_literal(eps)});")
    return None


def _merge_chunk(rk: RowKernel, ch: Chunk, loads, grad: bool) -> None:
    """One chunk's statistics (two-pass over its registers) merged into the thread's running
    ``tn, ts, tq`` (count, sum of x - shift, M2 about the running mean ``ts / tn``) and, with
    ``grad``, ``tb = sum gw``, ``tp = sum gw * (x - shift - ts / tn)``."""
    loads(ch)
    cnt = ch.count()
    rk.line(f"let c_n = {cnt};")
    rk.line(f"let c_s = {ch.sum(lambda i: f'(a{i} - shift)')};")
    rk.line(f"let c_m = c_s / {'c_n' if ch.full else 'max(c_n, 1.0)'};")
    rk.line(f"let c_q = {ch.sum(lambda i: f'sqv((a{i} - shift) - c_m)')};")
    rk.line("let t_m = ts / max(tn, 1.0);")
    rk.line("let n2 = tn + c_n;")
    rk.line("let m2 = (ts + c_s) / max(n2, 1.0);")
    rk.line("tq = tq + c_q + (c_m - t_m) * (c_m - t_m) * (tn * c_n / max(n2, 1.0));")
    if grad:
        rk.line(f"let c_b = {ch.sum(lambda i: f'gw{i}')};")
        rk.line(f"let c_p = {ch.sum(lambda i: f'gw{i} * ((a{i} - shift) - c_m)')};")
        rk.line("tp = tp + (t_m - m2) * tb + c_p + (c_m - m2) * c_b;")
        rk.line("tb = tb + c_b;")
    rk.line("ts = ts + c_s;")
    rk.line("tn = n2;")


def _setup(graph: Graph, node_id: int, limits: Limits, x_id: int, prologue=None, deferred=None):
    node = graph[node_id]
    kind = kind_of(node.op)
    shape = graph[x_id].type.shape
    plan = plan_groups(shape, kind, node.attr_dict, limits)
    if plan is None or (prologue is not None and plan.chunked):
        return None
    kb = KernelBuilder(graph, node, limits, deferred)
    rk = RowKernel(kb, plan)
    if prologue is not None:
        return node, kind, shape, kb, rk, prologue(kb, rk)
    x = kb.read(x_id, "x")
    if not sources_bound(x):
        return None
    return node, kind, shape, kb, rk, rk.bind(x)


def lower_norm_team(
    graph: Graph,
    node_id: int,
    limits: Limits,
    act: int | None = None,
    store: bool = True,
    prologue=None,
    deferred=None,
) -> list[KernelSource] | None:
    """Forward ``((x - shift) - mean) * rstd * w + b`` as one team kernel, or None. With
    ``act`` (a silu node reading this one) the kernel also stores ``silu(y)`` there, and y
    only when ``store``. With ``prologue`` (``(kb, rk) -> x loader``, register mode only, see
    ``_stats``) x is computed in the kernel, not read (``norm.prologue``; ``deferred``: the
    ``KernelBuilder``'s split-K products summed in place)."""
    st = _setup(graph, node_id, limits, graph[node_id].inputs[0], prologue, deferred)
    if st is None:
        return None
    node, kind, shape, kb, rk, xv = st
    w = kb.read(node.inputs[1], "weight")
    b = kb.read(node.inputs[2], "bias") if len(node.inputs) > 2 else None
    outs = bind_outputs(kb, node_id, act, store)
    chan = _channel(rk, kind, shape, node.attr_dict)
    wp, bp = _param(rk, w, "w", chan), _param(rk, b, "b", chan)
    regs = _stats(rk, xv, kind == "rms_norm", node.attr("eps"))

    def write(ch: Chunk) -> None:
        if regs is None:
            rk.load(ch, xv, "a")
        wv, bv = wp(ch), bp(ch)
        plus = (lambda i: f" + {bv(i)}") if b is not None else (lambda i: "")
        store_normalized(
            rk, ch, outs, lambda i: f"((a{i} - shift) - mean) * rstd * {wv(i)}{plus(i)}"
        )

    if regs is not None:
        write(regs)
    else:
        rk.each_chunk(write)
    if act is not None:
        rk.extra_helpers += act_helpers(rk.plan.width)
    return [rk.finish("", 8 * node.type.numel, 2 * node.type.nbytes)]


def lower_norm_backward_team(
    graph: Graph,
    node_id: int,
    limits: Limits,
    pro: int | None = None,
    store: bool = True,
    stats: bool = False,
    residual: int | None = None,
) -> list[KernelSource] | None:
    """Input gradient ``rstd * (gw - d1 / n - xc rstd * (rstd pg / n))`` as one team kernel
    (rms_norm: no ``d1`` term), or None. With ``pro`` (the ``silu_backward`` node producing
    g) g is computed from its operands (``activation.GradIn``) and stored there only with
    ``store``. With ``stats`` the kernel also leaves each group's statistics for the weight
    gradient's channel sums (``stats_store``). With ``residual`` (an ``add`` of the input
    gradient and a value r of its shape: ``passes.fuse_norm.residual_add``) the kernel stores
    ``dx + r`` into the add's value instead of dx (dx rounded to f16 first where it is stored
    so, as the add kernel would read it): the same f32 operations as the two kernels."""
    node = graph[node_id]
    st = _setup(graph, node_id, limits, node.inputs[0])
    if st is None:
        return None
    node, kind, shape, kb, rk, xv = st
    rms = kind == "rms_norm"
    w = kb.read(node.inputs[1], "weight")
    gin = GradIn(rk, node, pro, store)
    if not gin.bound:
        return None
    rv = None
    if residual is not None:
        (r_id,) = [v for v in graph[residual].inputs if v != node_id]
        r = kb.read(r_id, "res")
        if not sources_bound(r):
            return None
        rv = rk.bind(r)
    out = kb.write(node_id if residual is None else residual, "dx")
    gin.bind_output()
    wp = _param(rk, w, "w", _channel(rk, kind, shape, node.attr_dict))
    regs = _stats(rk, xv, rms, node.attr("eps"), (gin, wp))
    if stats:
        stats_store(rk, "row", rk.plan.rows)
    inv_n = f32_literal(1.0 / rk.plan.n)
    centre = "" if rms else " - c1"
    if not rms:
        rk.line(f"let c1 = d1 * {inv_n};")
    rk.line(f"let c2 = rstd * pg * {inv_n};")

    def dx(i: int) -> str:
        return f"rstd * (gw{i}{centre} - (xc{i} * rstd) * c2)"

    def value(i: int) -> str:  # what is stored: dx, or the residual add's dx + r
        if rv is None:
            return dx(i)
        if node.type.dtype is DType.f16:  # dx as the add kernel would read it back
            return f"{as_stored(dx(i), rk.plan.width)} + res{i}"
        return f"{dx(i)} + res{i}"

    def store(ch: Chunk) -> None:
        if rv is not None:
            rk.load(ch, rv, "res")
        rk.store(ch, out, value)
        gin.store(ch)

    if regs is not None:
        store(regs)
    else:

        def write(ch: Chunk) -> None:
            rk.load(ch, xv, "a")
            gin(ch)
            wv = wp(ch)
            for i in range(ch.m):
                rk.line(f"let gw{i} = g{i} * {wv(i)};")
                rk.line(f"let xc{i} = (a{i} - shift) - mean;")
            store(ch)

        rk.each_chunk(write)
    rk.extra_helpers = gin.helpers()
    res = rv is not None  # one more add and one more operand read per element
    return [rk.finish("", (14 + res) * node.type.numel, (3 + res) * node.type.nbytes)]


def stats_team(graph: Graph, node_id: int, limits: Limits, x_id: int) -> KernelSource | None:
    """(shift, mean, rstd) of every group into scratch ``stats`` [3 * groups], or None."""
    st = _setup(graph, node_id, limits, x_id)
    if st is None:
        return None
    node, kind, shape, kb, rk, xv = st
    _stats(rk, xv, kind == "rms_norm", node.attr("eps"))
    s = kb.scratch("stats", 3 * rk.plan.rows, node.type.dtype, "stats")
    rk.line("if (live && y == 0u) {")
    for k, v in enumerate(("shift", "mean", "rstd")):
        rk.line(f"  {s}[3u * row + {u(k)}] = {v};")
    rk.line("}")
    return rk.finish("stats")


def weight_backward_team(
    graph: Graph, node_id: int, limits: Limits, with_stats: bool = True, bias: int | None = None
) -> list[KernelSource] | None:
    """batch_norm's ``dweight[c] = rstd * sum g * xc`` over channel c as one team kernel; group
    norm's channel sums of ``g * xhat`` with the group statistics from scratch (the stats
    kernel comes first; without ``with_stats`` only the sums, the statistics left in scratch
    by the input gradient's kernel: ``stats_store``; with ``bias``, the ``sum`` node of the
    bias gradient over the same channels, whose ``sum g`` the channel walk also takes); None
    for the other norms and layouts the teams do not serve."""
    node = graph[node_id]
    x_id, g_id = node.inputs
    kind = kind_of(node.op)
    if kind == "batch_norm":
        st = _setup(graph, node_id, limits, x_id)
        if st is None:
            return None
        node, kind, shape, kb, rk, xv = st
        g = kb.read(g_id, "g")
        out = kb.write(node_id, "dweight")
        one = Src(g.type, literal="1.0")
        _stats(rk, xv, False, node.attr("eps"), (rk.bind(g), _param(rk, one, "w", None)))
        rk.line(f"if (live && y == 0u) {{ {kb.store(out, 'row', 'rstd * pg')} }}")
        return [rk.finish("")]
    if kind != "group_norm":
        return None
    shape = graph[x_id].type.shape
    n, c, s = _segments(shape)
    plan = _plan_channels(n, c, s, limits)
    stats_k = stats_team(graph, node_id, limits, x_id) if with_stats else None
    if plan is None or (with_stats and stats_k is None):
        return None
    groups = node.attr("num_groups")
    kb = KernelBuilder(graph, node, limits)
    x, g = kb.read(x_id, "x"), kb.read(g_id, "g")
    if not sources_bound(g):
        return None
    st = kb.scratch("stats", 3 * n * groups, node.type.dtype, "stats")
    out = kb.write(node_id, "dweight")
    bout = None if bias is None else kb.write(bias, "dbias")
    rk = RowKernel(kb, plan)
    xv, gv = rk.bind(x), rk.bind(g)
    segu = s // plan.width
    rk.line(f"let gj = rowc / {u(c // groups)};")
    rk.line("var acc = 0.0;")
    rk.line("var bacc = 0.0;")

    def body(ch: Chunk) -> None:
        rk.load(ch, xv, "a")
        rk.load(ch, gv, "g")
        if bout is not None:
            rk.line(f"bacc = bacc + {ch.sum(lambda i: f'g{i}')};")
        for i in range(ch.m):
            j = ch.unit(i)
            sample = f"({j}) / {u(segu)}" if plan.segmented else "0u"
            rk.line(f"let s{i} = 3u * ({sample} * {u(groups)} + gj);")
        term = lambda i: f"g{i} * (((a{i} - {st}[s{i}]) - {st}[s{i} + 1u]) * {st}[s{i} + 2u])"  # noqa: E731
        rk.line(f"acc = acc + {ch.sum(term)};")

    rk.each_chunk(body)
    if bout is None:
        rk.reduce("acc", "+", "total")
        rk.line(f"if (live && y == 0u) {{ {kb.store(out, 'row', 'total')} }}")
    else:
        rk.reduce_sums(["acc", "bacc"], ["total", "btotal"])
        stores = f"{kb.store(out, 'row', 'total')} {kb.store(bout, 'row', 'btotal')}"
        rk.line(f"if (live && y == 0u) {{ {stores} }}")
    return [stats_k, rk.finish("reduce")] if with_stats else [rk.finish("reduce")]


def stats_store(rk: RowKernel, group: str, count: int, cond: str = "") -> None:
    """Store ``shift, mean, rstd`` of group ``group`` into scratch ``stats`` [3 * count] (the
    weight gradient's: group_norm's ``weight_backward_team``, layer_norm's and rms_norm's column
    sums ``lowering._channel_sums``) from thread 0 of live rows (``cond``: a further WGSL
    condition, `` && ...``)."""
    st = rk.kb.scratch("stats", 3 * count, rk.kb.node.type.dtype, "stats")
    rk.line(f"if (live && y == 0u{cond}) {{")
    for k, v in enumerate(("shift", "mean", "rstd")):
        rk.line(f"  {st}[3u * ({group}) + {u(k)}] = {v};")
    rk.line("}")


def update_stats_stores(kb: KernelBuilder, node, m: int) -> tuple[str, list[str]]:
    """How ``batch_norm_update_stats`` (or ``batch_norm_stats``) stores channel ``row``'s
    statistics, given ``shift + mean`` and ``ssd`` (the sum of squared deviations over ``m``
    values).

    Returns:
        (the WGSL condition suffix `` && ...`` or ``""``, the store statements). The condition
        is false when the guard's clip operand is non-finite (the guard skipped the step,
        ``ops/update.py``): the statistics are still computed, so the kernel's workgroup
        barriers stay in uniform control flow, but not stored, and the running statistics
        keep their bits as the parameters do.
    """
    ins = node.inputs
    if node.op == "batch_norm_stats":  # [2, C]: the mean, then the unbiased variance
        out = kb.write(node.id, "stats")
        var = f"ssd / {f32_literal(m - 1)}"
        c = u(node.type.shape[1])
        return "", [kb.store(out, "row", "shift + mean"), kb.store(out, f"{c} + row", var)]
    mom = node.attr("momentum")
    a, b = f32_literal(mom), f32_literal(1.0 - mom)
    rm, rv = kb.write(ins[1], "running_mean"), kb.write(ins[2], "running_var")
    base_m, base_v = f"{rm}[row]", f"{rv}[row]"
    clip_id = ins[3] if len(ins) == 4 else None
    kept = ""
    if clip_id is not None:
        kept = f" && !{is_nonfinite(kb.read(clip_id, 'clip').at('0u'))}"
    stores = [
        f"{rm}[row] = {a} * (shift + mean) + {b} * {base_m};",
        f"{rv}[row] = {a} * (ssd / {f32_literal(m - 1)}) + {b} * {base_v};",
    ]
    return kept, stores


def update_stats_team(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource] | None:
    """batch_norm's running statistics (``lowering.lower_update_stats``) as one team kernel."""
    node = graph[node_id]
    x_id = node.inputs[0]
    shape = graph[x_id].type.shape
    n, c, s = _segments(shape)
    plan = _plan_channels(n, c, s, limits)
    if plan is None:
        return None
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(x_id, "x")
    if not sources_bound(x):
        return None
    kept, stores = update_stats_stores(kb, node, plan.n)
    rk = RowKernel(kb, plan)
    _stats(rk, rk.bind(x), False, 0.0)
    rk.line(f"if (live && y == 0u{kept}) {{")
    for line in stores:
        rk.line(f"  {line}")
    rk.line("}")
    return [rk.finish("")]

"""group_norm forward and input gradient with each group split across several workgroups.

One team per group (``norm.team``) leaves most of a large GPU idle when the groups are few and
long: a U-Net's ``[4, 128, 64, 64]`` with 32 groups is 128 teams of 16384 elements, so at
most 128 workgroups on the H200's 132 multiprocessors, and the forward ran at 36% of copy
bandwidth (``bench/results/bandwidth_gn_h200.json``). Here the group is cut into ``P`` equal
contiguous chunks (``P`` divides the group's length; a vec4 layout keeps the chunk length a
multiple of 4), each chunk a team row of its own, in two dispatches:

  * ``partial``: per chunk, the team statistics of ``norm.team._stats`` about one shift, the
    group's first element (so the offset cancels exactly, as in one pass): ``m_c`` (the mean of
    ``x - shift`` over the chunk), ``M2_c`` (its squared deviations about ``m_c``), and for the
    input gradient ``b_c = sum gw``, ``p_c = sum gw * (x - shift - m_c)`` (``gw = g * w``),
    into scratch ``parts [count * P, 2 or 4]``.
  * ``apply``: every thread merges its group's ``P`` partials in chunk order (deterministic,
    no atomics; all threads of the group get the same bits) by the exact decomposition for
    equal counts ``n_c = L / P`` (Chan et al., 1979): ``mean = sum m_c / P``, ``ssd = sum (M2_c
    + n_c (m_c - mean)^2)``, ``d1 = sum b_c``, ``pg = sum (p_c + (m_c - mean) b_c)``; ``rstd =
    inverseSqrt(ssd / L + eps)``; then it writes its chunk as the one-team kernels do
    (forward ``((x - shift) - mean) * rstd * w + b``; input gradient ``rstd * (gw - d1 / L -
    xc rstd * rstd pg / L)``).

x is read twice (as the chunked team kernels do); the partials are ``8 P`` or ``16 P`` bytes
per group. The plan (``split_chunks``): only when ``SPLIT`` is on (off by default: it lost on the
H200, see ``SPLIT``), only on GPUs (not ``Limits.cpu``), only when the
one-team kernel would have fewer than ``SPLIT_BELOW`` workgroups and the input has at least
``SPLIT_MIN_NUMEL`` elements (below that the second dispatch, ~17 us on the H200's timestamp
floor, costs more than the idle multiprocessors: the W5 U-Net's groups of 2048-4096 elements
stay one team kernel), then the largest divisor ``P`` of the group length towards
``TARGET_GROUPS`` chunk rows, chunks of at least ``MIN_CHUNK`` elements, ``P <= MAX_CHUNKS``.
"""

from __future__ import annotations

import math

from ....graph.ir import Graph
from ....ops.norm_ref import group_dims
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.literals import f32_literal, u
from ..matmul.plan import SMS
from ..rowwise.team import Chunk, RowKernel, TeamPlan, plan_team, sources_bound
from .activation import GradIn, act_helpers, bind_outputs, store_normalized
from .team import _param, _stats, plan_groups, stats_store

# Off: on the H200 the split lost at every size timed (bench/results/bandwidth_gn_split_h200.txt,
# forward 18.8 us split against 12.1 one-team at [4, 128, 64, 64], 27.4 against 24.8 at
# [2, 256, 64, 64]; forward + backward 49.2 against 34.8 and 69.9 against 66.7): the second
# dispatch costs more than the idle multiprocessors do. Kept for larger inputs and other GPUs
# (``bench/bandwidth.py --variants split`` times it); True: the plan below decides.
SPLIT = False
SPLIT_BELOW = 2 * SMS  # one-team workgroups below which a large input is split
SPLIT_MIN_NUMEL = 1 << 21  # elements (8 MiB of f32): smaller inputs keep one dispatch
TARGET_GROUPS = 8 * SMS  # chunk rows the split aims at
MIN_CHUNK = 2048  # elements per chunk at least
MAX_CHUNKS = 64
# Tests and benchmarks: chunks per group for every group_norm lowered (None: the plan; 1: never
# split). A value that does not divide the group length (or breaks vec4 units) is lowered to
# the nearest valid divisor below it.
FORCE_CHUNKS: int | None = None


def _valid(length: int, spatial: int, p: int) -> bool:
    """Whether ``p`` chunks cut a group of ``length`` into equal chunks that keep the group's
    unit width (vec4 when ``spatial`` is a multiple of 4)."""
    if p < 1 or length % p:
        return False
    return spatial % 4 or (length // p) % 4 == 0


def split_chunks(shape, attrs, limits: Limits) -> int:
    """Chunks per group of group_norm on ``shape`` (1: the one-team kernels)."""
    count, length, _ = group_dims(shape, "group_norm", attrs)
    spatial = math.prod(shape[2:])
    if FORCE_CHUNKS is not None:
        want = FORCE_CHUNKS
    else:
        plan = plan_groups(shape, "group_norm", attrs, limits)
        if not SPLIT or limits.cpu or plan is None or plan.groups >= SPLIT_BELOW:
            return 1
        if count * length < SPLIT_MIN_NUMEL:
            return 1
        want = min(-(-TARGET_GROUPS // count), MAX_CHUNKS, length // MIN_CHUNK)
    for p in range(max(1, min(want, length)), 1, -1):
        if _valid(length, spatial, p):
            return p
    return 1


def _chunk_plan(shape, attrs, limits: Limits, p: int) -> TeamPlan | None:
    count, length, _ = group_dims(shape, "group_norm", attrs)
    n = length // p
    return plan_team(count * p, n, limits, align=math.gcd(math.prod(shape[2:]), n), chunked=True)


def _setup(graph: Graph, node_id: int, limits: Limits):
    """(P, the chunk plan) of a group_norm / group_norm_backward node, or None (no split)."""
    node = graph[node_id]
    shape = graph[node.inputs[0]].type.shape
    if node.type.numel == 0:
        return None
    p = split_chunks(shape, node.attr_dict, limits)
    if p < 2:
        return None
    plan = _chunk_plan(shape, node.attr_dict, limits, p)
    return None if plan is None else (p, plan)


def _begin(graph, node_id, limits, plan: TeamPlan, p: int):
    """A kernel over the chunk rows: builder, row kernel, x bound, and ``gstart`` (the unit of
    the group's first element) defined."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    if not sources_bound(x):
        return None
    rk = RowKernel(kb, plan)
    xv = rk.bind(x)
    rk.line(f"let gstart = (rowc / {u(p)}) * {u(p * plan.units)};")
    return node, kb, rk, xv


def _channel(rk: RowKernel, shape, groups: int, p: int):
    """Weight index of unit ``j`` of chunk row ``rowc`` (channel of the group's unit
    ``(rowc % P) * units + j``)."""
    c, s = shape[1], math.prod(shape[2:])
    plan = rk.plan
    segu = s // plan.width
    first = "0u" if groups == 1 else f"((rowc / {u(p)}) % {u(groups)}) * {u(c // groups)}"
    rk.line(f"let gch = {first};")
    rk.line(f"let coff = (rowc % {u(p)}) * {u(plan.units)};")
    return lambda j: f"gch + (coff + {j}) / {u(segu)}"


def _store_parts(rk: RowKernel, kb: KernelBuilder, values: list[str], rows: int) -> None:
    k = len(values)
    parts = kb.scratch("parts", k * rows, kb.node.type.dtype, "parts")
    rk.line("if (live && y == 0u) {")
    for i, v in enumerate(values):
        rk.line(f"  {parts}[{u(k)} * row + {u(i)}] = {v};")
    rk.line("}")


def _merge(rk: RowKernel, kb: KernelBuilder, xv: str, p: int, eps: float, grad: bool) -> None:
    """Statements leaving the group's ``shift``, ``mean``, ``ssd``, ``rstd`` (and with
    ``grad`` ``d1``, ``pg``) from its ``p`` partials, in chunk order."""
    plan = rk.plan
    k = 4 if grad else 2
    parts = kb.scratch("parts", k * plan.rows, kb.node.type.dtype, "parts")
    lane = ".x" if plan.width == 4 else ""
    length = plan.n * p
    rk.line(f"let shift = {kb.load(xv, 'gstart')}{lane};")
    rk.line(f"let pb = (rowc / {u(p)}) * {u(p * k)};")
    rk.line("var msum = 0.0;")
    rk.line(
        f"for (var i = 0u; i < {u(p)}; i = i + 1u) {{ msum = msum + {parts}[pb + {u(k)} * i]; }}"
    )
    rk.line(f"let mean = msum / {f32_literal(p)};")
    for v in ("ssd", "d1", "pg") if grad else ("ssd",):
        rk.line(f"var {v} = 0.0;")
    rk.line(f"for (var i = 0u; i < {u(p)}; i = i + 1u) {{")
    rk.line(f"  let q = pb + {u(k)} * i;")
    rk.line(f"  let dm = {parts}[q] - mean;")
    rk.line(f"  ssd = ssd + ({parts}[q + 1u] + {f32_literal(plan.n)} * dm * dm);")
    if grad:
        rk.line(f"  d1 = d1 + {parts}[q + 2u];")
        rk.line(f"  pg = pg + ({parts}[q + 3u] + dm * {parts}[q + 2u]);")
    rk.line("}")
    rk.line(f"let rstd = inverseSqrt(ssd / {f32_literal(length)} + {f32_literal(eps)});")


def lower_group_norm_split(
    graph: Graph, node_id: int, limits: Limits, act: int | None = None, store: bool = True
) -> list[KernelSource] | None:
    """group_norm forward as ``partial`` + ``apply`` over the group's chunks, or None (the plan
    keeps one team per group, or an operand is a constant). ``act``, ``store``: a SiLU
    epilogue, as ``team.lower_norm_team``."""
    st = _setup(graph, node_id, limits)
    if st is None:
        return None
    p, plan = st
    eps = graph[node_id].attr("eps")
    first = _begin(graph, node_id, limits, plan, p)
    if first is None:
        return None
    node, kb, rk, xv = first
    _stats(rk, xv, False, eps, shift_unit="gstart")
    _store_parts(rk, kb, ["mean", "ssd"], plan.rows)
    partial = rk.finish("partial", 4 * node.type.numel, node.type.nbytes)

    node, kb, rk, xv = _begin(graph, node_id, limits, plan, p)
    shape = node.type.shape
    w = kb.read(node.inputs[1], "weight")
    b = kb.read(node.inputs[2], "bias") if len(node.inputs) > 2 else None
    outs = bind_outputs(kb, node_id, act, store)
    chan = _channel(rk, shape, node.attr("num_groups"), p)
    wp, bp = _param(rk, w, "w", chan), _param(rk, b, "b", chan)
    _merge(rk, kb, xv, p, eps, False)

    def write(ch: Chunk) -> None:
        rk.load(ch, xv, "a")
        wv, bv = wp(ch), bp(ch)
        plus = (lambda i: f" + {bv(i)}") if b is not None else (lambda i: "")
        value = lambda i: f"((a{i} - shift) - mean) * rstd * {wv(i)}{plus(i)}"  # noqa: E731
        store_normalized(rk, ch, outs, value)

    rk.each_chunk(write)
    if act is not None:
        rk.extra_helpers = act_helpers(plan.width)
    return [partial, rk.finish("apply", 4 * node.type.numel, 2 * node.type.nbytes)]


def _backward_kernel(graph, node_id, limits, plan: TeamPlan, p: int, stage: str, pro, store, stats):
    """The ``partial`` or ``apply`` kernel of the input gradient, or None (constant operand);
    ``pro``, ``store``: a SiLU-gradient prologue (``activation.GradIn``), stored by
    ``apply``; ``stats``: ``apply`` also leaves the merged statistics for the weight gradient
    (``team.stats_store``)."""
    first = _begin(graph, node_id, limits, plan, p)
    if first is None:
        return None
    node, kb, rk, xv = first
    eps = node.attr("eps")
    w = kb.read(node.inputs[1], "weight")
    gin = GradIn(rk, node, pro, store and stage == "apply")
    if not gin.bound:
        return None
    wp = _param(rk, w, "w", _channel(rk, node.type.shape, node.attr("num_groups"), p))
    rk.extra_helpers = gin.helpers()
    if stage == "partial":
        _stats(rk, xv, False, eps, (gin, wp), shift_unit="gstart")
        _store_parts(rk, kb, ["mean", "ssd", "d1", "pg"], plan.rows)
        return rk.finish("partial", 8 * node.type.numel, 2 * node.type.nbytes)
    out = kb.write(node_id, "dx")
    gin.bind_output()
    _merge(rk, kb, xv, p, eps, True)
    if stats:
        stats_store(rk, f"row / {u(p)}", plan.rows // p, f" && row % {u(p)} == 0u")
    inv_n = f32_literal(1.0 / (plan.n * p))
    rk.line(f"let c1 = d1 * {inv_n};")
    rk.line(f"let c2 = rstd * pg * {inv_n};")

    def write(ch: Chunk) -> None:
        rk.load(ch, xv, "a")
        gin(ch)
        wv = wp(ch)
        for i in range(ch.m):
            rk.line(f"let gw{i} = g{i} * {wv(i)};")
            rk.line(f"let xc{i} = (a{i} - shift) - mean;")
        rk.store(ch, out, lambda i: f"rstd * (gw{i} - c1 - (xc{i} * rstd) * c2)")
        gin.store(ch)

    rk.each_chunk(write)
    return rk.finish("apply", 8 * node.type.numel, 3 * node.type.nbytes)


def lower_group_norm_backward_split(
    graph: Graph,
    node_id: int,
    limits: Limits,
    pro: int | None = None,
    store: bool = True,
    stats: bool = False,
) -> list[KernelSource] | None:
    """group_norm's input gradient as ``partial`` + ``apply`` over the group's chunks, or
    None. ``pro``, ``store``, ``stats``: as ``team.lower_norm_backward_team``."""
    st = _setup(graph, node_id, limits)
    if st is None:
        return None
    p, plan = st
    stages = ("partial", "apply")
    ks = [_backward_kernel(graph, node_id, limits, plan, p, s, pro, store, stats) for s in stages]
    return None if None in ks else ks

"""``matmul`` ``[..., M, K] @ [..., K, N]``: the lowering, split-K and the output store.

Every matmul lowers to one of two kernels, chosen per shape by a ``plan.Plan``:
  * ``tiled`` (``tiled.py``): 256 threads register-tile a BM x BN output block
    (``plan.TILINGS``: 128x128, 128x64, 64x128, 64x64 with K steps of 16, 32 or 64, 256x128,
    128x256), vec4 global loads where the layout allows, the next K tile prefetched into
    registers while the current one is multiplied out of double-buffered workgroup memory
    (one barrier per K step), or two tiles ahead through two register sets (``Plan.deep``,
    the default on 128x128);
  * ``gemv`` (``gemv.py``): M <= 8 (decode), threads split K and reduce in workgroup
    memory, each warp reading neighbouring addresses of the weight.
Either can split K (``Plan.splits`` > 1): chunk s of K writes its partial product to scratch
``[split][batch][M][N]``, and a second dispatch sums the chunks in a fixed order
(deterministic) and applies the store (or the fused epilogue); or, for a product whose
every reader can sum the partials itself (``deferred``), no second dispatch: the readers
bind the partials and sum them in the same order. Loads past M, N or K read zero; stores
past M or N are skipped.
"""

from __future__ import annotations

from collections.abc import Mapping

from ....dtypes import DType
from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import PER_THREAD, element_slots
from ..core.literals import u
from ..elementwise.maps import lower_fill
from .gemv import emit_gemv
from .plan import GEMV_MAX_M, MAX_SCRATCH, WG, choose_plan, plan_source
from .problem import Epilogue, Problem, Store, problem_of
from .simd import SIMD, emit_simd
from .tiled import emit_tiled


def matmul_choices(graph: Graph, limits: Limits) -> list[dict]:
    """The plan of each matmul of ``graph`` with a product to compute (no empty output, K > 0),
    in node order: ``{"node", "m", "k", "n", "batch", "layout", "plan", "source"}`` with M, K,
    N and batch after batch folding (``problem_of``), the key of ``TUNED`` and of the tuning
    cache, and ``source`` as ``plan.plan_source`` gives it. What ``compile`` records in
    ``Program.meta["matmuls"]``, and what ``meganeura.tune`` tunes."""
    out = []
    for node in graph.nodes:
        if node.op != "matmul" or node.type.numel == 0:
            continue
        if graph[node.inputs[0]].type.shape[-1] == 0:
            continue
        p = problem_of(graph, node.id)
        plan, source = plan_source(p.m, p.k, p.n, p.nb, p.layout, limits)
        out.append(
            {"node": node.id, "m": p.m, "k": p.k, "n": p.n, "batch": p.nb, "layout": p.layout,
             "plan": plan.name, "source": source}
        )  # fmt: skip
    return out


def split_layout(graph: Graph, node_id: int, limits: Limits) -> tuple[int, int, int] | None:
    """(splits, K per split, elements of one partial) of a matmul ``lower_matmul`` splits, or
    None when it runs as one dispatch (or none: no elements, K = 0)."""
    node = graph[node_id]
    if node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return None
    p = problem_of(graph, node_id)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    step = plan.tiling.bk if plan.kernel == "tiled" else 16
    splits, chunk = _splits(plan.splits, p, step, limits)
    return None if splits == 1 else (splits, chunk, p.nb * p.m * p.n)


def lower_matmul(
    graph: Graph,
    node_id: int,
    limits: Limits,
    epilogue: Epilogue | None = None,
    deferred: Mapping | None = None,
    defer_sum: bool = False,
    sum_only: bool = False,
) -> list[KernelSource]:
    """Batched, broadcast matmul: one dispatch, or two with split-K.

    Args:
        epilogue: computes and stores the values derived from the product (a fusion group
            anchored here); None stores the product itself. The caller excludes K = 0.
        deferred: split-K products the epilogue reads as sums of their partials
            (``KernelBuilder``'s ``deferred``).
        defer_sum: split-K only, no epilogue: emit the first dispatch alone; the product's
            readers sum its partials (``deferred``).
        sum_only: split-K only: emit the summing dispatch alone (``split_group`` computes
            the partials with other products).

    Raises:
        ValueError: when a forced plan cannot run this shape (gemv for M > 8, a tile over
            the workgroup-memory limit) or a bound value is too large (``core.builder``).
    """

    node = graph[node_id]
    if node.type.numel == 0:
        return []
    if graph[node.inputs[0]].type.shape[-1] == 0:
        return lower_fill(graph, node_id, limits, 0.0)
    p = problem_of(graph, node_id)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel == "gemv" and p.m > GEMV_MAX_M:
        raise ValueError(f"gemv plan for M = {p.m} > {GEMV_MAX_M} (%{node_id})")
    step = plan.tiling.bk if plan.kernel == "tiled" else 16
    splits, chunk = _splits(plan.splits, p, step, limits)
    emit = {"gemv": emit_gemv, "simd": emit_simd}.get(plan.kernel, emit_tiled)
    if defer_sum and (splits == 1 or epilogue is not None):
        raise ValueError(f"%{node_id}: only a split-K product without epilogue defers its sum")
    kb = KernelBuilder(graph, node, limits, deferred)
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
    if plan.kernel == "simd":
        extra = ", @builtin(subgroup_size) sgs: u32"
        main = kb.finish("", body, SIMD, groups, helpers, flops, nbytes, extra_args=extra)
    else:
        main = kb.finish("", body, WG, groups, helpers, flops=flops, nbytes=nbytes)
    if splits == 1 or defer_sum:
        if sum_only:
            raise ValueError(f"%{node_id}: no summing dispatch to emit alone")
        return [main]
    summed = _sum_splits(graph, node_id, limits, splits, total, p.n, epilogue, deferred)
    return [summed] if sum_only else [main, summed]


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
    epilogue: Epilogue | None, deferred: Mapping | None = None,
) -> KernelSource:  # fmt: skip
    """Second split-K dispatch: each element sums its ``splits`` partials in split order (a
    deterministic result), then is stored (or run through the epilogue). ``deferred.
    SplitPartials.helper`` is the same loop, for readers summing partials themselves."""
    kb = KernelBuilder(graph, graph[node_id], limits, deferred)
    part = kb.scratch("splitk", splits * total, DType.f32, "part")
    store = _output_store(kb, node_id, epilogue)
    body, groups = sum_body(kb, part, store, splits, total, n)
    helpers, flops, nbytes = "", splits * total, 4 * splits * total
    if epilogue is None:
        nbytes += graph[node_id].type.nbytes
    else:
        helpers = epilogue.helpers
        flops, nbytes = flops + epilogue.flops, nbytes + epilogue.nbytes
    return kb.finish("sum_splits", body, 256, groups, helpers, flops, nbytes)


def sum_body(
    kb: KernelBuilder, part: str, store: Store, splits: int, total: int, n: int
) -> tuple[str, int]:
    """(body, workgroups) of the summing kernel: element i of the product (``total``
    elements, ``n`` columns) is the sum of its ``splits`` partials in ``part`` (bound in
    ``kb``) in split order from 0.0, then ``store(value, flat, col)``. Workgroup ``wg`` (256
    threads, ``lid``) owns ``PER_THREAD * 256`` elements; ``summing.py`` runs several such
    bodies in one dispatch, each on its own range of workgroups."""
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
    return "\n".join(lines), groups

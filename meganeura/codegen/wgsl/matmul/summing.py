"""Summing dispatches of split-K products that run back to back, as one dispatch.

A split-K product whose readers do not sum its partials keeps a summing dispatch
(``lowering._sum_splits``); those of products computed together (``split_group``: q, k and v
of a prefill, read by an attention kernel that does not sum partials) run one after the
other, each a small grid (SmolLM2: 72, 24 and 24 workgroups) paying a dispatch's launch.
``merge_sum_runs`` takes the program's dispatch list and replaces each run of consecutive
plain summing dispatches (no fused epilogue: the product is stored) with one dispatch at the
first one's position, in which product j owns a contiguous range of workgroups and runs its
own summing body (``lowering.sum_body``: the same f32 additions in the same order from 0.0,
the same store) into its own output, so values are bit-identical. Consecutive dispatches
leave nothing between them: every partial set is computed before the first sum (the partials
dispatch precedes its own sum), no sum reads another's output, and the outputs, written at the
first position instead of a few dispatches later, are read after the last; the memory
planner sees the merged kernel's bindings (each product's partials, a ``ScratchRef`` owned by
its matmul, and its output), so lifetimes follow. A run is cut at the binding limit (two
bindings a product). ``set_enabled(False)`` compiles the old programs (A/B, tests).
"""

from __future__ import annotations

from collections.abc import Sequence

from ....dtypes import DType
from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.literals import u
from .lowering import split_layout, sum_body
from .problem import problem_of

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler


def set_enabled(on: bool) -> None:
    """Merge back-to-back summing dispatches (on, the default) or not, for programs compiled
    from now on (benchmarks and tests compare both)."""
    ENABLED[:] = [bool(on)]


def lower_sum_run(graph: Graph, nids: Sequence[int], limits: Limits) -> KernelSource:
    """One dispatch summing the partials of split-K matmuls ``nids`` (two or more, each with
    a plain summing dispatch: no epilogue) and storing each product, as their own summing
    dispatches would (module docstring).

    Raises:
        ValueError: when a node is not a split-K matmul, or the run needs more storage
            bindings than ``limits`` allow.
    """
    if 2 * len(nids) > limits.max_storage_buffers_per_shader_stage:
        raise ValueError(
            f"summing {len(nids)} products needs {2 * len(nids)} storage bindings; the limit "
            f"is {limits.max_storage_buffers_per_shader_stage}"
        )
    kb = KernelBuilder(graph, graph[nids[0]], limits)
    lines: list[str] = []
    start = flops = nbytes = 0
    for j, nid in enumerate(nids):
        layout = split_layout(graph, nid, limits) if graph[nid].op == "matmul" else None
        if layout is None:
            raise ValueError(f"%{nid} ({graph[nid].op}) is not a split-K matmul")
        splits, _, total = layout
        part = kb.scratch("splitk", splits * total, DType.f32, f"part{j}", owner=nid)
        out = kb.write(nid, f"c{j}")

        def store(value: str, flat: str, col: str, out=out) -> str:
            return kb.store(out, flat, value)

        body, groups = sum_body(kb, part, store, splits, total, problem_of(graph, nid).n)
        lines.append(f"  {'if' if j == 0 else 'else if'} (wg < {u(start + groups)}) {{")
        if start:
            lines.append(f"    let wg = wg - {u(start)};")
        lines.append(indent(body))
        lines.append("  }")
        start += groups
        flops += splits * total
        nbytes += 4 * splits * total + graph[nid].type.nbytes
    ks = kb.finish("", "\n".join(lines), 256, start, "", flops=flops, nbytes=nbytes)
    ids = "+".join(str(n) for n in nids)
    return KernelSource(f"%{ids} matmul sum_splits", ks.wgsl, ks.bindings, ks.grid, flops, nbytes)


def merge_sum_runs(
    graph: Graph,
    dispatches: list[tuple[int, KernelSource]],
    plain: set[int],
    limits: Limits,
) -> list[tuple[int, KernelSource]]:
    """``dispatches`` with each run of consecutive plain summing dispatches (their positions
    in ``plain``) replaced by one ``lower_sum_run`` dispatch at the run's first position; at
    most ``max_storage_buffers_per_shader_stage // 2`` products a dispatch. Unchanged when
    the feature is off."""
    if not ENABLED[0] or len(plain) < 2:
        return dispatches
    most = max(1, limits.max_storage_buffers_per_shader_stage // 2)
    out: list[tuple[int, KernelSource]] = []
    run: list[int] = []

    def flush() -> None:
        for i in range(0, len(run), most):
            part = run[i : i + most]
            if len(part) == 1:
                out.append(dispatches[part[0]])
            else:
                nids = [dispatches[p][0] for p in part]
                out.append((nids[0], lower_sum_run(graph, nids, limits)))
        run.clear()

    for pos, entry in enumerate(dispatches):
        if pos in plain:
            run.append(pos)
            continue
        flush()
        out.append(entry)
    flush()
    return out

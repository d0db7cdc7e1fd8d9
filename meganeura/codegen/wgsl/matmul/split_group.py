"""Several split-K products sharing their left operand in one dispatch (q, k and v of a
prefill), their sums deferred to their readers (``deferred``).

``plan_split_groups`` picks, among the deferred products (plain matmuls: no epilogue, every
reader sums the partials), those that read one left operand through the same strides, M and K
with the tiled kernel and no batch, and whose right operands are leaves or computed before the
first of them; no op with in-place effects may lie between the first and the last. The group
runs at its first product's position (every operand is ready there; every reader of a product
comes after that product), as one dispatch: product j owns a contiguous range of workgroups,
and a workgroup branches on its id (uniform control flow, so the barriers inside stay valid,
as in ``horizontal.py``) into product j's copy of ``tiled.emit_tiled``, which writes product
j's partials into its own scratch (owned by that matmul, so its readers find it). Per product
the arithmetic is that of its own first dispatch, so values are bit-identical; workgroup memory
is declared at the largest tiling's size.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass

from ....dtypes import DType
from ....graph.ir import LEAF_OPS, Graph, resolve_view
from ....ops import OPS
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.literals import u
from .lowering import _splits
from .plan import WG, choose_plan
from .problem import fold_transpose, problem_of
from .tiled import emit_tiled


@dataclass(frozen=True)
class SplitGroup:
    """Deferred split-K matmuls run as one dispatch at the first one's position.

    Attributes:
        anchors: the matmuls, in program order (two or more).
    """

    anchors: tuple[int, ...]

    @property
    def first(self) -> int:
        return self.anchors[0]


def _key(graph: Graph, nid: int, limits: Limits) -> tuple | None:
    p = problem_of(graph, nid)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel != "tiled" or p.nb != 1:
        return None
    return (resolve_view(graph, p.a.value), p.a.rows, p.a.cols, p.m, p.k)


def plan_split_groups(graph: Graph, deferred: Mapping, limits: Limits) -> tuple[SplitGroup, ...]:
    """Groups of the deferred products (``deferred.plan_deferred_sums``) that one dispatch can
    compute (module docstring), greedily in program order; at most as many products as keep
    the kernel within ``limits.max_storage_buffers_per_shader_stage`` (A, then each product's
    B and partials)."""
    most = (limits.max_storage_buffers_per_shader_stage - 1) // 2
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    open_runs: dict[tuple, list[int]] = {}
    runs: list[list[int]] = []
    for nid in sorted(k for k in deferred if graph[k].op == "matmul"):
        key = _key(graph, nid, limits)
        if key is None:
            continue
        run = open_runs.get(key)
        b = resolve_view(graph, fold_transpose(graph, graph[nid].inputs[1])[0])
        ok = (
            run is not None
            and len(run) < most
            and (graph[b].op in LEAF_OPS or b < run[0])
            and not any(run[0] < e < nid for e in effects)
        )
        if ok:
            run.append(nid)
        else:
            open_runs[key] = [nid]
            runs.append(open_runs[key])
    return tuple(SplitGroup(tuple(r)) for r in runs if len(r) > 1)


_SHARED = re.compile(r"var<workgroup> (\w+): array<vec4<f32>, (\d+)>;")


def lower_split_group(graph: Graph, group: SplitGroup, limits: Limits) -> list[KernelSource]:
    """The one dispatch writing every product's partials (module docstring).

    Raises:
        ValueError: as ``lower_matmul`` for one of the products.
    """
    kb = KernelBuilder(graph, graph[group.first], limits)
    lines: list[str] = []
    shared: dict[str, int] = {}
    start = flops = nbytes = 0
    for j, nid in enumerate(group.anchors):
        p = problem_of(graph, nid)
        plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
        splits, chunk = _splits(plan.splits, p, plan.tiling.bk, limits)
        total = p.nb * p.m * p.n
        part = kb.scratch("splitk", splits * total, DType.f32, f"part{j}", owner=nid, write=True)

        def store(value: str, flat: str, col: str, part=part, total=total) -> str:
            return kb.store(part, f"split * {u(total)} + {flat}", value)

        body, helpers, groups = emit_tiled(kb, p, plan, splits, chunk, store)
        for name, size in _SHARED.findall(helpers):
            shared[name] = max(shared.get(name, 0), int(size))
        cond = f"wg < {u(start + groups)}"
        lines.append(f"  {'if' if j == 0 else 'else if'} ({cond}) {{")
        if start:
            lines.append(f"    let wg = wg - {u(start)};")
        lines.append(indent(body))
        lines.append("  }")
        start += groups
        flops += 2 * total * p.k
        nbytes += p.b.src.type.nbytes + 4 * splits * total
        if j == 0:
            nbytes += p.a.src.type.nbytes
    decls = "".join(f"var<workgroup> {n}: array<vec4<f32>, {s}>;\n" for n, s in shared.items())
    if 16 * sum(shared.values()) > limits.max_workgroup_storage_size:
        raise ValueError(
            f"matmuls {group.anchors} need {16 * sum(shared.values())} B of workgroup memory; "
            f"the limit is {limits.max_workgroup_storage_size}"
        )
    ks = kb.finish("", "\n".join(lines), WG, start, decls, flops=flops, nbytes=nbytes)
    ids = "+".join(str(a) for a in group.anchors)
    return [KernelSource(f"%{ids} matmul", ks.wgsl, ks.bindings, ks.grid, ks.flops, ks.bytes)]

"""The partials of several split-K products sharing their left operand in one dispatch (q, k
and v of a prefill; gate and up), or summed by one kernel (sum groups, below).

``plan_split_groups`` picks, among the products whose sums are deferred to their readers
(``deferred``) and the split anchors of matmul-anchored fusion groups (whose summing dispatch
runs the epilogue and stays at the group's sink), those that read one left operand through the
same strides, M and K with the tiled kernel and no batch, and whose right operands are leaves
or computed before the first of them; no op with in-place effects may lie between the first and
the last. The dispatch runs at the first product's position (every operand is ready there;
every reader of a partial set, a deferred product's reader or a group's summing dispatch,
comes after its product; a plain product whose readers do not sum the partials keeps its
summing dispatch at its own position): product j owns a contiguous range of workgroups,
and a workgroup branches on its id (uniform control flow, so the barriers inside stay valid,
as in ``horizontal.py``) into product j's copy of ``tiled.emit_tiled``, which writes product
j's partials into its own scratch (owned by that matmul, so its readers find it). Per product
the arithmetic is that of its own first dispatch, so values are bit-identical; workgroup memory
is declared at the largest tiling's size.

Sum groups (``SplitGroup.shared_left`` False): products whose partials (or values) one kernel
alone reads, whatever their operands: the input gradient of a layer's MLP, ``dG @ Wg + dU @
Wu``, is gate's product (the anchor of a fusion group adding the two, whose summing dispatch
runs the epilogue) plus up's (its sum deferred into that same dispatch); attention's, ``dQ @
Wq + dK @ Wk + dV @ Wv``, has q's split product (deferred), k's unsplit one (stored, read by
the epilogue of v's) and v's (the epilogue's anchor, not a member). One dispatch computes the
members at the LAST one's position (the first one's operands are ready there; the one reader
follows every member): a split member writes its own partials as above, an unsplit one
(``direct``: a plain tiled product, not in a group) stores its value as its own dispatch would.
Each keeps its own partials and its own summing order, so values are bit-identical (one sum
over the concatenated K would have reordered the additions for no fewer dispatches). A member
must be read by one kernel only, not be a graph output, and not be read by a node without a
kernel; split products whose readers do not sum (``summed``) keep their summing dispatch at
their own position and stay out; no op with in-place effects may lie between the first and the
last; at most a third of the storage-buffer limit of members (A, B and partials or output
each). ``set_sum_groups(False)`` turns them off for programs compiled from then on (A/B).
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ....dtypes import DType
from ....graph.ir import LEAF_OPS, Graph, resolve_view
from ....ops import OPS
from ....passes.fuse import FusionGroup
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, indent
from ..core.literals import u
from .deferred import ENABLED, _readers
from .lowering import _splits, split_layout
from .plan import WG, choose_plan
from .problem import fold_transpose, problem_of
from .tiled import emit_tiled

SUM_GROUPS = [True]  # sum groups are planned (``set_sum_groups``)


def set_sum_groups(on: bool) -> None:
    """Plan sum groups (on, the default) or not, for programs compiled from now on (A/B and
    tests)."""
    SUM_GROUPS[:] = [bool(on)]


@dataclass(frozen=True)
class SplitGroup:
    """Split-K matmuls whose partials one dispatch computes, at the first one's position.

    Attributes:
        anchors: the matmuls, in program order (two or more).
        owners: per matmul, the node owning its partials: the matmul itself when its sum is
            deferred to its readers, else the sink of its fusion group, whose summing
            dispatch (with the epilogue) stays at the sink (``lower_group(sum_only=True)``).
    """

    anchors: tuple[int, ...]
    owners: tuple[int, ...]
    summed: frozenset[int] = frozenset()
    shared_left: bool = True
    direct: frozenset[int] = frozenset()

    # ``summed``: plain products (no fusion group) whose readers do not sum the partials: each
    # keeps its summing dispatch at its own position (``lower_matmul(sum_only=True)``).
    # ``shared_left`` False: a sum group (products read by one kernel, module docstring), run at
    # the last product's position. ``direct``: its unsplit products, stored by this dispatch.

    @property
    def first(self) -> int:
        return self.anchors[0]

    @property
    def position(self) -> int:
        """The node at whose position the dispatch runs."""
        return self.anchors[0] if self.shared_left else self.anchors[-1]


def _key(graph: Graph, nid: int, limits: Limits) -> tuple | None:
    p = problem_of(graph, nid)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel != "tiled" or p.nb != 1:
        return None
    return (resolve_view(graph, p.a.value), p.a.rows, p.a.cols, p.m, p.k)


def plan_split_groups(
    graph: Graph,
    deferred: Mapping,
    limits: Limits,
    groups: Sequence = (),
    needed: Sequence[bool] | None = None,
) -> tuple[SplitGroup, ...]:
    """Groups of split-K products that one dispatch can compute (module docstring), greedily
    in program order: the deferred products (``deferred.plan_deferred_sums``), the split
    anchors of matmul-anchored fusion groups (``groups``) and, given ``needed``, the other
    split plain products (``SplitGroup.summed``); at most as many products as keep the kernel
    within ``limits.max_storage_buffers_per_shader_stage`` (A, then each product's B and
    partials). Then, with ``set_sum_groups`` on, sum groups among the products left alone
    (not ``summed``): per reading kernel, in program order. Sorted by first product."""
    if not ENABLED[0]:
        return ()
    most = (limits.max_storage_buffers_per_shader_stage - 1) // 2
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    owner = {k: k for k in deferred if graph[k].op == "matmul"}
    grouped = {m for g in groups for m in g.members}
    summed = set()
    for node in graph.nodes if needed is not None else ():
        nid = node.id
        if node.op == "matmul" and needed[nid] and nid not in grouped and nid not in owner:
            if split_layout(graph, nid, limits) is not None:
                owner[nid] = nid
                summed.add(nid)
    for g in groups:
        a = getattr(g, "anchor", None)
        if isinstance(g, FusionGroup) and a is not None and graph[a].op == "matmul":
            if split_layout(graph, a, limits) is not None:
                owner[a] = g.sink
    open_runs: dict[tuple, list[int]] = {}
    runs: list[list[int]] = []
    for nid in sorted(owner):
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
    runs = [r for r in runs if len(r) > 1]
    out = [SplitGroup(tuple(r), tuple(owner[a] for a in r), frozenset(summed.intersection(r)))
           for r in runs]  # fmt: skip
    if SUM_GROUPS[0]:
        taken = {a for r in runs for a in r}
        candidates = {k: v for k, v in owner.items() if k not in taken and k not in summed}
        direct = set()
        for node in graph.nodes if needed is not None else ():
            nid = node.id
            if node.op == "matmul" and needed[nid] and nid not in grouped and nid not in owner:
                if _unsplit(graph, nid, limits):
                    candidates[nid] = nid
                    direct.add(nid)
        most = limits.max_storage_buffers_per_shader_stage // 3  # A, B and output each
        for r in _sum_runs(graph, candidates, groups, limits, effects, most, needed):
            owners = tuple(candidates[a] for a in r)
            d = frozenset(direct.intersection(r))
            out.append(SplitGroup(tuple(r), owners, shared_left=False, direct=d))
    return tuple(sorted(out, key=lambda g: g.first))


def _unsplit(graph: Graph, nid: int, limits: Limits) -> bool:
    """Whether matmul ``nid`` runs as one unsplit tiled dispatch of its own."""
    node = graph[nid]
    if node.type.numel == 0 or graph[node.inputs[0]].type.shape[-1] == 0:
        return False
    p = problem_of(graph, nid)
    plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
    if plan.kernel != "tiled" or p.nb != 1:
        return False
    return _splits(plan.splits, p, plan.tiling.bk, limits)[0] == 1


def _sum_runs(
    graph: Graph,
    owner: Mapping[int, int],
    groups: Sequence,
    limits: Limits,
    effects: list[int],
    most: int,
    needed: Sequence[bool] | None,
) -> list[list[int]]:
    """Runs of products whose partials (or, unsplit, values) one kernel alone reads (module
    docstring: sum groups), in program order, at most ``most`` products each."""
    group_of = {m: g for g in groups for m in g.members}
    users = graph.users()
    outputs = {resolve_view(graph, v) for _, v in graph.outputs}
    by_reader: dict[int, list[int]] = {}
    for nid in sorted(owner):
        if _key(graph, nid, limits) is None:
            continue
        if owner[nid] != nid:  # a fusion group's anchor: its summing dispatch reads them
            kernels = {owner[nid]}
        else:  # a deferred or unsplit product: the kernels of its readers
            readers = _readers(graph, users, nid)
            if nid in outputs or any(needed is None or not needed[r] for r in readers):
                continue  # read outside any kernel, or by a kernel bound elsewhere
            kernels = {group_of[r].sink if r in group_of else r for r in readers}
        if len(kernels) == 1:
            by_reader.setdefault(kernels.pop(), []).append(nid)
    runs = []
    for products in by_reader.values():
        run: list[int] = []
        for nid in products:
            if run and (len(run) == most or any(run[0] < e < nid for e in effects)):
                runs.append(run)
                run = []
            run.append(nid)
        runs.append(run)
    return [r for r in runs if len(r) > 1]


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
    for j, (nid, owner) in enumerate(zip(group.anchors, group.owners, strict=True)):
        p = problem_of(graph, nid)
        plan = choose_plan(p.m, p.k, p.n, p.nb, p.layout, limits)
        splits, chunk = _splits(plan.splits, p, plan.tiling.bk, limits)
        total = p.nb * p.m * p.n
        if nid in group.direct:  # unsplit: the product itself, as its own dispatch stores it
            part = kb.write(nid, f"c{j}")

            def store(value: str, flat: str, col: str, part=part) -> str:
                return kb.store(part, flat, value)

        else:
            part = kb.scratch(
                "splitk", splits * total, DType.f32, f"part{j}", owner=owner, write=True
            )

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
        nbytes += p.b.src.type.nbytes
        nbytes += graph[nid].type.nbytes if nid in group.direct else 4 * splits * total
        if j == 0 or not group.shared_left:
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

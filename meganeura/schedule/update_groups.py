"""Optimizer update groups: the per-parameter update ops that run as one kernel.

``apply_optimizer`` appends one update op per parameter (``sgd_update``, ``sgd_momentum_update``,
``adam_update``); the IR and the interpreter keep them so. This stage picks the ones that can
share one dispatch and lays out their storage: each group owns arenas, one buffer each for its
parameters, its gradients and each optimizer state (exp_avg, exp_avg_sq, momentum_buffer), and
member ``k`` sits at the same element offset ``offsets[k]`` in all of them. The group kernel
(``codegen.wgsl.optim.lower_update_group``) binds the arenas whole and walks a baked table of
segments, so it needs a fixed number of bindings however many parameters the group holds.

Invariants:
  * members of a group have the same op, attributes, ``hyper`` and ``clip`` operands and dtype,
    and lie in one run of the schedule in which every kernel-producing node is an update op;
    an update reads only its own gradient and writes only its own parameter and state, so
    running the run's updates together at the run's end changes no value read by anyone;
  * offsets are multiples of ``limits.min_storage_buffer_offset_alignment`` bytes, so every
    other kernel can bind a member's parameter or gradient as a sub-range of its arena;
    the padding between members is never read or written as data;
  * a member's gradient is the root of a value no one else owns: not a leaf, constant or graph
    output, and no other member's gradient; a candidate failing any condition keeps its own
    kernel, as does a group of one (``schedule`` also excludes members that one kernel would
    bind in one arena both read-only and writable, which wgpu rejects);
  * each arena fits one storage binding and has fewer than 2^31 elements (else the group
    is split).
"""

from __future__ import annotations

from ..codegen.kernel import MAX_ELEMENTS, Limits, UpdateGroup
from ..graph.ir import LEAF_OPS, SUBRANGE_OPS, VIEW_OPS, Graph, resolve_view
from ..ops import OPS

UPDATE_OPS = frozenset({"sgd_update", "sgd_momentum_update", "adam_update"})


def arena_roles(graph: Graph, group: UpdateGroup) -> tuple[str, ...]:
    """``("param", "grad", "state0", ...)``: the arenas of ``group``, in binding order."""
    n_state = len(graph[group.members[0]].inputs) - 4
    return ("param", "grad") + tuple(f"state{k}" for k in range(n_state))


def arena_value(graph: Graph, member: int, role: str) -> int:
    """The root id of the value that ``member`` keeps in arena ``role``."""
    p, g, _, _, *state = graph[member].inputs
    vid = {"param": p, "grad": g}.get(role)
    if vid is None:
        vid = state[int(role.removeprefix("state"))]
    return resolve_view(graph, vid)


def plan_update_groups(
    graph: Graph, needed: list[bool], limits: Limits, exclude: frozenset[int] = frozenset()
) -> tuple[UpdateGroup, ...]:
    """Group the needed update ops of ``graph`` (see the module docstring).

    Args:
        graph: a verified graph.
        needed: per node id, whether the node's kernels run.
        limits: the adapter's limits (offset alignment, binding size).
        exclude: update node ids that must keep their own kernel.

    Returns:
        The groups, each of two or more members, in program order of their last member.
    """
    outputs = {resolve_view(graph, v) for _, v in graph.outputs}
    runs: list[list[int]] = [[]]
    for node in graph.nodes:
        if not needed[node.id] or node.op in LEAF_OPS or node.op in VIEW_OPS:
            continue
        if node.op in SUBRANGE_OPS:  # storage, not a kernel: it does not break a run of updates
            continue
        if node.op not in OPS:
            continue
        if node.op in UPDATE_OPS:
            runs[-1].append(node.id)
        elif runs[-1]:
            runs.append([])
    groups: list[UpdateGroup] = []
    for run in runs:
        by_key: dict[tuple, list[int]] = {}
        claimed: set[int] = set()
        for nid in run:
            key = _key(graph, nid)
            if key is None or nid in exclude or not _eligible(graph, nid, outputs, claimed):
                continue
            claimed.update(arena_value(graph, nid, r) for r in ("param", "grad"))
            by_key.setdefault(key, []).append(nid)
        for members in sorted(by_key.values(), key=lambda m: m[-1]):
            for chunk in _split(graph, members, limits):
                if len(chunk) > 1:
                    groups.append(_layout(graph, len(groups), chunk, limits))
    return tuple(groups)


def _key(graph: Graph, nid: int) -> tuple | None:
    node = graph[nid]
    p, _, hyper, clip, *_ = node.inputs
    if graph[p].type.numel == 0:
        return None
    attrs = tuple(sorted(node.attr_dict.items()))
    return (node.op, attrs, graph[p].type.dtype, resolve_view(graph, hyper), _clip_key(graph, clip))


def _clip_key(graph: Graph, clip: int):
    root = resolve_view(graph, clip)
    if graph[root].op == "constant":
        return ("constant", graph[root].attr("value"))
    return root


def _eligible(graph: Graph, nid: int, outputs: set[int], claimed: set[int]) -> bool:
    p, g, _, _, *state = graph[nid].inputs
    pr, gr = resolve_view(graph, p), resolve_view(graph, g)
    if graph[pr].op != "parameter" or pr in claimed:
        return False
    if any(graph[resolve_view(graph, s)].op != "state" for s in state):
        return False
    gnode = graph[gr]
    return not (gnode.op in LEAF_OPS or gnode.op == "constant" or gr in outputs or gr in claimed)


def _aligned_step(graph: Graph, member: int, limits: Limits) -> int:
    itemsize = graph[graph[member].inputs[0]].type.dtype.itemsize
    return max(1, limits.min_storage_buffer_offset_alignment // itemsize)


def _split(graph: Graph, members: list[int], limits: Limits) -> list[list[int]]:
    """Consecutive chunks whose arenas fit one binding and u32 element indices."""
    chunks: list[list[int]] = [[]]
    end = 0
    for m in members:
        t = graph[graph[m].inputs[0]].type
        step = _aligned_step(graph, m, limits)
        start = -(-end // step) * step if chunks[-1] else 0
        fits = (start + t.numel) * t.dtype.itemsize <= limits.max_storage_buffer_binding_size
        if chunks[-1] and not (fits and start + t.numel <= MAX_ELEMENTS):
            chunks.append([])
            start = 0
        chunks[-1].append(m)
        end = start + t.numel
    return chunks


def _layout(graph: Graph, index: int, members: list[int], limits: Limits) -> UpdateGroup:
    offsets, end = [], 0
    for m in members:
        step = _aligned_step(graph, m, limits)
        start = -(-end // step) * step
        offsets.append(start)
        end = start + graph[graph[m].inputs[0]].type.numel
    return UpdateGroup(index, tuple(members), tuple(offsets), end)

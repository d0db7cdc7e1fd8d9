"""Rotary embeddings and KV-cache writes of one attention step as one kernel.

A decoding layer rotates its queries and keys by the same positions and writes the rotated
keys and the values into its KV cache::

    q_rot = apply_rotary_emb(q, theta, off)
    k_rot = apply_rotary_emb(k, theta, off)
    keys = index_copy_(k_cache, 2, slots, k_rot)
    values = index_copy_(v_cache, 2, slots, v)

Four dispatches of a few hundred threads each, where each dispatch costs more than the work.
``plan_rope_cache`` groups them so that one kernel (``codegen.wgsl.attention.rope_cache``)
rotates both, stores ``q_rot`` (and ``k_rot`` where something else reads it) and writes the
cache rows. Without a cache (prefill of a model without one, training) it groups just the two
rotations of the same positions. ``attach_attention`` (a decode step) and
``attach_prefill_attention`` (a forward without a cache) then grow groups by the attention
reading them, whose kernel does the rotations itself (``rope_attention``, ``rope_prefill``).
The typed IR is not rewritten: the interpreter and autodiff never see a fused op; the scheduler
lowers the group at its last member's position.

Invariants of every group returned (each check is conservative; a rejected group only costs
dispatches):
  * one or two needed ``apply_rotary_emb`` nodes with the same offset operand (or none), the
    same ``theta``, ``position_offset`` and ``inverse`` and the same head dim D (any dtypes),
    nonzero elements; optionally ``index_copy_`` nodes whose source is one of those rotations (one
    copy per rotation) and further ``index_copy_`` nodes with the same index operand and dim
    whose source is computed outside the group (the values);
  * at least two members;
  * every node outside the group that reads a member (through views) comes after the group's
    last member, so the kernel can run there; this covers the cache versions: the attention
    that reads ``keys`` and ``values`` runs after the write, as program order promised
    (``ops.inplace``: ``graph.verify`` already forbids reads of an older version after the
    write);
  * no op with in-place effects other than the members lies between the first and the last
    member, so the operands read at the kernel's position hold the values the members saw;
  * no member reads the storage a member writes (a cache, or a stored rotation), and no two
    members write one storage, so the threads of the kernel never race on one buffer;
  * with ``max_bindings``, the kernel binds at most that many storage buffers.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from ..dtypes import DType
from ..graph.ir import Graph, resolve_version, resolve_view
from ..ops import OPS
from ..ops.attention import SDPA
from ..ops.inplace import INDEX_COPY
from .fuse import FusionGroup, _readers

ROPE = "apply_rotary_emb"


def _rope_key(graph: Graph, nid: int) -> tuple:
    """What two rotations must share to be computed by one kernel (not the dtype: the kernel
    computes in f32 and each load and store converts, so fast mode's f16 queries pair with
    keys kept f32 for their f32 cache)."""
    n = graph[nid]
    offset = resolve_view(graph, n.inputs[1]) if len(n.inputs) > 1 else None
    return (offset, n.type.shape[-1], n.attrs)


def rope_cache_bindings(graph: Graph, group: FusionGroup) -> int:
    """Storage buffers the group's kernel binds: each member's operands (views resolved,
    constants inlined, members the kernel computes left out), the stored rotations, the
    written caches and, for a group grown by ``attach_attention``, the attention's output,
    each counted once."""
    members = set(group.members)
    bound = set()
    for m in group.members:
        for i in graph[m].inputs:
            if i in members:
                continue
            r = resolve_view(graph, i)
            if graph[r].op != "constant" and r not in members:
                bound.add(r)
    bound.update(resolve_view(graph, o) for o in group.outputs)
    return len(bound)


def _valid(graph: Graph, users, effects, members: tuple[int, ...], outputs) -> bool:
    first, last = members[0], members[-1]
    mset = set(members)
    if any(first < e < last and e not in mset for e in effects):
        return False
    written = {resolve_view(graph, o) for o in outputs}
    if len(written) < len(outputs):  # two writes of one cache: program order would decide
        return False
    for m in members:
        if any(r not in mset and r < last for r in _readers(graph, users, m)):
            return False
        node = graph[m]
        ins = node.inputs[1:] if node.op == INDEX_COPY else node.inputs
        for i in ins:
            if i not in mset and resolve_view(graph, i) in written:
                return False
    return True


def _make(graph, users, effects, out_roots, anchor, cand, max_bindings) -> FusionGroup | None:
    """The group of members ``cand``, or None when it breaks an invariant."""
    members = tuple(sorted(cand))
    if len(members) < 2:
        return None
    mset = set(members)
    outputs = tuple(
        m
        for m in members
        if graph[m].op == INDEX_COPY
        or m in out_roots
        or any(x not in mset for x in _readers(graph, users, m))
    )
    if not _valid(graph, users, effects, members, outputs):
        return None
    group = FusionGroup(members, outputs, graph[anchor].type.shape, anchor)
    if max_bindings is not None and rope_cache_bindings(graph, group) > max_bindings:
        return None
    return group


def _group_of(graph, users, effects, out_roots, rots, copies, taken, max_bindings):
    """The largest valid group of rotations ``rots`` with their cache writes and the values'
    writes (see ``plan_rope_cache``), or None."""
    own = []  # one cache write per rotation, reading the rotation directly
    for rot in rots:
        c = next((c for c in copies if c not in taken and graph[c].inputs[2] == rot), None)
        if c is not None and graph[graph[c].inputs[0]].type.numel > 0:
            own.append(c)
    extra = []
    if own:
        index, dim = graph[own[0]].inputs[1], graph[own[0]].attr("dim")
        extra = [
            c
            for c in copies
            if c not in taken
            and c not in own
            and graph[c].inputs[1] == index
            and graph[c].attr("dim") == dim
            and graph[c].inputs[2] not in rots
            and graph[graph[c].inputs[2]].type.numel > 0
        ]
    best = None
    for base in (rots + own, rots):
        best = _make(graph, users, effects, out_roots, rots[0], base, max_bindings)
        if best is not None:
            break
    if best is None:
        return None
    for c in extra:  # the values' writes, one at a time, in program order
        grown = _make(graph, users, effects, out_roots, rots[0], [*best.members, c], max_bindings)
        best = grown or best
    return best


def plan_rope_cache(
    graph: Graph, needed: Sequence[bool], max_bindings: int | None = None
) -> tuple[FusionGroup, ...]:
    """Group rotary embeddings of the same positions with the KV-cache writes of their
    results (see the module docstring for the invariants).

    Greedy, in program order: each needed rotation pairs with the next one of the same key
    (offset operand, head dim, attributes); the pair takes the ``index_copy_`` nodes
    reading either rotation, then the other ``index_copy_`` nodes with the same index operand
    and dim, one at a time in program order, each kept where the group stays valid. Where the
    rotations with their copies break an invariant, the rotations alone are tried, then the
    first rotation without its partner (with its own cache write).

    Args:
        graph: a verified graph.
        needed: per node, whether it gets kernels.
        max_bindings: the most storage buffers one kernel may bind; None: no bound.

    Returns:
        Groups of two or more members, ``anchor`` the first rotation, ordered by their last
        member. ``outputs`` are the rotations read outside the group (or graph outputs) and
        the ``index_copy_`` members (their value is the cache they write).
    """
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
    ropes = [n.id for n in graph.nodes if n.op == ROPE and needed[n.id] and n.type.numel > 0]
    copies = [n.id for n in graph.nodes if n.op == INDEX_COPY and needed[n.id]]
    taken: set[int] = set()
    groups = []
    for r in ropes:
        if r in taken:
            continue
        partner = next(
            (
                s
                for s in ropes
                if s > r and s not in taken and _rope_key(graph, s) == _rope_key(graph, r)
            ),
            None,
        )
        tries = [[r, partner], [r]] if partner is not None else [[r]]
        for rots in tries:  # with its partner, else alone (with its cache write)
            best = _group_of(graph, users, effects, out_roots, rots, copies, taken, max_bindings)
            if best is not None:
                groups.append(best)
                taken.update(best.members)
                break
    return tuple(sorted(groups, key=lambda g: g.sink))


def attach_attention(
    graph: Graph,
    groups: Sequence[FusionGroup],
    needed: Sequence[bool],
    fusible: Callable[[int], bool],
    max_bindings: int | None = None,
) -> tuple[FusionGroup, ...]:
    """Extend decode-step groups of ``plan_rope_cache`` with the attention that reads them,
    for one kernel (``codegen.wgsl.attention.rope_attention``) to do all five nodes.

    A group qualifies when it is exactly a query rotation, a key rotation, the key's cache
    write and a value cache write at the same slots, and one needed
    ``scaled_dot_product_attention`` reads (through views only) the rotated queries, the key
    cache version and the value cache version written by the group, with both rotations
    read by nothing else and the head dim a multiple of 8. ``fusible(attention)`` says whether
    the adapter's plan gives the attention one lane-kernel row tile per (batch, kv head) (no
    block kernel, no key split): the kernel's workgroup then reads only the cache rows it
    writes. As for the groups themselves, no op with in-place effects may lie between the first
    member and the attention, nothing outside the group may read a member before the
    attention, and the attention's other operands (mask, key count) are not written by the
    group.

    Returns:
        ``groups`` with the qualifying ones grown by their attention (the new sink); outputs
        the two cache writes and the attention; sorted by sink.
    """
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
    taken = {m for g in groups for m in g.members}
    out = []
    for g in groups:
        grown = _with_attention(graph, users, effects, out_roots, g, needed, fusible, taken)
        if grown is not None and (
            max_bindings is None or rope_cache_bindings(graph, grown) <= max_bindings
        ):
            g = grown
        out.append(g)
    return tuple(sorted(out, key=lambda g: g.sink))


def _with_attention(graph, users, effects, out_roots, group, needed, fusible, taken):
    members = group.members
    ropes = [m for m in members if graph[m].op == ROPE]
    copies = [m for m in members if graph[m].op == INDEX_COPY]
    if len(ropes) != 2 or len(copies) != 2 or len(members) != 4:
        return None
    kcopy = [c for c in copies if graph[c].inputs[2] in ropes]
    if len(kcopy) != 1:
        return None
    kcopy = kcopy[0]
    vcopy = next(c for c in copies if c != kcopy)
    krope = graph[kcopy].inputs[2]
    qrope = next(r for r in ropes if r != krope)
    if qrope in out_roots or krope in out_roots:
        return None
    if _readers(graph, users, krope) != [kcopy]:
        return None
    readers = _readers(graph, users, qrope)
    if len(readers) != 1:
        return None
    att = readers[0]
    node = graph[att]
    if node.op != SDPA or not needed[att] or att in taken or att < members[-1]:
        return None
    if resolve_version(graph, node.inputs[0]) != qrope:
        return None
    if resolve_version(graph, node.inputs[1]) != kcopy:
        return None
    if resolve_version(graph, node.inputs[2]) != vcopy:
        return None
    if graph[qrope].type.shape[-1] % 8 or not fusible(att):
        return None
    new = (*members, att)
    mset = set(new)
    if any(members[0] < e < att and e not in mset for e in effects):
        return None
    for m in new[:-1]:
        if any(r not in mset and r < att for r in _readers(graph, users, m)):
            return None
    written = {resolve_view(graph, c) for c in copies}
    if any(resolve_view(graph, i) in written for i in node.inputs[3:]):
        return None
    return FusionGroup(new, (kcopy, vcopy, att), node.type.shape, ropes[0])


def attach_prefill_attention(
    graph: Graph,
    groups: Sequence[FusionGroup],
    needed: Sequence[bool],
    fusible: Callable[[int], bool],
    max_bindings: int | None = None,
) -> tuple[FusionGroup, ...]:
    """Extend the rotation pairs of ``plan_rope_cache`` (no cache writes: prefill or a forward
    without a KV cache) with the attention that reads them, for one kernel
    (``codegen.wgsl.attention.rope_prefill``) to rotate queries and keys as it loads them.

    A group qualifies when it is exactly two rotations, one needed
    ``scaled_dot_product_attention`` (not in another group) reads the one directly as its
    queries (operand 0) and the other as its keys (operand 1), nothing else reads either
    rotation (training programs, whose backward reads them, keep them), neither is a graph
    output, both are f32 (the fused kernel keeps the rotated values in f32 registers: the same
    values as stored f32 rotations) and the head dim is a multiple of 8. ``fusible(attention)``
    says whether the adapter's plan runs the forward on the lane kernel (no block kernel, no key
    split). No op with in-place effects may lie between the first rotation and the attention,
    so the rotations' operands hold, at the attention's position, the values the rotations
    read.

    Returns:
        ``groups`` with the qualifying ones grown by their attention (the new sink, the only
        output); sorted by sink.
    """
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
    taken = {m for g in groups for m in g.members}
    out = []
    for g in groups:
        grown = _with_prefill_attention(graph, users, effects, out_roots, g, needed, taken)
        if (
            grown is not None
            and fusible(grown.sink)
            and (max_bindings is None or rope_cache_bindings(graph, grown) <= max_bindings)
        ):
            g = grown
        out.append(g)
    return tuple(sorted(out, key=lambda g: g.sink))


def _with_prefill_attention(graph, users, effects, out_roots, group, needed, taken):
    members = group.members
    if len(members) != 2 or any(graph[m].op != ROPE for m in members):
        return None
    if any(m in out_roots for m in members):
        return None
    readers = _readers(graph, users, members[0])
    if len(readers) != 1 or _readers(graph, users, members[1]) != readers:
        return None
    att = readers[0]
    node = graph[att]
    if node.op != SDPA or not needed[att] or att in taken:
        return None
    qrope, krope = node.inputs[0], node.inputs[1]
    if {qrope, krope} != set(members) or qrope == krope:
        return None
    if any(graph[m].type.dtype != DType.f32 for m in members):
        return None
    if graph[qrope].type.shape[-1] % 8:
        return None
    if any(members[0] < e < att for e in effects):
        return None
    return FusionGroup((*members, att), (att,), node.type.shape, members[0])

"""Fusion planning: which nodes of a graph share one kernel.

``plan_fusion`` groups elementwise nodes with their elementwise producers, and optionally one
``matmul`` whose result feeds them (an epilogue: bias, activation, residual computed in the
matmul's store stage). ``plan_attention_key_value`` pairs the key and value gradients of one
attention, which one kernel computes in one pass over the probabilities;
``plan_attention_lse`` has an attention's forward kernel also write its ``..._lse`` node (the
one group that runs at its first member). The typed IR stays
the source of truth: the graph is not rewritten, the interpreter and autodiff never see a
fused op; the scheduler lowers each group as one kernel (``codegen.wgsl.elementwise.fused``)
at the position of its last member.

Invariants of every group ``plan_fusion`` returns (each check is conservative; a rejected
merge only costs a dispatch); an attention pair keeps the first and the ordering and
effect rules (its two members have their own shapes and read no member):
  * it has two or more members, all needed (they would get kernels), with nonzero elements;
  * every member's shape broadcasts (NumPy rule) to the group's ``shape``, and every stored
    member (one read outside the group, through a view or directly, or a graph output) has
    exactly that shape, so the kernel writes each stored element once;
  * a member's operands are other members (read directly, not through views) or values
    outside the group whose storage does not belong to a member;
  * every node outside the group that uses a member comes after the group's last member,
    so placing the kernel there keeps program order valid (no value is read before it is
    written, and no cycle through outside nodes exists);
  * no op with in-place effects lies between the first and the last member, so the
    external inputs read at the kernel's position hold the values the members saw;
  * at most one ``matmul`` (the anchor); then the group's shape is the matmul's, and the
    other members all come after it, so none is one of its operands;
  * with ``max_bindings``, the kernel binds at most that many storage buffers: its external
    inputs (views resolved, constants inlined) and stored members, plus one for the split-K
    scratch of an anchored group (the adapter's ``max_storage_buffers_per_shader_stage``:
    32 on lavapipe and NVIDIA, 8-10 in browsers).
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass

from ..graph.ir import VIEW_OPS, Graph, resolve_view
from ..ops import OPS
from ..ops.attention import BWD_K, BWD_Q, BWD_V, DELTA, LSE, SDPA


@dataclass(frozen=True)
class FusionGroup:
    """Nodes computed by one kernel.

    Attributes:
        members: node ids in program order; the last is where the kernel runs.
        outputs: members the kernel stores (read outside the group, or graph outputs).
        shape: the iteration shape; every stored member has it (an attention pair: the key
            gradient's shape; the value gradient may differ in the last dim).
        anchor: the ``matmul`` whose store stage computes the others, or the attention
            key-gradient node whose kernel also computes its value-gradient sibling
            (``plan_attention_key_value``), or None.
    """

    members: tuple[int, ...]
    outputs: tuple[int, ...]
    shape: tuple[int, ...]
    anchor: int | None = None

    @property
    def sink(self) -> int:
        """The last member: the kernel runs at its position."""
        return self.members[-1]


# Whether an erf GELU (or its gradient) stays out of matmul epilogues. Its exact erfc
# (``core.mathlib``: three branches of rational polynomials and two exps) inlined once per
# accumulator of a tile grows the kernel past what its loop needs and costs more there than in
# a kernel of its own: W4's fc1 (1500 x 384 x 1536 nt, bias and GELU in the epilogue) ran 111.7
# us a layer in the H200 step against 87.3 for the bare product. Apart, timed interleaved
# (``bench/results/lever_ab_h200_erf_apart.json``, off / on): W4 train 1.021 (9.04 -> 8.85 ms),
# W4 fwd 0.990 (2.563 -> 2.588: the GELU's own pass costs about what the epilogue did).
_ERF_APART = [True]


def set_erf_apart(on: bool) -> None:
    """Keep erf GELUs (and their gradients) out of matmul epilogues (True, the default) or let
    them join like any elementwise op (False). Read when a program compiles."""
    _ERF_APART[0] = bool(on)


def _erf_heavy(node) -> bool:
    return node.op in ("gelu", "gelu_backward") and node.attr("approximate", "none") == "none"


def _broadcasts(src: Sequence[int], dst: Sequence[int]) -> bool:
    if len(src) > len(dst):
        return False
    tail = dst[len(dst) - len(src) :]
    return all(s in (1, d) for s, d in zip(src, tail, strict=True))


class _Planner:
    def __init__(
        self,
        graph: Graph,
        fusible: Collection[str],
        needed: Sequence[bool],
        max_bindings: int | None = None,
    ) -> None:
        self.graph, self.fusible, self.max_bindings = graph, fusible, max_bindings
        self.users = graph.users()
        self.out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
        self.effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
        self.group: dict[int, frozenset[int]] = {}
        self.anchor: dict[frozenset[int], int | None] = {}
        for node in graph.nodes:
            if not needed[node.id] or node.type.numel == 0:
                continue
            if node.op in fusible or self._is_anchor(node.id):
                g = frozenset({node.id})
                self.group[node.id] = g
                self.anchor[g] = node.id if node.op == "matmul" else None

    def _is_anchor(self, nid: int) -> bool:
        node = self.graph[nid]
        return node.op == "matmul" and self.graph[node.inputs[0]].type.shape[-1] > 0

    def stored(self, members: frozenset[int], m: int) -> bool:
        return m in self.out_roots or any(u not in members for u in self.users[m])

    def bindings(self, members: frozenset[int], anchor: int | None) -> int:
        """Storage buffers the group's kernel binds (see the module docstring)."""
        g = self.graph
        external = {resolve_view(g, i) for m in members for i in g[m].inputs if i not in members}
        external = {r for r in external if g[r].op != "constant"}
        stored = sum(self.stored(members, m) for m in members)
        return len(external) + stored + (anchor is not None)

    def valid(self, members: frozenset[int], shape: tuple[int, ...], anchor: int | None) -> bool:
        g = self.graph
        last, first = max(members), min(members)
        if anchor is not None and (g[anchor].type.shape != shape or first != anchor):
            return False
        if any(first < e < last for e in self.effects):
            return False
        for m in members:
            for i in g[m].inputs:
                if i not in members and resolve_view(g, i) in members:
                    return False  # a member read back from memory inside its own kernel
            if self.stored(members, m):
                if g[m].type.shape != shape:
                    return False
                if any(u not in members and u < last for u in self.users[m]):
                    return False
        # last: the only check whose cost grows with the group's size
        return self.max_bindings is None or self.bindings(members, anchor) <= self.max_bindings

    def consume(self, nid: int) -> None:
        """Merge the groups of ``nid``'s direct operands into ``nid``'s group where valid."""
        if nid not in self.group or self.graph[nid].op not in self.fusible:
            return
        shape = self.graph[nid].type.shape
        for i in dict.fromkeys(self.graph[nid].inputs):
            mine, theirs = self.group[nid], self.group.get(i)
            if theirs is None or theirs is mine:
                continue
            a, b = self.anchor[mine], self.anchor[theirs]
            if a is not None and b is not None:
                continue
            members = mine | theirs
            anchor = a if a is not None else b
            if (
                anchor is not None
                and _ERF_APART[0]
                and any(_erf_heavy(self.graph[m]) for m in members)
            ):
                continue
            if not all(_broadcasts(self.graph[m].type.shape, shape) for m in members):
                continue
            if not self.valid(members, shape, anchor):
                continue
            del self.anchor[mine], self.anchor[theirs]
            self.anchor[members] = anchor
            for m in members:
                self.group[m] = members


def plan_fusion(
    graph: Graph,
    fusible: Collection[str],
    needed: Sequence[bool] | None = None,
    max_bindings: int | None = None,
) -> tuple[FusionGroup, ...]:
    """Group nodes into kernels (see the module docstring for the invariants kept).

    Greedy, in program order: each fusible node absorbs the groups of its direct operands
    when the merged group stays valid. Producers with several users stay in the group as
    extra stored outputs when every outside user comes later (a matmul + bias whose
    pre-activation value the backward pass reads, say).

    Args:
        graph: a verified graph.
        fusible: op names the fused emitter can compute per element (elementwise ops);
            ``matmul`` may additionally anchor a group.
        needed: per node, whether it gets kernels; default every node.
        max_bindings: the most storage buffers one kernel may bind (the adapter's
            ``max_storage_buffers_per_shader_stage``); None: no bound.

    Returns:
        The groups of two or more members, ordered by their last member.
    """
    needed = needed if needed is not None else [True] * len(graph.nodes)
    planner = _Planner(graph, fusible, needed, max_bindings)
    for node in graph.nodes:
        planner.consume(node.id)
    groups = []
    for members in {g for g in planner.group.values() if len(g) > 1}:
        order = tuple(sorted(members))
        outputs = tuple(m for m in order if planner.stored(members, m))
        shape = graph[order[-1]].type.shape
        groups.append(FusionGroup(order, outputs, shape, planner.anchor[members]))
    return tuple(sorted(groups, key=lambda grp: grp.sink))


def _readers(graph: Graph, users: list[list[int]], vid: int) -> list[int]:
    """The nodes that read ``vid``'s storage: its users, through views to their users."""
    out = []
    for u in users[vid]:
        out.extend(_readers(graph, users, u) if graph[u].op in VIEW_OPS else [u])
    return out


def plan_attention_key_value(
    graph: Graph, needed: Sequence[bool], accept: Callable[[int], bool] = lambda _: True
) -> tuple[FusionGroup, ...]:
    """Pair the key and value gradients of each attention, for one kernel to compute both
    (FlashAttention-2's backward forms dK and dV in one pass: Dao 2023, Algorithm 2).

    A pair is a needed ``..._backward_key`` node (operands q, k, v, dO, stats, mask?) and a
    needed ``..._backward_value`` node reading the same q, k, dO, stats and mask with the same
    attributes, when ``accept(key node)`` holds (the kernel's choice:
    ``codegen.wgsl.attention.lowering.key_value_fusible``). The kernel runs at the later
    member's position, so no node may read the earlier one before that and no op with in-place
    effects may lie between them.

    Returns:
        Groups of (key gradient, value gradient) in program order, both stored, anchored on
        the key-gradient node, ordered by their last member.
    """
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    values: dict[tuple, int] = {}
    for n in graph.nodes:
        if n.op == BWD_V and needed[n.id]:
            values.setdefault((n.inputs, n.attrs), n.id)
    groups = []
    for n in graph.nodes:
        if n.op != BWD_K or not needed[n.id]:
            continue
        q, k, _, g, stats, *mask = n.inputs
        dv = values.get(((q, k, g, stats, *mask), n.attrs))
        if dv is None or not accept(n.id):
            continue
        first, last = min(n.id, dv), max(n.id, dv)
        if any(r < last for r in _readers(graph, users, first)):
            continue
        if any(first < e < last for e in effects):
            continue
        del values[((q, k, g, stats, *mask), n.attrs)]
        groups.append(FusionGroup((first, last), (first, last), graph[n.id].type.shape, n.id))
    return tuple(sorted(groups, key=lambda grp: grp.sink))


def plan_attention_lse(
    graph: Graph,
    needed: Sequence[bool],
    accept: Callable[[int], bool] = lambda _: True,
    taken: Collection[int] = (),
) -> tuple[FusionGroup, ...]:
    """Pair each attention forward with the ``..._lse`` node of its backward, for the
    forward's kernel to write the rows' log-sum-exp too (FlashAttention-2 saves it in its
    forward: Dao 2023, Algorithm 1, line 13), so no pass over the keys is repeated.

    A pair is a needed forward node (q, k, v, mask?) not in ``taken`` (other groups' members)
    and a needed ``..._lse`` node reading the same q, k and mask with the same attributes,
    when ``accept(forward node)`` holds (``codegen.wgsl.attention.lowering.lse_fusible``).
    Unlike every other group, the kernel runs at the FIRST member's position (the forward's:
    its output is read long before the backward): the lse node reads only values the forward
    reads, so its operands exist there, and no op with in-place effects may lie between the
    two (the values it reads are the ones the forward saw).

    Returns:
        Groups of (forward, lse), both stored, anchored on the forward node.
    """
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    forwards: dict[tuple, int] = {}
    for n in graph.nodes:
        if n.op == SDPA and needed[n.id] and n.id not in taken:
            q, k, _, *extra = n.inputs
            forwards.setdefault(((q, k, *extra), n.attrs), n.id)
    groups = []
    for n in graph.nodes:
        if n.op != LSE or not needed[n.id]:
            continue
        fwd = forwards.get((n.inputs, n.attrs))
        if fwd is None or not accept(fwd) or any(fwd < e < n.id for e in effects):
            continue
        del forwards[(n.inputs, n.attrs)]
        groups.append(FusionGroup((fwd, n.id), (fwd, n.id), graph[fwd].type.shape, fwd))
    return tuple(sorted(groups, key=lambda grp: grp.sink))


def plan_attention_delta(
    graph: Graph,
    needed: Sequence[bool],
    accept: Callable[[int, int], bool] = lambda _d, _q: True,
    taken: Collection[int] = (),
) -> tuple[FusionGroup, ...]:
    """Pair each attention backward's ``..._delta`` node with the ``..._backward_query`` node
    reading it, for the query gradient's kernel to compute the rows' delta itself
    (``codegen.wgsl.attention.dq_delta``): FlashAttention-2's D = rowsum(dO o O) (Dao 2023,
    Algorithm 2 line 4) is one dot product per query row, which the dq kernel's rows need
    anyway.

    A pair is a needed delta node and a needed dq node (neither in ``taken``) whose stats
    operand it is, when ``accept(delta, dq)`` holds (``dq_delta.delta_fusible``). The kernel
    runs at dq's (the last member's) position, so no node may read the delta before dq, and
    no op with in-place effects may lie between them (delta's operands are the ones it saw).

    Returns:
        Groups of (delta, dq), both stored, anchored on the dq node.
    """
    users = graph.users()
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    groups = []
    for n in graph.nodes:
        if n.op != BWD_Q or not needed[n.id] or n.id in taken:
            continue
        delta = n.inputs[4]
        if graph[delta].op != DELTA or not needed[delta] or delta in taken:
            continue
        if any(r < n.id for r in _readers(graph, users, delta)):
            continue
        if any(delta < e < n.id for e in effects) or not accept(delta, n.id):
            continue
        groups.append(FusionGroup((delta, n.id), (delta, n.id), graph[n.id].type.shape, n.id))
    return tuple(groups)

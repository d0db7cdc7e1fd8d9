"""Scheduling: graph -> ordered dispatches with symbolic bindings, and value lifetimes.

Node order is already a valid schedule; this stage decides which nodes need kernels (those
whose values reach an output or an effect, judged by what each kernel really binds after
constant inlining and transpose folding), resolves views (``reshape``, ``stop_gradient``) to
the value whose buffer they share, and measures each value's lifetime in dispatch positions.

With fusion on, ``passes.fuse.plan_fusion`` groups nodes (and ``plan_attention_key_value``
pairs attention gradients, ``passes.fuse_matmul.plan_matmul_groups`` merges matmuls
sharing a left operand (small-M gemv ones, and tiled ones: ``matmul.tiled_group``), with the
norm producing it, then tiled ones sharing a right operand (weight gradients:
``matmul.tiled_rgroup``), ``passes.fuse_conv`` anchors elementwise groups on the conv2d they
alone read (run in the conv's store, ``conv.epilogue``), and ``passes.rope_cache`` joins
rotary embeddings and KV-cache writes, and in a decode step, or a forward without a cache,
the attention reading them); a group is lowered as one kernel
(``codegen.wgsl.elementwise.fused``, ``codegen.wgsl.matmul.horizontal``,
``codegen.wgsl.matmul.tiled_group``, ``attention.rope_cache``, ``attention.rope_attention``,
``attention.rope_prefill``, ``conv.epilogue``) at its last member's position (an
attention forward paired with its backward's ``..._lse`` node, ``plan_attention_lse``: at the
forward's; a ``..._delta`` node paired with the query gradient reading it,
``plan_attention_delta``, runs in dq's kernel: ``attention.dq_delta``),
binding the group's external inputs and its stored outputs only, so lifetimes come from those
bindings; the other members get no kernel and no storage. Split-K products whose readers all
sum the partials themselves (``matmul.deferred``) get no summing dispatch and no storage, and
split-K products sharing their left operand compute their partials in one dispatch at the first
one's position (``matmul.split_group``); summing dispatches that run back to back (q, k and
v's) become one (``matmul.summing``, after lowering); a layer_norm / rms_norm reading the one
stored output of a split-K matmul group computes it from the partials, and the group keeps its
partials dispatch only (``norm.prologue``), as does a conv whose output a train-mode batch_norm
or a group_norm reads first (``norm.conv_prologue``: the norm sums the partials); scratch bound
by another node's kernel (``ScratchRef.owner``) lives until its last reader. Optimizer updates
are grouped likewise (``update_groups``): one kernel per group at its last member's position,
over arenas that the assembler lays out.
``passes.fuse_norm.plan_norm_activation`` groups a group_norm with the SiLU reading it, and a
group_norm_backward with the silu_backward, weight gradient and bias sum around it (and a
layer_norm / rms_norm input gradient with its weight gradient and layer_norm's bias sum); such a
group is lowered by the norm lowerings (one or two kernels, and the weight gradient's channel
sums) at its last member's position.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..codegen.kernel import ArenaRef, KernelSource, Limits, ScratchRef, UpdateGroup, ValueRef
from ..codegen.wgsl import lower, reads
from ..codegen.wgsl.attention.dq_delta import delta_fusible, lower_dq_delta
from ..codegen.wgsl.attention.lowering import (
    key_value_fusible,
    lower_forward_lse,
    lse_fusible,
    rope_attention_fusible,
    rope_prefill_fusible,
)
from ..codegen.wgsl.attention.rope_attention import lower_rope_attention
from ..codegen.wgsl.attention.rope_cache import lower_rope_cache
from ..codegen.wgsl.attention.rope_prefill import lower_rope_prefill
from ..codegen.wgsl.conv.epilogue import conv_epilogue_fits, lower_conv_group
from ..codegen.wgsl.conv.lowering import lower_conv2d, lower_conv2d_backward_input
from ..codegen.wgsl.elementwise.fused import lower_group
from ..codegen.wgsl.elementwise.maps import FUSIBLE
from ..codegen.wgsl.matmul.deferred import SplitPartials, plan_deferred_sums
from ..codegen.wgsl.matmul.horizontal import NORM_MAX_K, gemv_key, group_fits, lower_matmul_group
from ..codegen.wgsl.matmul.lowering import lower_matmul
from ..codegen.wgsl.matmul.split_group import SplitGroup, lower_split_group, plan_split_groups
from ..codegen.wgsl.matmul.summing import merge_sum_runs
from ..codegen.wgsl.matmul.tiled_group import (
    is_tiled_group,
    lower_tiled_group,
    tiled_group_fits,
    tiled_key,
)
from ..codegen.wgsl.matmul.tiled_rgroup import (
    is_right_group,
    lower_right_group,
    right_group_fits,
    right_key,
)
from ..codegen.wgsl.norm.conv_prologue import ConvNorm, lower_conv_norm, plan_conv_norms
from ..codegen.wgsl.norm.lowering import norm_act_fusible
from ..codegen.wgsl.norm.prologue import lower_norm_prologue, plan_norm_prologues
from ..codegen.wgsl.optim import lower_update_group
from ..graph.ir import ALIAS_OPS, PLACED_OPS, SUBRANGE_OPS, VIEW_OPS, Graph
from ..ops import OPS
from ..ops.attention import BWD_Q, SDPA
from ..ops.inplace import INDEX_COPY
from ..passes.fuse import (
    FusionGroup,
    plan_attention_delta,
    plan_attention_key_value,
    plan_attention_lse,
    plan_fusion,
)
from ..passes.fuse_conv import plan_conv_epilogues
from ..passes.fuse_matmul import MatmulGroup, plan_matmul_groups
from ..passes.fuse_norm import plan_norm_activation
from ..passes.rope_cache import (
    ROPE,
    attach_attention,
    attach_prefill_attention,
    plan_rope_cache,
)
from .planner import Interval
from .update_groups import arena_roles, arena_value, plan_update_groups

PINNED_LEAVES = frozenset({"input", "parameter", "state"})


@dataclass(frozen=True)
class Schedule:
    """Ordered dispatches plus what the planner and assembler need.

    Attributes:
        dispatches: (node id, KernelSource) in execution order.
        root: node id -> id of the value whose storage it uses (itself unless a view).
        pinned: root ids that own a buffer for the whole program (leaves, outputs, the
            ``row_block`` aliases of leaves, which live in their leaf's buffer, and the
            operands of a ``row_concat``, which live in its buffer).
        intervals: lifetimes of the other roots and of scratch, keyed by root id or
            (node id, scratch key).
        groups: the fusion groups lowered as one kernel each (empty without fusion).
        update_groups: optimizer updates lowered as one kernel each over arenas (empty
            without fusion); their gradients are pinned (in the gradient arena).
    """

    dispatches: tuple[tuple[int, KernelSource], ...]
    root: dict[int, int]
    pinned: frozenset[int]
    intervals: tuple[Interval, ...]
    groups: tuple[FusionGroup | MatmulGroup, ...] = ()
    update_groups: tuple[UpdateGroup, ...] = ()


def schedule(graph: Graph, limits: Limits, fuse: bool = False) -> Schedule:
    """Order the kernels of ``graph`` and compute value lifetimes (see module docstring).

    Args:
        graph: a verified graph.
        limits: the adapter's limits.
        fuse: lower fusion groups (``plan_fusion``) and optimizer update groups
            (``plan_update_groups``) as one kernel each.

    Raises:
        ValueError: when an output is a constant (it has no storage to read back).
    """
    needed = needed_nodes(graph)
    root: dict[int, int] = {}
    for node in graph.nodes:
        aliases = node.op in VIEW_OPS or node.op in ALIAS_OPS  # index_copy_ writes operand 0
        root[node.id] = root[node.inputs[0]] if aliases else node.id

    # A row-block alias lives in its leaf's buffer, so it is pinned with it.
    pinned = {
        node.id for node in graph.nodes if node.op in PINNED_LEAVES or node.op in SUBRANGE_OPS
    }
    # The operands of a placed concatenation live in its (output) buffer.
    pinned.update(i for node in graph.nodes if node.op in PLACED_OPS for i in node.inputs)
    for name, v in graph.outputs:
        if graph.nodes[root[v]].op == "constant":
            raise ValueError(f"output {name!r} is a constant; it has no storage")
        pinned.add(root[v])

    groups = ()
    if fuse:
        kv = plan_attention_key_value(graph, needed, lambda n: key_value_fusible(graph, n, limits))
        bound = limits.max_storage_buffers_per_shader_stage
        fused = plan_fusion(graph, FUSIBLE, needed, max_bindings=bound)
        fused = plan_matmul_groups(
            graph,
            fused,
            needed,
            lambda n: gemv_key(graph, n, limits) or tiled_key(graph, n, limits),
            max_bindings=bound,
            norm_max_k=NORM_MAX_K,
            accept=lambda g: (
                tiled_group_fits(graph, g, limits)
                if is_tiled_group(g, graph, limits)
                else group_fits(graph, g, limits)
            ),
        )
        fused = plan_matmul_groups(  # weight gradients sharing x (matmul.tiled_rgroup)
            graph,
            fused,
            needed,
            lambda n: right_key(graph, n, limits),
            max_bindings=bound,
            accept=lambda g: right_group_fits(graph, g, limits),
            shared="right",
        )
        fused = plan_conv_epilogues(  # elementwise groups in a conv's store (conv.epilogue)
            graph, fused, FUSIBLE, needed, bound, lambda g: conv_epilogue_fits(graph, g, limits)
        )
        rope = plan_rope_cache(graph, needed, max_bindings=bound)
        rope = attach_attention(
            graph,
            rope,
            needed,
            lambda n: rope_attention_fusible(graph, n, limits),
            max_bindings=bound,
        )
        rope = attach_prefill_attention(
            graph,
            rope,
            needed,
            lambda n: rope_prefill_fusible(graph, n, limits),
            max_bindings=bound,
        )
        taken = {m for g in fused + kv + rope for m in g.members}
        norm_act = plan_norm_activation(
            graph, needed, taken, lambda n, o: norm_act_fusible(graph, n, o, limits)
        )
        lse = plan_attention_lse(
            graph,
            needed,
            lambda n: lse_fusible(graph, n, limits),
            taken={m for g in rope for m in g.members},
        )
        delta = plan_attention_delta(
            graph,
            needed,
            lambda d, q: delta_fusible(graph, d, q, limits),
            taken={m for g in fused + kv + rope + norm_act + lse for m in g.members},
        )
        groups = fused + kv + rope + norm_act + lse + delta
        groups = tuple(sorted(groups, key=lambda g: g.sink))
    updates = plan_update_groups(graph, needed, limits) if fuse else ()
    deferred = plan_deferred_sums(graph, needed, groups, limits) if fuse else {}
    split_groups = plan_split_groups(graph, deferred, limits, groups, needed) if fuse else ()
    prologues = plan_norm_prologues(graph, needed, groups, limits, deferred) if fuse else {}
    conv_norms = plan_conv_norms(graph, needed, groups, limits, deferred) if fuse else {}
    lowered = (deferred, split_groups, prologues, conv_norms)
    dispatches = _lower_all(graph, needed, limits, groups, updates, *lowered)
    clash = _arena_clashes(graph, dispatches, updates)
    if clash:  # rare: a kernel writes one member's gradient and reads another's
        updates = plan_update_groups(graph, needed, limits, exclude=clash)
        dispatches = _lower_all(graph, needed, limits, groups, updates, *lowered)
    pinned.update(arena_value(graph, m, "grad") for g in updates for m in g.members)

    first: dict = {}
    last: dict = {}
    sizes: dict = {}
    for pos, (nid, ks) in enumerate(dispatches):
        for b in ks.bindings:
            if isinstance(b, ValueRef):
                key = root[b.node]
                if key in pinned:
                    continue
                sizes[key] = graph.nodes[key].type.nbytes
            elif isinstance(b, ArenaRef):
                continue  # arenas are pinned
            elif isinstance(b, ScratchRef):
                key = b.slot(nid)
                # A key may be bound at several sizes by a node's kernels: keep the largest.
                sizes[key] = max(sizes.get(key, 0), b.nbytes)
            else:  # pragma: no cover - codegen contract
                raise TypeError(f"unknown binding {b!r}")
            first.setdefault(key, pos)
            last[key] = pos
    intervals = tuple(Interval(k, sizes[k], first[k], last[k]) for k in first)
    return Schedule(tuple(dispatches), root, frozenset(pinned), intervals, groups, updates)


def needed_nodes(graph: Graph) -> list[bool]:
    """Per node id, whether its value is bound by a kernel that reaches an output or an effect
    (judged by what each kernel really binds: ``codegen.wgsl.reads``)."""
    needed = [False] * len(graph.nodes)
    for _, v in graph.outputs:
        needed[v] = True
    for node in graph.nodes:
        if node.op in OPS and OPS[node.op].writes:
            needed[node.id] = True
    for node in reversed(graph.nodes):
        if not needed[node.id]:
            continue
        operands = node.inputs if node.op in VIEW_OPS else reads(graph, node.id)
        for i in operands:
            needed[i] = True
    return needed


def _lower_all(
    graph: Graph,
    needed: list[bool],
    limits: Limits,
    groups: tuple[FusionGroup | MatmulGroup, ...],
    updates: tuple[UpdateGroup, ...],
    deferred: dict[int, SplitPartials],
    split_groups: tuple[SplitGroup, ...] = (),
    prologues: dict[int, FusionGroup] | None = None,
    conv_norms: dict[int, ConvNorm] | None = None,
) -> list[tuple[int, KernelSource]]:
    prologues = prologues or {}
    conv_norms = conv_norms or {}
    summed_convs = {cn.conv for cn in conv_norms.values()}
    summed_by_norm = {g.sink for g in prologues.values()}
    group_of = {m: g for g in groups for m in g.members}
    split_of = {a: g for g in split_groups for a in g.anchors}
    update_of = {m: g for g in updates for m in g.members}
    dispatches: list[tuple[int, KernelSource]] = []
    plain_sums: set[int] = set()  # positions of plain summing dispatches (matmul.summing)
    for node in graph.nodes:
        if needed[node.id] and node.op in OPS and node.op not in VIEW_OPS:
            group = group_of.get(node.id)
            ugroup = update_of.get(node.id)
            if ugroup is not None:
                is_sink = node.id == ugroup.sink
                kernels = [lower_update_group(graph, ugroup, limits)] if is_sink else []
            elif node.id in split_of:  # at the first (sum groups: last) product's position
                sg = split_of[node.id]
                kernels = lower_split_group(graph, sg, limits) if node.id == sg.position else []
                if node.id in sg.summed:  # its readers need the product stored
                    kernels += lower_matmul(graph, node.id, limits, sum_only=True)
                    plain_sums.add(len(dispatches) + len(kernels) - 1)
            elif node.id in deferred and node.op == "matmul":
                kernels = lower_matmul(graph, node.id, limits, defer_sum=True)
            elif node.id in deferred:
                kernels = lower_conv2d_backward_input(graph, node.id, limits, defer_sum=True)
            elif node.id in prologues:  # computes its input: the group's summing dispatch
                kernels = lower_norm_prologue(graph, node.id, prologues[node.id], limits, deferred)
                if kernels is None:  # pragma: no cover - plan_norm_prologues lowered it
                    raise ValueError(f"%{node.id}: no norm prologue lowering")
            elif node.id in summed_convs:  # its partials alone: a norm sums them
                kernels = lower_conv2d(graph, node.id, limits, deferred=deferred, defer_sum=True)
            elif node.id in conv_norms:  # computes its input: the conv's summing dispatch
                kernels = lower_conv_norm(graph, conv_norms[node.id], limits, deferred)
                if kernels is None:  # pragma: no cover - plan_conv_norms lowered it
                    raise ValueError(f"%{node.id}: no conv norm lowering")
            elif group is None:
                kernels = lower(graph, node.id, limits, deferred)
                if node.op == "matmul" and len(kernels) == 2 and _plain_sum(kernels[1]):
                    plain_sums.add(len(dispatches) + 1)  # [partials, sum]
            elif group.anchor is not None and graph[group.anchor].op == SDPA:
                # the forward + lse pair runs at its FIRST member (plan_attention_lse)
                first, second = group.members
                at_first = node.id == first
                kernels = lower_forward_lse(graph, first, second, limits) if at_first else []
            elif node.id != group.sink:
                kernels = []
            elif group.anchor is not None and graph[group.anchor].op == BWD_Q:
                kernels = lower_dq_delta(graph, *group.members, limits)  # dq_delta
            elif isinstance(group, MatmulGroup) and is_right_group(group):
                kernels = lower_right_group(graph, group, limits)
            elif isinstance(group, MatmulGroup) and is_tiled_group(group, graph, limits):
                kernels = lower_tiled_group(graph, group, limits)
            elif isinstance(group, MatmulGroup):
                kernels = lower_matmul_group(graph, group, limits)
            elif group.anchor is not None and graph[group.anchor].op == "conv2d":
                kernels = lower_conv_group(graph, group, limits, deferred)
            elif group.anchor is not None and graph[group.anchor].op == ROPE:
                writes_cache = any(graph[m].op == INDEX_COPY for m in group.members)
                if graph[group.sink].op == SDPA and not writes_cache:  # no KV cache: prefill
                    kernels = lower_rope_prefill(graph, group, limits, deferred)
                elif graph[group.sink].op == SDPA:
                    kernels = lower_rope_attention(graph, group, limits, deferred)
                else:
                    kernels = lower_rope_cache(graph, group, limits, deferred)
            else:
                sum_only = group.anchor in split_of  # its partials come from a split group
                by_norm = node.id in summed_by_norm  # its summing dispatch runs in a norm
                kernels = lower_group(graph, group, limits, deferred, sum_only, by_norm)
            dispatches.extend((node.id, ks) for ks in kernels)
    return merge_sum_runs(graph, dispatches, plain_sums, limits)


def _plain_sum(ks: KernelSource) -> bool:
    """Whether ``ks`` is a split-K product's summing dispatch storing the product (a
    ``lower_matmul`` without epilogue: it binds the partials and the output only)."""
    return ks.name.endswith(" matmul sum_splits") and len(ks.bindings) == 2


def _arena_clashes(
    graph: Graph, dispatches: list[tuple[int, KernelSource]], updates: tuple[UpdateGroup, ...]
) -> frozenset[int]:
    """Update members that a kernel binds in one arena both read-only and writable.

    wgpu tracks usage per buffer, not per range, so one dispatch may not bind one buffer as
    ``read`` and as ``read_write`` even at disjoint offsets.
    """
    where: dict[int, tuple[tuple, int]] = {}  # root -> (arena key, member)
    for g in updates:
        for role in arena_roles(graph, g):
            for m in g.members:
                where[arena_value(graph, m, role)] = (g.arena_key(role), m)
    clash: set[int] = set()
    for _, ks in dispatches:
        seen: dict[tuple, list[tuple[int, bool]]] = {}
        for b in ks.bindings:
            if isinstance(b, ValueRef) and b.node in where:
                key, m = where[b.node]
                seen.setdefault(key, []).append((m, b.write))
        for uses in seen.values():
            if len({w for _, w in uses}) > 1:
                clash.update(m for m, _ in uses)
    return frozenset(clash)

"""Conv epilogues: an elementwise fusion group reading a ``conv2d`` runs in the conv's store.

``plan_conv_epilogues`` runs after ``fuse.plan_fusion`` (and the matmul groups) and anchors
an unanchored elementwise ``FusionGroup`` on a ``conv2d`` product that it alone reads: the
eval BatchNorm folded into an affine map of the conv's output (``passes.fold_batch_norm``,
``into="output"``) and the ReLU or residual add after it. The group's per-element code then
runs where the conv stores each output element (``codegen.wgsl.conv.epilogue``): in the
implicit GEMM's store stage, or, when the conv splits K, in the dispatch summing its
partials, as a matmul-anchored group's does. The conv's value is never stored and the
group's own dispatch disappears: ResNet-50's eval forward at batch 4 goes from 132 H200
dispatches to 83 (docs/vision.md).

Invariants of every anchored group (each check conservative; a rejected group keeps its own
kernel and the conv its store):
  * the group was an elementwise group without anchor (or a lone elementwise node, in no
    group: its only member besides the conv, and stored); the conv is needed, precedes every
    member (so none is one of its operands, and the group keeps ``FusionGroup``'s "anchor
    first"), has the group's shape, is no graph output, and every node reading it (through
    views too) is a member reading it directly;
  * no op with in-place effects lies between the conv and the group's last member, where the
    conv's kernel now runs (its operands hold the values they held at the conv's position);
  * with ``max_bindings``, the conv's kernel binds at most that many storage buffers: its
    input, weight and bias, the group's external inputs (views resolved, constants inlined)
    and stored members, plus one for the split-K partials;
  * ``accept`` (the conv lowering's word, ``conv.epilogue.conv_epilogue_fits``) holds.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..graph.ir import Graph, resolve_view
from ..ops import OPS
from .fuse import FusionGroup

ENABLED = [True]  # bench A/B switch (``set_enabled``); never changed by the compiler


def set_enabled(on: bool) -> None:
    """Anchor elementwise groups on the conv2d they read (on, the default) or not, for
    programs compiled from now on (benchmarks and tests compare the two)."""
    ENABLED[:] = [bool(on)]


def plan_conv_epilogues(
    graph: Graph,
    groups: Sequence,
    fusible: Collection[str],
    needed: Sequence[bool],
    max_bindings: int | None = None,
    accept: Callable[[FusionGroup], bool] = lambda _: True,
) -> tuple:
    """Anchor elementwise groups on the ``conv2d`` they alone read (module docstring).

    Args:
        graph: a verified graph.
        groups: the schedule's groups so far (``FusionGroup``, ``MatmulGroup``, ...); the
            ``FusionGroup``s without anchor are candidates, and so is each needed node of a
            ``fusible`` op in no group (a lone residual add reading a conv, as one member).
        fusible: op names the fused emitter computes per element (``elementwise.maps.
            FUSIBLE``).
        needed: per node, whether it gets kernels.
        max_bindings: the adapter's storage-buffer limit per kernel (None: no bound).
        accept: the conv kernel's last word on an anchored group.

    Returns:
        ``groups`` with each anchored group replaced by (a lone node: joined by) one with the
        conv as its first member and anchor (not an output), ordered by last member. Of
        several convs a group could anchor on, the first in program order is taken.
    """
    if not ENABLED[0]:
        return tuple(groups)
    users = graph.users()
    out_roots = {resolve_view(graph, v) for _, v in graph.outputs}
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]
    grouped = {m for g in groups for m in g.members}
    lone = [
        FusionGroup((n.id,), (n.id,), n.type.shape)
        for n in graph.nodes
        if n.op in fusible and needed[n.id] and n.id not in grouped and n.type.numel
        and any(graph[i].op == "conv2d" for i in n.inputs)
    ]  # fmt: skip
    out = []
    for grp in [*groups, *lone]:
        if isinstance(grp, FusionGroup) and grp.anchor is None:
            new = _anchor(graph, grp, needed, users, out_roots, effects, max_bindings, accept)
            if new is None and len(grp.members) == 1:
                continue  # a lone node stays a kernel of its own
            grp = grp if new is None else new
        out.append(grp)
    return tuple(sorted(out, key=lambda g: g.sink))


def _anchor(
    graph, grp, needed, users, out_roots, effects, max_bindings, accept
) -> FusionGroup | None:
    members = set(grp.members)
    convs = sorted({i for m in grp.members for i in graph[m].inputs if graph[i].op == "conv2d"})
    for conv in convs:
        if not needed[conv] or conv in out_roots or conv > grp.members[0]:
            continue
        if graph[conv].type.shape != grp.shape or any(u not in members for u in users[conv]):
            continue  # a view of it is no member either
        if any(conv < e < grp.sink for e in effects):
            continue
        cand = FusionGroup((conv, *grp.members), grp.outputs, grp.shape, conv)
        if max_bindings is not None and _bindings(graph, cand) > max_bindings:
            continue
        if accept(cand):
            return cand
    return None


def _bindings(graph: Graph, grp: FusionGroup) -> int:
    """Storage buffers of the conv's kernel with ``grp`` as its epilogue (an upper bound:
    the split-K partials are counted whether or not the conv splits)."""
    members = set(grp.members)
    external = {resolve_view(graph, i) for m in grp.members for i in graph[m].inputs}
    external = {r for r in external if r not in members and graph[r].op != "constant"}
    return len(external) + len(grp.outputs) + 1

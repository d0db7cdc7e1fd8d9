"""Pair a group_norm with the SiLU that reads it, and the SiLU's gradient with the norm's input
gradient (and the weight gradient's statistics with it), for one kernel to compute each pair
(the normalize-then-activate of a U-Net's or a diffusion model's residual blocks); and a
layer_norm / rms_norm input gradient with its weight gradient's statistics (and layer_norm's
bias gradient with the weight gradient's column sums): two kernels per norm backward, not three
or four.

The norm kernel stores ``silu(y)`` from its registers (``codegen.wgsl.norm.activation
.store_normalized``), and y itself only when something else reads it (in training the SiLU's
gradient does), so the pair costs one dispatch instead of two and the SiLU's read of y goes.
The input-gradient kernel computes its ``g = gy * silu_grad(y)`` from the SiLU gradient's
operands (``activation.GradIn``) and stores g only when read elsewhere (in training the
weight and bias gradients read it). A group_norm_weight_backward of the same x and g joins the
input gradient: its kernel leaves the group statistics in the weight gradient's scratch, so
only the channel sums remain (its own statistics kernel goes); the bias gradient's sum of g over
the channels joins those. layer_norm_backward and rms_norm_backward pair likewise with their
``*_weight_backward`` (no SiLU prologue): the input gradient's team kernel leaves the row
statistics, the weight gradient's column sums read them (and layer_norm's bias gradient, the
``sum`` of g over the leading dims, joins the column sums). A layer_norm / rms_norm input
gradient read only by an ``add`` (the residual stream's gradient of a pre-norm block: SmolLM2's
training step has 60, Whisper-tiny's 20) joins too: its kernel stores ``dx + r`` into the add's
value and dx is never stored (``RESIDUAL``).

The graph is not rewritten: as ``passes.fuse`` groups, a group is a ``FusionGroup`` anchored
on the norm, lowered at its last member's position.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from ..graph.ir import VIEW_OPS, Graph, resolve_view
from ..ops import OPS
from .fuse import FusionGroup
from .permute_views import write_view

ACTIVATIONS = ("silu",)
BACKWARDS = ("group_norm_backward", "layer_norm_backward", "rms_norm_backward")
RESIDUAL = [True]  # the residual add joins a layer_norm / rms_norm input gradient (A/B switch)
# products whose readers may sum their split-K partials themselves (``matmul.deferred``): the
# norm kernel reads its operands whole, so an add reading one stays apart
_SPLIT_OPS = ("matmul", "conv2d_backward_input")


def residual_add(graph: Graph, node_id: int, users, outs, free) -> int | None:
    """The ``add`` that is the only reader of the layer_norm / rms_norm input gradient
    ``node_id`` (not a graph output), whose other operand is a plain value of the same shape
    (not a view, not a product whose sum may be deferred to its readers), or None."""
    node = graph[node_id]
    us = users[node_id]
    if not RESIDUAL[0] or node.op == "group_norm_backward" or node_id in outs or len(us) != 1:
        return None
    a = graph[us[0]]
    if a.op != "add" or not free(a.id) or a.type.shape != node.type.shape:
        return None
    other = [v for v in a.inputs if v != node_id]
    if len(a.inputs) != 2 or len(other) != 1:
        return None
    r = graph[other[0]]
    if r.type.shape != node.type.shape or resolve_view(graph, r.id) != r.id or r.op in _SPLIT_OPS:
        return None
    return a.id


def _bias_sum(graph: Graph, kind: str, shape: tuple[int, ...], attrs) -> list:
    """The (attrs, shape) pairs of the ``sum`` node that is the bias gradient of a ``kind``
    norm of input ``shape`` (``ops.norm._bias_grad``): group_norm sums g over (N, *spatial) to
    [C]; layer_norm's bias gradient is autodiff's sum of g over the leading (broadcast) dims,
    keepdim, to [1, ..., 1, *normalized] (a reshape to the bias's shape follows); rms_norm has
    none."""
    if kind == "group_norm":
        dims = (0, *range(2, len(shape)))
        return [({"dims": dims, "keepdim": False}, (shape[1],))]
    if kind == "layer_norm":
        lead = len(shape) - attrs["normalized_ndim"]
        if lead == 0:
            return []
        dims, norm = tuple(range(lead)), tuple(shape[lead:])
        return [
            ({"dims": dims, "keepdim": True}, (1,) * lead + norm),
            ({"dims": dims, "keepdim": False}, norm),
        ]
    return []


def plan_norm_activation(
    graph: Graph,
    needed: Sequence[bool],
    taken: Collection[int] = (),
    accept: Callable[[int, tuple[int, ...]], bool] = lambda n, o: True,
) -> tuple[FusionGroup, ...]:
    """Groups anchored on a norm node: (group_norm, silu) where the silu's operand is the
    norm's output itself; and a group_norm_backward with the silu_backward producing its g
    and / or the group_norm_weight_backward reading the same x and g (its kernel leaves the
    group statistics for the weight gradient's channel sums) and then the bias gradient's
    ``sum`` of g over the same channels (the channel sums take it too); and a
    layer_norm_backward / rms_norm_backward with its ``*_weight_backward`` of the same x, g and
    attributes, then (layer_norm) the bias gradient's ``sum`` of g over the leading dims.

    A member joins when it is needed and in no other group (``taken``), has the norm's shape
    (group_norm / silu pairs; storage dtypes may differ in the fast mode's storage plan), is
    not written through a placed view, every reader outside the group of every member but
    the last comes after the last (the kernel runs there), no op with in-place effects lies
    between the first and the last, and ``accept(norm node, the other members)`` (the lowering
    serves it: ``codegen.wgsl.norm.lowering.norm_act_fusible``). A norm read by several silus
    pairs with the first.

    Returns:
        Groups ordered by their last member, anchored on the norm node. Outputs: the last
        member, every other member that is a graph output or read outside the group, and the
        silu_backward's g whenever the weight gradient is in the group (its channel sums read
        g from memory).
    """
    users = graph.users()
    outs = {v for _, v in graph.outputs}
    effects = [n.id for n in graph.nodes if n.op in OPS and OPS[n.op].writes]

    def free(v: int) -> bool:
        return needed[v] and v not in taken and write_view(graph, v) is None

    def readers(v: int) -> list[int]:
        """The nodes reading ``v``, a view's readers in place of the view (no kernel)."""
        out = []
        for u in users[v]:
            out += readers(u) if graph[u].op in VIEW_OPS else [u]
        return out

    def valid(members: list[int]) -> bool:
        last = max(members)
        for m in members:
            if any(u not in members and u < last for u in readers(m)):
                return False
        return not any(min(members) < e < last for e in effects)

    groups = []
    for node in graph.nodes:
        if not free(node.id):
            continue
        if node.op == "group_norm":
            acts = [u for u in users[node.id] if graph[u].op in ACTIVATIONS and free(u)]
            if not acts or graph[acts[0]].inputs != (node.id,):
                continue
            if graph[acts[0]].type.shape != node.type.shape:
                continue
            members = [node.id, acts[0]]
        elif node.op in BACKWARDS:
            kind = node.op.removesuffix("_backward")
            x, _, g = node.inputs
            members = [node.id]
            if (
                kind == "group_norm"
                and graph[g].op == "silu_backward"
                and free(g)
                and g not in node.inputs[:2]
                and graph[g].type.shape == node.type.shape
                and valid([g, node.id])
            ):
                members.insert(0, g)
            wgrads = [
                u
                for u in users[x]
                if graph[u].op == f"{kind}_weight_backward"
                and graph[u].inputs == (x, g)
                and graph[u].attrs == node.attrs
                and u > node.id
                and free(u)
            ]
            if wgrads and valid([*members, wgrads[0]]):
                members.append(wgrads[0])
                bias_sum = _bias_sum(graph, kind, graph[x].type.shape, node.attr_dict)
                sums = [
                    u
                    for u in users[g]
                    if graph[u].op == "sum"
                    and (graph[u].attr_dict, graph[u].type.shape) in bias_sum
                    and u > wgrads[0]
                    and free(u)
                ]
                if sums and valid([*members, sums[0]]):
                    members.append(sums[0])
            # last: the residual add (one dispatch) yields to the bias sum (two), whose
            # readers may come before the add
            res = residual_add(graph, node.id, users, outs, free)
            if res is not None and valid([*members, res]):
                members.append(res)
        else:
            continue
        members.sort()
        if len(members) < 2 or not valid(members):
            continue
        if not accept(node.id, tuple(m for m in members if m != node.id)):
            continue
        member_set = set(members)
        wgrad = any(graph[m].op.endswith("_weight_backward") for m in members)
        outputs = tuple(
            m
            for m in members
            if m == members[-1]
            or m in outs
            or any(u not in member_set for u in users[m])
            or (wgrad and graph[m].op == "silu_backward")
        )
        shape = graph[node.id].type.shape
        groups.append(FusionGroup(tuple(members), outputs, shape, node.id))
    return tuple(sorted(groups, key=lambda grp: grp.sink))

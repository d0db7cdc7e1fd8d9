"""Dead-code elimination, common-subexpression elimination and permute folding.

Both keep every named leaf that the remaining graph needs, every output and every node with
effects (optimizer updates); ``input`` leaves are always kept so a compiled program's feed
signature never changes because a pass found an input unused.
"""

from __future__ import annotations

import dataclasses

from ..graph.ir import Graph, Node
from ..ops import OPS


def renumber(
    graph: Graph, keep: list[bool], remap: dict[int, int] | None = None
) -> tuple[Graph, dict[int, int]]:
    """Drop nodes whose ``keep`` flag is False and renumber the rest densely.

    Args:
        keep: one flag per node.
        remap: optional pre-mapping of node ids to equivalent earlier ids (CSE).

    Returns:
        (new graph, old id -> new id for kept nodes).
    """
    remap = remap or {}
    new_id: dict[int, int] = {}
    nodes: list[Node] = []
    for n in graph.nodes:
        if not keep[n.id]:
            continue
        ins = tuple(new_id[remap.get(i, i)] for i in n.inputs)
        new_id[n.id] = len(nodes)
        nodes.append(dataclasses.replace(n, id=len(nodes), inputs=ins))
    for old, target in remap.items():
        if target in new_id:
            new_id.setdefault(old, new_id[target])
    outs = tuple((k, new_id[remap.get(v, v)]) for k, v in graph.outputs)
    return Graph(tuple(nodes), outs), new_id


def reorder(graph: Graph, order: list[int]) -> tuple[Graph, dict[int, int]]:
    """``graph`` with its nodes in ``order`` (every node id once, each after its inputs),
    renumbered; and old id -> new id.

    Raises:
        ValueError: ``order`` is not a permutation of the node ids, or puts a node before one
            of its inputs.
    """
    if sorted(order) != list(range(len(graph.nodes))):
        raise ValueError(f"reorder: not a permutation of the {len(graph.nodes)} node ids")
    new_id = {old: k for k, old in enumerate(order)}
    nodes = []
    for old in order:
        n = graph[old]
        ins = tuple(new_id[i] for i in n.inputs)
        if any(i >= len(nodes) for i in ins):
            raise ValueError(f"reorder: %{old} ({n.op}) would come before one of its inputs")
        nodes.append(dataclasses.replace(n, id=len(nodes), inputs=ins))
    outs = tuple((k, new_id[v]) for k, v in graph.outputs)
    return Graph(tuple(nodes), outs), new_id


def _is_effect(n: Node) -> bool:
    d = OPS.get(n.op)
    return d is not None and bool(d.writes)


def dce(graph: Graph) -> tuple[Graph, dict[int, int]]:
    """Remove nodes that neither reach an output nor an effect."""
    live = [False] * len(graph.nodes)
    for _, v in graph.outputs:
        live[v] = True
    for n in graph.nodes:
        if _is_effect(n) or n.op == "input":
            live[n.id] = True
    for n in reversed(graph.nodes):
        if live[n.id]:
            for i in n.inputs:
                live[i] = True
    return renumber(graph, live)


def cse(graph: Graph) -> tuple[Graph, dict[int, int]]:
    """Merge nodes with the same op, operands and attributes (leaves and effects excluded)."""
    seen: dict[tuple, int] = {}
    remap: dict[int, int] = {}
    keep = [True] * len(graph.nodes)
    for n in graph.nodes:
        if n.name is not None or _is_effect(n):
            continue
        attrs = tuple((k, repr(v)) for k, v in n.attrs)  # repr keeps -0.0 apart from 0.0
        key = (n.op, tuple(remap.get(i, i) for i in n.inputs), attrs, n.type)
        if key in seen:
            remap[n.id] = seen[key]
            keep[n.id] = False
        else:
            seen[key] = n.id
    return renumber(graph, keep, remap)


def moves_only_unit_dims(shape: tuple[int, ...], dims: tuple[int, ...]) -> bool:
    """Whether ``permute(x, dims)`` of an ``x`` of ``shape`` keeps the order of every dim of
    size > 1, so that the row-major element order is unchanged: the permute is a reshape."""
    big = [d for d in dims if shape[d] != 1]
    return big == sorted(big)


def fold_permutes(graph: Graph) -> tuple[Graph, dict[int, int]]:
    """Compose ``permute(permute(x, a), b)`` into one permute of ``x``, or into ``x`` itself
    when the composition is the identity (the backward of ``x @ W^T`` transposes a transpose),
    and turn a permute that only moves size-1 dims (``[B, 1, H, D] -> [B, H, 1, D]`` of a
    one-token decode step) into a reshape, a view with no kernel. The inner permute is left
    for ``dce`` to remove when nothing else reads it."""
    from ..graph.ir import make_attrs

    nodes = list(graph.nodes)
    remap: dict[int, int] = {}
    keep = [True] * len(nodes)
    for n in graph.nodes:
        if n.op != "permute":
            continue
        inner = nodes[remap.get(n.inputs[0], n.inputs[0])]
        if inner.op == "permute":
            outer_dims, inner_dims = n.attr("dims"), inner.attr("dims")
            dims = tuple(inner_dims[d] for d in outer_dims)
            if dims == tuple(range(len(dims))):
                remap[n.id] = inner.inputs[0]
                keep[n.id] = False
                continue
            n = nodes[n.id] = dataclasses.replace(
                n, inputs=(inner.inputs[0],), attrs=make_attrs({"dims": dims})
            )
            inner = nodes[remap.get(n.inputs[0], n.inputs[0])]
        if moves_only_unit_dims(inner.type.shape, n.attr("dims")):
            nodes[n.id] = dataclasses.replace(
                n, op="reshape", attrs=make_attrs({"shape": n.type.shape})
            )
    return renumber(Graph(tuple(nodes), graph.outputs), keep, remap)

"""Checks the invariants every graph must keep, for graphs produced by passes.

* node ids equal positions; inputs refer to earlier nodes (so no cycle can exist);
* every op is known and its type rule reproduces the stored type;
* leaf names are unique; outputs refer to existing nodes;
* every ``input`` leaf is used (an unused input is almost always a wiring mistake);
* in-place writes that return their storage (``ALIAS_OPS``: ``index_copy_``) write a ``state``
  leaf, and once a node writes a storage no later node or output reads an older version of it
  (it would see the new values: program order is execution order).
"""

from __future__ import annotations

from .ir import ALIAS_OPS, LEAF_OPS, VIEW_OPS, Graph, resolve_version, resolve_view
from .printer import format_node


class GraphError(ValueError):
    """A graph breaks an IR invariant; the message quotes the offending node."""


def verify(graph: Graph, allow_unused_inputs: bool = False) -> None:
    """Raise GraphError when ``graph`` breaks an invariant (see module docstring)."""
    from ..ops import OPS

    names: dict[str, int] = {}
    used = [False] * len(graph.nodes)
    for i, n in enumerate(graph.nodes):
        if n.id != i:
            raise GraphError(f"node at position {i} has id {n.id}: {format_node(n)}")
        for j in n.inputs:
            if not 0 <= j < i:
                kind = "a cycle or forward reference" if j >= i else "an invalid id"
                raise GraphError(f"%{i} reads %{j}, {kind}: {format_node(n)}")
            used[j] = True
        if n.op in LEAF_OPS:
            if n.inputs:
                raise GraphError(f"leaf with operands: {format_node(n)}")
            if n.name is not None:
                if n.name in names:
                    raise GraphError(f"name {n.name!r} used by %{names[n.name]} and %{i}")
                names[n.name] = i
            continue
        if n.op not in OPS:
            raise GraphError(f"unknown op: {format_node(n)}")
        types = [graph.nodes[j].type for j in n.inputs]
        try:
            t = OPS[n.op].infer(types, n.attr_dict)
        except (TypeError, KeyError, ValueError) as e:
            raise GraphError(f"ill-typed node {format_node(n)}: {e}") from None
        if t != n.type:
            raise GraphError(f"stored type {n.type} != inferred {t}: {format_node(n)}")
    for name, j in graph.outputs:
        if not 0 <= j < len(graph.nodes):
            raise GraphError(f"output {name!r} refers to missing node %{j}")
        used[j] = True
    _check_versions(graph)
    if not allow_unused_inputs:
        for n in graph.nodes:
            if n.op == "input" and not used[n.id]:
                raise GraphError(
                    f"input {n.name!r} (%{n.id}: {n.type}, declared at {n.loc}) is never used"
                )


def _check_versions(graph: Graph) -> None:
    """The in-place rules of the module docstring."""
    if not any(n.op in ALIAS_OPS for n in graph.nodes):
        return
    latest: dict[int, int] = {}  # storage root -> id of its newest version

    def check(vid: int, reader: str) -> None:
        root = resolve_view(graph, vid)
        newest = latest.get(root)
        if newest is not None and resolve_version(graph, vid) != newest:
            raise GraphError(
                f"{reader} reads %{vid}, an older version of {graph[root].name or f'%{root}'} "
                f"than %{newest} ({graph[newest].op}), which is already written in place; read "
                f"the value {graph[newest].op} returned instead"
            )

    for n in graph.nodes:
        if n.op in VIEW_OPS:
            continue
        for i in n.inputs:
            check(i, format_node(n))
        if n.op in ALIAS_OPS:
            root = resolve_view(graph, n.inputs[0])
            if graph[root].op != "state":
                raise GraphError(
                    f"{format_node(n)} writes %{root} ({graph[root].op}) in place; only a "
                    "state leaf (a module Buffer) or an earlier in-place write of one may be"
                )
            latest[root] = n.id
    for name, v in graph.outputs:
        check(v, f"output {name!r}")

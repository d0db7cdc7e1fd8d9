"""Stable text form of a graph, one line per node: ``%3: f32[32,128] = matmul %1, %2``.

The format is part of the interface: error messages quote it and golden tests pin it.
"""

from __future__ import annotations

from .ir import Graph, Node


def _fmt_value(v) -> str:
    if isinstance(v, float):
        return repr(v)
    if isinstance(v, tuple):
        return "(" + ", ".join(_fmt_value(x) for x in v) + ("," if len(v) == 1 else "") + ")"
    if isinstance(v, str):
        return repr(v)
    return str(v)


def format_node(node: Node) -> str:
    """One node as text, e.g. ``%4: f32[64,10] = add %2, %3``."""
    parts = [f"%{node.id}: {node.type} = {node.op}"]
    operands = ", ".join(f"%{i}" for i in node.inputs)
    extras = []
    if node.name is not None:
        extras.append(f"name={node.name!r}")
    extras.extend(f"{k}={_fmt_value(v)}" for k, v in node.attrs)
    body = ", ".join(x for x in [operands, *extras] if x)
    if body:
        parts.append(" " + body)
    return "".join(parts)


def format_graph(graph: Graph) -> str:
    """The whole graph, then its outputs, e.g. ``return loss=%9``."""
    lines = [format_node(n) for n in graph.nodes]
    if graph.outputs:
        lines.append("return " + ", ".join(f"{k}=%{v}" for k, v in graph.outputs))
    return "\n".join(lines)

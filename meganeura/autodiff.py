"""Reverse-mode automatic differentiation as a graph-to-graph transform.

``differentiate`` appends gradient nodes to a copy of the graph in one reverse sweep. The two
pieces of bookkeeping every gradient rule would otherwise repeat live here, once:
  * fan-out accumulation: a value read by several nodes gets the sum of their contributions;
  * unbroadcasting: a contribution shaped like the broadcast result is summed back to the
    operand's shape (over leading dims and dims where the operand had size 1).
Gradient rules therefore stay one to three lines (``meganeura/ops/*``).
"""

from __future__ import annotations

from collections.abc import Sequence

from .graph.builder import GraphBuilder, Tensor
from .graph.ir import Graph
from .ops import OPS
from .ops import functional as F


def unbroadcast(g: Tensor, shape: tuple[int, ...]) -> Tensor:
    """Sum ``g`` down to ``shape``, undoing NumPy broadcasting."""
    if g.shape == shape:
        return g
    lead = g.ndim - len(shape)
    dims = list(range(lead))
    dims += [lead + i for i, s in enumerate(shape) if s == 1 and g.shape[lead + i] != 1]
    if dims:
        g = F.sum(g, dims, keepdim=True)
    return F.reshape(g, shape)


def _listed(names: Sequence[str], limit: int = 12) -> str:
    """``'a', 'b', 'c'`` (the first ``limit``, then how many more), or ``none``."""
    shown = ", ".join(repr(k) for k in names[:limit])
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return (shown + more) or "none"


def missing_loss(graph: Graph, name: str) -> ValueError:
    """The error for a loss name that no output of ``graph`` has: it lists the outputs."""
    return ValueError(
        f"loss {name!r}: no output named {name!r}; the graph's outputs are "
        f"{_listed([k for k, _ in graph.outputs])} (name the loss with "
        f"GraphBuilder.output({name!r}, ...), or pass loss=<one of them>)"
    )


def _resolve(graph: Graph, ref: int | str, what: str) -> int:
    if isinstance(ref, str):
        if ref in graph.output_dict:
            return graph.output_dict[ref]
        leaf = next((n for n in graph.nodes if n.name == ref), None)
        if leaf is not None:
            return leaf.id
        if what == "loss":
            raise missing_loss(graph, ref)
        leaves = [n.name for n in graph.nodes if n.name is not None]
        raise ValueError(f"{what} {ref!r}: no leaf named {ref!r}; the leaves are {_listed(leaves)}")
    if not isinstance(ref, int) or not 0 <= ref < len(graph.nodes):
        raise ValueError(f"{what} {ref!r}: not a node id of the graph (0..{len(graph) - 1})")
    return ref


def differentiate(
    graph: Graph,
    loss: int | str,
    wrt: Sequence[int | str],
    unreachable: str = "zero",
    seed: float = 1.0,
    seed_node: int | None = None,
) -> tuple[Graph, dict[int, int]]:
    """Append the gradients of ``seed * loss`` with respect to ``wrt`` to ``graph``.

    Args:
        graph: the forward graph.
        loss: node id, output name or leaf name of a floating scalar.
        wrt: node ids or leaf names (usually the parameters).
        unreachable: what a ``wrt`` value that does not influence the loss gets: ``"zero"``
            an explicit zero gradient (a broadcast constant), ``"omit"`` no entry (as
            PyTorch leaves its ``.grad`` None, so optimizers skip it).
        seed: the gradient the backward pass starts from, d(loss) (1: the plain gradients;
            a loss scale ``S`` gives ``S`` times them, as ``loss.backward(S * ones)``).
        seed_node: a node of ``graph`` (f32[]) to start from instead of the constant ``seed``
            (a dynamic loss scale, ``optim.scaler``).

    Returns:
        (new graph, {wrt node id: gradient node id}).

    Raises:
        ValueError: when ``loss`` names no output or leaf (the message lists the outputs) or
            is not a floating scalar, a ``wrt`` name is no leaf, or a rule is missing for an
            op on the path from ``wrt`` to ``loss``.
    """
    loss_id = _resolve(graph, loss, "loss")
    wrt_ids = [_resolve(graph, w, "wrt") for w in wrt]
    lt = graph.nodes[loss_id].type
    if lt.shape != () or not lt.dtype.is_floating:
        shown = f"{loss!r} (%{loss_id})" if isinstance(loss, str) else f"%{loss_id}"
        raise ValueError(
            f"loss must be a floating scalar, got {shown}: {lt}"
            + (" (reduce it with .sum() or .mean())" if lt.dtype.is_floating else "")
        )

    # Only nodes that depend on some wrt value and feed the loss need gradients.
    depends = [False] * len(graph.nodes)
    for w in wrt_ids:
        depends[w] = True
    for n in graph.nodes:
        if any(depends[i] for i in n.inputs):
            depends[n.id] = True
    feeds = [False] * len(graph.nodes)
    feeds[loss_id] = True
    for n in reversed(graph.nodes[: loss_id + 1]):
        if feeds[n.id]:
            for i in n.inputs:
                feeds[i] = True

    b = GraphBuilder(graph)
    if seed_node is None:
        start = b.constant(float(seed), lt.dtype)
    else:
        start = b.tensor(_resolve(graph, seed_node, "seed_node"))
        if start.shape != () or start.dtype is not lt.dtype:
            raise ValueError(
                f"seed_node %{seed_node} must be a {lt.dtype}[] scalar, got {start.type}"
            )
    contributions: dict[int, list[Tensor]] = {loss_id: [start]}

    def total(node_id: int) -> Tensor | None:
        parts = contributions.get(node_id)
        if not parts:
            return None
        acc = parts[0]
        for p in parts[1:]:
            acc = acc + p
        return acc

    for n in reversed(graph.nodes[: loss_id + 1]):
        if not (depends[n.id] and feeds[n.id]) or n.inputs == ():
            continue
        g = total(n.id)
        if g is None:
            continue
        d = OPS[n.op]
        if d.grad is None:
            if not d.differentiable:
                continue
            raise ValueError(f"op {n.op!r} (%{n.id}) has no gradient rule")
        ins = [b.tensor(i) for i in n.inputs]
        grads = d.grad(n, ins, b.tensor(n.id), g)
        for i, gi in zip(n.inputs, grads):
            if gi is None or not (depends[i] and feeds[i]):
                continue
            t = graph.nodes[i].type
            if not t.dtype.is_floating:
                continue
            gi = unbroadcast(gi, t.shape)
            contributions.setdefault(i, []).append(gi)

    out: dict[int, int] = {}
    for w in wrt_ids:
        g = total(w)
        if g is None and unreachable == "omit":
            continue
        if g is None:
            t = graph.nodes[w].type
            g = F.broadcast_to(b.constant(0.0, t.dtype), t.shape)
        elif g.shape != graph.nodes[w].type.shape:
            g = F.broadcast_to(g, graph.nodes[w].type.shape)
        out[w] = g.id
    return b.build_unverified(), out

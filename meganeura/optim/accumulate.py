"""Gradient accumulation over micro-batches: the graph rewrites of its two programs.

A step over ``k`` micro-batches (Hugging Face's ``gradient_accumulation_steps``: the update uses
the mean of the micro-batch gradients) runs two programs, both forward + backward:

  * the *accumulate* program, for micro-batches ``0 .. k-2``: ``add_to_accumulators`` appends an
    ``accumulate`` of every gradient into the state ``<param>.grad_accum`` and of the loss into
    ``_accum.loss``, and no update;
  * the *apply* program, for the last micro-batch: ``mean_with_accumulators`` replaces each
    gradient by ``(<param>.grad_accum + g) / k`` before clipping and the update, and the
    ``loss`` output by the mean loss ``(_accum.loss + loss) / k``.

``accumulate`` overwrites its accumulator when the host feeds ``accum.first`` = 1 (the step's
first micro-batch), so accumulators need no zeroing and hold nothing between steps. The
accumulators are ordinary state leaves: the caller shares them between the two programs.
"""

from __future__ import annotations

from ..graph.builder import GraphBuilder
from ..graph.ir import Graph

ACCUM_FIRST_INPUT = "accum.first"
LOSS_ACCUMULATOR = "_accum.loss"


def grad_accumulator(param: str) -> str:
    """The state name of a parameter's gradient accumulator."""
    return f"{param}.grad_accum"


def add_to_accumulators(graph: Graph, grads: dict[int, int], loss: str) -> Graph:
    """``graph`` plus an ``accumulate`` of each gradient and of output ``loss``.

    Args:
        graph: a graph holding the parameters and their gradients (``differentiate``'s).
        grads: parameter node id -> gradient node id.
        loss: the name of the scalar loss output.

    Adds the input ``accum.first`` (f32[]: 1 on the first micro-batch of a step, else 0).
    """
    b = GraphBuilder(graph)
    first = b.input(ACCUM_FIRST_INPUT, ())
    for p, g in grads.items():
        t = graph[p].type
        acc = b.state(grad_accumulator(graph[p].name), t.shape, t.dtype)
        b.add("accumulate", [acc, b.tensor(g), first])
    loss_t = b.tensor(graph.output_dict[loss])
    b.add("accumulate", [b.state(LOSS_ACCUMULATOR, (), loss_t.dtype), loss_t, first])
    return b.build_unverified()


def mean_with_accumulators(
    graph: Graph, grads: dict[int, int], loss: str, steps: int
) -> tuple[Graph, dict[int, int]]:
    """The last micro-batch's view: gradients and loss averaged with the accumulated ones.

    Args:
        graph: as for :func:`add_to_accumulators`.
        grads: parameter node id -> gradient node id.
        loss: the loss output's name; it is re-pointed at the mean loss.
        steps: the number of micro-batches ``k`` (>= 2).

    Returns:
        (graph, parameter node id -> node id of the mean gradient).
    """
    b = GraphBuilder(graph)
    mean = {}
    for p, g in grads.items():
        t = graph[p].type
        acc = b.state(grad_accumulator(graph[p].name), t.shape, t.dtype)
        mean[p] = ((acc + b.tensor(g)) / float(steps)).id
    loss_t = b.tensor(graph.output_dict[loss])
    acc = b.state(LOSS_ACCUMULATOR, (), loss_t.dtype)
    b.outputs[loss] = ((acc + loss_t) / float(steps)).id
    return b.build_unverified(), mean

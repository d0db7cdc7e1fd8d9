"""The non-finite guard of a training step, as PyTorch's GradScaler ``found_inf``.

``apply_optimizer(..., guard=...)`` checks the loss and the gradients' global sum of squares on
the GPU, by bit pattern, and feeds the update ops a NaN clip coefficient when either is inf or
NaN; an update op given a non-finite clip writes nothing (``ops/update.py``), so the step leaves
parameters and optimizer state bit-identical. The program gains:

  * the state ``_guard.skipped`` (f32[]): steps skipped since the host last read it;
  * the input ``guard.reset`` (f32[]): 1 on the first step after the host read the count (the
    count restarts at this step's own), else 0;
  * the output ``guard.skipped``: the count after this step, fetched with the loss in the same
    read, so the guard costs no host round trip of its own.

Modes: ``"skip"`` skips only the steps whose own loss or gradients are non-finite; ``"raise"``
is sticky: once a step trips, every later step is skipped too until the host reads the count
(and raises), so a loop that reads the loss only every n-th step stops updating at the first
bad step instead of training on past it. A sum of squares beyond f32's range (gradient
elements near 1.8e19) trips the guard as well, as ``clip_grad_norm_(error_if_nonfinite=True)``
would.

BatchNorm's running statistics are guarded too: ``defer_update_stats`` moves each
``batch_norm_update_stats`` after the guard and gives it the clip coefficient, so a skipped
step leaves ``running_mean``/``running_var`` bit-identical (issue 11, item 3).
"""

from __future__ import annotations

import dataclasses

from ..dtypes import DType
from ..graph.builder import GraphBuilder, Tensor
from ..graph.ir import Graph

GUARD_STATE = "_guard.skipped"
GUARD_RESET_INPUT = "guard.reset"
GUARD_OUTPUT = "guard.skipped"
GUARD_MODES = ("raise", "skip")
PENDING_SUFFIX = "pending"


def append_guard(
    b: GraphBuilder,
    clip: Tensor,
    checked: list[Tensor],
    mode: str,
    uncounted: list[Tensor] | None = None,
) -> Tensor:
    """Append the guard to ``b``; returns the clip coefficient the update ops must use.

    Args:
        b: the builder of the training graph (after the backward pass).
        clip: the f32[] clip coefficient (the constant 1.0 without clipping).
        checked: f32[] scalars to check: the loss, the gradients' sum of squares.
        mode: ``"raise"`` (sticky) or ``"skip"``.
        uncounted: more scalars whose non-finite value skips the step without counting it
            (a dynamic loss scale's gradients, ``optim.scaler``: an overflow is expected).

    Raises:
        ValueError: an unknown mode.
    """
    if mode not in GUARD_MODES:
        raise ValueError(f"guard mode must be one of {GUARD_MODES}, got {mode!r}")
    checked = [c if c.dtype is DType.f32 else c.to(DType.f32) for c in checked]
    skipped = b.state(GUARD_STATE, (), DType.f32)
    reset = b.input(GUARD_RESET_INPUT, ())
    clip = clip if clip.dtype is DType.f32 else clip.to(DType.f32)
    # guard_clip reads the count before guard_count writes it: node order is execution order.
    guarded = b.add("guard_clip", [clip, skipped, reset, *checked], {"sticky": mode == "raise"})
    b.add("guard_count", [skipped, guarded, reset])
    b.output(GUARD_OUTPUT, skipped)
    if uncounted:
        uncounted = [c if c.dtype is DType.f32 else c.to(DType.f32) for c in uncounted]
        guarded = b.add("guard_clip", [guarded, skipped, reset, *uncounted], {"sticky": False})
    return guarded


def pending_stats(name: str) -> str:
    """The state name of a running statistic's pending copy (gradient accumulation)."""
    return f"{name}.{PENDING_SUFFIX}"


def defer_update_stats(
    graph: Graph, accumulation: str | None = None
) -> tuple[Graph, dict[int, int]]:
    """Move a guarded training graph's running-statistics updates after the guard's decision.

    ``batch_norm_update_stats`` runs in the forward, before the loss exists; left there, a
    skipped step (a NaN batch) would still write its NaN statistics into ``running_mean`` and
    ``running_var``. Each such op is re-appended at the end of the graph with the guard's clip
    coefficient (its kernel then writes nothing when the clip is NaN, as the optimizer updates
    do), and the original is dropped. The op recomputes the statistics from the batch ``x``,
    which the backward reads anyway: ``x`` now lives on from the backward's
    ``batch_norm_backward`` to the end of the step (docs/training.md gives what that costs).
    An update whose running statistics another node reads after it (a hand-built graph that
    uses the new statistics in the same step) stays where it is, unguarded, since moving it
    would change what that node reads.

    With gradient accumulation the earlier micro-batches' programs run before any guard can
    decide, so their updates are staged in a pending copy
    of each statistic (the state ``<name>.pending``, which the caller shares between the
    programs as it shares gradient accumulators): the first micro-batch (input
    ``accum.first`` = 1) updates the copy from the running statistic, the next ones the copy
    itself, and the guarded last micro-batch writes its update of the copy into the running
    statistic, or nothing when the step is skipped (a module called twice: its second update
    chains from its first). The values are torch's sequential per-forward updates, applied at
    the end of the step. There the update is split in two: ``batch_norm_stats`` computes the
    batch statistics in the forward, where the update was, and ``batch_norm_update_stats_into``
    blends them into the destination at the end, so the batch input is not kept alive.

    Args:
        graph: a training graph: with ``accumulation`` None or ``"commit"`` one holding the
            guard (``append_guard``'s ``guard_clip``; a graph without it is returned
            unchanged); with ``"stage"`` an accumulate program (``accum.first`` input).
        accumulation: None (no accumulation), ``"stage"`` (micro-batches ``0 .. k-2``) or
            ``"commit"`` (the last micro-batch of ``k > 1``).

    Returns:
        (the rewritten graph, old node id -> new node id of every kept node).
    """
    from ..passes.simplify import renumber  # passes sit after the optimizer in the pipeline
    from .accumulate import ACCUM_FIRST_INPUT

    identity = {n.id: n.id for n in graph.nodes}
    b = GraphBuilder(graph)
    if accumulation == "stage":
        clip, take = b.constant(1.0), b.tensor(graph.find(ACCUM_FIRST_INPUT, "input").id)
    else:
        clips = [n.id for n in graph.nodes if n.op == "guard_clip"]
        if not clips:
            return graph, identity
        clip, take = b.tensor(clips[-1]), b.constant(1.0)
    keep = [True] * len(graph.nodes)
    pending: dict[int, tuple[Tensor, Tensor]] = {}
    for n in graph.nodes:
        if n.op != "batch_norm_update_stats" or len(n.inputs) != 3:
            continue
        written = set(n.inputs[1:])
        later = graph.nodes[n.id + 1 :]
        if any(written & set(m.inputs) for m in later if m.op != "batch_norm_update_stats"):
            continue
        x, rm, rv = (b.tensor(i) for i in n.inputs)
        if accumulation is None:
            t = b.add(n.op, [x, rm, rv, clip], n.attr_dict)
        else:
            if rm.id not in pending:  # the statistics' first update in this program
                pending[rm.id] = tuple(
                    b.state(pending_stats(s.node.name), s.shape, s.dtype) for s in (rm, rv)
                )
                src = take
            else:  # a module called twice: its next update chains from the one before
                src = b.constant(0.0)
            pm, pv = pending[rm.id]
            # The statistics are computed where the update was, in the forward, so the batch
            # input dies there (kept for the update, it lived through the step's end: +9% of a
            # ResNet-18 step's planned memory with accumulation).
            b.add("batch_norm_stats", [x])  # type-checked, then put in the update's place
            b.nodes[n.id] = dataclasses.replace(b.nodes.pop(), id=n.id, loc=n.loc)
            stats = b.tensor(n.id)
            into = [rm, rv, pm, pv] if accumulation == "stage" else [pm, pv, rm, rv]
            t = b.add("batch_norm_update_stats_into", [stats, *into, src, clip], n.attr_dict)
            b.nodes[t.id] = dataclasses.replace(b.nodes[t.id], loc=n.loc, origin=n.origin)
            continue
        b.nodes[t.id] = dataclasses.replace(b.nodes[t.id], loc=n.loc, origin=n.origin)
        keep[n.id] = False
    if all(keep):
        return b.build_unverified(), identity
    keep += [True] * (len(b.nodes) - len(graph.nodes))
    return renumber(b.build_unverified(), keep)

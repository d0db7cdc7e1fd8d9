"""``apply_optimizer``: append gradient clipping and one update op per parameter."""

from __future__ import annotations

from ..graph.builder import GraphBuilder
from ..graph.ir import Graph
from ..ops import functional as F
from .guard import append_guard
from .optimizers import Optimizer
from .scaler import GradScaler, append_scale_update

HYPER_INPUT = "optim.hyper"


def apply_optimizer(
    graph: Graph,
    grads: dict[int, int],
    optimizer: Optimizer,
    max_grad_norm: float | None = None,
    loss: str | None = None,
    guard: str | None = None,
    max_bindings: int = 8,
    loss_scale: float = 1.0,
    scaler: GradScaler | None = None,
    scale_node: int | None = None,
) -> Graph:
    """Return ``graph`` plus the optimizer's update of every parameter in ``grads``.

    Args:
        graph: a graph holding parameters and their gradients.
        grads: parameter node id -> gradient node id (from ``differentiate``).
        optimizer: SGD, Adam or AdamW.
        max_grad_norm: clip gradients by their global L2 norm, as
            torch.nn.utils.clip_grad_norm_: coefficient ``min(1, max / (norm + 1e-6))``.
            The norm before clipping is exposed as the output ``grad_norm``.
        loss: the name of the loss output (the guard checks it).
        guard: ``"raise"`` or ``"skip"``: append the non-finite guard (``optim.guard``) over
            the loss and the gradients: clipping's sum of squares when clipping (no extra
            pass), else ``found_inf`` over every gradient element; None: no guard.
        max_bindings: the adapter's storage bindings per kernel: one ``found_inf`` reads
            at most ``max_bindings - 2`` gradients (its scratch and a spare take two).
        loss_scale: the factor the gradients in ``grads`` carry (``CompileOptions.loss_scale``,
            a power of two): the norm is divided by it before clipping and the coefficient
            the update ops multiply the gradient by carries ``1 / loss_scale``.
        scaler: a dynamic loss scale instead (``optim.scaler``): the gradients carry the
            value of node ``scale_node`` (``scaler.current_scale``), which the step then
            updates; needs ``guard``, which then counts only a non-finite loss.

    Adds the input ``optim.hyper`` (f32[optimizer.hyper_size]), fed each step by the host,
    and with a guard its input, state and output (``optim.guard``).
    """
    if scaler is not None and (guard is None or scale_node is None):
        raise ValueError("a dynamic loss scale needs the non-finite guard and its scale node")
    b = GraphBuilder(graph)
    hyper = b.input(HYPER_INPUT, (optimizer.hyper_size,))
    if scaler is not None:
        scale = b.tensor(scale_node)
        inv = 1.0 / scale
    else:
        inv = 1.0 / loss_scale
    pairs = [(b.tensor(p), b.tensor(g)) for p, g in grads.items()]
    total = None
    if max_grad_norm is not None:
        for _, g in pairs:
            sq = F.sum(g * g)
            total = sq if total is None else total + sq
    if max_grad_norm is not None:
        if max_grad_norm <= 0:
            raise ValueError(f"max_grad_norm must be positive, got {max_grad_norm}")
        norm = F.sqrt(total)
        if scaler is not None or loss_scale != 1.0:
            norm = norm * inv
        b.output("grad_norm", norm)
        clip = F.minimum(float(max_grad_norm) / (norm + 1e-6), 1.0)
        if scaler is not None or loss_scale != 1.0:
            clip = clip * inv
    else:
        clip = inv if scaler is not None else b.constant(inv)
    if guard is not None:
        checked = [] if loss is None else [b.tensor(graph.output_dict[loss])]
        if total is not None:  # clipping's sum of squares is non-finite iff a gradient is
            on_grads = [total]
        else:
            per = max(1, max_bindings - 2)
            grads_ = [g for _, g in pairs]
            on_grads = [b.add("found_inf", grads_[i : i + per]) for i in range(0, len(grads_), per)]
        if scaler is None:
            clip = append_guard(b, clip, checked + on_grads, guard)
        else:  # an overflow of the scaled gradients is a skip the scaler expects, not an error
            clip = append_guard(b, clip, checked, guard, uncounted=on_grads)
    for p, g in pairs:
        optimizer.append_update(b, p, g, hyper, clip)
    if scaler is not None:
        append_scale_update(b, graph, scaler, scale, clip)
    return b.build_unverified()

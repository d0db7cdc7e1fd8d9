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
"""

from __future__ import annotations

from ..dtypes import DType
from ..graph.builder import GraphBuilder, Tensor

GUARD_STATE = "_guard.skipped"
GUARD_RESET_INPUT = "guard.reset"
GUARD_OUTPUT = "guard.skipped"
GUARD_MODES = ("raise", "skip")


def append_guard(b: GraphBuilder, clip: Tensor, checked: list[Tensor], mode: str) -> Tensor:
    """Append the guard to ``b``; returns the clip coefficient the update ops must use.

    Args:
        b: the builder of the training graph (after the backward pass).
        clip: the f32[] clip coefficient (the constant 1.0 without clipping).
        checked: f32[] scalars to check: the loss, the gradients' sum of squares.
        mode: ``"raise"`` (sticky) or ``"skip"``.

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
    return guarded

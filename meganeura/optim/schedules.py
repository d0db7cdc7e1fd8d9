"""Learning-rate schedules, evaluated on the host once per optimizer step.

Role in the pipeline: the training loop asks ``schedule(step)`` for the lr of the optimizer step
it is about to run and passes it to the compiled program as a scalar input, so changing the lr
never recompiles a shader.

Invariants:
    * ``step`` counts optimizer steps from 0; ``schedule(0)`` is the lr of the first update.
    * Schedules are frozen dataclasses: pure functions of ``step`` with no hidden state, so
      resuming from a checkpoint needs only the step count.
    * Returned values are Python floats, finite and >= 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Protocol

__all__ = ["ConstantLR", "CosineLR", "LinearWarmup", "Schedule", "SCHEDULES", "get_schedule"]


class Schedule(Protocol):
    """Anything that maps an optimizer step (from 0) to a learning rate."""

    def __call__(self, step: int) -> float: ...


def _check_step(step: int) -> None:
    if step < 0:
        raise ValueError(f"step counts optimizer steps from 0, got {step}")


def _check_lr(lr: float, name: str = "lr") -> None:
    if not (math.isfinite(lr) and lr >= 0):
        raise ValueError(f"{name} must be finite and >= 0, got {lr}")


@dataclass(frozen=True)
class ConstantLR:
    """The same lr at every step.

    Attributes:
        lr: the learning rate.
    """

    lr: float

    def __post_init__(self) -> None:
        _check_lr(self.lr)

    def __call__(self, step: int) -> float:
        _check_step(step)
        return float(self.lr)


@dataclass(frozen=True)
class LinearWarmup:
    """Linear warm-up to ``lr``, then constant: ``lr * min(1, (step + 1) / warmup_steps)``.

    The ``+ 1`` makes the first step use ``lr / warmup_steps`` rather than 0 (a step with lr 0 is
    wasted) and reaches ``lr`` at step ``warmup_steps - 1``. It equals PyTorch's
    ``LambdaLR(opt, lambda s: min(1, (s + 1) / warmup_steps))`` and, for ``warmup_steps > 1``,
    ``LinearLR(opt, start_factor=1 / warmup_steps, total_iters=warmup_steps - 1)``
    (https://pytorch.org/docs/stable/generated/torch.optim.lr_scheduler.LinearLR.html).

    Attributes:
        lr: the peak learning rate.
        warmup_steps: number of steps over which the lr rises, >= 1.
    """

    lr: float
    warmup_steps: int

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        if self.warmup_steps < 1:
            raise ValueError(f"warmup_steps must be >= 1, got {self.warmup_steps}")

    def __call__(self, step: int) -> float:
        _check_step(step)
        return float(self.lr) * min(1.0, (step + 1) / self.warmup_steps)


@dataclass(frozen=True)
class CosineLR:
    """Optional linear warm-up, then cosine decay from ``lr`` to ``min_lr``.

    With ``W = warmup_steps``, ``t = step - W`` and ``T = total_steps - W``:

    * ``step < W``: ``lr * (step + 1) / W`` (as :class:`LinearWarmup`);
    * ``W <= step < total_steps``: ``min_lr + (lr - min_lr) * (1 + cos(pi * t / T)) / 2``;
    * ``step >= total_steps``: ``min_lr``.

    The decay is the closed form of PyTorch's ``CosineAnnealingLR`` with ``T_max = T`` and
    ``eta_min = min_lr`` (Loshchilov & Hutter, "SGDR", ICLR 2017, without restarts;
    https://pytorch.org/docs/stable/generated/torch.optim.lr_scheduler.CosineAnnealingLR.html).
    Unlike PyTorch, which keeps following the cosine back up after ``T_max``, it holds ``min_lr``.

    Attributes:
        lr: peak learning rate, reached at step ``W`` (step 0 when there is no warm-up).
        total_steps: number of optimizer steps of the run; must exceed ``warmup_steps``.
        warmup_steps: steps of linear warm-up, >= 0.
        min_lr: final learning rate, 0 <= min_lr <= lr.
    """

    lr: float
    total_steps: int
    warmup_steps: int = 0
    min_lr: float = 0.0

    def __post_init__(self) -> None:
        _check_lr(self.lr)
        _check_lr(self.min_lr, "min_lr")
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr ({self.min_lr}) must not exceed lr ({self.lr})")
        if self.warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {self.warmup_steps}")
        if self.total_steps <= self.warmup_steps:
            raise ValueError(
                f"total_steps ({self.total_steps}) must exceed warmup_steps ({self.warmup_steps})"
            )

    def __call__(self, step: int) -> float:
        _check_step(step)
        lr, min_lr = float(self.lr), float(self.min_lr)
        if step < self.warmup_steps:
            return lr * (step + 1) / self.warmup_steps
        if step >= self.total_steps:
            return min_lr
        t = step - self.warmup_steps
        decay_steps = self.total_steps - self.warmup_steps
        return min_lr + (lr - min_lr) * (1.0 + math.cos(math.pi * t / decay_steps)) / 2.0


SCHEDULES: dict[str, type] = {
    "constant": ConstantLR,
    "warmup": LinearWarmup,
    "cosine": CosineLR,
}


def get_schedule(name: str, **kwargs: float | int) -> Schedule:
    """Build a schedule by its CLI name.

    Args:
        name: ``"constant"`` (:class:`ConstantLR`), ``"warmup"`` (:class:`LinearWarmup`) or
            ``"cosine"`` (:class:`CosineLR`).
        **kwargs: the dataclass fields, e.g. ``lr=0.1, total_steps=1000, warmup_steps=50``.

    Returns:
        The schedule.

    Raises:
        ValueError: unknown ``name`` (the message lists the known ones) or invalid values.
        TypeError: a missing or unexpected keyword for that schedule.
    """
    try:
        cls = SCHEDULES[name]
    except KeyError:
        raise ValueError(f"unknown lr schedule {name!r}; choose from {sorted(SCHEDULES)}") from None
    try:
        return cls(**kwargs)
    except TypeError as e:
        raise TypeError(f"lr schedule {name!r}: {e}") from e

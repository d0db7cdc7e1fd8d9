"""What the training recipes share: the checks of ``meganeura train``'s settings, its
``--schedule`` and the AdamW ``Trainer`` built from a recipe's settings (``mnist``, ``resnet``),
and how a recipe runs data-parallel over MPI ranks (``data_parallel``; ``finetune`` too).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..optim import AdamW
from ..optim.schedules import Schedule, get_schedule
from ..training import Trainer


def lr_schedule(name: str, lr: float, total_steps: int, warmup_steps: int = 0) -> Schedule:
    """``meganeura train --schedule``: ``"constant"`` at ``lr``; ``"warmup"``, linear from 0
    over ``max(warmup_steps, 1)`` steps; ``"cosine"``, ``warmup_steps`` of warm-up then cosine
    decay over ``total_steps`` (``optim.schedules``).

    Raises:
        ValueError: an unknown ``name`` (the message lists the known ones).
    """
    if name == "warmup":
        return get_schedule("warmup", lr=lr, warmup_steps=max(warmup_steps, 1))
    if name == "cosine":
        return get_schedule("cosine", lr=lr, total_steps=total_steps, warmup_steps=warmup_steps)
    return get_schedule(name, lr=lr)


def adamw_trainer(
    model,
    loss_fn,
    cfg,
    total_steps: int,
    device=None,
    distributed: bool = False,
    accumulation_steps: int = 1,
) -> Trainer:
    """The recipe's ``Trainer``: AdamW(``cfg.lr``, ``cfg.weight_decay``), the
    :func:`lr_schedule` ``cfg.schedule`` over ``total_steps``, ``cfg.max_grad_norm`` and
    ``cfg.precision``. ``cfg``: a ``MnistConfig`` or ``ResNetTrainConfig`` (any object with
    those fields and ``warmup_steps``). ``distributed``: a ``distributed.DistributedTrainer``
    (``distributed.init`` called first). ``accumulation_steps``: micro-batches per update
    (``Trainer``'s).

    Raises:
        ValueError: an unknown ``cfg.schedule``.
    """
    cls = Trainer
    if distributed:
        from ..distributed import DistributedTrainer as cls
    return cls(
        model,
        AdamW(lr=cfg.lr, weight_decay=cfg.weight_decay),
        loss_fn,
        schedule=lr_schedule(cfg.schedule, cfg.lr, total_steps, cfg.warmup_steps),
        max_grad_norm=cfg.max_grad_norm,
        device=device,
        precision=cfg.precision,
        accumulation_steps=accumulation_steps,
    )


def check_train_settings(cfg, minimums: tuple[tuple[str, int, int], ...] = ()) -> None:
    """The settings every ``meganeura train`` job shares, then the job's own ``(flag, value,
    minimum)`` triples: ``--epochs``, ``--batch-size`` and ``--log-every`` at least 1,
    ``--warmup-steps`` at least 0, ``--lr`` positive, ``--out`` a folder or a new path.

    Raises:
        ValueError: the first setting out of range (the message names the flag, what it must
            be and what it is).
    """
    for flag, value, low in (
        *minimums,
        ("--epochs", cfg.epochs, 1),
        ("--batch-size", cfg.batch_size, 1),
        ("--warmup-steps", cfg.warmup_steps, 0),
        ("--log-every", cfg.log_every, 1),
    ):
        if value < low:
            raise ValueError(f"{flag} must be >= {low}, got {value}")
    if not cfg.lr > 0:
        raise ValueError(f"--lr must be > 0, got {cfg.lr}")
    if Path(cfg.out).exists() and not Path(cfg.out).is_dir():
        raise ValueError(f"--out {cfg.out}: is a file, expected a folder (or a new path)")


@dataclass(frozen=True)
class DataParallel:
    """Where a recipe's run stands among ``mpiexec``'s ranks (:func:`data_parallel`).

    Attributes:
        world_size: ranks (1 without ``--distributed``).
        main: whether this is rank 0, which alone logs and writes.
        device: the runtime Device to train on.
        context: ``distributed.Context`` with ``--distributed``, else None.
    """

    world_size: int
    main: bool
    device: object
    context: object | None

    def shard(self, array: np.ndarray) -> np.ndarray:
        """This rank's equal part of a global batch array along dim 0 (the array itself
        with one rank; ``distributed.shard``)."""
        if self.context is None:
            return array
        from ..distributed import shard

        return shard(array)


def data_parallel(distributed: bool, batch_size: int, device=None, unit: str = "batch"):
    """A recipe's :class:`DataParallel`: one rank on ``device`` unless ``distributed``, where
    ``distributed.init()`` (which the CLI calls first, with the adapter) gives the ranks and
    the device.

    Raises:
        ValueError: ``batch_size`` is not divisible by the world size (each rank takes an
            equal shard of every ``unit``).
    """
    if not distributed:
        return DataParallel(1, True, device, None)
    from .. import distributed as dist

    ctx = dist.init()
    world = ctx.world_size
    if batch_size % world:
        raise ValueError(
            f"--batch-size {batch_size} must be divisible by the {world} ranks (each rank "
            f"takes an equal shard of every {unit})"
        )
    return DataParallel(world, ctx.rank == 0, device or ctx.device, ctx)

"""Checking a module Trainer's checkpoint before any of it is applied (``Trainer.load``).

A checkpoint is one safetensors file (``io.checkpoint``): the model's state dict under its
PyTorch names, the optimizer state as ``optimizer/<parameter name>.<suffix>`` (no PyTorch name
holds a "/", so the two never collide), and as metadata the step counter, the count of skipped
steps, the optimizer's configuration and the global RNG state.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

from .. import random as mn_random
from ..io.checkpoint import CheckpointError, check_count, check_rng_state
from ..nn.module import Module
from ..nn.parameter import Buffer
from ..optim import Optimizer
from .batches import check_optimizer

OPTIMIZER_PREFIX = "optimizer/"


def check_trainer_checkpoint(
    path: str | Path,
    tensors: Mapping[str, np.ndarray],
    meta: Mapping,
    model: Module,
    optimizer: Optimizer,
) -> tuple:
    """Check a loaded checkpoint against ``model`` and ``optimizer``; touches neither.

    Returns:
        (step, skipped steps, RNG state, the model's state dict, {(parameter, suffix): moment}).

    Raises:
        CheckpointError: what ``Trainer.load`` documents, naming the key, the expected and the
            actual value.
    """
    step = check_count(path, meta, "step", "the number of steps taken")
    skipped = 0  # checkpoints from before the guard have none
    if "skipped_steps" in meta:
        skipped = check_count(path, meta, "skipped_steps", "the number of skipped steps")
    check_optimizer(path, meta, optimizer)
    rng = check_rng_state(path, meta, "rng", mn_random.default_generator().bit_generator)
    params = dict(model.named_parameters())
    model_sd, moments, problems = {}, {}, []
    for key, value in tensors.items():
        if not key.startswith(OPTIMIZER_PREFIX):
            model_sd[key] = value
            continue
        owner, _, suffix = key.removeprefix(OPTIMIZER_PREFIX).rpartition(".")
        p = params.get(owner)
        if p is None or suffix not in optimizer.state_suffixes:
            problems.append(f"unknown optimizer state {key!r}")
        elif value.shape != p.shape or value.dtype != p.dtype.numpy:
            problems.append(
                f"{key!r}: expected {p.dtype.numpy}{list(p.shape)}, "
                f"got {value.dtype}{list(value.shape)}"
            )
        else:
            moments[(p, suffix)] = value
    # The model's tensors as saved: exact dtypes too (load_state_dict alone would convert a
    # float64 or float16 value, and the run would not continue bit-identically).
    for key, t in model._state_items():
        value = model_sd.get(key)
        want = t._host.dtype if isinstance(t, Buffer) and t.host_only else t.dtype.numpy
        if value is not None and (value.shape != t.shape or value.dtype != want):
            problems.append(
                f"{key!r}: expected {np.dtype(want)}{list(t.shape)}, "
                f"got {value.dtype}{list(value.shape)}"
            )
    if problems:
        raise CheckpointError(f"{path}: " + "; ".join(problems))
    return step, skipped, rng, model_sd, moments

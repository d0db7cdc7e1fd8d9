"""A module Trainer's checkpoints: ``state_dict``, ``save`` and ``load`` (``TrainerCheckpoints``,
which ``Trainer`` inherits), every part checked before any of it is applied.

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
from ..io.checkpoint import (
    CheckpointError,
    check_count,
    check_rng_state,
    load_checkpoint,
    save_checkpoint,
)
from ..nn.module import Module, StateDictError
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


class TrainerCheckpoints:
    """The module Trainer's checkpoint methods (``Trainer`` inherits them): its state dict,
    ``save`` and ``load`` through ``io.checkpoint``, checked by
    :func:`check_trainer_checkpoint` before anything is applied."""

    def state_dict(self) -> dict[str, np.ndarray]:
        """The model's state dict (PyTorch names) and, under ``optimizer/<param>.<suffix>``
        (``exp_avg``, ``exp_avg_sq``, ``momentum_buffer``), the optimizer state of every
        parameter the trainer has updated; NumPy copies.

        Raises:
            NonFiniteError: an unread step was skipped (``check_nonfinite``).
            RuntimeError: the trainer is closed.
        """
        self._live()
        self.check_nonfinite()
        sd = dict(self.model.state_dict())
        for name, p in self.model.named_parameters():
            for suffix, buf in self._moments.get(p, {}).items():
                sd[f"{OPTIMIZER_PREFIX}{name}.{suffix}"] = buf.data
        return sd

    def save(self, path: str | Path, metadata: Mapping | None = None) -> None:
        """Write the model, the optimizer state, the step counter, the global RNG state
        (``meganeura.random``), the count of skipped steps and ``metadata`` atomically
        (``io.checkpoint``).

        Raises:
            NonFiniteError: an unread step was skipped (``check_nonfinite``); nothing is
                written.
        """
        self.check_nonfinite()
        meta = {
            "step": self.step_count,
            "skipped_steps": self.skipped_steps,
            "optimizer": self.optimizer.config(),
            "rng": mn_random.get_rng_state(),
            "accumulation_steps": self.accumulation_steps,
            **(metadata or {}),
        }
        save_checkpoint(path, self.state_dict(), meta)

    def load(self, path: str | Path) -> dict:
        """Restore a checkpoint written by :meth:`save`; returns its metadata.

        The training that follows continues bit-identically to the one that saved. Everything
        is checked before anything is applied: on any error the model, the optimizer state,
        the step counter and the RNG are as they were.

        Raises:
            CheckpointError: missing or corrupt file; ``optimizer`` metadata missing or of
                another type; a ``step`` that is not an int >= 0; an ``rng`` that is not a
                generator state (``io.checkpoint.check_rng_state``); optimizer state for
                unknown parameters or of the wrong shape or dtype; model keys missing,
                unexpected, or of another shape or dtype than the model's. The message names
                the key, the expected and the actual value. Other metadata keys are the
                caller's (``save(metadata=...)``) and are returned unchecked.
            RuntimeError: the trainer is closed.
        """
        self._live()
        tensors, meta = load_checkpoint(path)
        checked = check_trainer_checkpoint(path, tensors, meta, self.model, self.optimizer)
        step, skipped, rng, model_sd, moments = checked
        try:  # checks every key and shape before it writes any
            self.model.load_state_dict(model_sd, strict=True)
        except StateDictError as e:
            raise CheckpointError(f"{path}: {e}") from e
        for p, slots in self._moments.items():
            for suffix, buf in slots.items():
                if (p, suffix) not in moments:  # never updated in the saved run: zero
                    buf.copy_(np.zeros(p.shape, p.dtype.numpy))
        for (p, suffix), value in moments.items():
            self._moment(p, suffix).copy_(value)
        self.step_count = step
        self._guard.skipped_steps = skipped
        self._guard.forget()  # steps run before the load no longer matter
        mn_random.set_rng_state(rng)
        return meta

"""Optimizers (updates appended to the training graph) and host-side LR schedules."""

from . import schedules
from .apply import HYPER_INPUT, apply_optimizer
from .optimizers import SGD, Adam, AdamW, Optimizer

__all__ = ["SGD", "Adam", "AdamW", "Optimizer", "apply_optimizer", "HYPER_INPUT", "schedules"]

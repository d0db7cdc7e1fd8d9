"""Optimizers (updates appended to the training graph) and host-side LR schedules."""

from . import schedules
from .apply import HYPER_INPUT, apply_optimizer
from .optimizers import SGD, Adam, AdamW, Optimizer
from .scaler import GradScaler

__all__ = [
    "SGD",
    "Adam",
    "AdamW",
    "GradScaler",
    "Optimizer",
    "apply_optimizer",
    "HYPER_INPUT",
    "schedules",
]

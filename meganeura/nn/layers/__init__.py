"""Layers with torch.nn's names, arguments, defaults, state-dict names and initialization."""

from .containers import ModuleDict, ModuleList, Sequential
from .linear import Flatten, Identity, Linear

__all__ = ["Flatten", "Identity", "Linear", "ModuleDict", "ModuleList", "Sequential"]

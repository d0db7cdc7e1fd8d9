"""Layers for building models on the graph builder."""

from .conv_layers import BatchNorm2d, Conv2d
from .layers import Linear, Module, Sequential, uniform

__all__ = ["BatchNorm2d", "Conv2d", "Linear", "Module", "Sequential", "uniform"]

"""Layers for building models on the graph builder."""

from .layers import Linear, Module, Sequential, uniform

__all__ = ["Linear", "Module", "Sequential", "uniform"]

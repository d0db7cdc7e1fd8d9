"""Layers: small objects that declare parameters in a graph and apply ops to tensors.

A layer records how each of its parameters is initialized; ``init_parameters`` draws them
from a NumPy Generator on the host, so a seed fixes every initial weight.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import numpy as np

from ..graph.builder import GraphBuilder, Tensor
from ..ops import functional as F

Initializer = Callable[[np.random.Generator], np.ndarray]


class Module:
    """Base class: keeps ``{parameter name: initializer}`` for the parameters it declared."""

    def __init__(self) -> None:
        self.initializers: dict[str, Initializer] = {}

    def init_parameters(self, rng: np.random.Generator) -> dict[str, np.ndarray]:
        """Draw every parameter (in declaration order) from ``rng``."""
        return {name: init(rng) for name, init in self.initializers.items()}


def uniform(shape: tuple[int, ...], bound: float) -> Initializer:
    """U(-bound, bound) as float32."""
    return lambda rng: rng.uniform(-bound, bound, size=shape).astype(np.float32)


class Linear(Module):
    """``y = x @ weight^T + bias``, weight [out_features, in_features], bias [out_features].

    Initialization as torch.nn.Linear: weight and bias ~ U(-1/sqrt(in), 1/sqrt(in)) (the
    kaiming_uniform_ with a = sqrt(5) that PyTorch uses reduces to this bound).
    """

    def __init__(
        self, b: GraphBuilder, name: str, in_features: int, out_features: int, bias: bool = True
    ) -> None:
        super().__init__()
        bound = 1.0 / math.sqrt(in_features)
        self.weight = b.parameter(f"{name}.weight", (out_features, in_features))
        self.initializers[f"{name}.weight"] = uniform((out_features, in_features), bound)
        self.bias = None
        if bias:
            self.bias = b.parameter(f"{name}.bias", (out_features,))
            self.initializers[f"{name}.bias"] = uniform((out_features,), bound)

    def __call__(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)


class Sequential(Module):
    """Applies layers and callables in order; collects the layers' initializers."""

    def __init__(self, *layers) -> None:
        super().__init__()
        self.layers = layers
        for layer in layers:
            if isinstance(layer, Module):
                self.initializers.update(layer.initializers)

    def __call__(self, x: Tensor) -> Tensor:
        for layer in self.layers:
            x = layer(x)
        return x

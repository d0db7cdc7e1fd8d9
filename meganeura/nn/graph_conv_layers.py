"""Layers for convolutional nets: Conv2d and BatchNorm2d (PyTorch layouts and initialization)."""

from __future__ import annotations

import math

import numpy as np

from ..graph.builder import GraphBuilder, Tensor
from .graph_layers import Module, uniform


class Conv2d(Module):
    """``conv2d`` with weight [out, in/groups, kH, kW] and optional bias [out].

    Initialization as torch.nn.Conv2d: U(-1/sqrt(fan_in), 1/sqrt(fan_in)) for weight and bias,
    fan_in = in/groups * kH * kW.
    """

    def __init__(
        self,
        b: GraphBuilder,
        name: str,
        in_channels: int,
        out_channels: int,
        kernel_size: int,
        stride: int = 1,
        padding: int = 0,
        bias: bool = True,
        groups: int = 1,
    ) -> None:
        super().__init__()
        k = kernel_size
        shape = (out_channels, in_channels // groups, k, k)
        bound = 1.0 / math.sqrt(in_channels // groups * k * k)
        self.weight = b.parameter(f"{name}.weight", shape)
        self.initializers[f"{name}.weight"] = uniform(shape, bound)
        self.bias = None
        if bias:
            self.bias = b.parameter(f"{name}.bias", (out_channels,))
            self.initializers[f"{name}.bias"] = uniform((out_channels,), bound)
        self.stride, self.padding, self.groups = stride, padding, groups

    def __call__(self, x: Tensor) -> Tensor:
        from ..ops.conv import conv2d

        return conv2d(x, self.weight, self.bias, self.stride, self.padding, groups=self.groups)


class BatchNorm2d(Module):
    """Batch normalization over [N, C, H, W] with affine weight/bias and running statistics
    (state tensors ``running_mean`` = 0 and ``running_var`` = 1 at start, as PyTorch).

    ``training=True`` normalizes with batch statistics and updates the running statistics in
    the same step; ``training=False`` uses the running statistics.
    """

    def __init__(
        self,
        b: GraphBuilder,
        name: str,
        num_features: int,
        training: bool = True,
        momentum: float = 0.1,
        eps: float = 1e-5,
    ) -> None:
        super().__init__()
        c = (num_features,)
        self.weight = b.parameter(f"{name}.weight", c)
        self.bias = b.parameter(f"{name}.bias", c)
        self.running_mean = b.state(f"{name}.running_mean", c)
        self.running_var = b.state(f"{name}.running_var", c)
        self.initializers[f"{name}.weight"] = lambda rng: np.ones(c, np.float32)
        self.initializers[f"{name}.bias"] = lambda rng: np.zeros(c, np.float32)
        self.initializers[f"{name}.running_mean"] = lambda rng: np.zeros(c, np.float32)
        self.initializers[f"{name}.running_var"] = lambda rng: np.ones(c, np.float32)
        self.training, self.momentum, self.eps = training, momentum, eps

    def __call__(self, x: Tensor) -> Tensor:
        from ..ops.norm import batch_norm

        return batch_norm(
            x,
            self.running_mean,
            self.running_var,
            self.weight,
            self.bias,
            self.training,
            self.momentum,
            self.eps,
        )

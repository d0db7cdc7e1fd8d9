"""A small conv net for MNIST: two 3x3 conv layers (16 and 32 channels), each followed by
BatchNorm, ReLU and 2x2 max pooling, then a linear classifier (32*7*7 -> 10)."""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import i32
from ..graph.builder import GraphBuilder
from ..graph.ir import Graph
from ..nn.graph_conv_layers import BatchNorm2d, Conv2d
from ..nn.graph_layers import Linear, Module, Sequential
from ..ops import functional as F
from ..ops.pool import max_pool2d


@dataclass(frozen=True)
class ConvNetGraph:
    """Inputs ``x`` f32[batch, 1, 28, 28] (and ``y`` i32[batch] with labels); outputs
    ``logits`` f32[batch, 10] (and ``loss``)."""

    graph: Graph
    model: Module


def build_convnet(batch: int, labels: bool = True, training: bool = True) -> ConvNetGraph:
    """The conv net; ``training`` selects batch statistics (and running-stat updates) or
    running statistics in BatchNorm."""
    b = GraphBuilder()
    x = b.input("x", (batch, 1, 28, 28))
    layers = []
    for k, (cin, cout) in enumerate([(1, 16), (16, 32)], start=1):
        layers += [
            Conv2d(b, f"conv{k}", cin, cout, 3, padding=1, bias=False),
            BatchNorm2d(b, f"bn{k}", cout, training=training),
            F.relu,
            lambda t: max_pool2d(t, 2),
        ]
    layers += [lambda t: F.reshape(t, (batch, 32 * 7 * 7)), Linear(b, "fc", 32 * 7 * 7, 10)]
    model = Sequential(*layers)
    logits = model(x)
    b.output("logits", logits)
    if labels:
        y = b.input("y", (batch,), i32)
        b.output("loss", F.cross_entropy(logits, y))
    return ConvNetGraph(b.build(), model)

"""A multilayer perceptron classifier (the MNIST main job: 784-128-10 with ReLU)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from ..dtypes import i32
from ..graph.builder import GraphBuilder
from ..graph.ir import Graph
from ..nn.graph_layers import Linear, Module, Sequential
from ..ops import functional as F


@dataclass(frozen=True)
class MLPGraph:
    """The graph and the layer container that knows how to initialize its parameters.

    Inputs: ``x`` f32[batch, sizes[0]], and with labels ``y`` i32[batch].
    Outputs: ``logits`` f32[batch, sizes[-1]], and with labels ``loss`` f32[] (cross-entropy).
    """

    graph: Graph
    model: Module


def build_mlp(batch: int, sizes: Sequence[int] = (784, 128, 10), labels: bool = True) -> MLPGraph:
    """Linear layers ``fc1..fcN`` with ReLU between them.

    Args:
        batch: rows per step (programs have static shapes).
        sizes: layer widths, input first.
        labels: add the ``y`` input and the ``loss`` output (training); False for inference.
    """
    b = GraphBuilder()
    x = b.input("x", (batch, sizes[0]))
    layers = []
    for k, (n_in, n_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        layers.append(Linear(b, f"fc{k + 1}", n_in, n_out))
        if k < len(sizes) - 2:
            layers.append(F.relu)
    model = Sequential(*layers)
    logits = model(x)
    b.output("logits", logits)
    if labels:
        y = b.input("y", (batch,), i32)
        b.output("loss", F.cross_entropy(logits, y))
    return MLPGraph(b.build(), model)

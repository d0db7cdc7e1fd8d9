"""A multilayer perceptron classifier (the MNIST main job: 784-128-10 with ReLU).

Shapes: input f32 [N, sizes[0]] -> logits f32 [N, sizes[-1]]. Parameters ``fc1.weight``,
``fc1.bias``, ... ``fcN.bias``, as ``torch.nn.Linear`` lays them out and initializes them, so
a ``torch.nn.Sequential`` of the same Linear layers loads them key for key after renaming.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from .. import nn
from ..nn import functional as F
from . import ModelGraph


class MLP(nn.Module):
    """Linear layers ``fc1..fcN`` with ReLU between them.

    Args:
        sizes: layer widths, input first (at least two).

    Raises:
        ValueError: fewer than two sizes.
    """

    def __init__(self, sizes: Sequence[int] = (784, 128, 10)) -> None:
        super().__init__()
        if len(sizes) < 2:
            raise ValueError(f"an MLP needs an input and an output size, got {list(sizes)}")
        self.sizes = tuple(int(s) for s in sizes)
        for k, (n_in, n_out) in enumerate(zip(self.sizes[:-1], self.sizes[1:]), start=1):
            setattr(self, f"fc{k}", nn.Linear(n_in, n_out))

    def forward(self, x):
        layers = list(self.children())
        for k, fc in enumerate(layers):
            x = fc(x)
            if k < len(layers) - 1:
                x = F.relu(x)
        return x


def build_mlp(batch: int, sizes: Sequence[int] = (784, 128, 10), labels: bool = True) -> ModelGraph:
    """A fresh :class:`MLP` and its traced graph, for graph-level tests and benchmarks.

    Args:
        batch: rows per step (programs have static shapes).
        sizes: layer widths, input first.
        labels: add the ``y`` input and the ``loss`` output (training); False for inference.

    Returns:
        ``ModelGraph(graph, model)``: inputs ``x`` f32[batch, sizes[0]] (and ``y``
        i32[batch]); outputs ``logits`` f32[batch, sizes[-1]] (and ``loss`` f32[],
        cross-entropy).
    """
    model = MLP(sizes)
    x = np.zeros((batch, model.sizes[0]), np.float32)
    if not labels:
        return ModelGraph(nn.trace(model, x, fn=lambda x: {"logits": model(x)}), model)

    def forward(x, y):
        logits = model(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, y)}

    return ModelGraph(nn.trace(model, x, np.zeros(batch, np.int32), fn=forward), model)

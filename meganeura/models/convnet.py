"""A small conv net for MNIST: two 3x3 conv layers (16 and 32 channels), each followed by
BatchNorm, ReLU and 2x2 max pooling, then a linear classifier (32*7*7 -> 10).

Shapes: input f32 [N, 1, 28, 28] -> logits f32 [N, 10]. Parameters and buffers ``conv1``,
``bn1``, ``conv2``, ``bn2``, ``fc`` with torch.nn's names and initialization. BatchNorm uses
batch statistics and updates its running statistics in train mode, running statistics in
eval mode.
"""

from __future__ import annotations

import numpy as np

from .. import nn
from ..nn import functional as F
from . import ModelGraph


class ConvNet(nn.Module):
    """The MNIST conv net (no conv biases: BatchNorm follows each convolution)."""

    def __init__(self, num_classes: int = 10) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(1, 16, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(16)
        self.conv2 = nn.Conv2d(16, 32, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(32)
        self.pool = nn.MaxPool2d(2)
        self.fc = nn.Linear(32 * 7 * 7, num_classes)

    def forward(self, x):
        x = self.pool(F.relu(self.bn1(self.conv1(x))))
        x = self.pool(F.relu(self.bn2(self.conv2(x))))
        return self.fc(F.flatten(x, 1))


def build_convnet(batch: int, labels: bool = True, training: bool = True) -> ModelGraph:
    """A fresh :class:`ConvNet` and its traced graph, for graph-level tests and benchmarks.

    Args:
        batch: images per step.
        labels: add the ``y`` input and the ``loss`` output.
        training: trace in train mode (batch statistics, running-statistics updates) or in
            eval mode (running statistics).

    Returns:
        ``ModelGraph(graph, model)``: inputs ``x`` f32[batch, 1, 28, 28] (and ``y``
        i32[batch]); outputs ``logits`` f32[batch, 10] (and ``loss``).
    """
    model = ConvNet().train(training)
    x = np.zeros((batch, 1, 28, 28), np.float32)
    if not labels:
        return ModelGraph(nn.trace(model, x, fn=lambda x: {"logits": model(x)}), model)

    def forward(x, y):
        logits = model(x)
        return {"logits": logits, "loss": F.cross_entropy(logits, y)}

    return ModelGraph(nn.trace(model, x, np.zeros(batch, np.int32), fn=forward), model)

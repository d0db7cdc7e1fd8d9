"""The workloads as ``mn.nn`` modules: the MNIST MLP and conv net, a Llama-style decoder, BERT,
ResNet, a U-Net and the SmolVLA action expert, each with PyTorch's (or Hugging Face's, or
lerobot's) state-dict names.

Tests and benchmarks of the graph-level passes need the traced Graph itself: ``build_mlp``,
``build_convnet`` and ``build_transformer`` trace a fresh module (drawn from the global
generator, ``mn.manual_seed``) with ``mn.nn.trace`` and return it with its graph, as a
:class:`ModelGraph`.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..graph.ir import Graph
from ..nn.module import Module


class ModelGraph(NamedTuple):
    """A module and the Graph traced from it (``graph, model = build_mlp(64)``)."""

    graph: Graph
    model: Module

    def state_dict(self) -> dict[str, np.ndarray]:
        """The model's values of the graph's parameter and state leaves, by name: its state
        dict without the host-only buffers no kernel reads (BatchNorm's
        ``num_batches_tracked``), so a graph Session or GraphTrainer takes it as it is."""
        leaves = {n.name for op in ("parameter", "state") for n in self.graph.leaves(op)}
        return {k: v for k, v in self.model.state_dict().items() if k in leaves}

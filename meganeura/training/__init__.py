"""Training loops over compiled programs.

``Trainer(model, optimizer, loss_fn)`` trains an ``nn.Module`` (``training.trainer``);
``Trainer(graph, optimizer)`` returns a ``GraphTrainer`` over a hand-built Graph
(``training.graph``). Both own the step counter and the learning-rate schedule, feed the
optimizer's per-step hyper vector, and run forward + backward + update as one GPU submission.
"""

from .graph import GraphTrainer, compile_for, device_limits
from .trainer import Trainer

__all__ = ["GraphTrainer", "Trainer", "compile_for", "device_limits"]

"""Training loops over compiled programs.

``Trainer(model, optimizer, loss_fn)`` trains an ``nn.Module`` (``training.trainer``);
``Trainer(graph, optimizer)`` returns a ``GraphTrainer`` over a hand-built Graph
(``training.graph``). Both own the step counter and the learning-rate schedule, feed the
optimizer's per-step hyper vector, and run forward + backward + update as one replayed GPU step
(no host round trip), guarded against inf and NaN (``training.guard``: ``NonFiniteError``,
``NonFiniteWarning``).
"""

from .graph import GraphTrainer, compile_for, device_limits
from .guard import NonFiniteError, NonFiniteWarning
from .trainer import Trainer

__all__ = [
    "GraphTrainer",
    "NonFiniteError",
    "NonFiniteWarning",
    "Trainer",
    "compile_for",
    "device_limits",
]

"""meganeura: portable GPU training and inference through WebGPU (Vulkan, Metal, DX12).

Write a model as a PyTorch-style module; it is traced into a typed static graph and compiled
(autodiff, optimizer, memory plan, WGSL) per input signature::

    import meganeura as mn
    import meganeura.nn.functional as F

    class MLP(mn.nn.Module):
        def __init__(self):
            super().__init__()
            self.fc1, self.fc2 = mn.nn.Linear(784, 128), mn.nn.Linear(128, 10)

        def forward(self, x):
            return self.fc2(F.relu(self.fc1(x)))

    model = MLP()
    trainer = mn.Trainer(model, mn.optim.AdamW(), lambda m, x, y: F.cross_entropy(m(x), y))
    loss = trainer.step(x, y)          # NumPy batches; one replayed GPU step each
    logits = model.eval()(x)           # NumPy out

The layer below, ``mn.GraphBuilder``, writes the same graphs op by op; ``mn.compile(graph,
options)`` turns one into a Program.

The GPU runtime (``meganeura.runtime``, wgpu) is imported lazily, so graph building,
autodiff and code generation work without a GPU.
"""

from . import debug, nn, optim
from .autodiff import differentiate
from .compile import CompileOptions
from .dtypes import DType, bool_, f16, f32, i32, u32
from .export import export
from .graph.builder import GraphBuilder, GraphTypeError, Tensor
from .graph.interpret import interpret
from .graph.ir import Graph, Node, TensorType
from .graph.verify import GraphError, verify
from .nn.compiled import compile
from .nn.creation import full, ones, ones_like, rand, randn, tensor, zeros, zeros_like
from .nn.functional import *  # noqa: F403 - the op namespace, listed in nn.functional
from .nn.functional import __all__ as _ops_all
from .random import manual_seed
from .schedule.planner import plan_memory
from .schedule.program import Program
from .training import NonFiniteError, NonFiniteWarning, Trainer, compile_for

__version__ = "0.1.0"

__all__ = [
    "CompileOptions",
    "DType",
    "Graph",
    "GraphBuilder",
    "GraphError",
    "GraphTypeError",
    "Node",
    "NonFiniteError",
    "NonFiniteWarning",
    "Program",
    "Tensor",
    "TensorType",
    "Trainer",
    "bool_",
    "compile",
    "compile_for",
    "differentiate",
    "export",
    "f16",
    "f32",
    "i32",
    "interpret",
    "manual_seed",
    "full",
    "ones",
    "ones_like",
    "rand",
    "randn",
    "tensor",
    "zeros",
    "zeros_like",
    "debug",
    "nn",
    "optim",
    "plan_memory",
    "u32",
    "verify",
    *_ops_all,
]

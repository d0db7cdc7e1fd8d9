"""GraphTrainer: a compiled training step of a Graph with its optimizer's host-side bookkeeping.

``mn.Trainer(graph, optimizer)`` returns one (``mn.Trainer(model, optimizer, loss_fn)`` trains
a Module: ``training.trainer``). The trainer owns the step counter and the learning-rate
schedule; each ``step`` computes the optimizer's hyper vector on the host (float64 math, fed
as f32), feeds it with the batch, and runs the whole forward + backward + update as one GPU
submission. A step that fails validation raises before anything is uploaded, leaving
parameters, optimizer state and the step counter as they were.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..autodiff import missing_loss
from ..codegen.kernel import Limits
from ..compile import CompileOptions, compile
from ..graph.ir import Graph
from ..io.checkpoint import check_count, load_checkpoint, save_checkpoint
from ..optim import HYPER_INPUT, Optimizer
from ..schedule.program import Program
from .batches import check_optimizer


def device_limits(device) -> Limits:
    """The codegen Limits of a runtime Device."""
    return Limits(
        max_workgroups_per_dimension=device.max_compute_workgroups_per_dimension,
        max_workgroup_storage_size=device.max_compute_workgroup_storage_size,
        max_invocations_per_workgroup=device.max_compute_invocations_per_workgroup,
        max_storage_buffer_binding_size=device.max_storage_buffer_binding_size,
        min_storage_buffer_offset_alignment=device.min_storage_buffer_offset_alignment,
        max_storage_buffers_per_shader_stage=device.max_storage_buffers_per_shader_stage,
        shader_f16="shader-f16" in device.features,
        subgroups="subgroup" in device.features,
    )


def compile_for(graph: Graph, options: CompileOptions | None = None, device=None):
    """Compile ``graph`` for ``device`` (default device when None) and open a Session.

    Returns:
        (Program, Session).
    """
    from ..runtime import Session, get_device

    device = device or get_device()
    program = compile(graph, options, device_limits(device))
    return program, Session(program, device)


class GraphTrainer:
    """Compiles ``graph`` for training and runs steps (``mn.Trainer(graph, optimizer, ...)``).

    Args:
        graph: forward graph with a scalar output named ``loss``.
        optimizer: SGD, Adam or AdamW.
        loss: name of the output to minimize (and the output ``step`` returns by default).
        schedule: step -> learning rate; default the optimizer's constant ``lr``.
        max_grad_norm: clip gradients by global L2 norm (None: no clipping).
        device: a runtime Device; default the cached default device.
        fuse: fuse elementwise chains and matmul epilogues (``CompileOptions.fuse``).
        precision: ``"strict"`` or ``"fast"`` (``CompileOptions.precision``: f16 storage of
            activations and their gradients, f32 master weights and optimizer state).

    Raises:
        ValueError: when no output is named ``loss`` (the message lists the outputs), before
            any device is acquired.
    """

    def __init__(
        self,
        graph: Graph,
        optimizer: Optimizer,
        loss: str = "loss",
        schedule: Callable[[int], float] | None = None,
        max_grad_norm: float | None = None,
        device=None,
        fuse: bool = True,
        precision: str = "strict",
    ) -> None:
        if loss not in graph.output_dict:
            raise missing_loss(graph, loss)
        self.optimizer = optimizer
        self.loss = loss
        self.schedule = schedule or (lambda step: optimizer.lr)
        options = CompileOptions(
            loss=loss,
            optimizer=optimizer,
            max_grad_norm=max_grad_norm,
            fuse=fuse,
            precision=precision,
        )
        self.program: Program
        self.program, self.session = compile_for(graph, options, device)
        self.step_count = 0
        self._closed = False
        # Parameters the loss does not read are compiled away, but they are part of the model:
        # kept here on the host (zero until loaded) so state_dict and checkpoints hold the
        # whole model, as torch's state_dict does (issue 11, item 10b).
        self._unused = {
            n.name: np.zeros(n.type.shape, n.type.dtype.numpy)
            for n in graph.nodes
            if n.op == "parameter" and n.name not in self.program.parameters
        }

    @property
    def inputs(self) -> list[str]:
        """Names the caller feeds each step (the optimizer's hyper vector excluded)."""
        return [n for n in self.program.inputs if n != HYPER_INPUT]

    def lr(self) -> float:
        """Learning rate of the next step."""
        return float(self.schedule(self.step_count))

    def step(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None) -> dict:
        """One optimizer step on one batch; returns the fetched outputs (default: the loss,
        under its output name).

        Raises:
            InputError: bad feeds (nothing is changed).
        """
        self._live()
        full = dict(feeds)
        if HYPER_INPUT in full:
            raise ValueError(f"{HYPER_INPUT!r} is computed by the Trainer; do not feed it")
        full[HYPER_INPUT] = self.optimizer.hyper(self.step_count, self.lr())
        out = self.session.run(full, (self.loss,) if fetch is None else fetch)
        self.step_count += 1
        return out

    def load_parameters(self, params: Mapping[str, np.ndarray]) -> None:
        """Write initial parameter values: every parameter the program reads must be given;
        those the loss does not read may be (they start at zero).

        Raises:
            InputError: a missing or unknown name, or a value of another shape or dtype;
                nothing is written then.
        """
        self._live()
        unused = self._checked_unused({k: v for k, v in params.items() if k in self._unused})
        used = {k: v for k, v in params.items() if k not in self._unused}
        self.session.load_state_dict(
            {**{k: self.session.read(k) for k in self.program.state}, **used}
        )
        self._unused.update(unused)

    def _read_used(self) -> dict[str, np.ndarray]:
        return {k: self.session.read(k) for k in self.program.parameters}

    def _checked_unused(self, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        from ..runtime import InputError

        out = {}
        for k, v in values.items():
            want = self._unused[k]
            arr = np.asarray(v)
            if arr.shape != want.shape or arr.dtype != want.dtype:
                raise InputError(
                    f"parameter {k!r}: expected {want.dtype}{list(want.shape)}, "
                    f"got {arr.dtype}{list(arr.shape)}"
                )
            out[k] = arr.copy()
        return out

    def parameters(self) -> dict[str, np.ndarray]:
        """Current parameter values (read back from the device; those the loss does not
        read from the host copy)."""
        self._live()
        return {**self._read_used(), **{k: v.copy() for k, v in self._unused.items()}}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter of the graph (those the loss does not read too) and the optimizer
        state."""
        self._live()
        return {**self.session.state_dict(), **{k: v.copy() for k, v in self._unused.items()}}

    def save(self, path: str | Path, metadata: Mapping | None = None) -> None:
        """Write parameters, optimizer state, step counter and ``metadata`` atomically."""
        meta = {"step": self.step_count, "optimizer": self.optimizer.config(), **(metadata or {})}
        save_checkpoint(path, self.state_dict(), meta)

    def load(self, path: str | Path) -> dict:
        """Restore a checkpoint written by ``save``; returns its metadata.

        Everything is checked before anything is applied: on any error the trainer's
        parameters, optimizer state and step counter are as they were.

        Raises:
            CheckpointError: missing or corrupt file; missing or unknown keys, or a tensor of
                another shape or dtype (``io.checkpoint.load_checkpoint``); ``optimizer``
                metadata missing or of another type; a ``step`` that is not an int >= 0. The
                message names the key, the expected and the actual value.
            RuntimeError: the trainer is closed.
        """
        self._live()
        expected = {
            k: (s.shape, s.host.numpy)
            for k, s in {**self.program.parameters, **self.program.state}.items()
        }
        expected.update({k: (v.shape, v.dtype) for k, v in self._unused.items()})
        tensors, meta = load_checkpoint(path, expected)
        step = check_count(path, meta, "step", "the number of steps taken")
        check_optimizer(path, meta, self.optimizer)
        self.session.load_state_dict({k: v for k, v in tensors.items() if k not in self._unused})
        self._unused.update({k: tensors[k] for k in self._unused})
        self.step_count = step
        return meta

    def close(self) -> None:
        """Free the program's GPU memory now (as leaving a ``with`` block does); a closed
        trainer raises RuntimeError when used. Closing twice does nothing."""
        if not self._closed:
            self._closed = True
            self.session.close()

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(
                "this GraphTrainer is closed (close() or the end of its with block freed its "
                "GPU memory); make a new one to train again"
            )

    def __enter__(self) -> GraphTrainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

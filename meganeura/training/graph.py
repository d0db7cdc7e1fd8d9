"""GraphTrainer: a compiled training step of a Graph with its optimizer's host-side bookkeeping.

``mn.Trainer(graph, optimizer)`` returns one (``mn.Trainer(model, optimizer, loss_fn)`` trains
a Module: ``training.trainer``). The trainer owns the step counter and the learning-rate
schedule; each ``step`` computes the optimizer's hyper vector on the host (float64 math, fed
as f32), feeds it with the batch, and runs the whole forward + backward + update as one GPU
submission. A step that fails validation raises before anything is uploaded, leaving
parameters, optimizer state and the step counter as they were. A step whose loss or
gradients hold inf or NaN writes nothing on the GPU (``training.guard``).
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
from ..optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT, GUARD_STATE
from ..optim.scaler import SCALER_STATES
from ..schedule.program import Program
from .batches import check_optimizer
from .guard import StepGuard, StepRun, check_finite_feeds, check_mode, guard_outputs


def device_limits(device) -> Limits:
    """The codegen Limits of a runtime Device, with the matmul and attention lane plans tuned
    on it (``meganeura.tune``: its file in the tuning cache, if there is one)."""
    from ..tune.cache import device_attention_plans, device_plans

    return Limits(
        max_workgroups_per_dimension=device.max_compute_workgroups_per_dimension,
        max_workgroup_storage_size=device.max_compute_workgroup_storage_size,
        max_invocations_per_workgroup=device.max_compute_invocations_per_workgroup,
        max_storage_buffer_binding_size=device.max_storage_buffer_binding_size,
        min_storage_buffer_offset_alignment=device.min_storage_buffer_offset_alignment,
        max_storage_buffers_per_shader_stage=device.max_storage_buffers_per_shader_stage,
        max_buffer_size=device.max_buffer_size,
        shader_f16="shader-f16" in device.features,
        subgroups="subgroup" in device.features,
        cpu=str(device.info.get("adapter_type", "")).upper() == "CPU",
        matmul_plans=device_plans(device),
        attention_plans=device_attention_plans(device),
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
        on_nonfinite: ``"raise"`` or ``"skip"``, as ``Trainer``'s (``training.guard``).
        check_finite: check floating feeds for inf and NaN on the host before each step.
        loss_scale: a static loss scale (a power of two) or a dynamic one,
            ``optim.GradScaler(...)`` (``CompileOptions.loss_scale``).

    Raises:
        ValueError: when no output is named ``loss`` (the message lists the outputs), or an
            unknown ``on_nonfinite``, before any device is acquired.
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
        on_nonfinite: str = "raise",
        check_finite: bool = False,
        loss_scale: float = 1.0,
    ) -> None:
        if loss not in graph.output_dict:
            raise missing_loss(graph, loss)
        self._guard = StepGuard(check_mode(on_nonfinite), "GraphTrainer")
        self.check_finite = bool(check_finite)
        self.optimizer = optimizer
        self.loss = loss
        self.schedule = schedule or (lambda step: optimizer.lr)
        options = CompileOptions(
            loss=loss,
            optimizer=optimizer,
            max_grad_norm=max_grad_norm,
            fuse=fuse,
            precision=precision,
            nonfinite_guard=on_nonfinite,
            loss_scale=loss_scale,
        )
        self.program: Program
        self.graph, self.options = graph, options
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
        """Names the caller feeds each step (the optimizer's hyper vector and the guard's
        reset flag excluded)."""
        return [n for n in self.program.inputs if n not in (HYPER_INPUT, GUARD_RESET_INPUT)]

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient (``on_nonfinite="skip"``)."""
        return self._guard.skipped_steps

    def check_nonfinite(self) -> None:
        """Read the GPU's count of skipped steps if steps ran since the last read and act on
        it (``Trainer.check_nonfinite``); ``parameters``, ``state_dict`` and ``save`` call it.

        Raises:
            NonFiniteError: ``on_nonfinite="raise"`` and an unread step was skipped.
        """
        if self._guard.pending:
            self._settle({n: self.session.read(n) for n in guard_outputs(self.program.outputs)})

    def _settle(self, out, loss=None) -> None:
        def rewind(step: int, rng) -> None:
            self.step_count = step

        self.step_count -= self._guard.settle(out, loss, None, rewind)

    def lr(self) -> float:
        """Learning rate of the next step."""
        return float(self.schedule(self.step_count))

    def step(self, feeds: Mapping[str, np.ndarray], fetch: Sequence[str] | None = None) -> dict:
        """One optimizer step on one batch; returns the fetched outputs (default: the loss,
        under its output name). A step that fetches something reads the guard's count in the
        same read; with ``fetch=()`` it is read at the next read.

        Raises:
            InputError: bad feeds (nothing is changed).
            NonFiniteError: the loss or gradients of this step (or of an unread earlier
                one) hold inf or NaN; the update was skipped on the GPU (``on_nonfinite``);
                or, with ``check_finite``, a feed holds inf or NaN (nothing is run).
        """
        self._live()
        full = dict(feeds)
        for name in (HYPER_INPUT, GUARD_RESET_INPUT):
            if name in full:
                raise ValueError(f"{name!r} is computed by the Trainer; do not feed it")
        if self.check_finite:
            check_finite_feeds(full, self.step_count, "GraphTrainer")
        full[HYPER_INPUT] = self.optimizer.hyper(self.step_count, self.lr())
        full[GUARD_RESET_INPUT] = self._guard.reset_feed()
        fetch = (self.loss,) if fetch is None else tuple(fetch)
        counts = guard_outputs(self.program.outputs) if fetch else ()
        out = self.session.run(full, fetch + counts)
        run = StepRun(self.program, full, self.session, self.graph, self.options)
        self._guard.ran(self.step_count, None, (run,))
        self.step_count += 1
        if GUARD_OUTPUT in out:
            loss = float(out[self.loss]) if self.loss in out else None
            self._settle({n: out.pop(n) for n in counts}, loss)
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
        """Current parameter values (read back from the device, ``check_nonfinite`` first;
        those the loss does not read from the host copy)."""
        self._live()
        self.check_nonfinite()
        return {**self._read_used(), **{k: v.copy() for k, v in self._unused.items()}}

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every parameter of the graph (those the loss does not read too) and the optimizer
        state (``check_nonfinite`` first; the guard's count is not part of it)."""
        self._live()
        self.check_nonfinite()
        sd = self.session.state_dict()
        for name in (GUARD_STATE, *SCALER_STATES):  # per-run counters, a dynamic loss scale
            sd.pop(name, None)
        return {**sd, **{k: v.copy() for k, v in self._unused.items()}}

    def save(self, path: str | Path, metadata: Mapping | None = None) -> None:
        """Write parameters, optimizer state, step counter, the count of skipped steps and
        ``metadata`` atomically (``check_nonfinite`` first)."""
        sd = self.state_dict()  # first: reading the guard may change the counters
        meta = {
            "step": self.step_count,
            "skipped_steps": self.skipped_steps,
            "optimizer": self.optimizer.config(),
            **(metadata or {}),
        }
        save_checkpoint(path, sd, meta)

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
            if k != GUARD_STATE and k not in SCALER_STATES
        }
        expected.update({k: (v.shape, v.dtype) for k, v in self._unused.items()})
        tensors, meta = load_checkpoint(path, expected)
        step = check_count(path, meta, "step", "the number of steps taken")
        skipped = 0  # checkpoints from before the guard have none
        if "skipped_steps" in meta:
            skipped = check_count(path, meta, "skipped_steps", "the number of skipped steps")
        check_optimizer(path, meta, self.optimizer)
        for name in (GUARD_STATE, *SCALER_STATES):  # restart: the count, init_scale
            if name in self.program.state:
                tensors = {**tensors, name: np.zeros((), np.float32)}
        self.session.load_state_dict({k: v for k, v in tensors.items() if k not in self._unused})
        self._unused.update({k: tensors[k] for k in self._unused})
        self.step_count = step
        self._guard.skipped_steps = skipped
        self._guard.forget()
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

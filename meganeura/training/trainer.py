"""Trainer: trains an ``nn.Module`` on the GPU, one replayed step per (micro-)batch.

``Trainer(model, optimizer, loss_fn)`` traces ``loss_fn(model, *batch)`` (a scalar Tensor) once
per batch signature -- each array's shape and dtype, every other argument's value, each module's
train/eval mode and each parameter's ``requires_grad`` -- and compiles forward, backward and the
optimizer update into one program, cached as ``nn.compiled`` caches forward calls (and with its
helpers: ``flatten_arguments``, ``trace_call``, ``ProgramRunner``).

Shared state: every program of the model binds one GPU copy of its parameters and buffers, and
of the trainer's optimizer moments and gradient accumulators (``runtime.shared``: the trainer
owns one Buffer per (parameter, suffix), zero at start). A batch of another size, the
accumulation programs, the eval program and the model's own ``model(x)`` calls therefore all
read the same values, and every training program continues the same moments.

Invariants:
  * a step that raises before it runs (a loss_fn error, a batch the program rejects) changes
    nothing: parameters, moments, buffers, the step counter and the global RNG stay as they
    were; with accumulation every micro-batch is checked before the first one runs;
  * a step reads back only the loss (unless ``return_loss=False``), and the gradients when
    asked for;
  * what a traced forward does to host state (BatchNorm's ``num_batches_tracked += 1``,
    registered with ``Trace.on_run``) happens once per executed forward: after every run of a
    program, ``k`` times per step with accumulation; a step the guard skips has them taken
    back when the guard's count is read (``StepGuard``);
  * ``load`` checks the whole checkpoint before it applies any of it;
  * every step's update is guarded against inf and NaN on the GPU (``training.guard``): a
    step whose loss or gradients are non-finite writes no parameter, optimizer state or
    BatchNorm running statistics (issue 11 item 3), and the next read raises
    ``NonFiniteError`` (or warns, ``on_nonfinite="skip"``).
  * GPU memory: ``close()`` (or the end of a ``with`` block) frees the programs and optimizer
    state at once, a dropped Trainer when it is collected; at most ``max_programs`` programs
    are kept, the least recently used one closed beyond that.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass, replace

import numpy as np

from .. import random as mn_random
from ..compile import CompileOptions, grad_output
from ..graph.builder import Tensor
from ..graph.ir import Graph
from ..nn.compiled import (
    DEFAULT_MAX_PROGRAMS,
    CacheEntry,
    CacheInfo,
    ProgramCache,
    ProgramRunner,
    flatten_arguments,
    trace_call,
)
from ..nn.module import Module
from ..nn.parameter import Buffer, Parameter
from ..optim import HYPER_INPUT, Optimizer
from ..optim.accumulate import ACCUM_FIRST_INPUT, LOSS_ACCUMULATOR, grad_accumulator
from ..optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT, GUARD_STATE, PENDING_SUFFIX
from ..optim.scaler import SCALER_STATES, SKIPPED_OUTPUT, SKIPPED_STATE
from .batches import bind_model, check_loss, fn_name, split_batch
from .checkpoints import TrainerCheckpoints
from .graph import GraphTrainer
from .guard import StepGuard, StepRun, check_finite_feeds, check_mode, guard_outputs

LOSS = "loss"


@dataclass
class _Program:
    """A cached program and the gradient outputs it returns."""

    entry: CacheEntry
    grads: dict[str, str]  # gradient output -> parameter name (return_grads programs)


# what the eval-mode program drops from the training options
_EVAL = dict(loss=None, optimizer=None, max_grad_norm=None, accumulation_steps=1, loss_scale=1.0)


class Trainer(TrainerCheckpoints):
    """Trains ``model`` with ``optimizer`` on ``loss_fn(model, *batch)``.

    ``Trainer(graph, optimizer, loss="loss", ...)`` with a Graph returns a
    :class:`~meganeura.training.graph.GraphTrainer` instead.

    Args:
        model: the ``nn.Module`` to train (in the train/eval mode it is in at each step).
        optimizer: SGD, Adam or AdamW (``meganeura.optim``).
        loss_fn: ``loss_fn(model, *batch) -> Tensor``: a scalar floating loss written with
            meganeura ops; calling ``model(x)`` inside it runs ``forward`` while tracing.
        schedule: step -> learning rate (``optim.schedules``); default the optimizer's ``lr``.
        max_grad_norm: clip gradients by their global L2 norm (None: no clipping).
        accumulation_steps: micro-batches per update, ``k`` (Hugging Face's
            ``gradient_accumulation_steps``): each ``step`` splits every batch array along
            dim 0 into ``k`` parts (``np.array_split`` sizes) and updates with the mean of
            their gradients; the returned loss is the mean of their losses.
        precision: ``"strict"`` or ``"fast"`` (``CompileOptions.precision``).
        loss_scale: a power of two or ``optim.GradScaler(...)`` (``CompileOptions.loss_scale``;
            the fast mode's small gradients). A dynamic scale is shared by the trainer's
            programs; checkpoints do not hold it yet (a resume starts from ``init_scale``).
        fuse: ``CompileOptions.fuse``.
        device: a runtime Device (default: the default device).
        on_nonfinite: what a step whose loss or gradients hold inf or NaN does; its update is
            skipped on the GPU either way (``training.guard``). ``"raise"``: the read that
            sees it (the step's loss, or with ``return_loss=False`` the next read) raises
            ``NonFiniteError``, with the model, optimizer state, step counter and RNG as
            before that step. ``"skip"``: warn (``NonFiniteWarning``), count the step in
            ``skipped_steps`` and continue; a skipped step does not advance ``step_count``
            (the schedule's and Adam's step), as Hugging Face's Trainer with GradScaler.
        check_finite: also check every floating batch array on the host before a step runs
            and raise ``NonFiniteError`` naming the input (one NumPy pass over the batch;
            off by default).
        max_storage_binding_bytes: ``CompileOptions.max_storage_binding_bytes`` (None: the
            adapter's limit); larger tensors are bound in row blocks (docs/bindings.md).

    Attributes:
        max_programs: compiled programs kept (class default ``DEFAULT_MAX_PROGRAMS``, 32; at
            least 2 are kept); the least recently used one is closed, freeing its GPU memory,
            when a new batch signature would exceed it. None keeps every one.

    Raises:
        TypeError: a model that is not a Module, an unknown optimizer, a loss_fn that cannot
            take the model as its first argument.
        ValueError: a bad ``accumulation_steps``, ``max_grad_norm``, ``precision`` or
            ``on_nonfinite``.

    ``close()`` (or leaving ``with Trainer(...) as trainer:``) frees the programs' and the
    optimizer state's GPU memory; a dropped Trainer frees it when collected.
    """

    max_programs: int | None = DEFAULT_MAX_PROGRAMS

    def __new__(cls, model, *args, **kwargs):
        if isinstance(model, Graph):
            return GraphTrainer(model, *args, **kwargs)  # not a Trainer: __init__ is skipped
        return super().__new__(cls)

    def __init__(
        self,
        model: Module,
        optimizer: Optimizer,
        loss_fn: Callable[..., Tensor],
        *,
        schedule: Callable[[int], float] | None = None,
        max_grad_norm: float | None = None,
        accumulation_steps: int = 1,
        precision: str = "strict",
        fuse: bool = True,
        device=None,
        on_nonfinite: str = "raise",
        check_finite: bool = False,
        max_storage_binding_bytes: int | None = None,
        loss_scale: float = 1.0,
    ) -> None:
        if not isinstance(model, Module):
            raise TypeError(f"Trainer trains an nn.Module or a Graph, got {type(model).__name__}")
        if not isinstance(optimizer, Optimizer):
            raise TypeError(
                f"optimizer must be SGD, Adam or AdamW (meganeura.optim), got {optimizer!r}"
            )
        if max_grad_norm is not None and not max_grad_norm > 0:
            raise ValueError(f"max_grad_norm must be positive or None, got {max_grad_norm!r}")
        self._guard = StepGuard(
            check_mode(on_nonfinite), "Trainer", (self._host_counters, self._set_host_counters)
        )
        self.check_finite = bool(check_finite)
        self.model = model
        self.optimizer = optimizer
        self.loss_fn = loss_fn
        self.schedule = schedule or (lambda step: optimizer.lr)
        self.accumulation_steps = accumulation_steps
        self.device = device
        self._options = CompileOptions(
            loss=LOSS,
            optimizer=optimizer,
            max_grad_norm=max_grad_norm,
            fuse=fuse,
            precision=precision,
            shared_parameters=True,
            accumulation_steps=accumulation_steps,
            nonfinite_guard=on_nonfinite,
            max_storage_binding_bytes=max_storage_binding_bytes,
            loss_scale=loss_scale,
        )
        self._fn = bind_model(loss_fn, model)
        self.step_count = 0
        self._moments: dict[Parameter, dict[str, Buffer]] = {}
        self._accumulators: dict[Parameter, Buffer] = {}
        # running statistic -> its pending copy, staged by the micro-batches of an accumulated
        # step and committed by the guarded last one (``optim.guard.defer_update_stats``)
        self._pending_stats: dict[Buffer, Buffer] = {}
        self._loss_accumulator = Buffer(np.zeros((), np.float32))
        self._guard_state = Buffer(np.zeros((), np.float32))  # GPU count of skipped steps
        self._scaler_state: dict[str, Buffer] = {}  # a dynamic loss scale (optim.scaler)
        self._cache: ProgramCache = ProgramCache()
        self.hits = self.misses = 0
        self._closed = False

    # ------------------------------------------------------------------ steps
    @property
    def on_nonfinite(self) -> str:
        """``"raise"`` or ``"skip"`` (see the class docstring)."""
        return self._guard.mode

    @property
    def skipped_steps(self) -> int:
        """Steps skipped for a non-finite loss or gradient (``on_nonfinite="skip"``), as far
        as the host has read the GPU's count."""
        return self._guard.skipped_steps

    def check_nonfinite(self) -> None:
        """Read the GPU's count of skipped steps if steps ran since the last read (one host
        round trip), and act on it as a loss read would. ``evaluate``, ``save`` and
        ``state_dict`` call it; call it before reading parameters through the model after
        steps with ``return_loss=False``.

        Raises:
            NonFiniteError: ``on_nonfinite="raise"`` and an unread step was skipped.
        """
        if self._guard.pending:
            scaled = self._scaler_state.get(SKIPPED_STATE)
            counts = {GUARD_OUTPUT: self._guard_state.data, SKIPPED_OUTPUT: scaled and scaled.data}
            self._settle(counts)

    def _settle(self, out: Mapping, loss=None, grads=None) -> None:
        def rewind(step: int, rng) -> None:
            self.step_count = step
            mn_random.set_rng_state(rng)

        self.step_count -= self._guard.settle(
            out, loss, grads, rewind, restore_rng=mn_random.set_rng_state
        )

    def lr(self) -> float:
        """Learning rate of the next step."""
        return float(self.schedule(self.step_count))

    def step(self, *batch, return_grads: bool = False, return_loss: bool = True, **kwargs):
        """One optimizer step on one batch: forward, backward and update on the GPU.

        Args:
            *batch, **kwargs: the arguments of ``loss_fn`` after the model, positional or by
                name (``trainer.step(x=xs, y=ys)``; both spellings of a call share one
                compiled program): NumPy arrays (float64 fed as float32, int64 as int32) or
                static Python values, nested in tuples, lists and dicts as ``loss_fn`` takes
                them. A ``loss_fn`` argument named ``return_grads`` or ``return_loss`` cannot
                be passed by name.
            return_grads: also return each trained parameter's gradient (before clipping; with
                accumulation the mean over the micro-batches). Compiles a program of its own
                the first time, sharing parameters and moments with the others.
            return_loss: read the loss back. Reading it waits for the GPU to finish the step
                (a host round trip); a loop that logs every n-th step passes False on the
                others and the step returns None in the loss's place.

        Returns:
            The loss (a float), or ``(loss, {parameter name: gradient})`` with
            ``return_grads``; parameters that are frozen or do not reach the loss have no
            gradient (PyTorch leaves their ``.grad`` None).

        Raises:
            TypeError, ValueError: ``loss_fn`` failed while tracing (a note names the batch
                signature) or did not return a scalar floating Tensor; an unsplittable batch
                with accumulation; every parameter the loss reads is frozen.
            InputError: a batch the compiled program rejects (an out-of-range class index).
            NonFiniteError: with ``check_finite=True``, a batch array holding inf or NaN.
            Nothing is changed when any of these is raised.
            NonFiniteError: the loss or the gradients of this step (or, read now, of an
                earlier step run with ``return_loss=False``) hold inf or NaN; the update was
                skipped on the GPU and the trainer is as before that step, BatchNorm's running
                statistics and ``num_batches_tracked`` included (every micro-batch's, with
                accumulation). ``on_nonfinite="skip"`` warns instead.
        """
        k = self.accumulation_steps
        micro = split_batch(self._fn, batch, kwargs, k) if k > 1 else [(batch, kwargs)]
        rng_state = mn_random.get_rng_state()
        try:
            runs = []
            for i, (mb, mkw) in enumerate(micro):
                last = i == len(micro) - 1
                kind = "step" if last else "accumulate"
                prog, feeds = self._prepare(kind, mb, mkw, return_grads and last)
                inputs = prog.entry.runner.program.inputs
                if last and HYPER_INPUT in inputs:
                    feeds[HYPER_INPUT] = self.optimizer.hyper(self.step_count, self.lr())
                if not last and ACCUM_FIRST_INPUT in inputs:
                    feeds[ACCUM_FIRST_INPUT] = np.asarray(float(i == 0), np.float32)
                if last and GUARD_RESET_INPUT in inputs:
                    feeds[GUARD_RESET_INPUT] = self._guard.reset_feed()
                if self.check_finite:
                    check_finite_feeds(feeds, self.step_count, "Trainer")
                runs.append((prog, feeds))
            if len(runs) > 1:
                for prog, feeds in runs:
                    prog.entry.runner.session.check(feeds)
            # what the step's forwards advance (num_batches_tracked), taken back if the guard
            # skips the step, as the GPU skips its running-statistics updates
            host = self._host_counters()
            for prog, feeds in runs[:-1]:
                self._run(prog, feeds, ())
            prog, feeds = runs[-1]
            fetch = ((LOSS,) if return_loss else ()) + tuple(prog.grads)
            guarded = GUARD_OUTPUT in prog.entry.runner.program.outputs
            if fetch and guarded:  # the counts come in the same read
                fetch += guard_outputs(prog.entry.runner.program.outputs)
            out = self._run(prog, feeds, fetch)
        except BaseException:
            mn_random.set_rng_state(rng_state)
            raise
        if guarded:
            r = [p.entry.runner for p, _ in runs]  # what a locator replays (NonFiniteError.runs)
            located = tuple(
                StepRun(x.program, f, x.session, x.traced.graph, x.options)
                for x, (_, f) in zip(r, runs, strict=True)
            )
            self._guard.ran(self.step_count, rng_state, located, host)
        self.step_count += 1
        loss = float(out[LOSS]) if return_loss else None
        grads = {name: out[g] for g, name in prog.grads.items()}
        if GUARD_OUTPUT in out:
            self._settle(out, loss, grads if return_grads else None)
        if return_grads:
            return loss, grads
        return loss

    def evaluate(self, *batch, **kwargs) -> float:
        """``loss_fn`` on the eval-mode program (traced with ``model.eval()``, the modes
        restored after), reading the same parameters and buffers; returns the loss. The
        batch is given as to :meth:`step`.

        Raises:
            NonFiniteError: an earlier step run with ``return_loss=False`` was skipped
                (``check_nonfinite``).
        """
        self.check_nonfinite()
        prog, feeds = self._prepare("evaluate", batch, kwargs)
        return float(self._run(prog, feeds, (LOSS,))[LOSS])

    def _host_counters(self) -> dict[str, np.ndarray]:
        """Copies of the model's host-only buffers (BatchNorm's ``num_batches_tracked``)."""
        return {
            name: np.array(b.data) for name, b in self.model.named_buffers(_all=True) if b.host_only
        }

    def _set_host_counters(self, values: Mapping[str, np.ndarray]) -> None:
        buffers = dict(self.model.named_buffers(_all=True))
        for name, value in values.items():
            buffers[name].copy_(value)

    def _run(self, prog: _Program, feeds: dict, fetch: tuple) -> dict:
        runner = prog.entry.runner
        out = runner.run(feeds, fetch)
        prog.entry.calls += 1
        for effect in runner.traced.trace.host_effects:  # once per forward that ran
            effect()
        return out

    def _prepare(self, kind: str, batch: tuple, kwargs: dict, return_grads: bool = False, fn=None):
        """(program for this batch's signature, its feeds with fresh dropout seeds).

        ``fn`` replaces the bound ``loss_fn`` (``kind="apply"``: ``distributed``'s update from
        given gradients)."""
        self._live()
        fn = self._fn if fn is None else fn
        _, spec, arrays = flatten_arguments(fn, batch, kwargs)
        key = (kind, spec, return_grads)
        if kind != "evaluate":
            key += self.model.signature_key()
        prog = self._cache.get(key)
        if prog is None:
            self.misses += 1
            prog = self._cache[key] = self._compile(
                key, kind, batch, kwargs, arrays, return_grads, fn
            )
        else:
            self.hits += 1
        # At least 2: a step with accumulation runs two programs, both prepared before either runs.
        limit = None if self.max_programs is None else max(2, self.max_programs)
        self._cache.touch(key, limit, lambda p: p.entry.runner.session.close())
        runner = prog.entry.runner
        inputs = runner.program.inputs
        traced = runner.traced
        feeds = {n: a for n, (_, a) in zip(traced.inputs, arrays, strict=True) if n in inputs}
        rng = mn_random.default_generator()
        for name in traced.trace.seeds:
            seed = np.asarray(rng.integers(0, 2**32), np.uint32)
            if name in inputs:
                feeds[name] = seed
        return prog, feeds

    def _compile(self, key, kind, batch: tuple, kwargs: dict, arrays: list, return_grads: bool, fn):
        modes = [(m, m.training) for m in self.model.modules()]
        if kind == "evaluate":
            self.model.eval()
        try:
            traced = trace_call(self.model, fn, batch, kwargs, LOSS, check_loss)
        except Exception as e:
            shown = ", ".join(f"{n}: {a.dtype}{list(a.shape)}" for n, a in arrays)
            e.add_note(
                f"while tracing {fn_name(self.loss_fn)}(model, {shown}) for "
                f"Trainer.{'evaluate' if kind == 'evaluate' else 'step'}"
            )
            raise
        finally:
            for m, mode in modes:
                object.__setattr__(m, "training", mode)
        objects = traced.trace.objects
        trainable = tuple(
            n for n, o in objects.items() if isinstance(o, Parameter) and o.requires_grad
        )
        if kind == "evaluate":
            options = replace(self._options, **_EVAL)
        elif not trainable:
            raise ValueError(
                f"every parameter {fn_name(self.loss_fn)} reads has requires_grad=False: nothing "
                "to train (unfreeze some with requires_grad_())"
            )
        elif kind == "accumulate":
            options = replace(
                self._options,
                optimizer=None,
                max_grad_norm=None,
                accumulation_steps=1,
                accumulate_grads=True,
                trainable=trainable,
            )
        elif kind == "apply":  # one update from gradients given as inputs: no micro-batches
            options = replace(self._options, trainable=trainable, accumulation_steps=1)
        else:
            options = replace(self._options, trainable=trainable, output_grads=return_grads)
        shared = functools.partial(self._shared_key, objects)
        runner = ProgramRunner(traced, options, self.device, shared=shared)
        outputs = runner.program.outputs
        grads = {grad_output(n): n for n in trainable if grad_output(n) in outputs}
        entry = CacheEntry(
            key, traced.seconds, runner.compile_seconds, runner.setup_seconds, 0, runner
        )
        return _Program(entry, grads if return_grads else {})

    def _shared_key(self, objects: Mapping, name: str) -> Buffer | None:
        """The trainer's Buffer behind a program's optimizer-state or accumulator slot."""
        if name == LOSS_ACCUMULATOR:
            return self._loss_accumulator
        if name == GUARD_STATE:
            return self._guard_state
        if name in SCALER_STATES:  # one dynamic loss scale for every program of the trainer
            if name not in self._scaler_state:
                self._scaler_state[name] = Buffer(np.zeros((), np.float32))
            return self._scaler_state[name]
        owner, _, suffix = name.rpartition(".")
        p = objects.get(owner)
        if suffix == PENDING_SUFFIX and isinstance(p, Buffer):  # a running statistic's copy
            if p not in self._pending_stats:
                self._pending_stats[p] = Buffer(np.zeros(p.shape, p.dtype.numpy))
            return self._pending_stats[p]
        if not isinstance(p, Parameter):
            return None
        if name == grad_accumulator(owner):
            if p not in self._accumulators:
                self._accumulators[p] = Buffer(np.zeros(p.shape, p.dtype.numpy))
            return self._accumulators[p]
        if suffix in self.optimizer.state_suffixes:
            return self._moment(p, suffix)
        return None

    def _moment(self, p: Parameter, suffix: str) -> Buffer:
        slots = self._moments.setdefault(p, {})
        if suffix not in slots:
            slots[suffix] = Buffer(np.zeros(p.shape, p.dtype.numpy))
        return slots[suffix]

    # ------------------------------------------------------------------ cache
    def cache_info(self) -> CacheInfo:
        """Hits, misses and the compiled programs (train, accumulate, eval) with their
        trace/compile/setup seconds."""
        entries = tuple(p.entry for p in self._cache.values())
        return CacheInfo(self.hits, self.misses, len(self._cache), entries)

    def cache_clear(self) -> None:
        """Close every compiled program (parameters and optimizer state are kept)."""
        for p in self._cache.values():
            p.entry.runner.session.close()
        self._cache.clear()
        self.hits = self.misses = 0

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Free the GPU memory of the compiled programs and the optimizer state now, as
        leaving a ``with Trainer(...) as trainer:`` block does. The model keeps its trained
        values (they live as long as the model). A closed trainer raises RuntimeError on
        ``step``, ``evaluate``, ``state_dict``, ``save`` and ``load``; closing twice does
        nothing. A Trainer that is dropped without ``close`` frees the same memory when it
        is garbage-collected."""
        if self._closed:
            return
        self.cache_clear()
        self._closed = True
        # The shared store forgets these Buffers (weak keys) and frees blocks left empty.
        self._moments, self._accumulators, self._loss_accumulator = {}, {}, None
        self._pending_stats = {}
        self._guard_state = None
        self._scaler_state = {}
        self._guard.forget()  # its records hold the closed programs' feeds and Sessions

    def _live(self) -> None:
        if self._closed:
            raise RuntimeError(
                f"this {type(self).__name__} is closed (close() or the end of its with block "
                "freed its programs and optimizer state); make a new one to train again"
            )

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return (
            f"Trainer({type(self.model).__name__}, {self.optimizer!r}, "
            f"loss_fn={fn_name(self.loss_fn)}, step={self.step_count})"
        )

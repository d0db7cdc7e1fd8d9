"""Tracing a Module's ``forward`` into a Graph.

While a :class:`Trace` is active (a context variable), a module's parameters and buffers read
as graph Tensors (leaves named by their dotted paths from the traced root, as PyTorch names
them), calling a submodule runs its ``forward``, NumPy arrays mixed into ops become constants,
and dropout draws its seed from an input the caller feeds each run.

Leaves: a Parameter is a ``parameter`` leaf; a Buffer a ``state`` leaf; a NumPy constant a
``state`` leaf named ``_constant.<k>`` whose value the trace records; a dropout seed a u32[]
``input`` named ``_seed.<k>``. Leaves are made on first use, so a parameter the forward never
reads is not in the graph. After an in-place write of a Buffer (``index_copy_``) the Buffer
reads as the written value (``Trace.advance``).
"""

from __future__ import annotations

import contextvars
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import numpy as np

from ..dtypes import DType
from ..graph.builder import GraphBuilder, Tensor, use_builder
from .parameter import Buffer, Parameter, _Persistent, dtype_of, narrow_to_stored

_CURRENT: contextvars.ContextVar[Trace | None] = contextvars.ContextVar(
    "meganeura_trace", default=None
)

CONSTANT_PREFIX = "_constant."
SEED_PREFIX = "_seed."


class TraceError(RuntimeError):
    """Something a traced forward did cannot be part of a static graph."""


class Trace:
    """The graph under construction for one signature of one root module.

    Attributes:
        builder: the GraphBuilder.
        names: id(tensor object) -> dotted name from the root.
        objects: dotted name -> Parameter or Buffer, for the leaves made so far.
        constants: leaf name -> value of each NumPy constant.
        seeds: names of the dropout seed inputs, in creation order.
        host_effects: functions to call on the host after every run of the traced program
            (``on_run``).
    """

    def __init__(self, root) -> None:
        self.builder = GraphBuilder()
        self.names: dict[int, str] = {}
        for name, p in root.named_parameters(remove_duplicate=True):
            self.names.setdefault(id(p), name)
        for name, b in root.named_buffers(remove_duplicate=True, _all=True):
            self.names.setdefault(id(b), name)
        self.objects: dict[str, _Persistent] = {}
        self.constants: dict[str, np.ndarray] = {}
        self.seeds: list[str] = []
        self.host_effects: list[Callable[[], None]] = []
        self._leaves: dict[int, Tensor] = {}

    def leaf(self, obj: _Persistent, attr: str, owner=None) -> Tensor:
        """The graph leaf of a Parameter or Buffer (made on first use)."""
        t = self._leaves.get(id(obj))
        if t is not None:
            return t
        name = self.names.get(id(obj))
        if name is None:
            what = (
                f"{type(obj).__name__.lower()} {attr!r}"
                if attr
                else (f"a {type(obj).__name__} of shape {obj.shape}")
            )
            if owner is not None:
                what += f" of a {type(owner).__name__}"
            raise TraceError(
                f"forward reads {what}, which is not registered in the traced model (assign "
                "it as an attribute of the model or of a submodule in __init__; modules kept "
                "in a plain list or dict are not registered: use nn.ModuleList or "
                "nn.ModuleDict)"
            )
        if isinstance(obj, Buffer) and obj.host_only:
            raise TraceError(f"buffer {name!r} lives on the host only; forward cannot read it")
        if isinstance(obj, Parameter):
            t = self.builder.parameter(name, obj.shape, obj.dtype)
        else:
            t = self.builder.state(name, obj.shape, obj.dtype)
        self._leaves[id(obj)] = t
        self.objects[name] = obj
        return t

    def advance(self, old: Tensor, new: Tensor) -> None:
        """Make the Buffer whose current graph value is ``old`` read as ``new`` from now on:
        ``new`` is ``old``'s storage after an in-place write (``index_copy_``), so code that
        reads the attribute again (``self.cache``) sees the write, as in PyTorch."""
        for key, t in self._leaves.items():
            if t.id == old.id:
                self._leaves[key] = new

    def constant(self, value) -> Tensor:
        """A NumPy array as a constant tensor (float64 stored as f32, int64 as i32)."""
        arr = np.asarray(value)
        if arr.ndim == 0:
            dt = DType.f32 if arr.dtype.kind == "f" else None
            if arr.dtype.kind == "b":
                dt = DType.bool
            elif arr.dtype.kind in "iu":
                dt = DType.i32
            return self.builder.constant(arr.item(), dt)
        try:
            arr = narrow_to_stored(arr, f"constant of shape {arr.shape}")
        except ValueError as e:
            raise TraceError(str(e)) from None
        dt = dtype_of(arr, "constant")
        name = f"{CONSTANT_PREFIX}{len(self.constants)}"
        self.constants[name] = np.ascontiguousarray(arr)
        return self.builder.state(name, arr.shape, dt)

    def seed(self) -> Tensor:
        """A fresh u32[] input for one dropout site (fed a new random value each run)."""
        name = f"{SEED_PREFIX}{len(self.seeds)}"
        self.seeds.append(name)
        return self.builder.input(name, (), DType.u32)

    def on_run(self, fn: Callable[[], None]) -> None:
        """Call ``fn`` on the host after every run of the traced program.

        A forward runs once, at trace time; what it does to host-side state (BatchNorm's
        ``num_batches_tracked += 1``) must happen on every call, as in PyTorch, so it is
        registered here and replayed by whoever runs the program.
        """
        self.host_effects.append(fn)


def current_trace() -> Trace | None:
    """The active trace, or None outside ``Module`` tracing."""
    return _CURRENT.get()


@contextmanager
def tracing(trace: Trace) -> Iterator[Trace]:
    """Make ``trace`` the active one (and its builder ``current_builder()``) for the duration
    of the block."""
    token = _CURRENT.set(trace)
    try:
        with use_builder(trace.builder):  # ops without tensor operands (arange) find the graph
            yield trace
    finally:
        _CURRENT.reset(token)


def lift(value, builder: GraphBuilder) -> Tensor:
    """A NumPy array (or Parameter/Buffer) given as an op operand, as a Tensor of ``builder``.

    Raises:
        TypeError: outside a trace of ``builder`` (graph-building code must declare its inputs).
    """
    trace = current_trace()
    if trace is None or trace.builder is not builder:
        raise TypeError(
            f"a {type(value).__name__} operand can only be used inside a traced Module.forward; "
            "with a GraphBuilder, declare it with g.input, g.parameter or g.state"
        )
    if isinstance(value, _Persistent):
        return trace.leaf(value, "")
    return trace.constant(value)

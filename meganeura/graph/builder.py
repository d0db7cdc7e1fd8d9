"""GraphBuilder and Tensor: the only way to make a graph.

Every ``add`` runs the op's type rule before the node exists, so errors surface at the line
of user code that wrote the bad op, with the op, its operands' types and that line quoted.
Tensors are handles (builder, node id); arithmetic on them appends nodes.

Ops with no tensor operand (``arange``) need to know which graph to extend: they take a
``builder=`` argument, or else use ``current_builder()``, the builder a tracing layer has
made current with ``use_builder`` (a context variable, so threads and asyncio tasks each
see their own).
"""

from __future__ import annotations

import contextvars
import math
import os
import sys
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import numpy as np

from ..dtypes import DType, f32
from .ir import AttrValue, Graph, Node, TensorType, make_attrs
from .tensor_methods import TensorMethods

_PKG_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


_CURRENT: contextvars.ContextVar[GraphBuilder | None] = contextvars.ContextVar(
    "meganeura_current_builder", default=None
)


def current_builder() -> GraphBuilder | None:
    """The builder made current by ``use_builder`` in this context, or None."""
    return _CURRENT.get()


@contextmanager
def use_builder(builder: GraphBuilder) -> Iterator[GraphBuilder]:
    """Make ``builder`` current (``current_builder()``) inside the ``with`` block; the
    previous one is restored on exit, so blocks nest."""
    if not isinstance(builder, GraphBuilder):
        raise TypeError(f"use_builder expects a GraphBuilder, got {type(builder).__name__}")
    token = _CURRENT.set(builder)
    try:
        yield builder
    finally:
        _CURRENT.reset(token)


class GraphTypeError(TypeError):
    """An op was given operands its type rule rejects. The message names the op, each
    operand with its type, and the user's source line."""


def _user_location() -> str:
    """``file:line`` of the innermost frame outside the meganeura package."""
    f = sys._getframe(1)
    while f is not None:
        fn = f.f_code.co_filename
        if not os.path.abspath(fn).startswith(_PKG_DIR + os.sep):
            return f"{os.path.basename(fn)}:{f.f_lineno}"
        f = f.f_back
    return "<unknown>"


def _describe(v) -> str:
    """An operand as error messages show it: a Tensor as ``%3: f32[2,3]``, a list holding
    one as ``[%0: f32[2,3], %1: f32[2,4]]``, an array by its shape and dtype, anything else
    by its repr."""
    if isinstance(v, Tensor):
        return f"%{v.id}: {v.type}"
    if isinstance(v, np.ndarray):
        return f"ndarray(shape={v.shape}, dtype={v.dtype})"
    if isinstance(v, (list, tuple)) and any(isinstance(t, (Tensor, np.ndarray)) for t in v):
        return "[" + ", ".join(_describe(t) for t in v) + "]"
    return repr(v)


def format_call(op: str, operands: Sequence = (), attrs: dict | None = None) -> str:
    """``op(%0: f32[2,3], %1: f32[2,4], dim=0) at file:line``: an op call as the user wrote
    it, with the user's source line (the innermost frame outside meganeura)."""
    args = [_describe(v) for v in operands]
    args += [f"{k}={_describe(v)}" for k, v in (attrs or {}).items()]
    return f"{op}({', '.join(args)}) at {_user_location()}"


def op_error(
    op: str,
    operands: Sequence = (),
    attrs: dict | None = None,
    message: str = "",
    error: type[Exception] = GraphTypeError,
) -> Exception:
    """The error for arguments a user-facing function rejects before any node is added,
    worded as the builder words a type rule's failure: the function's name, the operands as
    the user passed them (Tensors with their types), its arguments, the user's line, then
    ``message``. A composite (``conv1d`` over ``conv2d``, ``embedding`` over
    ``index_select``) checks its arguments with this, so its errors speak of what the user
    wrote, not of the ops it lowers to.

    ``error`` is the class: GraphTypeError for shapes and dtypes, ValueError where a
    function documents one for a bad argument value (``padding="same"`` with a stride).
    """
    return error(f"{format_call(op, operands, attrs)}: {message}")


def check_fill_value(
    op: str, value, dtype: DType, operands: Sequence = (), name: str = "value"
) -> None:
    """Refuse a finite fill value that overflows ``dtype`` (1e39 for f32), as PyTorch's
    ``full``, ``masked_fill``, ``clamp`` and ``pad`` do ("value cannot be converted to type
    float without overflow", ``c10::checked_convert``). inf, -inf and NaN pass: they are what
    the user asked for. Arithmetic with such a scalar (``x * 1e39``) is not a fill: it gives
    inf, as in PyTorch.

    Raises:
        ValueError: naming ``op``, its operands, the value, the dtype's largest finite value
            and the user's line.
    """
    if not dtype.is_floating or isinstance(value, (bool, np.bool_)):
        return
    try:
        v = float(value)
    except (TypeError, ValueError):
        return  # not a number: the op's own checks word that
    top = float(np.finfo(dtype.numpy).max)
    if math.isfinite(v) and abs(v) > top:
        with np.errstate(over="ignore"):
            rounded = np.array(v, dtype.numpy)
        if not np.isfinite(rounded):
            raise op_error(
                op,
                operands,
                {name: value},
                f"{name} {v!r} cannot be converted to {dtype} without overflow (the largest "
                f"finite {dtype} is {top:.8g}); pass float('inf') for infinity, as PyTorch "
                "requires",
                ValueError,
            )


class GraphBuilder:
    """Appends typed nodes; ``build()`` returns the frozen Graph.

    Args:
        graph: optional graph to extend (autodiff and the optimizer append to a copy).

    Example:
        >>> g = GraphBuilder()
        >>> x = g.input("x", (64, 784))
        >>> w = g.parameter("w", (10, 784))
        >>> y = x @ w.T
    """

    def __init__(self, graph: Graph | None = None) -> None:
        self.nodes: list[Node] = list(graph.nodes) if graph is not None else []
        self.outputs: dict[str, int] = dict(graph.outputs) if graph is not None else {}
        self._names: dict[str, int] = {n.name: n.id for n in self.nodes if n.name is not None}
        self._constants: dict[tuple, int] = {}

    # ---- leaves -------------------------------------------------------------------------
    def _leaf(self, op: str, name: str, shape: Sequence[int], dtype: DType) -> Tensor:
        if not isinstance(name, str) or not name:
            raise ValueError(f"{op} name must be a non-empty string, got {name!r}")
        if name in self._names:
            prev = self.nodes[self._names[name]]
            raise ValueError(
                f"{op} name {name!r} at {_user_location()} already used by %{prev.id} "
                f"({prev.op}, {prev.loc})"
            )
        try:
            shape = tuple(int(s) for s in shape)
        except TypeError:
            raise TypeError(
                f"{op} {name!r}: shape must be a sequence of ints, got {shape!r}"
            ) from None
        t = TensorType(shape, dtype)
        node = Node(len(self.nodes), op, (), (), t, name, _user_location())
        self.nodes.append(node)
        self._names[name] = node.id
        return Tensor(self, node.id)

    def input(self, name: str, shape: Sequence[int], dtype: DType = f32) -> Tensor:
        """A value fed by the host before each step (a batch, labels, a learning rate)."""
        return self._leaf("input", name, shape, dtype)

    def parameter(self, name: str, shape: Sequence[int], dtype: DType = f32) -> Tensor:
        """A trainable tensor that persists across steps."""
        return self._leaf("parameter", name, shape, dtype)

    def state(self, name: str, shape: Sequence[int], dtype: DType = f32) -> Tensor:
        """A persistent, non-trainable tensor, zero at start (optimizer moments)."""
        return self._leaf("state", name, shape, dtype)

    def constant(self, value: float | int | bool, dtype: DType = f32) -> Tensor:
        """A scalar baked into the program (a float may be inf or NaN). Equal constants are
        shared."""
        if isinstance(value, (np.generic,)):
            value = value.item()
        if dtype.is_floating:
            value = float(value)  # inf and NaN too: kernels build them from their bits
        elif dtype is DType.bool:
            value = bool(value)
        else:
            value = int(value)
        key = (repr(value), dtype)  # repr keeps -0.0 apart from 0.0
        if key in self._constants:
            return Tensor(self, self._constants[key])
        node = Node(
            len(self.nodes),
            "constant",
            (),
            make_attrs({"value": value}),
            TensorType((), dtype),
            None,
            _user_location(),
        )
        self.nodes.append(node)
        self._constants[key] = node.id
        return Tensor(self, node.id)

    # ---- ops ----------------------------------------------------------------------------
    def add(
        self,
        op: str,
        inputs: Sequence[Tensor],
        attrs: dict[str, AttrValue] | None = None,
        *,
        origin: str = "",
    ) -> Tensor:
        """Append ``op(inputs, **attrs)`` after checking its type rule.

        ``origin`` names the user-facing function adding the node when it is not ``op``
        (``Node.origin``: ``embedding`` for its ``index_select``), so that later errors
        about the node (a token id out of range) speak of what the user called.

        Raises:
            GraphTypeError: when the type rule rejects the operands.
            KeyError: for an unknown op name.
        """
        from ..ops import OPS
        from ..ops.registry import ShapeError

        if op not in OPS:
            raise KeyError(f"unknown op {op!r}")
        d = OPS[op]
        inputs = [self._operand(op, t) for t in inputs]
        for t in inputs:
            if t.builder is not self:
                raise GraphTypeError(f"{op}: operand %{t.id} belongs to another graph")
        if d.arity is not None and len(inputs) != d.arity:
            raise GraphTypeError(f"{op} takes {d.arity} operands, got {len(inputs)}")
        attrs = dict(attrs or {})
        types = [self.nodes[t.id].type for t in inputs]
        try:
            out = d.infer(types, attrs)
        except ShapeError as e:
            raise op_error(op, inputs, attrs, str(e)) from None
        node = Node(
            len(self.nodes),
            op,
            tuple(t.id for t in inputs),
            make_attrs(attrs),
            out,
            None,
            _user_location(),
            origin,
        )
        self.nodes.append(node)
        return Tensor(self, node.id)

    def _operand(self, op: str, t) -> Tensor:
        if isinstance(t, Tensor):
            return t
        if isinstance(t, np.ndarray) or hasattr(t, "_shape"):
            from ..nn.tracing import lift  # NumPy constants and module tensors, while tracing

            try:
                return lift(t, self)
            except TypeError as e:
                raise GraphTypeError(f"{op} at {_user_location()}: {e}") from None
        raise GraphTypeError(f"{op}: operand {t!r} is not a Tensor")

    def output(self, name: str, tensor: Tensor) -> Tensor:
        """Name a value so it can be fetched after each step."""
        if tensor.builder is not self:
            raise GraphTypeError(f"output {name!r}: tensor belongs to another graph")
        if name in self.outputs and self.outputs[name] != tensor.id:
            raise ValueError(f"output name {name!r} already used")
        self.outputs[name] = tensor.id
        return tensor

    def tensor(self, node_id: int) -> Tensor:
        return Tensor(self, node_id)

    def build_unverified(self) -> Graph:
        """Freeze without the unused-input check (for passes that append to a graph)."""
        from .verify import verify

        g = Graph(tuple(self.nodes), tuple(self.outputs.items()))
        verify(g, allow_unused_inputs=True)
        return g

    def build(self) -> Graph:
        """Freeze into a Graph and verify it (raises GraphError on a broken invariant)."""
        from .verify import verify

        g = Graph(tuple(self.nodes), tuple(self.outputs.items()))
        verify(g)
        return g


@dataclass(frozen=True, eq=False)
class Tensor(TensorMethods):
    """A handle to one value of a graph under construction; its torch.Tensor methods and
    operators come from ``tensor_methods.TensorMethods``."""

    builder: GraphBuilder
    id: int

    @property
    def node(self) -> Node:
        return self.builder.nodes[self.id]

    @property
    def type(self) -> TensorType:
        return self.node.type

    @property
    def shape(self) -> tuple[int, ...]:
        return self.node.type.shape

    @property
    def dtype(self) -> DType:
        return self.node.type.dtype

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def __repr__(self) -> str:
        return f"Tensor(%{self.id}: {self.type})"

    def __bool__(self) -> bool:
        raise TypeError(
            f"the truth value of {self!r} is unknown while the graph is built: a traced tensor "
            "has a value only when the compiled program runs. Use where(cond, a, b) for a "
            "value-dependent choice, or pass a Python value as a static argument"
        )

    def __float__(self) -> float:
        raise TypeError(f"float() of {self!r}: a traced tensor has no value until the program runs")

    def __int__(self) -> int:
        raise TypeError(f"int() of {self!r}: a traced tensor has no value until the program runs")

    def __index__(self) -> int:
        raise TypeError(
            f"{self!r} used as a Python index or size: a traced tensor has no value until the "
            "program runs (index with an integer tensor: x[idx] or index_select)"
        )

    def __len__(self) -> int:
        if not self.shape:
            raise TypeError("len() of a 0-d tensor")
        return self.shape[0]

    def __iter__(self):
        raise TypeError(
            f"iterating over {self!r}: unbind it explicitly (x.unbind(0), x[i] for i in "
            "range(n)) or use split"
        )

    def numpy(self):
        raise TypeError(
            f".numpy() of {self!r}: a traced tensor has no value until the program runs; return "
            "it from forward and the compiled call gives a NumPy array"
        )

    def item(self):
        raise TypeError(f".item() of {self!r}: a traced tensor has no value until the program runs")

    def __array__(self, dtype=None, copy=None):
        raise TypeError(
            f"np.asarray({self!r}): a traced tensor has no value until the program runs; "
            "NumPy functions cannot act on it (use meganeura's ops)"
        )

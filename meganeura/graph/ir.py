"""The typed SSA IR: TensorType, Node and Graph, all frozen.

A Graph is an ordered tuple of Nodes; a node's id is its index and every input id is smaller
than the node's own, so list order is always a valid schedule (no cycles can be expressed).
Nodes are created only through the builder, which runs each op's type rule, so an ill-typed
graph cannot be constructed; ``verify`` re-checks these invariants for graphs made by passes.

Leaf ops: ``input`` (fed by the host each step), ``parameter`` (trainable, persistent),
``state`` (persistent, e.g. optimizer moments; zero-initialized), ``constant`` (a scalar
baked into the program). Ops with effects (optimizer updates) write some of their inputs in
place; they produce a token value of type u32[] that nothing reads, except the in-place ops of
``ALIAS_OPS`` (``index_copy_``): their value is the storage they wrote (operand 0's), a new
*version* of it that later readers name, so program order orders the write before them. A
graph may not read an older version of a storage after a newer one exists (``verify``).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ..dtypes import DType

AttrValue = int | float | bool | str | None | tuple


@dataclass(frozen=True)
class TensorType:
    """Shape and element type of a value. Shapes are static tuples of non-negative ints."""

    shape: tuple[int, ...]
    dtype: DType

    def __post_init__(self) -> None:
        if not isinstance(self.shape, tuple) or not all(
            isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in self.shape
        ):
            raise TypeError(f"shape must be a tuple of non-negative ints, got {self.shape!r}")
        if not isinstance(self.dtype, DType):
            raise TypeError(f"dtype must be a meganeura DType, got {self.dtype!r}")

    @property
    def ndim(self) -> int:
        return len(self.shape)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize

    def __str__(self) -> str:
        return f"{self.dtype}[{','.join(str(s) for s in self.shape)}]"


LEAF_OPS = frozenset({"input", "parameter", "state", "constant"})
# Ops whose value is their operand's storage reinterpreted (contiguous, row-major): no kernel.
VIEW_OPS = frozenset({"reshape", "stop_gradient"})
PERSISTENT_OPS = frozenset({"parameter", "state"})
# In-place ops whose value is operand 0's storage after their write: they run a kernel (unlike
# views) but own no buffer; readers of their value bind operand 0's buffer.
ALIAS_OPS = frozenset({"index_copy_"})
# Ops whose value is rows [start, start + length) of a leaf's storage, bound as that byte range
# of the leaf's buffer (``passes.split_bindings``): no kernel, and unlike a view a value of its
# own to code generation, which binds it in place of the (too large) leaf.
SUBRANGE_OPS = frozenset({"row_block"})
# Ops whose buffer holds their operands, each at its row offset (``passes.split_bindings``): no
# kernel; the operands' kernels write their rows of it in place (a concatenation elided).
PLACED_OPS = frozenset({"row_concat"})


@dataclass(frozen=True)
class Node:
    """One SSA value.

    Attributes:
        id: index of the node in its graph.
        op: name of the op (a key of ``meganeura.ops.OPS``).
        inputs: ids of operand nodes, all smaller than ``id``.
        attrs: op attributes as sorted (key, value) pairs; values are ints, floats, bools,
            strings, None or tuples of those.
        type: the result type.
        name: user-visible name of leaves (``"fc1.weight"``), else None.
        loc: ``file:line`` of the user code that created the node (for error messages).
        origin: the user-facing function that added the node when it is not the op itself
            (``"embedding"`` for its ``index_select``), else ``""``; like ``loc`` it only
            words error messages, so it takes no part in comparisons.
    """

    id: int
    op: str
    inputs: tuple[int, ...]
    attrs: tuple[tuple[str, AttrValue], ...]
    type: TensorType
    name: str | None = None
    loc: str = field(default="", compare=False)
    origin: str = field(default="", compare=False)

    def attr(self, key: str, default: AttrValue = None) -> AttrValue:
        for k, v in self.attrs:
            if k == key:
                return v
        return default

    @property
    def attr_dict(self) -> dict[str, AttrValue]:
        return dict(self.attrs)


def make_attrs(attrs: dict[str, AttrValue] | None) -> tuple[tuple[str, AttrValue], ...]:
    """Normalize an attribute dict into the sorted, hashable form stored in a Node."""
    if not attrs:
        return ()
    out = []
    for k, v in sorted(attrs.items()):
        if isinstance(v, list):
            v = tuple(v)
        out.append((k, v))
    return tuple(out)


@dataclass(frozen=True)
class Graph:
    """An ordered, typed SSA program.

    Attributes:
        nodes: all nodes; ``nodes[i].id == i``.
        outputs: named results, as (name, node id) pairs in declaration order.
    """

    nodes: tuple[Node, ...]
    outputs: tuple[tuple[str, int], ...] = ()

    def __len__(self) -> int:
        return len(self.nodes)

    def __getitem__(self, i: int) -> Node:
        return self.nodes[i]

    @property
    def output_dict(self) -> dict[str, int]:
        return dict(self.outputs)

    def leaves(self, op: str) -> list[Node]:
        """Leaf nodes of one kind (``"input"``, ``"parameter"``, ``"state"``) in order."""
        return [n for n in self.nodes if n.op == op]

    def find(self, name: str, op: str | None = None) -> Node:
        """The leaf called ``name``.

        Raises:
            KeyError: when no leaf has that name.
        """
        for n in self.nodes:
            if n.name == name and (op is None or n.op == op):
                return n
        raise KeyError(f"graph has no {op or 'leaf'} named {name!r}")

    def users(self) -> list[list[int]]:
        """For each node, the ids of the nodes that read it."""
        out: list[list[int]] = [[] for _ in self.nodes]
        for n in self.nodes:
            for i in n.inputs:
                out[i].append(n.id)
        return out

    def __str__(self) -> str:
        from .printer import format_graph

        return format_graph(self)


def resolve_view(graph: Graph, vid: int) -> int:
    """The id of the value whose storage ``vid`` reads: ``vid`` itself, or for a view
    (``VIEW_OPS``: ``reshape``, ``stop_gradient``) the value it reinterprets, and for an
    in-place write (``ALIAS_OPS``) the value it wrote, followed through chains of both.
    Scheduling, memory planning and code generation bind that value's buffer."""
    while graph[vid].op in VIEW_OPS or graph[vid].op in ALIAS_OPS:
        vid = graph[vid].inputs[0]
    return vid


def resolve_version(graph: Graph, vid: int) -> int:
    """The version of a storage that ``vid`` reads: ``resolve_view`` through views only, so an
    in-place write (``ALIAS_OPS``) is a version of its own."""
    while graph[vid].op in VIEW_OPS:
        vid = graph[vid].inputs[0]
    return vid

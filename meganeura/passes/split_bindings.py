"""Split values larger than one storage binding into row blocks.

WebGPU caps one storage binding at ``max_storage_buffer_binding_size`` (128 MiB on lavapipe and
in browsers, 2 GiB - 4 B on NVIDIA) while one buffer may be larger (``max_buffer_size``: 2 GiB
on lavapipe). SmolLM2-360M's tied embedding / LM head, f32[49152, 960], is 188 MB: it fits a
buffer but no binding. This pass rewrites the program so that no kernel binds a value larger
than the limit, after differentiation and the optimizer (so the backward pass and the update
are split too) and before scheduling.

Design:
  * A value is *big* when it is bound by kernels (not a constant, not a view) and its bytes
    exceed ``limit`` (``CompileOptions.max_storage_binding_bytes``, else the adapter's
    ``Limits.max_storage_buffer_binding_size``). Every big value is split along dim 0 into
    row blocks; all values with the same number of rows ``R`` share one partition, so blocks
    of a parameter, its gradient and its optimizer state line up. A block holds ``k`` rows,
    the largest count whose bytes fit ``limit`` for every big value of ``R`` rows and whose
    byte offset ``k * row_bytes`` is a multiple of ``min_storage_buffer_offset_alignment``
    for each value bound at offsets into one buffer (leaves, outputs); the last block takes
    the rest. Partitions are made on first use.
  * A big leaf (parameter, state, input) keeps one buffer; its blocks are ``row_block``
    aliases (``graph.ir.SUBRANGE_OPS``): values of their own to code generation, no kernel,
    bound by the assembler as the byte range ``[start * row_bytes, end * row_bytes)`` of the
    leaf's buffer. Optimizer updates write the leaf through them.
  * A big intermediate never exists whole: each block is its own SSA value (so blocks need no
    alignment, and the memory planner reuses their buffers as it does any value's). One with
    batch dims made by a matmul is kept as the row blocks of its 2-D flattening (``unflat``).
  * A big graph output is a ``row_concat`` of its blocks (``graph.ir.PLACED_OPS``): no
    kernel; the assembler places each block at its rows of the output's buffer, so the
    blocks' kernels write the output in place.
  * Each op that reads or makes a big value is rewritten per block by a rule:
      - elementwise maps (``codegen.wgsl.elementwise.maps.FUSIBLE``: unary, binary, ``where``,
        ``cast``, ``clamp``, ``broadcast_to``): the op per block; operands that broadcast
        along dim 0 are read whole, small operands with ``R`` rows are sliced;
      - ``index_select(x, idx, dim=0)`` (embedding): per block an ``index_select`` of
        ``clamp(idx, start, end - 1) - start``, merged in block order by ``where(idx >= start,
        ...)``: exact, one value per token;
      - ``index_select_backward`` (embedding backward, scatter-add): per block, the gradient
        rows of tokens outside the block are zeroed and the rest scattered into the block's
        rows: exact (each block adds the same terms in the same order, plus zeros);
      - ``matmul``: tiled by the blocks of its operands and output (``split_rules``): the tied
        LM head ``x @ W^T`` per block of W's rows (output columns, concatenated), contractions
        over a split dim as sums of per-block products, a big output per block of its rows;
      - ``cross_entropy`` and its backward over split logits (``split_rules``);
      - ops of rows (reductions, ``softmax``, ``log_softmax``, ``cumsum`` over dims other than
        0): per block; ``sum`` over dim 0 too, as partial sums added in block order;
      - optimizer updates (``sgd_update``, ``sgd_momentum_update``, ``adam_update``) and
        ``accumulate``: one update per block on the ``row_block`` aliases of the parameter and
        state; ``found_inf`` (the non-finite guard) reads the blocks, in chunks that respect
        the binding count, summed;
      - views: ``stop_gradient`` per block, ``reshape`` when it keeps dim 0 (or splits dim 0
        of a 2-D value into batch dims, and back).
    A block-split value that some other op must read whole is concatenated (``cat`` along
    dim 0) when the result fits one binding.
  * Anything else raises ``BindingSplitError`` naming the tensor, its size, the limit and the
    op that reads it: never a silently wrong program. Not split (today): norms, attention,
    reductions other than ``sum`` over dim 0, softmax over dim 0, ``gather``,
    ``index_select`` along another dim, batched matmuls with a big batched ``B``, views that
    move dim 0, rows larger than the limit.

``compile`` reads the label checks (token-id range checks) from the graph before this pass,
since the rewritten ``index_select``s read computed indices.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

from ..codegen.kernel import Limits
from ..dtypes import DType
from ..graph.ir import (
    LEAF_OPS,
    PLACED_OPS,
    SUBRANGE_OPS,
    VIEW_OPS,
    Graph,
    Node,
    TensorType,
    make_attrs,
    resolve_view,
)
from ..ops import OPS
from ..ops.registry import ShapeError
from . import split_rules
from .simplify import cse, dce

# Leaves that own a buffer whose row ranges can be bound at offsets.
_STORAGE_LEAVES = frozenset({"input", "parameter", "state"})
_UPDATES = frozenset({"sgd_update", "sgd_momentum_update", "adam_update", "accumulate"})
# Ops whose row i reads only row i of their operand when their dim(s) exclude 0.
_REDUCTIONS = ("sum", "mean", "amax", "amin", "max", "min", "argmax", "argmin", "var", "logsumexp")
_ROWWISE = frozenset({*_REDUCTIONS, "softmax", "log_softmax", "cumsum"})
SUPPORTED = (
    "elementwise maps, index_select/embedding along dim 0 and its backward, matmul/linear with "
    "a 2-D big operand, cross_entropy and its backward, reductions and softmax over dims but 0 "
    "(sum over any), optimizer updates, found_inf, stop_gradient, reshape keeping dim 0"
)


class BindingSplitError(ValueError):
    """A value larger than one storage binding is read by an op that cannot be split."""


def split_bindings(graph: Graph, limits: Limits) -> tuple[Graph, dict[int, int]]:
    """Rewrite ``graph`` so that no kernel binds more than one binding's bytes (see the module
    docstring).

    Args:
        graph: a verified graph (after autodiff, the optimizer, simplification and the storage
            plan).
        limits: ``max_storage_buffer_binding_size`` is the byte limit;
            ``min_storage_buffer_offset_alignment`` the alignment of block offsets;
            ``max_storage_buffers_per_shader_stage`` caps the bindings of the kernels made.

    Returns:
        (the rewritten graph, old node id -> new node id for the nodes kept as they were:
        leaves, and every node when nothing is split).

    Raises:
        BindingSplitError: a big value is read by an op this pass cannot split, is a graph
            output, or has rows too large for one block.
    """
    limit = limits.max_storage_buffer_binding_size
    big = {n.id for n in graph.nodes if _bound(n) and n.type.nbytes > limit}
    if not big:
        return graph, {n.id: n.id for n in graph.nodes}
    splitter = _Splitter(graph, limits, big)
    new_graph, kept = splitter.run()
    for rewrite in (cse, dce):
        new_graph, id_map = rewrite(new_graph)
        kept = {old: id_map[new] for old, new in kept.items() if new in id_map}
    check_bindings(new_graph, limit)
    return new_graph, kept


def _bound(n: Node) -> bool:
    return n.op not in VIEW_OPS and n.op != "constant" and n.type.numel > 0


def _label(n: Node) -> str:
    name = f" {n.name!r}" if n.name else ""
    return f"tensor %{n.id}{name} ({n.op}: {n.type}) of {n.type.nbytes} bytes"


def _where(n: Node) -> str:
    return f" at {n.loc}" if n.loc else ""


def check_bindings(graph: Graph, limit: int) -> None:
    """Raise BindingSplitError when a kernel of ``graph`` would bind a value of more than
    ``limit`` bytes (naming the value and the op whose kernel binds it)."""
    from ..codegen.wgsl import reads
    from ..schedule.schedule import needed_nodes

    needed = needed_nodes(graph)
    outputs = {v for _, v in graph.outputs}
    for n in graph.nodes:
        if not needed[n.id] or n.op in LEAF_OPS | VIEW_OPS | SUBRANGE_OPS | PLACED_OPS:
            continue
        own = () if OPS[n.op].writes else (n.id,)
        for v in (*reads(graph, n.id), *own):
            if graph[v].type.nbytes > limit:
                raise _refusal(graph[v], n, limit, output=v in outputs)


def _refusal(value: Node, op: Node | None, limit: int, output: bool = False, why: str = ""):
    if why:
        what = why
    elif op is None or (output and op.id == value.id):
        what = "it is a graph output, which is not written in row blocks"
    else:
        what = f"op {op.origin or op.op} %{op.id}{_where(op)} that reads it cannot be split"
    return BindingSplitError(
        f"{_label(value)}{_where(value)} is larger than one storage binding ({limit} bytes: "
        f"CompileOptions.max_storage_binding_bytes, else the adapter's "
        f"max_storage_buffer_binding_size) and {what}. Split by row blocks: {SUPPORTED} "
        f"(docs/bindings.md)."
    )


def row_partition(
    rows: int,
    row_bytes: Sequence[int],
    limit: int,
    align: int,
    aligned: Sequence[int] | None = None,
) -> tuple[tuple[int, int], ...]:
    """Row ranges ``(start, end)`` splitting ``rows`` rows so that a block of each row size in
    ``row_bytes`` fits ``limit`` bytes, and one of each size in ``aligned`` (default
    ``row_bytes``: the values bound at offsets into one buffer) starts at a multiple of
    ``align`` bytes.

    Raises:
        ValueError: no whole number of rows fits (a row, or the alignment step, is too large).
    """
    step = 1
    for rb in row_bytes if aligned is None else aligned:
        step = math.lcm(step, align // math.gcd(rb, align))
    most = min(limit // rb for rb in row_bytes)
    k = most // step * step
    if k < 1:
        raise ValueError(
            f"rows of {max(row_bytes)} bytes cannot be split into blocks of at most "
            f"{limit} bytes starting at multiples of {align} bytes (a block holds a multiple "
            f"of {step} rows)"
        )
    return tuple((s, min(s + k, rows)) for s in range(0, rows, k))


class _Splitter:
    def __init__(self, graph: Graph, limits: Limits, big: set[int]) -> None:
        self.g, self.limits, self.limit = graph, limits, limits.max_storage_buffer_binding_size
        self.big = big
        self.nodes: list[Node] = []
        self.new: dict[int, int] = {}  # old id -> new id of the whole value
        self.blocked: dict[int, list[int]] = {}  # old id -> new ids of its row blocks
        # old id of an N-d value -> new ids of the row blocks of its 2-D flattening [-1, last]
        self.unflat: dict[int, list[int]] = {}
        self.aliases: dict[tuple[int, int], int] = {}
        self.consts: dict[tuple, int] = {}
        self.output_roots = {resolve_view(graph, v) for _, v in graph.outputs}
        self.placed: set[int] = set()
        # Per row count: its big values' row bytes, and those of the values bound at offsets
        # into one buffer (leaves, and outputs, whose blocks are written in place).
        self.by_rows: dict[int, tuple[list[int], list[int]]] = {}
        for v in sorted(big):
            t = graph[v].type
            sizes, aligned = self.by_rows.setdefault(t.shape[0], ([], []))
            sizes.append(t.nbytes // t.shape[0])
            if graph[v].op in _STORAGE_LEAVES or v in self.output_roots:  # one buffer
                aligned.append(t.nbytes // t.shape[0])
        self._parts: dict[int, tuple[tuple[int, int], ...]] = {}

    def part(
        self, rows: int, row_bytes: int = 0, aligned: bool = False, value: Node | None = None
    ) -> tuple[tuple[int, int], ...]:
        """The row blocks of values of ``rows`` rows, made on first use (a big value that
        nothing splits, such as a transpose folded into a matmul, needs none). ``row_bytes``
        adds a value no big value of the graph stands for (a matmul's output with its batch
        dims flattened, ``value``), ``aligned`` when its blocks are placed in one buffer (an
        output)."""
        if rows not in self._parts:
            sizes, offsets = self.by_rows.setdefault(rows, ([], []))
            if row_bytes:
                sizes.append(row_bytes)
                offsets.extend([row_bytes] if aligned else [])
            sizes, aligned = self.by_rows[rows]
            align = self.limits.min_storage_buffer_offset_alignment
            try:
                self._parts[rows] = row_partition(rows, sizes, self.limit, align, aligned)
            except ValueError as e:
                v = next((v for v in sorted(self.big) if self.g[v].type.shape[0] == rows), None)
                why = f"its rows cannot be split: {e}"
                named = value if v is None else self.g[v]
                if named is None:  # pragma: no cover - every caller's rows have a value
                    raise BindingSplitError(f"{rows} rows: {why}") from None
                raise _refusal(named, None, self.limit, why=why) from None
        return self._parts[rows]

    # ---- emitting nodes ---------------------------------------------------------------------
    def emit(
        self, op: str, inputs: Sequence[int], attrs: dict, like: Node, dtype: DType | None = None
    ) -> int:
        """Append ``op``; a copy of ``like``'s op (a block of it) is stored as ``like`` is,
        else the result is typed by the op's rule (or ``dtype``)."""
        types = [self.nodes[i].type for i in inputs]
        try:
            t = OPS[op].infer(types, attrs)
        except ShapeError:
            # The fast mode's storage plan stores some operands as f16 while kernels compute
            # in f32 (passes.precision): such an op is typed as computed.
            t = OPS[op].infer([_computed(x) for x in types], attrs)
        floating = t.dtype.is_floating and like.type.dtype.is_floating
        if dtype is None and op == like.op and floating:
            dtype = like.type.dtype
        if dtype is not None:
            t = TensorType(t.shape, dtype)
        node = Node(len(self.nodes), op, tuple(inputs), make_attrs(attrs), t, None, like.loc)
        self.nodes.append(dataclasses.replace(node, origin=like.origin))
        return node.id

    def const(self, value, dtype: DType) -> int:
        key = (repr(value), dtype)
        if key not in self.consts:
            node = Node(len(self.nodes), "constant", (), make_attrs({"value": value}),
                        TensorType((), dtype))  # fmt: skip
            self.nodes.append(node)
            self.consts[key] = node.id
        return self.consts[key]

    def whole(self, v: int, consumer: Node) -> int:
        """The new id of old value ``v`` whole; a block-split value is concatenated."""
        if v in self.new:
            return self.new[v]
        if v in self.blocked and self.g[v].type.nbytes <= self.limit:
            self.new[v] = self.cat(self.blocked[v], 0, self.g[v])
            return self.new[v]
        if v in self.unflat and self.g[v].type.nbytes <= self.limit:
            flat = self.cat(self.unflat[v], 0, self.g[v])
            self.new[v] = self.emit("reshape", [flat], {"shape": self.g[v].type.shape}, consumer)
            return self.new[v]
        raise _refusal(self.g[v], consumer, self.limit)

    def cat(self, ids: list[int], dim: int, like: Node) -> int:
        """``cat`` of ``ids`` along ``dim``, as a tree when they exceed one kernel's bindings."""
        per = max(2, self.limits.max_storage_buffers_per_shader_stage - 1)
        while len(ids) > 1:
            ids = [
                ids[i] if len(ids[i : i + per]) == 1 else self.emit("cat", ids[i : i + per],
                                                                    {"dim": dim}, like)
                for i in range(0, len(ids), per)
            ]  # fmt: skip
        return ids[0]

    def add_all(self, ids: list[int], like: Node, dtype: DType | None = None) -> int:
        """The sum of ``ids`` in order; the last addition stored as ``dtype`` when given."""
        out = ids[0]
        for k, i in enumerate(ids[1:], 2):
            out = self.emit("add", [out, i], {}, like, dtype if k == len(ids) else None)
        return out

    def slice(self, v_new: int, dim: int, start: int, end: int, like: Node) -> int:
        shape = self.nodes[v_new].type.shape
        if start == 0 and end == shape[dim]:
            return v_new
        attrs = {
            "start": tuple(start if d == dim else 0 for d in range(len(shape))),
            "end": tuple(end if d == dim else s for d, s in enumerate(shape)),
            "step": (1,) * len(shape),
        }
        return self.emit("slice", [v_new], attrs, like)

    # ---- blocks of a value ------------------------------------------------------------------
    def splittable(self, v: int) -> bool:
        """Whether old value ``v`` has row blocks (split, or a big leaf that can be aliased)."""
        return v in self.blocked or (v in self.big and self.g[v].op in _STORAGE_LEAVES)

    def reaches(self, v: int) -> bool:
        """Whether old value ``v`` is split, or a transpose of a split value (a matmul reads
        it through the transpose)."""
        x = self.transposed(v)
        return self.splittable(v) or v in self.unflat or (x is not None and self.splittable(x))

    def block(self, v: int, b: int, rows: int, consumer: Node) -> int:
        """Rows ``part(rows)[b]`` of old value ``v`` (whose dim 0 has ``rows`` rows)."""
        if v in self.blocked:
            return self.blocked[v][b]
        start, end = self.part(rows)[b]
        n = self.g[v]
        if v in self.big and n.op in _STORAGE_LEAVES:
            key = (v, b)
            if key not in self.aliases:
                attrs = {"start": start, "length": end - start}
                self.aliases[key] = self.emit("row_block", [self.new[v]], attrs, n)
            return self.aliases[key]
        if resolve_view(self.g, v) in self.big:  # a big value with no blocks (a transpose)
            raise _refusal(n, consumer, self.limit)
        return self.slice(self.whole(v, consumer), 0, start, end, consumer)

    def blocks(self, v: int, consumer: Node) -> list[int]:
        rows = self.g[v].type.shape[0]
        return [self.block(v, b, rows, consumer) for b in range(len(self.part(rows)))]

    # ---- the walk ---------------------------------------------------------------------------
    def run(self) -> tuple[Graph, dict[int, int]]:
        for n in self.g.nodes:
            touched = n.id in self.big or any(self.reaches(i) for i in n.inputs)
            if n.op in LEAF_OPS or not touched:
                self.copy(n)
                continue
            rule = _RULES.get(n.op)
            if n.op in _ELEMENTWISE:
                rule = _Splitter.elementwise
            if rule is None or not rule(self, n):
                self.fallback(n)
        outputs = []
        for name, v in self.g.outputs:
            blocks = self.blocked.get(v, self.unflat.get(v))
            if v in self.new or self.g[v].type.nbytes <= self.limit or blocks is None:
                outputs.append((name, self.whole(v, self.g[v])))
            else:
                outputs.append((name, self.place(v, blocks)))
        kept = {n.id: self.new[n.id] for n in self.g.nodes if n.op in LEAF_OPS}
        return Graph(tuple(self.nodes), tuple(outputs)), kept

    def place(self, v: int, blocks: list[int]) -> int:
        """A big output made in row blocks: a ``row_concat`` whose buffer the blocks' kernels
        write in place, each at its rows (offsets aligned, as the partition ensures)."""
        align, off = self.limits.min_storage_buffer_offset_alignment, 0
        for blk in blocks:
            node = self.nodes[blk]
            stored = node.op not in LEAF_OPS | VIEW_OPS | SUBRANGE_OPS | PLACED_OPS
            if not stored or blk in self.placed or off % align:
                why = (
                    "its row blocks cannot be written in place into one output buffer (a "
                    "block is a view, shared, or at an unaligned offset)"
                )
                raise _refusal(self.g[v], None, self.limit, why=why)
            self.placed.add(blk)
            off += node.type.nbytes
        out = self.emit("row_concat", blocks, {}, self.g[v])
        if self.nodes[out].type.shape != self.g[v].type.shape:  # kept flat: batch dims back
            out = self.emit("reshape", [out], {"shape": self.g[v].type.shape}, self.g[v])
        return out

    def copy(self, n: Node) -> None:
        ins = tuple(self.whole(i, n) for i in n.inputs)
        self.new[n.id] = len(self.nodes)
        self.nodes.append(dataclasses.replace(n, id=len(self.nodes), inputs=ins))

    def fallback(self, n: Node) -> None:
        """An op with no rule: kept whole if its operands exist whole (a big leaf's permute
        may yet be folded into a matmul; ``check_bindings`` refuses what a kernel binds);
        a transpose of a split value is left for the matmul rule."""
        if n.op == "permute" and n.inputs[0] in self.blocked:
            return  # no whole value: only a matmul rule may read it (whole() refuses others)
        self.copy(n)

    # ---- rules: each returns True when it rewrote the node ----------------------------------
    def elementwise(self, n: Node) -> bool:
        out = n.type
        if out.ndim == 0 or out.shape[0] not in self.by_rows:
            return False
        rows = out.shape[0]
        split = [i for i in n.inputs if self.g[i].type.shape[:1] == (rows,) and self.splittable(i)]
        if n.id not in self.big and not split:
            return False  # e.g. an operand with batch dims kept flat: read whole, if it fits
        blocks = []
        for b, (start, end) in enumerate(self.part(rows)):
            ins = []
            for i in n.inputs:
                t = self.g[i].type
                if t.ndim == out.ndim and t.shape[0] == rows:
                    ins.append(self.block(i, b, rows, n))
                else:  # broadcast along dim 0: read whole
                    ins.append(self.whole(i, n))
            attrs = dict(n.attrs)
            if n.op == "broadcast_to":
                attrs["shape"] = (end - start, *tuple(attrs["shape"])[1:])
            blocks.append(self.emit(n.op, ins, attrs, n))
        self.blocked[n.id] = blocks
        return True

    def view(self, n: Node) -> bool:
        x, shape = n.inputs[0], n.type.shape
        if n.op == "reshape" and x in self.unflat:  # back to 2-D: the blocks as they are
            if len(shape) != 2 or shape[-1] != self.g[x].type.shape[-1]:
                return False
            self.blocked[n.id] = self.unflat[x]
            return True
        if not self.splittable(x):
            return False
        xt = self.g[x].type
        if n.op == "reshape" and x in self.blocked and xt.ndim == 2 and len(shape) > 2:
            if shape[-1] == xt.shape[-1]:  # dim 0 split into batch dims: kept flat
                self.unflat[n.id] = self.blocked[x]
                return True
        rows = xt.shape[0]
        if n.op == "reshape" and (not shape or shape[0] != rows):
            return False
        out = []
        for b, (start, end) in enumerate(self.part(rows)):
            attrs = {"shape": (end - start, *shape[1:])} if n.op == "reshape" else dict(n.attrs)
            out.append(self.emit(n.op, [self.block(x, b, rows, n)], attrs, n))
        self.blocked[n.id] = out
        return True

    def transposed(self, v: int) -> int | None:
        """The old id of ``x`` when old value ``v`` is ``permute(x, (1, 0))``, else None."""
        n = self.g[v]
        ok = n.op == "permute" and n.attr("dims") == (1, 0)
        return n.inputs[0] if ok else None

    def rowwise(self, n: Node) -> bool:
        """An op whose row ``i`` reads row ``i`` only (a reduction or softmax over other dims
        than 0) per block; ``sum`` over dim 0 too, as partial sums added in block order."""
        (x,) = n.inputs
        if not self.splittable(x):
            return False
        dims = n.attr("dims", (n.attr("dim"),))
        if 0 in dims and n.op != "sum":
            return False
        parts = [self.emit(n.op, [blk], dict(n.attrs), n) for blk in self.blocks(x, n)]
        if 0 in dims:
            self.new[n.id] = self.add_all(parts, n)
        else:
            self.blocked[n.id] = parts
        return True

    def update(self, n: Node) -> bool:
        """An effect op per block, on the ``row_block`` aliases of the leaves it writes."""
        writes = OPS[n.op].writes
        target = self.g[n.inputs[writes[0]]]
        for pos in writes:  # every written operand: a big leaf of the target's shape
            w = n.inputs[pos]
            if w not in self.big or self.g[w].op not in _STORAGE_LEAVES:
                return False
            if self.g[w].type.shape != target.type.shape:
                return False
        rows = target.type.shape[0]
        token = None
        for b in range(len(self.part(rows))):
            ins = [
                self.block(i, b, rows, n)
                if self.g[i].type.shape == target.type.shape
                else self.whole(i, n)
                for i in n.inputs
            ]
            token = self.emit(n.op, ins, dict(n.attrs), n)
        self.new[n.id] = token  # nothing reads an update's token
        return True

    def found_inf(self, n: Node) -> bool:
        parts: list[int] = []
        for i in n.inputs:
            parts.extend(self.blocks(i, n) if self.splittable(i) else [self.whole(i, n)])
        per = max(1, self.limits.max_storage_buffers_per_shader_stage - 1)
        checks = [
            self.emit("found_inf", parts[i : i + per], {}, n) for i in range(0, len(parts), per)
        ]
        self.new[n.id] = self.add_all(checks, n)
        return True


def _computed(t: TensorType) -> TensorType:
    """``t`` as kernels compute it: f16 storage widened to f32."""
    return TensorType(t.shape, DType.f32) if t.dtype is DType.f16 else t


def _elementwise_ops() -> frozenset[str]:
    from ..codegen.wgsl.elementwise.maps import FUSIBLE

    return frozenset(FUSIBLE)


_ELEMENTWISE = _elementwise_ops()
_RULES = {
    "index_select": split_rules.index_select,
    "index_select_backward": split_rules.index_select_backward,
    "matmul": split_rules.matmul,
    "cross_entropy": split_rules.cross_entropy,
    "cross_entropy_backward": split_rules.cross_entropy_backward,
    **{op: _Splitter.rowwise for op in _ROWWISE},
    "found_inf": _Splitter.found_inf,
    "reshape": _Splitter.view,
    "stop_gradient": _Splitter.view,
    **{op: _Splitter.update for op in _UPDATES},
}

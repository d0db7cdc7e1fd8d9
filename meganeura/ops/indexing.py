"""Shape and indexing ops: strided slices and ``Tensor.__getitem__``, constant padding,
concatenation, split, squeeze/unsqueeze (free reshapes); the integer-index gathers live in
``gather`` and their DEFS are appended to this family's.

IR ops (canonical attrs, normalized by the functions below; dims are non-negative):
  * ``slice``: attrs ``start``, ``end``, ``step``, one int per dim (``0 <= start < end <=
    size``, ``step >= 1``, ``end`` = last element read + 1); ``slice_backward`` scatters the
    gradient into zeros of ``shape`` (PyTorch's aten::slice_backward, all dims at once).
  * ``pad``: attrs ``pad`` = one (before, after) pair per dim, in dim order (the PyTorch
    argument lists the last dim first), negative pairs crop; ``value`` a finite float.
    Its gradient is ``pad`` with the pairs negated: exact for any mix of signs.
  * ``cat``: variadic, attr ``dim``; operands agree on every other dim and on dtype.
  * ``gather``, ``index_select`` and their backward ops: see ``gather``.
  * ``row_block``: attrs ``start``, ``length``: rows ``[start, start + length)`` of dim 0,
    an alias of that byte range of its operand's buffer (``graph.ir.SUBRANGE_OPS``), made only
    by ``passes.split_bindings`` after differentiation (no gradient rule, no kernel).
  * ``row_concat``: variadic, ``cat`` along dim 0 whose operands are written in place into
    its buffer (``graph.ir.PLACED_OPS``; a graph output of ``passes.split_bindings``).

Empty slices and empty operands are rejected when the graph is built: meganeura has no use
for zero-size intermediate tensors, and an empty operand has no buffer to bind.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from ..graph.builder import Tensor, check_fill_value, op_error
from ..graph.ir import TensorType
from . import functional as F
from . import gather
from .gather import check_dim
from .registry import OpDef, ShapeError


def slice_length(start: int, end: int, step: int) -> int:
    return -(-(end - start) // step)


# ---- slice ----------------------------------------------------------------------------------
def _check_slice(shape, attrs) -> tuple[int, ...]:
    start, end, step = attrs["start"], attrs["end"], attrs["step"]
    n = len(shape)
    if not (len(start) == len(end) == len(step) == n):
        raise ShapeError(
            f"start/end/step need one entry per dim ({n}), got {len(start)}/{len(end)}/{len(step)}"
        )
    out = []
    for d, (s, e, k, size) in enumerate(zip(start, end, step, shape)):
        if k < 1:
            raise ShapeError(f"dim {d}: step must be >= 1, got {k}")
        if not 0 <= s <= size or not 0 <= e <= size:
            raise ShapeError(f"dim {d}: start {s} / end {e} outside [0, {size}]")
        if s >= e:
            raise ShapeError(
                f"dim {d}: slice [{s}:{e}:{k}] of size {size} is empty; empty tensors are not "
                f"supported"
            )
        out.append(slice_length(s, e, k))
    return tuple(out)


def _slice_type(types, attrs):
    (x,) = types
    return TensorType(_check_slice(x.shape, attrs), x.dtype)


def _slice_backward_type(types, attrs):
    (g,) = types
    shape = tuple(attrs["shape"])
    want = _check_slice(shape, {**attrs, "end": tuple(shape)})
    if not g.dtype.is_floating:
        raise ShapeError(f"gradient must be floating, got {g}")
    if len(want) != g.ndim or any(gs > w for gs, w in zip(g.shape, want)) or g.numel == 0:
        raise ShapeError(f"gradient shape {list(g.shape)} does not fit a slice of {list(shape)}")
    return TensorType(shape, g.dtype)


def _index_tuple(start, length, step):
    return tuple(builtins.slice(s, s + (n - 1) * k + 1, k) for s, n, k in zip(start, length, step))


def _slice_np(xs, a):
    (x,) = xs
    key = tuple(builtins.slice(s, e, k) for s, e, k in zip(a["start"], a["end"], a["step"]))
    return np.ascontiguousarray(x[key])


def _slice_backward_np(xs, a):
    (g,) = xs
    out = np.zeros(a["shape"], g.dtype)
    out[_index_tuple(a["start"], g.shape, a["step"])] = g
    return out


def _slice_grad(node, i, o, g):
    attrs = {"shape": i[0].shape, "start": node.attr("start"), "step": node.attr("step")}
    return (g.builder.add("slice_backward", [g], attrs),)


def _slice_backward_grad(node, i, o, g):
    start, step = node.attr("start"), node.attr("step")
    end = tuple(s + (n - 1) * k + 1 for s, n, k in zip(start, i[0].shape, step))
    return (g.builder.add("slice", [g], {"start": start, "end": end, "step": step}),)


# ---- pad --------------------------------------------------------------------------------------
def _pad_type(types, attrs):
    (x,) = types
    pad, value = attrs["pad"], attrs["value"]
    if len(pad) != x.ndim or any(len(p) != 2 for p in pad):
        raise ShapeError(f"pad needs one (before, after) pair per dim ({x.ndim}), got {pad}")
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ShapeError(f"pad value must be a number, got {value!r}")
    if not math.isfinite(value) and not x.dtype.is_floating:
        raise ShapeError(f"pad value {value} does not fit {x.dtype.name} (an integer tensor)")
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, pad))
    if any(s < 0 for s in shape):
        raise ShapeError(f"padding {list(pad)} crops {list(x.shape)} below zero: {list(shape)}")
    if x.numel == 0 and math.prod(shape):
        raise ShapeError(f"cannot pad an empty tensor {x}; build the constant with broadcast_to")
    return TensorType(shape, x.dtype)


def _pad_np(xs, a):
    (x,) = xs
    shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, a["pad"]))
    out = np.full(shape, a["value"], dtype=x.dtype)
    dst = [(max(0, lo), min(n, lo + s)) for n, s, (lo, _) in zip(shape, x.shape, a["pad"])]
    if all(e > b for b, e in dst):
        src = tuple(builtins.slice(b - lo, e - lo) for (b, e), (lo, _) in zip(dst, a["pad"]))
        out[tuple(builtins.slice(b, e) for b, e in dst)] = x[src]
    return out


def _pad_grad(node, i, o, g):
    if g.type.numel == 0 or i[0].type.numel == 0:
        return (None,)
    neg = tuple((-lo, -hi) for lo, hi in node.attr("pad"))
    return (g.builder.add("pad", [g], {"pad": neg, "value": 0.0}),)


# ---- cat --------------------------------------------------------------------------------------
def cat_shape(types, dim: int) -> tuple[int, ...]:
    """Result shape of concatenating ``types`` along ``dim``; ShapeError names the mismatch."""
    if not types:
        raise ShapeError("cat needs at least one tensor")
    first = types[0]
    check_dim(dim, first.ndim)
    total = 0
    for k, t in enumerate(types):
        if t.dtype is not first.dtype:
            raise ShapeError(
                f"operand {k} has dtype {t.dtype}, operand 0 {first.dtype}; cat needs one dtype"
            )
        if t.ndim != first.ndim:
            raise ShapeError(
                f"operand {k} has {t.ndim} dims {list(t.shape)}, operand 0 has {first.ndim} "
                f"{list(first.shape)}; cat needs the same number of dims"
            )
        if any(a != b for d, (a, b) in enumerate(zip(t.shape, first.shape)) if d != dim):
            want = ", ".join("*" if d == dim else str(n) for d, n in enumerate(first.shape))
            raise ShapeError(
                f"operand {k} has shape {list(t.shape)} where [{want}] is expected: every dim "
                f"but dim {dim} must equal operand 0's {list(first.shape)}"
            )
        total += t.shape[dim]
    return first.shape[:dim] + (total,) + first.shape[dim + 1 :]


def _cat_type(types, attrs):
    shape = cat_shape(types, attrs["dim"])
    if math.prod(shape) and any(t.numel == 0 for t in types):
        raise ShapeError("cat of an empty operand with non-empty ones; drop it (F.cat does)")
    return TensorType(shape, types[0].dtype)


def _cat_grad(node, i, o, g):
    dim, off, out = node.attr("dim"), 0, []
    for t in i:
        n = t.shape[dim]
        start = tuple(off if d == dim else 0 for d in range(g.ndim))
        end = tuple(off + n if d == dim else s for d, s in enumerate(g.shape))
        step = (1,) * g.ndim
        out.append(g.builder.add("slice", [g], {"start": start, "end": end, "step": step}))
        off += n
    return tuple(out)


# ---- row_block --------------------------------------------------------------------------------
def _row_block_type(types, attrs):
    (x,) = types
    start, length = attrs["start"], attrs["length"]
    if x.ndim < 1:
        raise ShapeError(f"row_block needs a tensor of at least 1 dim, got {x}")
    if not (isinstance(start, int) and isinstance(length, int)):
        raise ShapeError(f"start and length must be ints, got {start!r} and {length!r}")
    if start < 0 or length < 1 or start + length > x.shape[0]:
        raise ShapeError(f"rows [{start}, {start + length}) are not within dim 0 of {x}")
    return TensorType((length,) + x.shape[1:], x.dtype)


def _row_block_np(xs, a):
    # A copy: the interpreter writes effect ops' results back into the leaf (``interpret``).
    return np.array(xs[0][a["start"] : a["start"] + a["length"]], copy=True)


def _row_concat_type(types, attrs):
    if any(t.ndim == 0 for t in types):
        raise ShapeError("row_concat needs tensors of at least 1 dim")
    return TensorType(cat_shape(types, 0), types[0].dtype)


DEFS = [
    OpDef("slice", _slice_type, _slice_np, _slice_grad, arity=1),
    OpDef(
        "slice_backward", _slice_backward_type, _slice_backward_np, _slice_backward_grad, arity=1
    ),
    OpDef("pad", _pad_type, _pad_np, _pad_grad, arity=1),
    OpDef("cat", _cat_type, lambda xs, a: np.concatenate(xs, a["dim"]), _cat_grad),
    # Made after autodiff only (passes.split_bindings), so it needs no gradient rule.
    OpDef("row_block", _row_block_type, _row_block_np, differentiable=False, arity=1),
    OpDef(
        "row_concat", _row_concat_type, lambda xs, a: np.concatenate(xs, 0), differentiable=False
    ),
    *gather.DEFS,
]


# ---- user-facing functions ----------------------------------------------------------------------
def _dim(dim: int, ndim: int, fn: str, x: Tensor | Sequence[Tensor], extra: int = 0) -> int:
    """``dim`` normalized into ``[0, ndim + extra)``; otherwise a GraphTypeError naming
    ``fn``, its operand ``x`` (a tensor or the list ``cat`` got) and the user's line."""
    n = ndim + extra
    if not isinstance(dim, (int, np.integer)) or not -n <= dim < max(n, 1) or n == 0:
        raise op_error(
            fn, [x], {"dim": dim}, f"dim {dim!r} out of range: expected {-n} <= dim < {n}"
        )
    return int(dim) % n


def _slice_dims(x: Tensor, ranges: dict[int, tuple[int, int, int]]) -> Tensor:
    """One ``slice`` node taking ``(start, end, step)`` (Python-normalized) on some dims."""
    start, end, step = [0] * x.ndim, list(x.shape), [1] * x.ndim
    for d, (s, e, k) in ranges.items():
        n = slice_length(s, e, k) if e > s else 0
        start[d], end[d], step[d] = s, (s + (n - 1) * k + 1 if n else e), k
    if start == [0] * x.ndim and end == list(x.shape) and step == [1] * x.ndim:
        return x
    attrs = {"start": tuple(start), "end": tuple(end), "step": tuple(step)}
    return x.builder.add("slice", [x], attrs)


def slice(x: Tensor, dim: int = 0, start=None, end=None, step: int = 1) -> Tensor:  # noqa: A001
    """``x`` restricted to ``start:end:step`` along ``dim`` (``aten::slice``; Python's rules).

    Args:
        x: any dtype, at least 1-D.
        dim: the sliced dim; negative counts from the end.
        start, end: None, or ints (negative ones count from the end; clamped to the size).
        step: a positive int.

    Returns:
        Same dtype, ``ceil((end - start) / step)`` elements along ``dim``.

    Raises:
        GraphTypeError: for a dim out of range or an empty result.
        ValueError: for a step < 1.
    """
    d = _dim(dim, x.ndim, "slice", x)
    if step < 1:
        raise ValueError(f"slice({x!r}): step must be positive, got {step}")
    return _slice_dims(x, {d: builtins.slice(start, end, step).indices(x.shape[d])})


def narrow(x: Tensor, dim: int, start: int, length: int) -> Tensor:
    """``length`` elements of ``x`` from ``start`` along ``dim`` (torch.narrow).

    Raises:
        GraphTypeError: for a dim out of range; IndexError when the range leaves the dim.
    """
    d = _dim(dim, x.ndim, "narrow", x)
    n = x.shape[d]
    s = start + n if start < 0 else start
    if not 0 <= s <= n or length < 0 or s + length > n:
        raise IndexError(f"narrow({x!r}, {dim}, {start}, {length}): outside dim of size {n}")
    return _slice_dims(x, {d: (s, s + length, 1)})


def select(x: Tensor, dim: int, index: int) -> Tensor:
    """``x`` at ``index`` along ``dim``, that dim removed (torch.select)."""
    d = _dim(dim, x.ndim, "select", x)
    n = x.shape[d]
    if not -n <= index < n:
        raise IndexError(f"select({x!r}, {dim}, {index}): index out of range for size {n}")
    i = index % n
    return F.reshape(_slice_dims(x, {d: (i, i + 1, 1)}), x.shape[:d] + x.shape[d + 1 :])


def index(x: Tensor, key) -> Tensor:
    """``x[key]`` with PyTorch's rules, for ``Tensor.__getitem__``.

    Supports ints (negative ones count from the end), slices with positive steps, ``...``,
    ``None`` (a new dim of size 1) and at most one integer Tensor (its values select along
    that dim, its shape replacing the dim, like ``index_select``). All the basic parts become
    one ``slice`` node and a free reshape.

    Raises:
        IndexError: for too many indices or an int out of range.
        ValueError: for a step < 1; NotImplementedError: for bool masks or several Tensors.
        GraphTypeError: for an empty result.
    """
    from .gather import index_select

    key = key if isinstance(key, tuple) else (key,)
    consumed = sum(1 for k in key if k is not None and k is not Ellipsis)
    if sum(1 for k in key if k is Ellipsis) > 1:
        raise IndexError("an index can only have a single ellipsis ('...')")
    if consumed > x.ndim:
        raise IndexError(f"too many indices for {x!r}: {consumed} for {x.ndim} dims")
    fill = (builtins.slice(None),) * (x.ndim - consumed)
    if Ellipsis in key:
        at = next(i for i, k in enumerate(key) if k is Ellipsis)
        key = key[:at] + fill + key[at + 1 :]
    else:
        key = key + fill
    ranges, shape, tensor, d = {}, [], None, 0
    for k in key:
        if k is None:
            shape.append(1)
            continue
        n = x.shape[d]
        if isinstance(k, Tensor):
            if not k.dtype.is_integer or tensor is not None:
                raise NotImplementedError(
                    f"index of {x!r}: only one integer Tensor index is supported, got {k!r}"
                )
            tensor = (d, k)
            shape.extend(k.shape)
        elif isinstance(k, builtins.slice):
            if k.step is not None and k.step < 1:
                raise ValueError(f"index of {x!r}: slice step must be positive, got {k.step}")
            ranges[d] = k.indices(n)
            shape.append(slice_length(*ranges[d]) if ranges[d][1] > ranges[d][0] else 0)
        elif isinstance(k, (int, np.integer)) and not isinstance(k, bool):
            if not -n <= k < n:
                raise IndexError(f"index {k} is out of bounds for dim {d} of {x!r}")
            ranges[d] = (int(k) % n, int(k) % n + 1, 1)
        else:
            raise NotImplementedError(f"index of {x!r}: unsupported key {k!r}")
        d += 1
    y = _slice_dims(x, ranges)
    if tensor is not None:
        y = index_select(y, tensor[0], F.reshape(tensor[1], (tensor[1].type.numel,)))
    return F.reshape(y, tuple(shape))


def cat(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Concatenate tensors of one dtype along ``dim`` (torch.cat).

    All operands have the same number of dims and agree on every dim but ``dim``. Operands
    with no elements are dropped (their gradient is empty anyway).

    Raises:
        GraphTypeError: for no tensors, a dim out of range, mixed dtypes or mismatched shapes,
            naming ``cat``, every operand's type, the dim and the caller's line, then the
            operand at fault with its shape and the expected one.
    """
    tensors = _operands("cat", tensors, dim)
    d = _dim(dim, tensors[0].ndim, "cat", tensors)
    try:
        cat_shape([t.type for t in tensors], d)
    except ShapeError as e:
        raise op_error("cat", [tensors], {"dim": dim}, str(e)) from None
    kept = [t for t in tensors if t.type.numel] or tensors[:1]
    if len(kept) == 1 and kept[0].shape[d] == sum(t.shape[d] for t in tensors):
        return kept[0]
    return kept[0].builder.add("cat", kept, {"dim": d})


def _operands(fn: str, tensors: Sequence[Tensor], dim) -> list[Tensor]:
    """``tensors`` as a non-empty list of Tensors of one graph, else a GraphTypeError."""
    tensors = list(tensors)
    if not tensors:
        raise op_error(fn, [tensors], {"dim": dim}, "needs at least one tensor")
    for k, t in enumerate(tensors):
        if not isinstance(t, Tensor):
            raise op_error(fn, [tensors], {"dim": dim}, f"operand {k} is not a Tensor: {t!r}")
        if t.builder is not tensors[0].builder:
            raise op_error(fn, [tensors], {"dim": dim}, f"operand {k} belongs to another graph")
    return tensors


def stack(tensors: Sequence[Tensor], dim: int = 0) -> Tensor:
    """Join same-shape tensors along a new dim (torch.stack).

    Raises:
        GraphTypeError: for no tensors, a dim out of range, or tensors of different shapes or
            dtypes (naming ``stack``, every operand's type, the dim and the caller's line).
    """
    tensors = _operands("stack", tensors, dim)
    d = _dim(dim, tensors[0].ndim, "stack", tensors, extra=1)
    first = tensors[0].type
    for k, t in enumerate(tensors):
        if t.type != first:
            raise op_error(
                "stack",
                [tensors],
                {"dim": dim},
                f"operand {k} is {t.type}, operand 0 {first}; stack needs one shape and dtype",
            )
    return cat([unsqueeze(t, d) for t in tensors], d)


def split(x: Tensor, split_size_or_sections: int | Sequence[int], dim: int = 0):
    """Pieces of ``x`` along ``dim`` (torch.split): of ``split_size_or_sections`` elements
    each (the last may be smaller) when it is an int, else of the listed sizes.

    Returns:
        A tuple of tensors (``slice`` nodes).

    Raises:
        GraphTypeError: for a dim out of range, a split size below 1, or sections that do
            not add up to the dim's size or include an empty one.
    """
    d = _dim(dim, x.ndim, "split", x)
    n = x.shape[d]
    args = {"split_size_or_sections": split_size_or_sections, "dim": dim}
    if isinstance(split_size_or_sections, (int, np.integer)):
        size = int(split_size_or_sections)
        if size < 1:
            raise op_error("split", [x], args, f"split size must be positive, got {size}")
        sizes = [min(size, n - s) for s in range(0, n, size)]
    else:
        sizes = [int(s) for s in split_size_or_sections]
        if sum(sizes) != n or min(sizes, default=1) < 1:
            raise op_error(
                "split",
                [x],
                args,
                f"sections {sizes} must be positive and sum to {n}, the size of dim {d}",
            )
    out, off = [], 0
    for s in sizes:
        out.append(_slice_dims(x, {d: (off, off + s, 1)}))
        off += s
    return tuple(out)


def chunk(x: Tensor, chunks: int, dim: int = 0):
    """At most ``chunks`` pieces of ``ceil(size / chunks)`` elements (torch.chunk)."""
    d = _dim(dim, x.ndim, "chunk", x)
    if chunks < 1:
        raise op_error("chunk", [x], {"chunks": chunks, "dim": dim}, "chunks must be positive")
    return split(x, max(1, -(-x.shape[d] // chunks)), d)


def pad(x: Tensor, pad: Sequence[int], mode: str = "constant", value: float | None = None):
    """Constant padding, as torch.nn.functional.pad: ``pad`` lists (before, after) pairs
    starting from the LAST dim; negative amounts crop.

    Args:
        x: any dtype.
        pad: an even number of ints, at most two per dim.
        mode: only ``"constant"``.
        value: the fill (default 0); inf, -inf and NaN too.

    Raises:
        GraphTypeError: for an odd or too long ``pad``, or a dim cropped below zero.
        ValueError: a finite ``value`` beyond ``x``'s dtype's range (1e39 for f32), as
            PyTorch refuses it (``check_fill_value``).
        NotImplementedError: for other modes.
    """
    if mode != "constant":
        raise NotImplementedError(f"pad mode {mode!r}: only 'constant' is implemented")
    pad = [int(p) for p in pad]
    if len(pad) % 2 or len(pad) > 2 * x.ndim:
        raise op_error(
            "pad", [x], {"pad": pad}, f"needs an even number of ints, at most {2 * x.ndim}"
        )
    pairs = [(0, 0)] * x.ndim
    for k in range(len(pad) // 2):
        pairs[x.ndim - 1 - k] = (pad[2 * k], pad[2 * k + 1])
    value = 0.0 if value is None else float(value)
    check_fill_value("pad", value, x.dtype, [x])
    if all(p == (0, 0) for p in pairs):
        return x
    if x.type.numel == 0:
        shape = tuple(s + lo + hi for s, (lo, hi) in zip(x.shape, pairs))
        return F.broadcast_to(x.builder.constant(value, x.dtype), shape)
    return x.builder.add("pad", [x], {"pad": tuple(pairs), "value": value})


def squeeze(x: Tensor, dim: int | Sequence[int] | None = None) -> Tensor:
    """Remove size-1 dims (all of them, or those of ``dim`` that have size 1): a free view."""
    if dim is None:
        dims = set(range(x.ndim))
    else:
        dims = {_dim(d, x.ndim, "squeeze", x) for d in ((dim,) if isinstance(dim, int) else dim)}
    return F.reshape(x, tuple(s for d, s in enumerate(x.shape) if not (d in dims and s == 1)))


def unsqueeze(x: Tensor, dim: int) -> Tensor:
    """A new size-1 dim at ``dim`` (in ``[-ndim - 1, ndim]``): a free view."""
    d = _dim(dim, x.ndim, "unsqueeze", x, extra=1)
    return F.reshape(x, x.shape[:d] + (1,) + x.shape[d:])

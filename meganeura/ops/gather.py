"""Gathers by integer index: ``gather`` (torch.gather / take_along_dim), ``index_select`` and
``embedding`` (an ``index_select`` of weight rows), with their scatter-add backward ops.

Index tensors are i32 or u32; values must lie in ``[0, size)`` of the indexed dim. The NumPy
references raise IndexError otherwise; the GPU kernels never read out of bounds: an index
out of range reads as zero and contributes no gradient. ``gather_backward`` and
``index_select_backward`` add the contributions of repeated indices in a fixed order (no
float atomics), so their results are deterministic run to run.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor, op_error
from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def check_dim(dim: int, ndim: int, what: str = "dim") -> None:
    """Raise ShapeError when ``dim`` (already normalized) is not in ``[0, ndim)``."""
    if not isinstance(dim, int) or not 0 <= dim < ndim:
        raise ShapeError(f"{what} {dim!r} out of range: expected 0 <= {what} < {ndim}")


def check_index(t: TensorType, what: str = "index") -> None:
    if not t.dtype.is_integer:
        raise ShapeError(f"{what} must be an integer tensor (i32 or u32), got {t}")


# ---- gather / index_select ----------------------------------------------------------------------
def _gather_common(x: TensorType, index: TensorType, dim: int) -> None:
    check_index(index)
    check_dim(dim, x.ndim)
    if index.ndim != x.ndim:
        raise ShapeError(f"index must have as many dims as the input ({x.ndim}), got {index}")
    for d, (a, b) in enumerate(zip(index.shape, x.shape)):
        if d != dim and a > b:
            raise ShapeError(
                f"index size {a} exceeds the input's {b} at dim {d} (expected index.shape[d] "
                f"<= input.shape[d] for d != dim)"
            )
    if x.shape[dim] == 0 and index.numel:
        raise ShapeError(f"cannot index the empty dim {dim} of {x}")


def _gather_type(types, attrs):
    x, index = types
    _gather_common(x, index, attrs["dim"])
    return TensorType(index.shape, x.dtype)


def _gather_backward_type(types, attrs):
    g, index = types
    shape = tuple(attrs["shape"])
    _gather_common(TensorType(shape, g.dtype), index, attrs["dim"])
    if g.shape != index.shape or not g.dtype.is_floating:
        raise ShapeError(f"gradient must be floating with the index's shape {index.shape}: {g}")
    return TensorType(shape, g.dtype)


def _check_range(index: np.ndarray, size: int) -> None:
    bad = (index < 0) | (index >= size)
    if bad.any():
        raise IndexError(f"index {index[bad].flat[0]} out of range for a dim of size {size}")


def _gather_coords(index: np.ndarray, dim: int) -> tuple:
    coords = list(np.indices(index.shape, sparse=True))
    coords[dim] = index.astype(np.int64)
    return tuple(coords)


def _gather_np(xs, a):
    x, index = xs
    _check_range(index, x.shape[a["dim"]])
    return x[_gather_coords(index, a["dim"])]


def _gather_backward_np(xs, a):
    g, index = xs
    _check_range(index, a["shape"][a["dim"]])
    out = np.zeros(a["shape"], g.dtype)
    np.add.at(out, _gather_coords(index, a["dim"]), g)
    return out


def _gather_grad(node, i, o, g):
    attrs = {"dim": node.attr("dim"), "shape": i[0].shape}
    if g.type.numel == 0:
        return (None, None)
    return (g.builder.add("gather_backward", [g, i[1]], attrs), None)


def _gather_backward_grad(node, i, o, g):
    return (g.builder.add("gather", [g, i[1]], {"dim": node.attr("dim")}), None)


def _index_select_type(types, attrs):
    x, index = types
    dim = attrs["dim"]
    check_index(index)
    check_dim(dim, x.ndim)
    if index.ndim != 1:
        raise ShapeError(f"index must be 1-D, got {index}")
    if x.shape[dim] == 0 and index.numel:
        raise ShapeError(f"cannot index the empty dim {dim} of {x}")
    return TensorType(x.shape[:dim] + index.shape + x.shape[dim + 1 :], x.dtype)


def _index_select_backward_type(types, attrs):
    g, index = types
    dim, size = attrs["dim"], attrs["size"]
    check_index(index)
    check_dim(dim, g.ndim)
    if index.ndim != 1 or g.shape[dim] != index.shape[0] or not g.dtype.is_floating:
        raise ShapeError(f"expected a floating gradient with {index.shape} at dim {dim}, got {g}")
    if not isinstance(size, int) or size < 1:
        raise ShapeError(f"size must be a positive int, got {size!r}")
    return TensorType(g.shape[:dim] + (size,) + g.shape[dim + 1 :], g.dtype)


def _index_select_np(xs, a):
    x, index = xs
    _check_range(index, x.shape[a["dim"]])
    return np.take(x, index.astype(np.int64), axis=a["dim"])


def _index_select_backward_np(xs, a):
    g, index = xs
    dim, size = a["dim"], a["size"]
    _check_range(index, size)
    out = np.zeros(g.shape[:dim] + (size,) + g.shape[dim + 1 :], g.dtype)
    np.add.at(np.moveaxis(out, dim, 0), index.astype(np.int64), np.moveaxis(g, dim, 0))
    return out


def _index_select_grad(node, i, o, g):
    dim = node.attr("dim")
    if g.type.numel == 0:
        return (None, None)
    attrs = {"dim": dim, "size": i[0].shape[dim]}
    return (g.builder.add("index_select_backward", [g, i[1]], attrs), None)


def _index_select_backward_grad(node, i, o, g):
    return (g.builder.add("index_select", [g, i[1]], {"dim": node.attr("dim")}), None)


DEFS = [
    OpDef("gather", _gather_type, _gather_np, _gather_grad, arity=2),
    OpDef(
        "gather_backward",
        _gather_backward_type,
        _gather_backward_np,
        _gather_backward_grad,
        arity=2,
    ),
    OpDef("index_select", _index_select_type, _index_select_np, _index_select_grad, arity=2),
    OpDef(
        "index_select_backward",
        _index_select_backward_type,
        _index_select_backward_np,
        _index_select_backward_grad,
        arity=2,
    ),
]


# ---- user-facing functions ----------------------------------------------------------------------
def _dim(dim: int, ndim: int, fn: str, x: Tensor) -> int:
    if not isinstance(dim, (int, np.integer)) or not -ndim <= dim < ndim:
        raise op_error(
            fn, [x], {"dim": dim}, f"dim {dim!r} out of range: expected {-ndim} <= dim < {ndim}"
        )
    return int(dim) % ndim


def gather(input: Tensor, dim: int, index: Tensor) -> Tensor:  # noqa: A002
    """``out[p, j, q] = input[p, index[p, j, q], q]`` along ``dim`` (torch.gather).

    Args:
        input: any dtype, at least 1-D.
        dim: the indexed dim; negative counts from the end.
        index: i32/u32 with as many dims as ``input``, no larger on the other dims.

    Returns:
        ``input``'s dtype, ``index``'s shape.

    Raises:
        GraphTypeError: for a dim out of range, a non-integer index or mismatched shapes.
    """
    d = _dim(dim, input.ndim, "gather", input)
    return input.builder.add("gather", [input, index], {"dim": d})


def take_along_dim(input: Tensor, indices: Tensor, dim: int | None = None) -> Tensor:  # noqa: A002
    """torch.take_along_dim: ``gather`` after broadcasting ``input`` and ``indices`` on every
    dim but ``dim``; with ``dim=None`` both are flattened first."""
    if dim is None:
        flat = F.reshape(input, (input.type.numel,))
        return gather(flat, 0, F.reshape(indices, (indices.type.numel,)))
    d = _dim(dim, input.ndim, "take_along_dim", input)
    if indices.ndim != input.ndim:
        raise op_error(
            "take_along_dim",
            [input, indices],
            {"dim": dim},
            f"indices must have as many dims as the input ({input.ndim})",
        )
    from .elementwise import broadcast_shapes

    try:
        both = broadcast_shapes(input.shape[:d] + (1,) + input.shape[d + 1 :],
                                indices.shape[:d] + (1,) + indices.shape[d + 1 :])  # fmt: skip
    except ShapeError as e:
        raise op_error("take_along_dim", [input, indices], {"dim": dim}, str(e)) from None
    x = F.broadcast_to(input, both[:d] + (input.shape[d],) + both[d + 1 :])
    i = F.broadcast_to(indices, both[:d] + (indices.shape[d],) + both[d + 1 :])
    return gather(x, d, i)


def index_select(input: Tensor, dim: int, index: Tensor) -> Tensor:  # noqa: A002
    """Entries ``index[j]`` of ``input`` along ``dim`` (torch.index_select).

    Args:
        input: any dtype, at least 1-D.
        dim: negative counts from the end.
        index: i32/u32, 1-D (a 0-d index is read as one element).

    Returns:
        ``input.shape`` with ``dim`` replaced by ``len(index)``.
    """
    d = _dim(dim, input.ndim, "index_select", input)
    if index.ndim == 0:
        index = F.reshape(index, (1,))
    return input.builder.add("index_select", [input, index], {"dim": d})


def embedding(input: Tensor, weight: Tensor) -> Tensor:  # noqa: A002
    """Rows of ``weight`` [V, E] picked by ``input`` (i32/u32, any shape): ``[*input, E]``
    (torch.nn.functional.embedding without padding_idx / max_norm).

    An ``index_select`` along dim 0 of the flattened indices plus free reshapes; the weight
    gradient sums the rows of repeated indices (``index_select_backward``). The node keeps
    ``origin="embedding"``, so a token id out of range fed to it is reported as one.

    Raises:
        GraphTypeError: for a weight that is not 2-D, non-integer token ids or an empty
            vocabulary, naming ``embedding``, both operands as given and the caller's line.
    """
    for name, t in (("input", input), ("weight", weight)):
        if not isinstance(t, Tensor):
            raise op_error("embedding", [input, weight], None, f"{name} must be a Tensor")
    why = None
    if weight.ndim != 2:
        why = f"weight must be 2-D [num_embeddings, embedding_dim], got {weight.type}"
    elif not input.dtype.is_integer:
        why = (
            f"input must hold integer token ids (i32 or u32), got {input.type} (declare the "
            "ids with dtype mn.i32)"
        )
    elif weight.shape[0] == 0 and input.type.numel:
        why = f"weight {list(weight.shape)} has no rows to look up"
    if why is not None:
        raise op_error("embedding", [input, weight], None, why)
    flat = F.reshape(input, (input.type.numel,))
    rows = weight.builder.add("index_select", [weight, flat], {"dim": 0}, origin="embedding")
    return F.reshape(rows, input.shape + (weight.shape[1],))


def one_hot(tensor: Tensor, num_classes: int = -1) -> Tensor:
    """``out[..., c] = tensor[...] == c`` as i32 (torch.nn.functional.one_hot; torch: int64).

    Args:
        tensor: i32/u32 class indices of any shape.
        num_classes: C; torch's default -1 (the largest value + 1) needs the values, which a
            traced tensor does not have, so it must be given.

    Returns:
        i32 ``tensor.shape + (num_classes,)``; a value outside [0, C) gives a zero row.

    Raises:
        ValueError: ``num_classes`` below 1. GraphTypeError: a non-integer tensor.
    """
    from .creation import arange

    if num_classes is None or int(num_classes) < 1:
        raise ValueError(
            f"one_hot: num_classes={num_classes}: give the class count (inferring it from the "
            "largest value needs the values, which exist only when the program runs)"
        )
    if not tensor.dtype.is_integer:
        raise op_error("one_hot", [tensor], {"num_classes": num_classes},
                       "expects integer class indices")  # fmt: skip
    classes = arange(int(num_classes), builder=tensor.builder)
    hit = F.eq(F.reshape(F.cast(tensor, DType.i32), tensor.shape + (1,)), classes)
    return F.cast(hit, DType.i32)

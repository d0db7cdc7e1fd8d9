"""Reductions and scans: sum, mean, amax, amin, max/min (values along a dim), argmax, argmin,
var, logsumexp and cumsum, with PyTorch's semantics.

Reduction attributes: ``dims`` (sorted, non-negative, unique; normalized by the user-facing
functions) and ``keepdim``; ``var`` adds ``correction`` (a float). Reducing over zero elements
is rejected when the graph is built, and so is a ``var`` whose ``N - correction <= 0`` (PyTorch
returns NaN/inf with a warning; WGSL has no portable NaN or inf, see ``var``). ``cumsum``
carries ``dim`` (non-negative) and ``reverse`` (scan from the end; the gradient of a forward
scan is a reverse scan of the upstream gradient and vice versa). Every NumPy reference keeps
its input's float width (the interpreter runs it in float64 for gradient checks).
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence
from typing import NamedTuple

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor
from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError

Dim = int | Sequence[int] | None


# ---- type rules -------------------------------------------------------------------------------
def _reduce_type(types, attrs):
    (t,) = types
    dims = attrs["dims"]
    if any(d < 0 or d >= t.ndim for d in dims) or len(set(dims)) != len(dims):
        raise ShapeError(f"dims {dims} invalid for a {t.ndim}-d tensor")
    if t.dtype is DType.bool:
        raise ShapeError("cannot reduce a bool tensor; cast it first")
    if math.prod(t.shape[d] for d in dims) == 0:
        raise ShapeError(f"reduction over zero elements (dims {dims} of shape {list(t.shape)})")
    if attrs["keepdim"]:
        shape = tuple(1 if i in dims else s for i, s in enumerate(t.shape))
    else:
        shape = tuple(s for i, s in enumerate(t.shape) if i not in dims)
    return TensorType(shape, t.dtype)


def _float_reduce_type(types, attrs):
    if not types[0].dtype.is_floating:
        raise ShapeError(f"expects a floating-point operand, got {types[0].dtype}")
    return _reduce_type(types, attrs)


def _var_type(types, attrs):
    out = _float_reduce_type(types, attrs)
    n = math.prod(types[0].shape[d] for d in attrs["dims"])
    if n - attrs["correction"] <= 0:
        raise ShapeError(
            f"var over {n} elements with correction {attrs['correction']}: degrees of freedom "
            f"N - correction must be > 0"
        )
    return out


def _arg_type(types, attrs):
    return TensorType(_reduce_type(types, attrs).shape, DType.i32)


def _cumsum_type(types, attrs):
    (t,) = types
    if t.dtype is DType.bool:
        raise ShapeError("cannot cumsum a bool tensor; cast it first")
    if not 0 <= attrs["dim"] < builtins.max(t.ndim, 1):
        raise ShapeError(f"dim {attrs['dim']} invalid for a {t.ndim}-d tensor")
    return t


def kept_shape(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[int, ...]:
    """``shape`` with the reduced ``dims`` set to 1 (the keepdim shape)."""
    return tuple(1 if i in dims else s for i, s in enumerate(shape))


def group_size(node, x) -> int:
    """Number of elements each output of reduction ``node`` over operand ``x`` combines."""
    return math.prod(x.shape[d] for d in node.attr("dims"))


# ---- gradient rules ---------------------------------------------------------------------------
def _expand_back(node, x, g):
    dims = node.attr("dims")
    return F.broadcast_to(F.reshape(g, kept_shape(x.shape, dims)), x.shape)


def _sum_grad(node, i, o, g):
    return (_expand_back(node, i[0], g),)


def _mean_grad(node, i, o, g):
    return (_expand_back(node, i[0], g) / float(group_size(node, i[0])),)


def _extremum_grad(node, i, o, g):
    # amax/amin: ties share the gradient equally, as torch.amax/amin document. A NaN maximum
    # equals nothing, so count = 0 and the group's gradient is NaN (0/0), as torch's.
    x = i[0]
    mask = F.cast(F.eq(x, _expand_back(node, x, o)), x.dtype)
    count = F.sum(mask, node.attr("dims"), keepdim=True)
    return (mask * _expand_back(node, x, g) / count,)


def _first_extremum_grad(node, i, o, g):
    # torch.max/min(x, dim): the whole gradient goes to the index returned (the first of ties);
    # "first" is where the running count of ties along the dim equals 1 (exact in i32). A NaN
    # maximum equals nothing: the hits are then the NaNs (x != x), so g goes to the first NaN,
    # the index argmax returns, as torch (a group without NaN has no x != x).
    from .elementwise import logical_or

    x, dims = i[0], node.attr("dims")
    if not dims:  # a 0-d input: the value is the input
        return (g,)
    (d,) = dims
    hit = F.cast(logical_or(F.eq(x, _expand_back(node, x, o)), F.ne(x, x)), DType.i32)
    first = F.eq(cumsum(hit, d) * hit, x.builder.constant(1, DType.i32))
    return (F.where(first, _expand_back(node, x, g), F.zero(g)),)


def _var_grad(node, i, o, g):
    x = i[0]
    mean = F.mean(x, node.attr("dims"), keepdim=True)
    scale = 2.0 / (group_size(node, x) - node.attr("correction"))
    return ((x - mean) * _expand_back(node, x, g) * scale,)


def _logsumexp_grad(node, i, o, g):
    # softmax(x) * g. Over one dim the softmax op recomputes it max-subtracted, independent
    # of the rounding of ``o`` (which costs ~ulp(|o|) relative when |o| is large).
    x, dims = i[0], node.attr("dims")
    p = F.softmax(x, dims[0]) if len(dims) == 1 else F.exp(x - _expand_back(node, x, o))
    return (p * _expand_back(node, x, g),)


def _cumsum_grad(node, i, o, g):
    return (_scan(g, node.attr("dim"), not node.attr("reverse")),)


# ---- NumPy references -------------------------------------------------------------------------
def _np_reduce(fn):
    def ref(xs, a):
        return np.asarray(fn(xs[0], axis=tuple(a["dims"]), keepdims=a["keepdim"]), xs[0].dtype)

    return ref


def _np_arg(fn):
    def ref(xs, a):
        x, dims = xs[0], tuple(a["dims"])
        # Move the reduced dims last and flatten them: the index is the flat row-major index
        # over the reduced dims (the index along ``dim``, or into the flattened input).
        kept = [d for d in range(x.ndim) if d not in dims]
        y = np.transpose(x, kept + list(dims)).reshape([x.shape[d] for d in kept] + [-1])
        out = fn(y, axis=-1).astype(np.int32)
        return out.reshape(kept_shape(x.shape, dims)) if a["keepdim"] else out

    return ref


def _np_var(xs, a):
    x, dims = xs[0], tuple(a["dims"])
    n = math.prod(x.shape[d] for d in dims)
    dev = x - np.mean(x, axis=dims, keepdims=True)
    m2 = np.sum(dev * dev, axis=dims, keepdims=a["keepdim"])
    return np.asarray(m2 / (n - a["correction"]), x.dtype)


def _np_logsumexp(xs, a):
    x, dims = xs[0], tuple(a["dims"])
    with np.errstate(divide="ignore", invalid="ignore", over="ignore"):
        m = np.max(x, axis=dims, keepdims=True)
        mz = np.where(np.isinf(m), 0, m)  # torch's rule: rows of +-inf give +-inf, not NaN
        out = np.log(np.sum(np.exp(x - mz), axis=dims, keepdims=True)) + m
    return np.asarray(out if a["keepdim"] else np.squeeze(out, dims), x.dtype)


def _np_cumsum(xs, a):
    x, d = xs[0], a["dim"]
    if x.ndim == 0:
        return x.copy()
    if a["reverse"]:
        return np.flip(np.cumsum(np.flip(x, d), d, dtype=x.dtype), d)
    return np.cumsum(x, d, dtype=x.dtype)


DEFS = [
    OpDef("sum", _reduce_type, _np_reduce(np.sum), _sum_grad, arity=1),
    OpDef("mean", _reduce_type, _np_reduce(np.mean), _mean_grad, arity=1),
    OpDef("amax", _reduce_type, _np_reduce(np.max), _extremum_grad, arity=1),
    OpDef("amin", _reduce_type, _np_reduce(np.min), _extremum_grad, arity=1),
    OpDef("max", _reduce_type, _np_reduce(np.max), _first_extremum_grad, arity=1),
    OpDef("min", _reduce_type, _np_reduce(np.min), _first_extremum_grad, arity=1),
    OpDef("argmax", _arg_type, _np_arg(np.argmax), differentiable=False, arity=1),
    OpDef("argmin", _arg_type, _np_arg(np.argmin), differentiable=False, arity=1),
    OpDef("var", _var_type, _np_var, _var_grad, arity=1),
    OpDef("logsumexp", _float_reduce_type, _np_logsumexp, _logsumexp_grad, arity=1),
    OpDef("cumsum", _cumsum_type, _np_cumsum, _cumsum_grad, arity=1),
]


# ---- user-facing functions --------------------------------------------------------------------
def _reduce(op: str, x: Tensor, dims: tuple[int, ...], keepdim: bool, **attrs) -> Tensor:
    return x.builder.add(op, [x], {"dims": dims, "keepdim": bool(keepdim), **attrs})


def amin(x: Tensor, dim: Dim = None, keepdim: bool = False) -> Tensor:
    """Minimum over ``dim`` (all dims when None), like ``torch.amin``.

    Ties share the gradient equally. Shapes: reduced dims removed (kept as 1 with
    ``keepdim``); dtype of ``x`` (f32, i32, u32).

    Raises:
        IndexError: for a dim out of range. GraphTypeError: for bool input or an empty group.
    """
    dims = F.normalize_dims(x, dim)
    return _reduce("amin", x, dims, keepdim) if dims else x


class ValuesIndices(NamedTuple):
    """``(values, indices)`` as ``torch.max(x, dim)`` / ``torch.min(x, dim)`` return them."""

    values: Tensor
    indices: Tensor


def _extremum(op: str, arg: str, whole: str, x: Tensor, dim: int | None, keepdim: bool):
    if dim is None:
        return _reduce(whole, x, tuple(range(x.ndim)), False) if x.ndim else x
    dims = (F.normalize_dim(int(dim), x.ndim),) if x.ndim else ()
    return ValuesIndices(_reduce(op, x, dims, keepdim), _reduce(arg, x, dims, keepdim))


def max(x: Tensor, dim: int | None = None, keepdim: bool = False):  # noqa: A001
    """``torch.max(x)`` (the maximum, ties share the gradient) or ``torch.max(x, dim)``.

    With ``dim``: a ``(values, indices)`` named tuple; indices (i32) are the first maximal
    position along ``dim``, which receives the whole gradient of its value (PyTorch's rule).

    Raises:
        IndexError: for a dim out of range. GraphTypeError: for bool input or an empty dim.
    """
    return _extremum("max", "argmax", "amax", x, dim, keepdim)


def min(x: Tensor, dim: int | None = None, keepdim: bool = False):  # noqa: A001
    """``torch.min(x)`` or ``torch.min(x, dim)``; the mirror of :func:`max`."""
    return _extremum("min", "argmin", "amin", x, dim, keepdim)


def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Index (i32) of the maximum along ``dim``, or into the flattened ``x`` when None, like
    ``torch.argmax``: the first index on ties. Not differentiable.

    NaN inputs are not supported (WGSL lets implementations assume there are none).

    Raises:
        IndexError: for a dim out of range. GraphTypeError: for bool input or an empty dim.
    """
    dims = (
        tuple(range(x.ndim)) if dim is None else (F.normalize_dim(int(dim), x.ndim),) * (x.ndim > 0)
    )
    return _reduce("argmax", x, dims, keepdim)


def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Index (i32) of the minimum; the mirror of :func:`argmax` (``torch.argmin``)."""
    dims = (
        tuple(range(x.ndim)) if dim is None else (F.normalize_dim(int(dim), x.ndim),) * (x.ndim > 0)
    )
    return _reduce("argmin", x, dims, keepdim)


def var(x: Tensor, dim: Dim = None, *, correction: float = 1, keepdim: bool = False) -> Tensor:
    """Variance over ``dim`` (all dims when None), like ``torch.var``:
    ``sum((x - mean)^2) / (N - correction)`` with ``N`` the number of elements reduced.

    Computed in f32 in two passes (the mean, then the squared deviations), each summed
    pairwise, so data with a large mean keeps its accuracy (no ``E[x^2] - E[x]^2``).
    Gradient: ``2 (x - mean) / (N - correction) * g``.

    Raises:
        IndexError: for a dim out of range.
        GraphTypeError: for non-float input, an empty group, or ``N - correction <= 0``
            (PyTorch returns NaN or inf there; WGSL has no portable NaN/inf).
    """
    dims = F.normalize_dims(x, dim)
    return _reduce("var", x, dims, keepdim, correction=float(correction))


def std(x: Tensor, dim: Dim = None, *, correction: float = 1, keepdim: bool = False) -> Tensor:
    """Standard deviation, ``sqrt(var(x, dim, correction, keepdim))`` (``torch.std``); a
    composite of :func:`var` and ``sqrt``."""
    return F.sqrt(var(x, dim, correction=correction, keepdim=keepdim))


def logsumexp(x: Tensor, dim: int | Sequence[int], keepdim: bool = False) -> Tensor:
    """``log(sum(exp(x)))`` over ``dim``, max-subtracted (``torch.logsumexp``).

    ``m + log(sum(exp(x - m)))`` with ``m`` the group maximum, replaced by 0 in the
    subtraction when it is infinite (PyTorch's rule, so all ``-inf`` groups give ``-inf``).
    Inf inputs work on backends that honour IEEE infinities (lavapipe does); WGSL lets
    implementations assume there are none. Gradient: ``softmax(x) * g``.

    Raises:
        IndexError: for a dim out of range. GraphTypeError: for non-float input or an
        empty group.
    """
    return _reduce("logsumexp", x, F.normalize_dims(x, dim), keepdim)


def _scan(x: Tensor, dim: int, reverse: bool) -> Tensor:
    return x.builder.add("cumsum", [x], {"dim": dim, "reverse": bool(reverse)})


def cumsum(x: Tensor, dim: int) -> Tensor:
    """Inclusive prefix sum along ``dim`` (``torch.cumsum``); the result keeps ``x``'s dtype
    (PyTorch widens integers to int64; i32 sums wrap on overflow).

    Long scans are blocked (per-block sums, then offsets), so each output's rounding error
    grows with the log of its position rather than the position. Gradient: the reverse
    cumulative sum of ``g`` along ``dim``.

    Raises:
        IndexError: for a dim out of range. GraphTypeError: for bool input.
    """
    return _scan(x, F.normalize_dim(int(dim), x.ndim), False)

"""The functional API, spelled as ``torch`` / ``torch.nn.functional`` spell it.

Each function appends one or a few typed nodes to the graph its tensor operands belong to.
Python scalars are lifted to constants of the other operand's dtype. Shapes and dtypes are
checked when the node is added; errors name the op, the operands and the caller's line.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

from ..dtypes import DType
from ..graph.builder import Tensor, op_error

Scalar = int | float


def _b(*xs):
    for x in xs:
        if isinstance(x, Tensor):
            return x.builder
    raise TypeError("at least one operand must be a meganeura Tensor")


def _lift(x, like: Tensor) -> Tensor:
    return x if isinstance(x, Tensor) else like.builder.constant(x, like.dtype)


def _binary(op: str, a, b) -> Tensor:
    like = a if isinstance(a, Tensor) else b
    _b(a, b)
    return like.builder.add(op, [_lift(a, like), _lift(b, like)])


def _unary(op: str, x: Tensor, **attrs) -> Tensor:
    return x.builder.add(op, [x], attrs or None)


def zero(like: Tensor) -> Tensor:
    """The scalar 0 of ``like``'s dtype (broadcasts anywhere)."""
    return like.builder.constant(0, like.dtype)


# ---- elementwise ----------------------------------------------------------------------------
def add(a, b) -> Tensor:
    return _binary("add", a, b)


def sub(a, b) -> Tensor:
    return _binary("sub", a, b)


def mul(a, b) -> Tensor:
    return _binary("mul", a, b)


def div(a, b) -> Tensor:
    return _binary("div", a, b)


def maximum(a, b) -> Tensor:
    return _binary("maximum", a, b)


def minimum(a, b) -> Tensor:
    return _binary("minimum", a, b)


def greater(a, b) -> Tensor:
    return _binary("greater", a, b)


def greater_equal(a, b) -> Tensor:
    return _binary("greater_equal", a, b)


def less(a, b) -> Tensor:
    return _binary("less", a, b)


def less_equal(a, b) -> Tensor:
    return _binary("less_equal", a, b)


def eq(a, b) -> Tensor:
    return _binary("eq", a, b)


def ne(a, b) -> Tensor:
    return _binary("ne", a, b)


def neg(x: Tensor) -> Tensor:
    return _unary("neg", x)


def exp(x: Tensor) -> Tensor:
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    return _unary("log", x)


def sqrt(x: Tensor) -> Tensor:
    return _unary("sqrt", x)


def relu(x: Tensor) -> Tensor:
    return _unary("relu", x)


def tanh(x: Tensor) -> Tensor:
    return _unary("tanh", x)


def sigmoid(x: Tensor) -> Tensor:
    return _unary("sigmoid", x)


def where(condition: Tensor, x, y) -> Tensor:
    """``condition ? x : y`` elementwise, broadcasting all three (torch.where)."""
    like = x if isinstance(x, Tensor) else y
    return condition.builder.add("where", [condition, _lift(x, like), _lift(y, like)])


def cast(x: Tensor, dtype: DType) -> Tensor:
    """Convert elements to ``dtype`` (``Tensor.to(dtype)`` in PyTorch)."""
    if x.dtype is dtype:
        return x
    return _unary("cast", x, dtype=dtype.value)


def stop_gradient(x: Tensor) -> Tensor:
    """Identity whose gradient is zero (``Tensor.detach`` in PyTorch)."""
    return _unary("stop_gradient", x)


# ---- shape ------------------------------------------------------------------------------------
def normalize_dim(d: int, ndim: int, what: str = "dim") -> int:
    """``d`` in ``[0, ndim)`` (negative dims count from the end, as in PyTorch); a 0-d tensor
    accepts 0 and -1, as ``torch.sum(t0d, 0)`` does.

    Raises:
        IndexError: when ``d`` is out of range; the message names ``what`` (``"dim"`` ...).
    """
    if not -ndim <= d < builtins.max(ndim, 1):
        raise IndexError(f"{what} {d} out of range for a {ndim}-d tensor")
    return d % ndim if ndim else 0


def reshape(x: Tensor, shape: Sequence[int]) -> Tensor:
    """Same elements in a new shape; one entry may be -1 (inferred).

    Raises:
        GraphTypeError: for more than one -1, a -1 that no size fits, or a shape of another
            number of elements (naming ``reshape``, ``x``'s type, the shape and the caller's
            line).
    """
    shape = [int(s) for s in shape]
    if shape.count(-1) > 1:
        raise op_error("reshape", [x], {"shape": tuple(shape)}, "only one dim can be -1")
    if -1 in shape:
        known = math.prod(s for s in shape if s != -1)
        if known == 0 or x.type.numel % known:
            why = (
                "the other dims hold no elements"
                if known == 0
                else f"{x.type.numel} elements of {list(x.shape)} are not a multiple of "
                f"{known}, the product of the other dims"
            )
            raise op_error("reshape", [x], {"shape": tuple(shape)}, f"cannot infer the -1: {why}")
        shape[shape.index(-1)] = x.type.numel // known
    if tuple(shape) == x.shape:
        return x
    return _unary("reshape", x, shape=tuple(shape))


def permute(x: Tensor, dims: Sequence[int]) -> Tensor:
    dims = tuple(normalize_dim(int(d), x.ndim) for d in dims)
    if dims == tuple(range(x.ndim)):
        return x
    return _unary("permute", x, dims=dims)


def transpose(x: Tensor, dim0: int, dim1: int) -> Tensor:
    perm = list(range(x.ndim))
    a, b = normalize_dim(dim0, x.ndim), normalize_dim(dim1, x.ndim)
    perm[a], perm[b] = perm[b], perm[a]
    return permute(x, perm)


def broadcast_to(x: Tensor, shape: Sequence[int]) -> Tensor:
    shape = tuple(int(s) for s in shape)
    if shape == x.shape:
        return x
    return _unary("broadcast_to", x, shape=shape)


def flatten(x: Tensor, start_dim: int = 0, end_dim: int = -1) -> Tensor:
    s, e = normalize_dim(start_dim, x.ndim), normalize_dim(end_dim, x.ndim)
    shape = x.shape[:s] + (math.prod(x.shape[s : e + 1]),) + x.shape[e + 1 :]
    return reshape(x, shape)


# ---- reductions -------------------------------------------------------------------------------
def normalize_dims(x: Tensor, dim) -> tuple[int, ...]:
    """The sorted, distinct dims of ``x`` named by ``dim`` (None: every dim; an int or a
    sequence of ints, negative from the end).

    Raises:
        IndexError: for a dim out of range.
    """
    if dim is None:
        return tuple(range(x.ndim))
    if isinstance(dim, int):
        dim = (dim,)
    out = sorted({normalize_dim(int(d), x.ndim) for d in dim})
    return tuple(out)


def _reduce(op: str, x: Tensor, dim, keepdim: bool) -> Tensor:
    dims = normalize_dims(x, dim)
    if not dims:
        return x
    return x.builder.add(op, [x], {"dims": dims, "keepdim": bool(keepdim)})


def sum(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``dim`` (all dims when None), like torch.sum."""
    return _reduce("sum", x, dim, keepdim)


def mean(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    return _reduce("mean", x, dim, keepdim)


def amax(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """Maximum over ``dim``; ties share the gradient equally (torch.amax)."""
    return _reduce("amax", x, dim, keepdim)


max = amax  # noqa: A001 - values only; argmax is a separate op


# ---- linear algebra and nn --------------------------------------------------------------------
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``[..., M, K] @ [..., K, N] -> [..., M, N]``, batch dims broadcast (torch.matmul)."""
    return a.builder.add("matmul", [a, b])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` with PyTorch's layout: weight [out, in], bias [out].

    Raises:
        GraphTypeError: for a weight that is not 2-D, an input whose last dim is not
            ``in_features``, or a bias that is not [out_features]; the message names
            ``linear``, the operands as given (the weight untransposed) and the caller's line.
    """
    operands = [x, weight] if bias is None else [x, weight, bias]
    why = None
    if not all(isinstance(t, Tensor) for t in operands):
        why = "input, weight and bias must be Tensors"
    elif weight.ndim != 2:
        why = f"weight must be 2-D [out_features, in_features], got {weight.type}"
    elif x.ndim < 2:
        why = f"input must be [*, in_features] with at least 2 dims, got {x.type}"
    elif x.shape[-1] != weight.shape[1]:
        why = (
            f"input has {x.shape[-1]} features (its last dim), but weight "
            f"{list(weight.shape)} is [out_features, in_features] with in_features="
            f"{weight.shape[1]}"
        )
    elif x.dtype is not weight.dtype:
        why = f"input and weight dtypes differ: {x.dtype} vs {weight.dtype}"
    elif bias is not None and (bias.shape != weight.shape[:1] or bias.dtype is not x.dtype):
        why = f"bias must be {x.dtype}[{weight.shape[0]}] (out_features), got {bias.type}"
    if why is not None:
        raise op_error("linear", operands, None, why)
    y = matmul(x, transpose(weight, -2, -1))
    return y if bias is None else y + bias


def softmax(x: Tensor, dim: int = -1) -> Tensor:
    return _unary("softmax", x, dim=normalize_dim(dim, x.ndim))


def log_softmax(x: Tensor, dim: int = -1) -> Tensor:
    return _unary("log_softmax", x, dim=normalize_dim(dim, x.ndim))


def cross_entropy(
    logits: Tensor, target: Tensor, ignore_index: int | None = -100, reduction: str = "mean"
) -> Tensor:
    """Cross-entropy of ``logits`` f32[N, C] against class indices ``target`` i32[N].

    Matches torch.nn.functional.cross_entropy for class-index targets (mean over rows whose
    target is not ``ignore_index``). Returns f32[].

    Raises:
        GraphTypeError: for shapes or dtypes other than the above.
    """
    return logits.builder.add(
        "cross_entropy", [logits, target], {"ignore_index": ignore_index, "reduction": reduction}
    )


def mse_loss(input: Tensor, target: Tensor, reduction: str = "mean") -> Tensor:  # noqa: A002
    """Mean (or sum) of squared differences, like torch.nn.functional.mse_loss."""
    if input.shape != target.shape:
        raise ValueError(f"mse_loss: input {input!r} and target {target!r} shapes differ")
    d = input - target
    if reduction == "mean":
        return mean(d * d)
    if reduction == "sum":
        return sum(d * d)
    raise ValueError(f"mse_loss: reduction must be 'mean' or 'sum', got {reduction!r}")

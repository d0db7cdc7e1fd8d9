"""The functional API, spelled as ``torch`` / ``torch.nn.functional`` spell it.

Each function appends one or a few typed nodes to the graph its tensor operands belong to.
Binary elementwise functions promote their operands as PyTorch does (``dtypes.result_type``:
an i32 tensor times 0.5 is f32, true division of integers is f32) by inserting ``cast``
nodes, so every IR op still sees one dtype; Python numbers become constants of the result
dtype. Shapes and dtypes are checked when the node is added; errors name the op, the operands
and the caller's line.
"""

from __future__ import annotations

import builtins
import math
from collections.abc import Sequence

import numpy as np

from ..dtypes import DType, as_dtype, result_type
from ..graph.builder import Tensor, op_error

Scalar = int | float
Operand = Tensor | int | float | bool | np.ndarray | np.generic


def _b(*xs):
    for x in xs:
        if isinstance(x, Tensor):
            return x.builder
    raise TypeError("at least one operand must be a meganeura Tensor")


def scalar_dtype(v) -> DType | None:
    """The dtype a Python (or NumPy) scalar takes part in promotion with: ``bool_``, ``i32``
    for an int, ``f32`` for a float; None for anything else."""
    if isinstance(v, (bool, np.bool_)):
        return DType.bool
    if isinstance(v, (int, np.integer)):
        return DType.i32
    if isinstance(v, (float, np.floating)):
        return DType.f32
    return None


def promote_operands(
    what: str, *xs, floating: bool = False, builder=None
) -> tuple[DType, list[Tensor]]:
    """``(dtype, operands)``: ``xs`` as Tensors of one dtype by PyTorch's type promotion
    (``dtypes.result_type``), ``cast`` nodes inserted where a tensor's dtype differs and
    scalars made constants of it. NumPy arrays (inside a traced forward) are tensors.

    Args:
        what: the user-facing function, for errors.
        floating: promote integer and bool results to f32 (true division, as torch's
            default dtype).
        builder: the graph, when ``xs`` may hold no Tensor (``where(c, 0.0, -inf)``).

    Raises:
        TypeError: no Tensor among ``xs``; GraphTypeError: an operand that is neither a
            Tensor, an array nor a number, or dtypes without a common one (i32 with u32).
    """
    for x in xs:
        if isinstance(x, Tensor):
            builder = x.builder
            break
    if builder is None:
        raise TypeError(f"{what}: at least one operand must be a meganeura Tensor")
    ops = [builder._operand(what, x) if isinstance(x, np.ndarray) or hasattr(x, "_shape") else x
           for x in xs]  # fmt: skip
    dims, zero_dims, scalars = [], [], []
    for x in ops:
        if isinstance(x, Tensor):
            (dims if x.ndim else zero_dims).append(x.dtype)
        elif (t := scalar_dtype(x)) is not None:
            scalars.append(t)
        else:
            raise op_error(what, xs, None, f"cannot combine a Tensor with {type(x).__name__}")
    try:
        dtype = result_type(dims, zero_dims, scalars)
    except TypeError as e:
        raise op_error(what, xs, None, str(e)) from None
    if floating and not dtype.is_floating:
        dtype = DType.f32
    return dtype, [cast(x, dtype) if isinstance(x, Tensor) else builder.constant(x, dtype)
                   for x in ops]  # fmt: skip


# bool results of these ops are torch's logical ops (True + True is True); others reject bool
_BOOL_ARITH = {"add": "logical_or", "mul": "logical_and", "maximum": "logical_or",
               "minimum": "logical_and"}  # fmt: skip


def _binary(op: str, a, b) -> Tensor:
    dtype, (x, y) = promote_operands(op, a, b)
    if dtype is DType.bool and op in _BOOL_ARITH:
        return x.builder.add(_BOOL_ARITH[op], [x, y])
    if dtype is DType.bool:
        raise op_error(op, [a, b], None, "not supported for two bool operands (torch neither); "
                       "use logical_xor, or cast to a numeric dtype")  # fmt: skip
    return x.builder.add(op, [x, y])


def _compare_op(op: str, a, b) -> Tensor:
    _, (x, y) = promote_operands(op, a, b)
    return x.builder.add(op, [x, y])


def _unary(op: str, x: Tensor, **attrs) -> Tensor:
    return x.builder.add(op, [x], attrs or None)


def zero(like: Tensor) -> Tensor:
    """The scalar 0 of ``like``'s dtype (broadcasts anywhere)."""
    return like.builder.constant(0, like.dtype)


# ---- elementwise ----------------------------------------------------------------------------
def add(input, other, *, alpha: Scalar = 1) -> Tensor:  # noqa: A002 - torch's names
    """``input + alpha * other`` elementwise with broadcasting and type promotion
    (torch.add); two bool tensors give their logical or, as in torch."""
    return _binary("add", input, other if alpha == 1 else mul(other, alpha))


def sub(input, other, *, alpha: Scalar = 1) -> Tensor:  # noqa: A002
    """``input - alpha * other`` (torch.sub); two bool operands raise, as in torch."""
    return _binary("sub", input, other if alpha == 1 else mul(other, alpha))


def mul(input, other) -> Tensor:  # noqa: A002
    """``input * other`` (torch.mul); two bool tensors give their logical and."""
    return _binary("mul", input, other)


def div(input, other, *, rounding_mode: str | None = None) -> Tensor:  # noqa: A002
    """``input / other`` (torch.div): true division, in f32 for integer and bool operands;
    ``rounding_mode="floor"`` is :func:`floor_divide`, ``"trunc"`` rounds toward zero (for
    integers in the result dtype, exactly).

    Raises:
        ValueError: another rounding_mode.
    """
    if rounding_mode is None:
        _, (x, y) = promote_operands("div", input, other, floating=True)
        return x.builder.add("div", [x, y])
    if rounding_mode == "floor":
        return floor_divide(input, other)
    if rounding_mode != "trunc":
        raise ValueError(
            f"div: rounding_mode must be None, 'trunc' or 'floor', got {rounding_mode!r}"
        )
    dtype, (x, y) = promote_operands("div", input, other)
    if dtype is DType.bool:
        raise op_error("div", [input, other], None, "trunc division of two bool operands")
    if not dtype.is_floating:
        return x.builder.add("div", [x, y])  # WGSL's integer division truncates
    from .elementwise import trunc

    return trunc(x.builder.add("div", [x, y]))


true_divide = div


def floor_divide(input, other) -> Tensor:  # noqa: A002
    """``floor(input / other)`` elementwise (torch.floor_divide, Python's ``//``), in the
    promoted dtype. Integers: exact, composed from the truncating division (the quotient is
    one less where the remainder is nonzero and its sign differs from the divisor's); a zero
    divisor gives an unspecified value where torch raises. Floats: ``floor(a / b)``, torch's
    documented formula; torch computes it through ``fmod`` and can differ where ``a / b``
    rounds to an integer (``1 // 0.1``: torch 9, here 10).

    Raises:
        GraphTypeError: two bool operands.
    """
    dtype, (x, y) = promote_operands("floor_divide", input, other)
    if dtype is DType.bool:
        raise op_error("floor_divide", [input, other], None, "two bool operands")
    q = x.builder.add("div", [x, y])
    if dtype.is_floating:
        from .elementwise import floor

        return floor(q)
    if dtype is DType.u32:
        return q
    from .elementwise import logical_and

    r = x.builder.add("sub", [x, x.builder.add("mul", [q, y])])
    zero_ = zero(r)
    off = logical_and(ne(r, zero_), ne(less(r, zero_), less(y, zero_)))
    return q - cast(off, dtype)


def remainder(input, other) -> Tensor:  # noqa: A002
    """``input - floor_divide(input, other) * other`` (torch.remainder, Python's ``%``): the
    result has the divisor's sign. Exact for integers; for floats the same formula in f32
    (torch's fmod-based kernel can differ by rounding where ``a / b`` is near an integer).

    Raises:
        GraphTypeError: two bool operands.
    """
    dtype, (x, y) = promote_operands("remainder", input, other)
    if dtype is DType.bool:
        raise op_error("remainder", [input, other], None, "two bool operands")
    q = floor_divide(x, y)
    return x.builder.add("sub", [x, x.builder.add("mul", [q, y])])


def maximum(input, other) -> Tensor:  # noqa: A002
    """Elementwise maximum with promotion (torch.maximum); ties split the gradient."""
    return _binary("maximum", input, other)


def minimum(input, other) -> Tensor:  # noqa: A002
    """Elementwise minimum with promotion (torch.minimum)."""
    return _binary("minimum", input, other)


def greater(a, b) -> Tensor:
    return _compare_op("greater", a, b)


def greater_equal(a, b) -> Tensor:
    return _compare_op("greater_equal", a, b)


def less(a, b) -> Tensor:
    return _compare_op("less", a, b)


def less_equal(a, b) -> Tensor:
    return _compare_op("less_equal", a, b)


def eq(a, b) -> Tensor:
    return _compare_op("eq", a, b)


def ne(a, b) -> Tensor:
    return _compare_op("ne", a, b)


gt, ge, lt, le = greater, greater_equal, less, less_equal


def neg(x: Tensor) -> Tensor:
    return _unary("neg", x)


def exp(x: Tensor) -> Tensor:
    return _unary("exp", x)


def log(x: Tensor) -> Tensor:
    return _unary("log", x)


def sqrt(x: Tensor) -> Tensor:
    return _unary("sqrt", x)


def relu(x: Tensor) -> Tensor:
    """``max(x, 0)`` (torch.relu); integer tensors through ``maximum``."""
    if not x.dtype.is_floating:
        return maximum(x, 0)
    return _unary("relu", x)


def tanh(x: Tensor) -> Tensor:
    return _unary("tanh", x)


def sigmoid(x: Tensor) -> Tensor:
    return _unary("sigmoid", x)


def where(condition: Tensor, input, other) -> Tensor:  # noqa: A002
    """``condition ? input : other`` elementwise, broadcasting all three (torch.where);
    ``input`` and ``other`` are promoted to one dtype (two Python floats give f32).

    Raises:
        GraphTypeError: a condition that is not bool.
    """
    if not isinstance(condition, Tensor):
        raise TypeError(f"where: condition must be a bool Tensor, got {condition!r}")
    _, (x, y) = promote_operands("where", input, other, builder=condition.builder)
    return condition.builder.add("where", [condition, x, y])


def cast(x: Tensor, dtype: DType) -> Tensor:
    """Convert elements to ``dtype`` (``Tensor.to(dtype)`` in PyTorch)."""
    dtype = as_dtype(dtype)
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


def sum(  # noqa: A001
    x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, *, dtype=None
) -> Tensor:
    """Sum over ``dim`` (all dims when None), like torch.sum; bool counts as i32 (torch:
    int64), ``dtype`` casts first."""
    if dtype is not None:
        x = cast(x, as_dtype(dtype))
    elif x.dtype is DType.bool:
        x = cast(x, DType.i32)
    return _reduce("sum", x, dim, keepdim)


def mean(
    x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False, *, dtype=None
) -> Tensor:
    """Mean over ``dim`` (all dims when None), like torch.mean; ``dtype`` casts first."""
    return _reduce("mean", x if dtype is None else cast(x, as_dtype(dtype)), dim, keepdim)


def amax(x: Tensor, dim: int | Sequence[int] | None = None, keepdim: bool = False) -> Tensor:
    """Maximum over ``dim``; ties share the gradient equally (torch.amax)."""
    return _reduce("amax", x, dim, keepdim)


max = amax  # noqa: A001 - values only; argmax is a separate op


# ---- linear algebra and nn --------------------------------------------------------------------
def matmul(a: Tensor, b: Tensor) -> Tensor:
    """``[..., M, K] @ [..., K, N] -> [..., M, N]``, batch dims broadcast (torch.matmul).

    A 1-D operand follows torch.matmul: ``a [K]`` is taken as ``[1, K]`` and ``b [K]`` as
    ``[K, 1]``, and that dim is removed from the result (two vectors give a 0-d dot product).
    The ``matmul`` op itself takes at least 2-D operands; the vector cases are views around it.

    Raises:
        GraphTypeError: for a 0-d operand, inner dims that differ, or batch dims that do not
            broadcast (naming ``matmul``, its operands and the caller's line).
    """
    if isinstance(a, Tensor) and isinstance(b, Tensor) and a.ndim and b.ndim:
        if 1 in (a.ndim, b.ndim):
            a2 = reshape(a, (1, a.shape[0])) if a.ndim == 1 else a
            b2 = reshape(b, (b.shape[0], 1)) if b.ndim == 1 else b
            out = a.builder.add("matmul", [a2, b2])
            drop = {out.ndim - 2} if a.ndim == 1 else set()
            drop |= {out.ndim - 1} if b.ndim == 1 else set()
            return reshape(out, [s for d, s in enumerate(out.shape) if d not in drop])
    return a.builder.add("matmul", [a, b])


def linear(x: Tensor, weight: Tensor, bias: Tensor | None = None) -> Tensor:
    """``x @ weight^T + bias`` with PyTorch's layout: weight [out, in], bias [out]; x is
    [*, in] -> [*, out], or unbatched [in] -> [out], as torch.nn.functional.linear.

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
    elif x.ndim < 1:
        why = f"input must be [*, in_features] with at least 1 dim, got {x.type}"
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
    if x.ndim == 1:  # torch's unbatched input: [in_features] -> [out_features]
        return reshape(linear(reshape(x, (1, x.shape[0])), weight, bias), weight.shape[:1])
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
    """``loss.mse_loss`` (torch.nn.functional.mse_loss), kept here for graph-building code."""
    from .loss import mse_loss as _mse_loss

    return _mse_loss(input, target, reduction=reduction)

"""The ``torch.Tensor`` methods and operators of a graph Tensor, as a mixin of
``builder.Tensor``.

Every method appends nodes through the functional API (``meganeura.nn.functional``, imported on
first use: the ops import this package), so a method means what the function of the same
name means: ``x.softmax(-1)`` is ``F.softmax(x, -1)``. Operators promote their operands as
PyTorch does (``i * 0.5`` is f32, ``i / 2`` is f32 true division, ``i // 2`` floor division);
comparisons with a Python value promote too. Tensors have no storage here, so the methods
about memory layout (``contiguous``, ``view``, ``clone``) are identities or reshapes, and
``to("cuda")`` ignores the device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from types import ModuleType

import numpy as np

from ..dtypes import DType, as_dtype

_F: list[ModuleType] = []

_OPERAND = (int, float, bool, np.generic, np.ndarray)


def _ops() -> ModuleType:
    """``meganeura.nn.functional``, imported on first use."""
    if not _F:
        from ..nn import functional

        _F.append(functional)
    return _F[0]


def _is_operand(o) -> bool:
    from .builder import Tensor

    return isinstance(o, (Tensor, *_OPERAND)) or hasattr(o, "_shape")


def _sizes(args) -> tuple:
    """``f(2, 3)`` and ``f((2, 3))`` as torch takes sizes: the tuple ``(2, 3)``."""
    if len(args) == 1 and isinstance(args[0], (tuple, list)):
        return tuple(args[0])
    return tuple(args)


_DEVICES = ("cpu", "cuda", "mps", "xpu", "meta", "gpu")

# The NumPy ufuncs behind ndarray's operators -> the functional op each one is.
_UFUNCS = {
    "add": "add",
    "subtract": "sub",
    "multiply": "mul",
    "true_divide": "div",
    "floor_divide": "floor_divide",
    "remainder": "remainder",
    "power": "pow",
    "matmul": "matmul",
    "greater": "greater",
    "greater_equal": "greater_equal",
    "less": "less",
    "less_equal": "less_equal",
    "equal": "eq",
    "not_equal": "ne",
}


class TensorMethods:
    """``torch.Tensor``'s methods and operators (mixed into ``builder.Tensor``)."""

    __slots__ = ()

    def __array_ufunc__(self, ufunc, method, *inputs, **kwargs):
        """``ndarray + tensor`` (NumPy's operators call ufuncs) is the op on both; any other
        NumPy function raises: a traced tensor has no value to compute on."""
        name = _UFUNCS.get(ufunc.__name__)
        if method == "__call__" and name is not None and not kwargs:
            return getattr(_ops(), name)(*inputs)
        raise TypeError(
            f"np.{ufunc.__name__} of {self!r}: a traced tensor has no value until the program "
            "runs; NumPy functions cannot act on it (use meganeura's ops)"
        )

    # ---- operators: PyTorch's type promotion (ops.functional.promote_operands) ------------
    def _binary(self, fn: str, o, reflected: bool = False):
        if not _is_operand(o):
            return NotImplemented
        f = getattr(_ops(), fn)
        return f(o, self) if reflected else f(self, o)

    def __add__(self, o):
        return self._binary("add", o)

    def __radd__(self, o):
        return self._binary("add", o, True)

    def __sub__(self, o):
        return self._binary("sub", o)

    def __rsub__(self, o):
        return self._binary("sub", o, True)

    def __mul__(self, o):
        return self._binary("mul", o)

    def __rmul__(self, o):
        return self._binary("mul", o, True)

    def __truediv__(self, o):
        return self._binary("div", o)

    def __rtruediv__(self, o):
        return self._binary("div", o, True)

    def __floordiv__(self, o):
        return self._binary("floor_divide", o)

    def __rfloordiv__(self, o):
        return self._binary("floor_divide", o, True)

    def __mod__(self, o):
        return self._binary("remainder", o)

    def __rmod__(self, o):
        return self._binary("remainder", o, True)

    def __pow__(self, o):
        return self._binary("pow", o)

    def __rpow__(self, o):
        return self._binary("pow", o, True)

    def __matmul__(self, o):
        return self._binary("matmul", o)

    def __rmatmul__(self, o):
        return self._binary("matmul", o, True)

    def __eq__(self, o):  # elementwise, as torch; other types compare by identity
        return self._binary("eq", o)

    def __ne__(self, o):
        return self._binary("ne", o)

    def __lt__(self, o):
        return self._binary("less", o)

    def __le__(self, o):
        return self._binary("less_equal", o)

    def __gt__(self, o):
        return self._binary("greater", o)

    def __ge__(self, o):
        return self._binary("greater_equal", o)

    __hash__ = object.__hash__  # defining __eq__ would otherwise remove it

    def _logical(self, fn: str, o):
        if not _is_operand(o):
            return NotImplemented
        if self.dtype is not DType.bool or getattr(o, "dtype", DType.bool) is not DType.bool:
            raise TypeError(
                f"{fn.replace('logical', 'bitwise')} of {self!r}: only bool tensors (masks) "
                "are supported; bitwise integer ops are not"
            )
        return getattr(_ops(), fn)(self, o)

    def __and__(self, o):
        return self._logical("logical_and", o)

    __rand__ = __and__

    def __or__(self, o):
        return self._logical("logical_or", o)

    __ror__ = __or__

    def __xor__(self, o):
        return self._logical("logical_xor", o)

    __rxor__ = __xor__

    def __invert__(self):
        if self.dtype is not DType.bool:
            raise TypeError(f"~ of {self!r}: only bool tensors (masks) are supported")
        return _ops().logical_not(self)

    def __neg__(self):
        return _ops().neg(self)

    def __pos__(self):
        return self

    def __abs__(self):
        return _ops().abs(self)

    def __getitem__(self, key):
        """NumPy/PyTorch basic indexing: ints, slices with positive steps, ``...``, ``None``
        and one integer Tensor key (``meganeura.ops.indexing.index``)."""
        return _ops().index(self, key)

    # ---- the named forms of the operators ------------------------------------------------
    def add(self, other, *, alpha=1):
        return _ops().add(self, other, alpha=alpha)

    def sub(self, other, *, alpha=1):
        return _ops().sub(self, other, alpha=alpha)

    def mul(self, other):
        return _ops().mul(self, other)

    def div(self, other, *, rounding_mode=None):
        return _ops().div(self, other, rounding_mode=rounding_mode)

    def floor_divide(self, other):
        return _ops().floor_divide(self, other)

    def remainder(self, other):
        return _ops().remainder(self, other)

    def pow(self, exponent):
        return _ops().pow(self, exponent)

    def matmul(self, other):
        return _ops().matmul(self, other)

    def maximum(self, other):
        return _ops().maximum(self, other)

    def minimum(self, other):
        return _ops().minimum(self, other)

    def eq(self, other):
        return _ops().eq(self, other)

    def ne(self, other):
        return _ops().ne(self, other)

    def lt(self, other):
        return _ops().less(self, other)

    def le(self, other):
        return _ops().less_equal(self, other)

    def gt(self, other):
        return _ops().greater(self, other)

    def ge(self, other):
        return _ops().greater_equal(self, other)

    def logical_and(self, other):
        return _ops().logical_and(self, other)

    def logical_or(self, other):
        return _ops().logical_or(self, other)

    def logical_not(self):
        return _ops().logical_not(self)

    # ---- elementwise math ------------------------------------------------------------------
    def _unary(name: str):  # noqa: N805 - builds the methods below
        def method(self):
            return getattr(_ops(), name)(self)

        method.__name__ = method.__qualname__ = name
        method.__doc__ = f"``F.{name}(self)`` (torch.Tensor.{name})."
        return method

    neg = _unary("neg")
    exp = _unary("exp")
    log = _unary("log")
    log1p = _unary("log1p")
    expm1 = _unary("expm1")
    sqrt = _unary("sqrt")
    rsqrt = _unary("rsqrt")
    abs = _unary("abs")
    sign = _unary("sign")
    sin = _unary("sin")
    cos = _unary("cos")
    tanh = _unary("tanh")
    sigmoid = _unary("sigmoid")
    relu = _unary("relu")
    erf = _unary("erf")
    reciprocal = _unary("reciprocal")
    floor = _unary("floor")
    ceil = _unary("ceil")
    trunc = _unary("trunc")
    isneginf = _unary("isneginf")
    del _unary

    def square(self):
        return self * self

    def clamp(self, min=None, max=None):  # noqa: A002 - torch's names
        return _ops().clamp(self, min, max)

    clip = clamp

    def softmax(self, dim: int = -1):
        return _ops().softmax(self, dim)

    def log_softmax(self, dim: int = -1):
        return _ops().log_softmax(self, dim)

    def masked_fill(self, mask, value):
        """``where(mask, value, self)`` in ``self``'s dtype (torch.Tensor.masked_fill: the
        value is converted to it, not promoted); ``value`` may be inf/-inf or a 0-d Tensor.

        Raises:
            GraphTypeError: a mask that is not bool or does not broadcast to ``self``.
            ValueError: a finite value beyond the dtype's range (1e39 for f32), as PyTorch.
        """
        from .builder import Tensor, check_fill_value, op_error

        if not isinstance(mask, Tensor) or mask.dtype is not DType.bool:
            raise op_error("masked_fill", [self, mask], None, "the mask must be a bool Tensor")
        if isinstance(value, Tensor):
            fill = _ops().cast(value, self.dtype)
        else:
            check_fill_value("masked_fill", value, self.dtype, [self, mask])
            fill = self.builder.constant(value, self.dtype)
        out = _ops().where(mask, fill, self)
        if out.shape != self.shape:
            raise op_error("masked_fill", [self, mask], None, "the mask must broadcast to self")
        return out

    def where(self, condition, other):
        """``torch.where(condition, self, other)``."""
        return _ops().where(condition, self, other)

    def detach(self):
        """The same value with no gradient (``stop_gradient``)."""
        return _ops().stop_gradient(self)

    # ---- dtype -------------------------------------------------------------------------------
    def to(self, *args, dtype=None, **kwargs):
        """``to(dtype)``, ``to(other)`` (other's dtype) or ``to(device)``: a ``cast`` where
        the dtype changes; devices (``"cuda"``, ``"cpu"``) and ``non_blocking``/``copy`` are
        ignored (the program runs where it was compiled)."""
        from .builder import Tensor

        target = dtype
        for a in args:
            if isinstance(a, Tensor):
                target = a.dtype
            elif isinstance(a, str) and a.split(":")[0] in _DEVICES or a is None:
                continue
            elif type(a).__name__ == "device":  # a torch.device, without importing torch
                continue
            else:
                target = a
        return self if target is None else _ops().cast(self, as_dtype(target))

    def type_as(self, other):
        return _ops().cast(self, other.dtype)

    def float(self):
        return _ops().cast(self, DType.f32)

    def half(self):
        return _ops().cast(self, DType.f16)

    def int(self):
        return _ops().cast(self, DType.i32)

    def long(self):
        """i32: meganeura stores no int64 (int64 arrays are fed as int32)."""
        return _ops().cast(self, DType.i32)

    def bool(self):
        return _ops().cast(self, DType.bool)

    def is_floating_point(self) -> bool:
        return self.dtype.is_floating

    # ---- shape -------------------------------------------------------------------------------
    def size(self, dim: int | None = None):
        """``torch.Tensor.size``: the shape, or one dim of it."""
        return self.shape if dim is None else self.shape[dim]

    def dim(self) -> int:
        return self.ndim

    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def T(self):  # noqa: N802 - PyTorch spelling
        """Reverse all dims (for 2-D: the transpose), like ``torch.Tensor.T``."""
        return self.permute(tuple(reversed(range(self.ndim))))

    @property
    def mT(self):  # noqa: N802 - PyTorch spelling
        """Transpose of the last two dims."""
        return self.transpose(-2, -1)

    def t(self):
        """The transpose of a tensor of at most 2 dims (torch.Tensor.t)."""
        if self.ndim > 2:
            raise ValueError(f"t() expects a tensor with <= 2 dims, got {self!r}")
        return self.T

    def permute(self, *dims):
        return _ops().permute(self, _sizes(dims))

    def transpose(self, dim0: int, dim1: int):
        return _ops().transpose(self, dim0, dim1)

    swapaxes = transpose

    def reshape(self, *shape):
        """Same elements in a new shape; one entry may be -1 (``functional.reshape``)."""
        return _ops().reshape(self, _sizes(shape))

    def view(self, *shape):
        """``reshape`` (there is no memory layout to share); ``view(dtype)`` is not supported.

        Raises:
            TypeError: for a dtype argument.
        """
        if len(shape) == 1 and not isinstance(shape[0], (int, np.integer, tuple, list)):
            raise TypeError(f"view({shape[0]!r}): reinterpreting bits as a dtype is not supported")
        return self.reshape(*shape)

    def view_as(self, other):
        return self.reshape(other.shape)

    def reshape_as(self, other):
        return self.reshape(other.shape)

    def contiguous(self, *args, **kwargs):
        """The tensor itself: graph values have no strides."""
        return self

    def clone(self, *args, **kwargs):
        """The tensor itself: graph values are never written in place."""
        return self

    def flatten(self, start_dim: int = 0, end_dim: int = -1):
        return _ops().flatten(self, start_dim, end_dim)

    def unflatten(self, dim: int, sizes: Sequence[int]):
        """Split dim ``dim`` into ``sizes`` (one may be -1), as torch.Tensor.unflatten."""
        d = dim % self.ndim if -self.ndim <= dim < self.ndim else None
        if d is None:
            raise IndexError(f"unflatten: dim {dim} out of range for {self!r}")
        sizes = list(sizes)
        if sizes.count(-1) == 1:
            sizes[sizes.index(-1)] = self.shape[d] // max(1, -math.prod(sizes))
        return self.reshape(self.shape[:d] + tuple(sizes) + self.shape[d + 1 :])

    def unsqueeze(self, dim: int):
        return _ops().unsqueeze(self, dim)

    def squeeze(self, dim=None):
        return _ops().squeeze(self, dim)

    def expand(self, *sizes):
        """Broadcast to ``sizes``; -1 keeps a dim; new dims are prepended (torch.expand)."""
        sizes = _sizes(sizes)
        lead = len(sizes) - self.ndim
        if lead < 0:
            raise ValueError(f"expand{sizes}: fewer sizes than the {self.ndim} dims of {self!r}")
        shape = tuple(
            self.shape[i - lead] if s == -1 and i >= lead else s for i, s in enumerate(sizes)
        )
        return _ops().broadcast_to(self, shape)

    def expand_as(self, other):
        return _ops().broadcast_to(self, other.shape)

    def broadcast_to(self, *shape):
        return _ops().broadcast_to(self, _sizes(shape))

    def repeat(self, *sizes):
        """Tile ``sizes[i]`` copies along each dim, new leading dims for extra sizes
        (torch.Tensor.repeat): one broadcast over interleaved size-1 dims, then a reshape."""
        sizes = tuple(int(s) for s in _sizes(sizes))
        if len(sizes) < self.ndim:
            raise ValueError(f"repeat{sizes}: fewer sizes than the {self.ndim} dims of {self!r}")
        shape = (1,) * (len(sizes) - self.ndim) + self.shape
        x = self.reshape(tuple(v for s in shape for v in (1, s)))
        x = _ops().broadcast_to(x, tuple(v for r, s in zip(sizes, shape) for v in (r, s)))
        return x.reshape(tuple(r * s for r, s in zip(sizes, shape)))

    def chunk(self, chunks: int, dim: int = 0):
        return _ops().chunk(self, chunks, dim)

    def split(self, split_size, dim: int = 0):
        return _ops().split(self, split_size, dim)

    def unbind(self, dim: int = 0):
        """The slices along ``dim``, that dim removed (torch.unbind), as a tuple."""
        return tuple(_ops().select(self, dim, i) for i in range(self.shape[dim]))

    def narrow(self, dim: int, start: int, length: int):
        return _ops().narrow(self, dim, start, length)

    def select(self, dim: int, index: int):
        return _ops().select(self, dim, index)

    def gather(self, dim: int, index):
        return _ops().gather(self, dim, index)

    def index_select(self, dim: int, index):
        return _ops().index_select(self, dim, index)

    def index_copy_(self, dim: int, index, source):
        """In place on a Buffer's state (``ops.inplace``); returns the written storage."""
        return _ops().index_copy_(self, dim, index, source)

    def new_full(self, size, fill_value, *, dtype=None, **kwargs):
        """``size`` filled with ``fill_value``, in this tensor's dtype unless ``dtype``."""
        t = self.builder.constant(fill_value, self.dtype if dtype is None else as_dtype(dtype))
        shape = tuple(int(s) for s in size)
        return _ops().broadcast_to(t, shape) if shape else t

    def new_zeros(self, *size, dtype=None, **kwargs):
        return self.new_full(_sizes(size), 0, dtype=dtype)

    def new_ones(self, *size, dtype=None, **kwargs):
        return self.new_full(_sizes(size), 1, dtype=dtype)

    # ---- reductions --------------------------------------------------------------------------
    def sum(self, dim=None, keepdim: bool = False, *, dtype=None):
        return _ops().sum(self, dim, keepdim, dtype=dtype)

    def mean(self, dim=None, keepdim: bool = False, *, dtype=None):
        return _ops().mean(self, dim, keepdim, dtype=dtype)

    def _var_args(self, dim, unbiased, keepdim, correction) -> dict:
        if correction is None:
            correction = 1 if unbiased is None else int(bool(unbiased))
        return {"correction": correction, "keepdim": keepdim}

    def var(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
        """torch.Tensor.var: ``var(dim, unbiased, keepdim)`` or ``correction=``."""
        return _ops().var(self, dim, **self._var_args(dim, unbiased, keepdim, correction))

    def std(self, dim=None, unbiased=None, keepdim: bool = False, *, correction=None):
        return _ops().std(self, dim, **self._var_args(dim, unbiased, keepdim, correction))

    def max(self, dim=None, keepdim: bool = False):
        """``max()`` (the maximum), ``max(dim)`` (``(values, indices)``, a named tuple) or
        ``max(other)`` (``maximum``), as torch.Tensor.max."""
        if dim is not None and not isinstance(dim, (int, np.integer)):
            return _ops().maximum(self, dim)
        return _ops().max(self, dim, keepdim)

    def min(self, dim=None, keepdim: bool = False):
        """The mirror of :meth:`max`."""
        if dim is not None and not isinstance(dim, (int, np.integer)):
            return _ops().minimum(self, dim)
        return _ops().min(self, dim, keepdim)

    def amax(self, dim=None, keepdim: bool = False):
        return _ops().amax(self, dim, keepdim)

    def amin(self, dim=None, keepdim: bool = False):
        return _ops().amin(self, dim, keepdim)

    def argmax(self, dim=None, keepdim: bool = False):
        return _ops().argmax(self, dim, keepdim)

    def argmin(self, dim=None, keepdim: bool = False):
        return _ops().argmin(self, dim, keepdim)

    def logsumexp(self, dim, keepdim: bool = False):
        return _ops().logsumexp(self, dim, keepdim)

    def cumsum(self, dim: int):
        return _ops().cumsum(self, dim)

    def any(self, dim=None, keepdim: bool = False):
        """Whether any element (along ``dim``) is nonzero, as bool (torch.any)."""
        hit = _ops().cast(_ops().ne(self, 0), DType.i32)
        return _ops().greater(_ops().amax(hit, dim, keepdim), 0)

    def all(self, dim=None, keepdim: bool = False):
        """Whether every element (along ``dim``) is nonzero, as bool (torch.all)."""
        hit = _ops().cast(_ops().ne(self, 0), DType.i32)
        return _ops().greater(_ops().amin(hit, dim, keepdim), 0)

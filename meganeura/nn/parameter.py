"""Parameter and Buffer: the named persistent tensors of a Module.

Before a model's first compiled call their values live on the host (NumPy); from then on they
live on the GPU once, in the device's :class:`~meganeura.runtime.shared.SharedStore`, and every
compiled program of the model binds them there. ``.data`` reads the current value wherever it
lives (a GPU read-back once resident), and assigning ``.data`` writes it there.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType

# Bumped by every change that can change a traced signature (a module's train/eval mode, a
# parameter's requires_grad, the module tree), so per-call signature keys are cached safely.
VERSION = [0]


def bump_version() -> None:
    VERSION[0] += 1


class UninitializedParameterError(RuntimeError):
    """A parameter or buffer was used before it was initialized or loaded."""


_NUMPY_TO_DTYPE = {
    np.dtype(np.float32): DType.f32,
    np.dtype(np.float16): DType.f16,
    np.dtype(np.int32): DType.i32,
    np.dtype(np.uint32): DType.u32,
    np.dtype(np.bool_): DType.bool,
}


def dtype_of(array: np.ndarray, what: str) -> DType:
    """The meganeura DType of a NumPy array's dtype.

    Raises:
        TypeError: a dtype meganeura does not store (float64, int64 ... convert first).
    """
    dt = _NUMPY_TO_DTYPE.get(np.dtype(array.dtype))
    if dt is None:
        raise TypeError(
            f"{what}: NumPy dtype {array.dtype} is not stored by meganeura; use float32, "
            "float16, int32, uint32 or bool"
        )
    return dt


def narrow_to_stored(arr: np.ndarray, what: str) -> np.ndarray:
    """float64 as float32 and int64 as int32 (as JAX does by default); other dtypes as they are.
    float64 values beyond float32's range become +-inf without a warning, as in
    ``torch.tensor(1e39)``.

    Raises:
        ValueError: int64 values outside the int32 range.
    """
    if arr.dtype == np.float64:
        with np.errstate(over="ignore"):
            return arr.astype(np.float32)
    if arr.dtype == np.int64:
        if arr.size and (arr.min() < -(2**31) or arr.max() >= 2**31):
            raise ValueError(f"{what}: int64 values outside the int32 range")
        return arr.astype(np.int32)
    return arr


class _Persistent:
    """Common part of Parameter and Buffer: shape, dtype, host value or GPU residency."""

    __slots__ = ("_host", "_shape", "_dtype", "_store", "__weakref__")

    def __init__(self, data, shape=None, dtype: DType | None = None) -> None:
        if data is None:
            if shape is None:
                raise ValueError(f"{type(self).__name__} without data needs a shape")
            self._host = None
            self._shape = tuple(int(s) for s in shape)
            self._dtype = dtype or DType.f32
        else:
            arr = np.array(data, copy=True)
            if arr.dtype == np.float64:
                arr = arr.astype(np.float32)
            self._dtype = dtype_of(arr, type(self).__name__)
            self._shape = arr.shape
            self._host = np.require(arr, requirements="C")
        self._store = None

    @property
    def shape(self) -> tuple[int, ...]:
        return self._shape

    @property
    def dtype(self) -> DType:
        return self._dtype

    @property
    def ndim(self) -> int:
        return len(self._shape)

    def numel(self) -> int:
        return int(np.prod(self._shape, dtype=np.int64))

    def size(self, dim: int | None = None):
        return self._shape if dim is None else self._shape[dim]

    @property
    def is_initialized(self) -> bool:
        return self._host is not None or (self._store is not None and self._store.resident(self))

    @property
    def data(self) -> np.ndarray:
        """The current value: a read-only host copy (read back from the GPU once resident).
        It is read-only so that an in-place edit (``p.data[...] = 0``), which in PyTorch would
        change the parameter, raises instead of silently changing a copy: assign instead
        (``p.data = value`` or ``p.copy_(value)``). ``numpy()`` gives a writable copy.

        Raises:
            UninitializedParameterError: never initialized or loaded.
        """
        if self._store is not None and self._store.resident(self):
            arr = self._store.read(self)
        elif self._host is None:
            raise UninitializedParameterError(
                f"this {type(self).__name__.lower()} of shape {self._shape} was never "
                "initialized or loaded"
            )
        else:
            arr = self._host.copy()
        arr.setflags(write=False)
        return arr

    @data.setter
    def data(self, value) -> None:
        self.copy_(value)

    def copy_(self, value) -> None:
        """Overwrite the value, converting floating dtypes to this tensor's dtype.

        Raises:
            ValueError: a different shape. TypeError: a non-numeric value.
        """
        arr = _as_array(value)
        if arr.shape != self._shape:
            raise ValueError(
                f"cannot copy a value of shape {arr.shape} into a {type(self).__name__.lower()} "
                f"of shape {self._shape}"
            )
        arr = np.require(convert(arr, self._dtype), requirements="C")
        if self._store is not None and self._store.resident(self):
            self._store.write(self, arr)
        else:
            self._host = arr

    def __deepcopy__(self, memo):
        """A new tensor of the same class and flags holding a host copy of the value (read
        back from the GPU once resident; none for an uninitialized one)."""
        new = object.__new__(type(self))
        memo[id(self)] = new
        for cls in type(self).__mro__:
            for slot in getattr(cls, "__slots__", ()):
                if slot != "__weakref__" and hasattr(self, slot):
                    object.__setattr__(new, slot, getattr(self, slot))
        new._store = None
        new._host = self.data if self.is_initialized else None
        return new

    def numpy(self) -> np.ndarray:
        """A writable host copy of the value (changing it does not change the tensor)."""
        arr = self.data.copy()
        return arr

    def __array__(self, dtype=None, copy=None):
        arr = self.data
        return arr if dtype is None else arr.astype(dtype)


def _as_array(value) -> np.ndarray:
    if hasattr(value, "detach") and hasattr(value, "cpu"):  # a torch.Tensor, without importing it
        value = value.detach().cpu()
        if str(value.dtype) == "torch.bfloat16":
            value = value.float()
        value = value.numpy()
    if isinstance(value, _Persistent):
        value = value.data
    arr = np.asarray(value)
    if arr.dtype == object:
        raise TypeError(f"expected a numeric array, got {type(value).__name__}")
    return arr


def convert(arr: np.ndarray, dtype: DType) -> np.ndarray:
    """``arr`` as ``dtype``: floating values of any width (f16, bf16, f64) convert to a floating
    target, integers to an integer one.

    Raises:
        TypeError: floating into integer, or integers into floating of a value that is not exact.
    """
    want = dtype.numpy
    if arr.dtype == want:
        return arr
    if arr.dtype.name == "bfloat16":  # ml_dtypes' bfloat16: the high half of an f32
        arr = (arr.view(np.uint16).astype(np.uint32) << 16).view(np.float32)
    kind = arr.dtype.kind
    if dtype.is_floating:
        if kind not in "fiub":
            raise TypeError(f"cannot convert {arr.dtype} to {dtype}")
        return arr.astype(want)
    if kind == "f":
        raise TypeError(f"cannot convert floating {arr.dtype} to {dtype}")
    info = np.iinfo(want) if dtype is not DType.bool else None
    if info is not None and arr.size and (arr.min() < info.min or arr.max() > info.max):
        raise TypeError(f"values of {arr.dtype} outside the range of {dtype}")
    return arr.astype(want)


class Parameter(_Persistent):
    """A trainable tensor of a Module (``torch.nn.Parameter``).

    Args:
        data: initial value (any array-like; float64 is stored as float32), or None for an
            uninitialized parameter of ``shape`` (it must be loaded before the model runs).
        requires_grad: False freezes it: the Trainer neither differentiates nor updates it.
        shape, dtype: for ``data=None``.
    """

    __slots__ = ("_requires_grad",)

    def __init__(self, data=None, requires_grad: bool = True, *, shape=None, dtype=None) -> None:
        super().__init__(data, shape, dtype)
        self._requires_grad = bool(requires_grad)

    @property
    def requires_grad(self) -> bool:
        return self._requires_grad

    @requires_grad.setter
    def requires_grad(self, value: bool) -> None:
        self._requires_grad = bool(value)
        bump_version()

    def requires_grad_(self, requires_grad: bool = True) -> Parameter:
        self.requires_grad = requires_grad
        return self

    def __repr__(self) -> str:
        flag = "" if self.requires_grad else ", requires_grad=False"
        return f"Parameter({self._dtype}{list(self._shape)}{flag})"


class Buffer(_Persistent):
    """A non-trainable tensor of a Module (``torch.nn.Buffer``): running statistics, masks.

    Args:
        data: the value (or None with ``shape`` for one loaded later).
        persistent: False leaves it out of ``state_dict``.
        host_only: kept on the host and never read by a compiled program (BatchNorm's
            ``num_batches_tracked``, int64 in PyTorch's state dicts).
    """

    __slots__ = ("persistent", "host_only")

    def __init__(
        self, data=None, persistent: bool = True, *, shape=None, dtype=None, host_only=False
    ) -> None:
        self.host_only = bool(host_only)
        if host_only:
            arr = np.array(data, copy=True)
            self._host, self._shape, self._store = arr, arr.shape, None
            self._dtype = None
        else:
            super().__init__(data, shape, dtype)
        self.persistent = bool(persistent)

    def copy_(self, value) -> None:
        if self.host_only:
            arr = _as_array(value)
            if arr.shape != self._shape:
                raise ValueError(f"cannot copy shape {arr.shape} into a buffer of {self._shape}")
            self._host = arr.astype(self._host.dtype)
            return
        super().copy_(value)

    def __repr__(self) -> str:
        return f"Buffer({self._dtype}{list(self._shape)})"

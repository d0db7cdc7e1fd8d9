"""Tensor creation as ``torch.zeros`` & co., usable on both sides of tracing.

Inside a traced ``forward`` they make graph tensors (a scalar constant broadcast to the shape,
or a NumPy constant); outside, they return NumPy arrays, so ``nn.Parameter(mn.zeros(4, 8))`` in
``__init__`` reads as it does in PyTorch. Random draws (``randn``, ``rand``) come from the global
generator (``meganeura.manual_seed``) and exist only outside tracing: a traced program has no
random state besides dropout's.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import check_fill_value
from .tracing import TraceError, current_trace


def _shape(size) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        size = tuple(size[0])
    return tuple(int(s) for s in size)


def _np_dtype(dtype) -> np.dtype:
    if dtype is None:
        return np.dtype(np.float32)
    if isinstance(dtype, DType):
        return np.dtype(dtype.numpy)
    return np.dtype(dtype)


def full(size, fill_value, dtype=None):
    """An array (or, while tracing, a Tensor) of ``size`` filled with ``fill_value``.

    Raises:
        ValueError: while tracing, a finite float ``fill_value`` beyond the dtype's range
            (1e39 for f32), as ``torch.full`` refuses it; inf, -inf and NaN are accepted.
    """
    shape = tuple(int(s) for s in size)
    trace = current_trace()
    if trace is None:
        return np.full(shape, fill_value, _np_dtype(dtype))
    from ..ops import functional as F

    dt = dtype if isinstance(dtype, DType) else DType.f32
    if dtype is not None and not isinstance(dtype, DType):
        dt = {"f": DType.f32, "i": DType.i32, "u": DType.u32, "b": DType.bool}[
            _np_dtype(dtype).kind
        ]
    check_fill_value("full", fill_value, dt)
    c = trace.builder.constant(fill_value, dt)
    return F.broadcast_to(c, shape) if shape else c


def zeros(*size, dtype=None):
    """``torch.zeros``: zeros of the shape (f32 by default)."""
    return full(_shape(size), 0, dtype)


def ones(*size, dtype=None):
    """``torch.ones``: ones of the shape (f32 by default)."""
    return full(_shape(size), 1, dtype)


def zeros_like(input, dtype=None):  # noqa: A002
    return full(input.shape, 0, dtype if dtype is not None else input.dtype)


def ones_like(input, dtype=None):  # noqa: A002
    return full(input.shape, 1, dtype if dtype is not None else input.dtype)


def tensor(data, dtype=None):
    """``torch.tensor``: a copy of ``data`` as an array, or while tracing a constant Tensor
    (float64 data is stored as f32, int64 as i32)."""
    # Values beyond float32's range become +-inf, silently, as in torch.tensor([1e39]).
    with np.errstate(over="ignore"):
        arr = np.array(data, dtype=None if dtype is None else _np_dtype(dtype))
        trace = current_trace()
        if trace is None:
            return arr.astype(np.float32) if arr.dtype == np.float64 else arr
        return trace.constant(arr)


def _host_random(what: str):
    if current_trace() is not None:
        raise TraceError(
            f"{what} inside a traced forward: the program has no random state (draw on the "
            "host and pass the array as an argument, or use dropout)"
        )
    from ..random import default_generator

    return default_generator()


def randn(*size, dtype=None) -> np.ndarray:
    """``torch.randn``: N(0, 1) draws from the global generator (host only)."""
    return _host_random("randn").standard_normal(_shape(size)).astype(_np_dtype(dtype))


def rand(*size, dtype=None) -> np.ndarray:
    """``torch.rand``: U[0, 1) draws from the global generator (host only)."""
    return _host_random("rand").random(_shape(size)).astype(_np_dtype(dtype))

"""Resampling (torch.nn.functional.interpolate): nearest, linear/bilinear/trilinear and area,
as composites of existing ops, so autodiff gives the gradients (no op of its own).

Each spatial dim is resampled on its own (the modes are separable), in dim order. Source
positions follow ATen's CPU kernels (``UpSample.h``, ``UpSampleKernel.cpp``) in f32, the
arithmetic PyTorch uses for float32 input, computed in the graph from ``arange``:
  * scale: ``1 / scale_factor`` (rounded to f32) when a scale factor is given and not
    recomputed, else ``f32(in) / f32(out)``; with ``align_corners=True`` (linear modes)
    ``f32(in - 1) / f32(out - 1)`` (0 when out = 1);
  * nearest: ``src = min(floor(f32(dst) * scale), in - 1)``, read with ``index_select``. For
    4-d input ATen's kernel (``nearest_idx``) keeps two older special cases, which 3-d and
    5-d inputs do not get: out = in copies and out = 2 in reads ``dst // 2``, whatever the
    scale factor (``interpolate(x, scale_factor=1.3)`` of a height 3 keeps it: 3 -> 3 rows);
    we follow both. When the source is ``dst // k`` for a whole factor k (checked on the
    host, in the same arithmetic) the input is broadcast to [.., in, k, ..] instead of
    gathered (one copy; the gradient a block sum);
  * linear: ``src = scale * dst`` (align_corners) or ``max(scale * (dst + 0.5) - 0.5, 0)``;
    ``i0 = min(floor(src), in - 1)``, ``i1 = i0 + (i0 < in - 1)``, ``l1 = clamp(src - i0, 0,
    1)``, ``out = x[i0] (1 - l1) + x[i1] l1``; a dim whose size does not change is copied, as
    ATen does whatever the scale;
  * area: ``adaptive_avg_pool2d`` to the output size (4-d input).
For float64 input PyTorch computes the linear modes' positions, and the nearest positions of
3-d and 5-d input, in float64, so its float64 results can pick another nearest neighbour
where ``dst * scale`` lands within an f32 rounding of an integer (18 of the 3,471 size pairs
with in < 40, out < 90, in 1-d); ours match its float32 results.
Index tensors are i32 and tiny (one per resampled dim); the gradient of each linear dim is
two ``index_select_backward`` scatter-adds.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor
from . import elementwise as E
from . import functional as F
from .creation import arange
from .gather import index_select
from .pool import adaptive_avg_pool2d, unbatched

LINEAR_MODES = {"linear": 3, "bilinear": 4, "trilinear": 5}
MODES = ("nearest", "area", *LINEAR_MODES)


def output_size(
    input_size: Sequence[int],
    size: int | Sequence[int] | None,
    scale_factor: float | Sequence[float] | None,
    recompute_scale_factor: bool | None,
) -> tuple[tuple[int, ...], tuple[float | None, ...]]:
    """(output sizes, scale factors the coordinate mapping uses: None where it uses in/out)
    for the spatial sizes ``input_size``, as torch.nn.functional.interpolate computes them.

    Raises:
        ValueError: neither or both of size and scale_factor, a sequence of the wrong
            length, recompute_scale_factor with a size, a factor <= 0, or an empty output.
    """
    dims = len(input_size)
    if (size is None) == (scale_factor is None):
        raise ValueError("interpolate: give exactly one of size and scale_factor")
    if size is not None:
        if recompute_scale_factor:
            raise ValueError("recompute_scale_factor is not meaningful with an explicit size")
        out = tuple(size) if isinstance(size, (tuple, list)) else (size,) * dims
        if len(out) != dims:
            raise ValueError(f"interpolate: size {size!r} needs {dims} entries")
        out, scales = tuple(int(s) for s in out), (None,) * dims
    else:
        sf = tuple(scale_factor) if isinstance(scale_factor, (tuple, list)) else (scale_factor,)
        sf = sf * dims if len(sf) == 1 else sf
        if len(sf) != dims:
            raise ValueError(f"interpolate: scale_factor {scale_factor!r} needs {dims} entries")
        if not all(float(f) > 0 and math.isfinite(float(f)) for f in sf):
            raise ValueError(f"interpolate: scale factors must be positive, got {scale_factor!r}")
        out = tuple(math.floor(float(n) * float(f)) for n, f in zip(input_size, sf))
        scales = (None,) * dims if recompute_scale_factor else tuple(float(f) for f in sf)
    if min(out) < 1:
        raise ValueError(f"interpolate: output size {out} of input {tuple(input_size)} is empty")
    return out, scales


def source_scale(n_in: int, n_out: int, factor: float | None, align_corners: bool) -> float:
    """The f32 scale mapping output to input positions (ATen's ``area_pixel_compute_scale``)."""
    if align_corners:
        return float(np.float32(n_in - 1) / np.float32(n_out - 1)) if n_out > 1 else 0.0
    if factor is not None:
        return float(np.float32(1.0 / factor))
    return float(np.float32(n_in) / np.float32(n_out))


def nearest_source_np(n_in: int, n_out: int, scale: float, legacy: bool) -> np.ndarray:
    """The nearest-mode source index of each output position, in the graph's f32 arithmetic;
    ``legacy``: with ATen's special cases for 4-d input (same size, double size)."""
    if legacy and n_out in (n_in, 2 * n_in):
        return np.arange(n_out) // (n_out // n_in)
    src = np.arange(n_out, dtype=np.float32) * np.float32(scale)
    return np.minimum(src.astype(np.int64), n_in - 1)


def _along(t: Tensor, ndim: int, axis: int) -> Tensor:
    """A 1-D [n] tensor shaped to broadcast along ``axis`` of an ``ndim``-d tensor."""
    return F.reshape(t, (t.shape[0],) + (1,) * (ndim - 1 - axis))


def _nearest_axis(x: Tensor, axis: int, n_out: int, factor: float | None) -> Tensor:
    n_in = x.shape[axis]
    scale = source_scale(n_in, n_out, factor, False)
    src = nearest_source_np(n_in, n_out, scale, legacy=x.ndim == 4)
    if n_out == n_in and np.array_equal(src, np.arange(n_out)):
        return x
    k = n_out // n_in
    if n_out == k * n_in and np.array_equal(src, np.arange(n_out) // k):
        shape = x.shape
        y = F.reshape(x, shape[: axis + 1] + (1,) + shape[axis + 1 :])
        y = F.broadcast_to(y, shape[: axis + 1] + (k,) + shape[axis + 1 :])
        return F.reshape(y, shape[:axis] + (n_out,) + shape[axis + 1 :])
    pos = arange(n_out, dtype=DType.f32, builder=x.builder) * scale
    index = F.minimum(F.cast(pos, DType.i32), n_in - 1)
    return index_select(x, axis, index)


def _linear_axis(
    x: Tensor, axis: int, n_out: int, factor: float | None, align_corners: bool
) -> Tensor:
    n_in = x.shape[axis]
    if n_out == n_in:
        return x
    scale = source_scale(n_in, n_out, factor, align_corners)
    dst = arange(n_out, dtype=DType.f32, builder=x.builder)
    src = dst * scale if align_corners else E.clamp((dst + 0.5) * scale - 0.5, min=0.0)
    i0 = F.minimum(F.cast(src, DType.i32), n_in - 1)
    i1 = i0 + F.cast(F.less(i0, n_in - 1), DType.i32)
    l1 = E.clamp(src - F.cast(i0, DType.f32), min=0.0, max=1.0)
    l0 = 1.0 - l1
    if x.dtype is not DType.f32:
        l0, l1 = F.cast(l0, x.dtype), F.cast(l1, x.dtype)
    lo, hi = index_select(x, axis, i0), index_select(x, axis, i1)
    return lo * _along(l0, x.ndim, axis) + hi * _along(l1, x.ndim, axis)


def interpolate(
    input: Tensor,  # noqa: A002 - PyTorch's name
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
    align_corners: bool | None = None,
    recompute_scale_factor: bool | None = None,
    antialias: bool = False,
) -> Tensor:
    """Resample the spatial dims of ``input``, as torch.nn.functional.interpolate.

    Args:
        input: floating [N, C, *spatial] with 1, 2 or 3 spatial dims.
        size: output spatial size (an int for every dim, or one per dim); or
        scale_factor: float or one per dim; output size ``floor(in * scale_factor)``, and,
            unless ``recompute_scale_factor``, the coordinate mapping uses ``1 / scale_factor``
            (which differs from in/out when the product is not whole).
        mode: ``"nearest"`` (any sizes), ``"linear"`` (3-d), ``"bilinear"`` (4-d),
            ``"trilinear"`` (5-d) or ``"area"`` (4-d: adaptive average pooling).
        align_corners: linear modes only (default False): map corner pixels' centres onto
            each other, ``src = dst * (in - 1) / (out - 1)``.
        recompute_scale_factor: map coordinates with in/out even when a scale factor gives
            the size.
        antialias: must be False.

    Returns:
        [N, C, *output size], input's dtype.

    Raises:
        ValueError: invalid size/scale arguments (``output_size``), or align_corners with
            nearest or area.
        NotImplementedError: other modes, antialias, or a mode that does not fit the rank.
    """
    if mode not in MODES:
        raise NotImplementedError(f"interpolate: mode {mode!r} is not supported (one of {MODES})")
    if antialias:
        raise NotImplementedError("interpolate: antialias=True is not supported")
    if mode in ("nearest", "area"):
        if align_corners is not None:
            raise ValueError(
                "align_corners option can only be set with the interpolating modes: "
                "linear | bilinear | trilinear"
            )
    elif input.ndim != LINEAR_MODES[mode]:
        raise NotImplementedError(
            f"interpolate: got {input.ndim}D input, but {mode} mode needs "
            f"{LINEAR_MODES[mode]}D input"
        )
    if not 3 <= input.ndim <= 5 or (mode == "area" and input.ndim != 4):
        raise NotImplementedError(
            f"interpolate: {mode} mode on {input.ndim}D input is not supported"
        )
    out, factors = output_size(input.shape[2:], size, scale_factor, recompute_scale_factor)
    if mode == "area":
        return adaptive_avg_pool2d(input, out)
    y = input
    for i, (n_out, factor) in enumerate(zip(out, factors)):
        if mode == "nearest":
            y = _nearest_axis(y, 2 + i, n_out, factor)
        else:
            y = _linear_axis(y, 2 + i, n_out, factor, bool(align_corners))
    return y


def upsample_nearest2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
) -> Tensor:
    """``interpolate(input, size, scale_factor, mode="nearest")`` for [N, C, H, W] or
    unbatched [C, H, W] input (ATen's upsample_nearest2d)."""
    return unbatched(input, 4, lambda x: interpolate(x, size, scale_factor, "nearest"))


def upsample_bilinear2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    align_corners: bool = False,
) -> Tensor:
    """``interpolate(input, size, scale_factor, mode="bilinear", align_corners)`` for
    [N, C, H, W] or unbatched [C, H, W] input (ATen's upsample_bilinear2d; the deprecated
    torch.nn.functional.upsample_bilinear is this with ``align_corners=True``)."""
    return unbatched(
        input, 4, lambda x: interpolate(x, size, scale_factor, "bilinear", align_corners)
    )

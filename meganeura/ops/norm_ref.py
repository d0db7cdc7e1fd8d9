"""Layout and NumPy references of the normalization ops (see ``ops/norm.py``).

``group_dims`` is the one place that says what a *group* (the elements normalized together)
and a *channel* (the elements sharing one weight) are for each norm; the WGSL lowerings use
it too. The references compute in the inputs' dtype (float64 in gradient checks), with the
same two-pass statistics the kernels use.
"""

from __future__ import annotations

import math

import numpy as np

from .registry import ShapeError


# ---- layout -----------------------------------------------------------------------------------
def group_dims(shape: tuple[int, ...], kind: str, attrs) -> tuple[int, int, tuple[int, ...]]:
    """(number of groups, elements per group, weight shape) of ``kind`` on ``shape``.

    Raises:
        ShapeError: when the attributes do not fit the shape.
    """
    if kind in ("layer_norm", "rms_norm"):
        k = attrs["normalized_ndim"]
        if not isinstance(k, int) or not 1 <= k <= len(shape):
            raise ShapeError(f"normalized_ndim {k!r} invalid for a {len(shape)}-d input")
        m = math.prod(shape[-k:])
        return math.prod(shape[:-k]), m, tuple(shape[-k:])
    if len(shape) < 2:
        raise ShapeError(f"expects an input [N, C, *] of at least 2 dims, got {list(shape)}")
    n, c, s = shape[0], shape[1], math.prod(shape[2:])
    if kind == "group_norm":
        g = attrs["num_groups"]
        if not isinstance(g, int) or g < 1 or c % g:
            raise ShapeError(f"num_groups {g!r} must be a positive divisor of the {c} channels")
        return n * g, (c // g) * s, (c,)
    return c, n * s, (c,)


def affine_view(p: np.ndarray, ndim: int, kind: str) -> np.ndarray:
    """A weight/bias/statistic array shaped to broadcast against the input."""
    p = np.asarray(p)
    if p.ndim == 0 or kind in ("layer_norm", "rms_norm"):
        return p
    return p.reshape((p.shape[0],) + (1,) * (ndim - 2))


def _grouped(x: np.ndarray, kind: str, attrs) -> np.ndarray:
    """``x`` as [groups, elements per group] (a copy for batch_norm)."""
    g, m, _ = group_dims(x.shape, kind, attrs)
    if kind != "batch_norm":
        return x.reshape(g, m)
    n, c = x.shape[:2]
    return x.reshape(n, c, -1).transpose(1, 0, 2).reshape(g, m)


def _ungrouped(y: np.ndarray, shape: tuple[int, ...], kind: str) -> np.ndarray:
    if kind != "batch_norm":
        return y.reshape(shape)
    n, c = shape[:2]
    return np.ascontiguousarray(y.reshape(c, n, -1).transpose(1, 0, 2)).reshape(shape)


def centered(xg: np.ndarray, rms: bool) -> tuple[np.ndarray, np.ndarray]:
    """(x - mean per group, mean) of ``xg [G, m]`` (keepdims); for rms_norm (x, 0).

    The mean is taken of ``x - x[:, :1]`` and subtracted from that, so a large common offset
    cancels exactly before any rounding (shifted-data algorithm), as in the kernels.
    """
    if rms:
        return xg, np.zeros((xg.shape[0], 1), xg.dtype)
    shift = xg[:, :1]
    d = xg - shift
    mean_d = np.mean(d, axis=1, keepdims=True)
    return d - mean_d, shift + mean_d


def _rstd(dev: np.ndarray, eps: float) -> np.ndarray:
    return 1.0 / np.sqrt(np.mean(dev * dev, axis=1, keepdims=True) + eps)


def _xhat(x: np.ndarray, kind: str, attrs) -> np.ndarray:
    """Normalized x, in x's layout."""
    dev, _ = centered(_grouped(x, kind, attrs), kind == "rms_norm")
    return _ungrouped(dev * _rstd(dev, attrs["eps"]), x.shape, kind)


def channel_axes(ndim: int, kind: str, attrs) -> tuple[int, ...]:
    """Axes summed to reduce a per-element value to the weight's shape."""
    if kind in ("layer_norm", "rms_norm"):
        return tuple(range(ndim - attrs["normalized_ndim"]))
    return (0, *range(2, ndim))


# ---- NumPy references -------------------------------------------------------------------------
def norm_np(kind: str):
    def ref(xs, a):
        x = np.asarray(xs[0])
        if kind == "batch_norm" and not a["training"]:
            _, mean, var, w, b = xs
            mean, var = affine_view(mean, x.ndim, kind), affine_view(var, x.ndim, kind)
            xhat = (x - mean) / np.sqrt(var + a["eps"])
        else:
            w, b = xs[1], (xs[2] if len(xs) > 2 else 0.0)
            xhat = _xhat(x, kind, a)
        y = xhat * affine_view(w, x.ndim, kind) + affine_view(b, x.ndim, kind)
        return np.asarray(y).astype(x.dtype, copy=False)

    return ref


def backward_np(kind: str):
    def ref(xs, a):
        x, w, g = (np.asarray(v) for v in xs)
        gw = _grouped(g * affine_view(w, x.ndim, kind), kind, a)
        xg = _grouped(x, kind, a)
        dev, _ = centered(xg, kind == "rms_norm")
        rstd = _rstd(dev, a["eps"])
        xh = dev * rstd
        dx = gw - xh * np.mean(gw * xh, axis=1, keepdims=True)
        if kind != "rms_norm":
            dx = dx - np.mean(gw, axis=1, keepdims=True)
        return _ungrouped(rstd * dx, x.shape, kind).astype(x.dtype, copy=False)

    return ref


def weight_backward_np(kind: str):
    def ref(xs, a):
        x, g = (np.asarray(v) for v in xs)
        xhat = _xhat(x, kind, a)
        dw = np.sum(g * xhat, axis=channel_axes(x.ndim, kind, a))
        return np.asarray(dw).astype(x.dtype, copy=False)

    return ref


def batch_stats_np(xs, a):
    """``batch_norm_stats(x)``: [2, C], the batch mean and the unbiased variance per channel."""
    x = np.asarray(xs[0])
    xg = _grouped(x, "batch_norm", {"eps": 0.0})
    dev, mean = centered(xg, False)
    var = np.sum(dev * dev, axis=1) / (xg.shape[1] - 1)
    return np.stack([mean[:, 0], var]).astype(x.dtype, copy=False)


def _blend(stats, rm, rv, a):
    mom = a["momentum"]
    new_m = mom * stats[0] + (1 - mom) * rm
    new_v = mom * stats[1] + (1 - mom) * rv
    return new_m.astype(rm.dtype, copy=False), new_v.astype(rv.dtype, copy=False)


def update_stats_into_np(xs, a):
    """``batch_norm_update_stats_into(stats, src_mean, src_var, mean, var, take_src, clip)``."""
    stats, sm, sv, dm, dv, take, clip = (np.asarray(v) for v in xs)
    if (np.asarray(clip, np.float32).view(np.uint32) & 0x7F800000) == 0x7F800000:
        return dm, dv
    return _blend(stats, *((sm, sv) if take != 0 else (dm, dv)), a)


def update_stats_np(xs, a):
    x, rm, rv = (np.asarray(v) for v in xs[:3])
    if len(xs) == 4:  # the guard's clip coefficient: non-finite means the step was skipped
        bits = np.asarray(xs[3], np.float32).view(np.uint32)
        if (bits & 0x7F800000) == 0x7F800000:
            return rm, rv
    return _blend(batch_stats_np([x], a), rm, rv, a)

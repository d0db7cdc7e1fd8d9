"""Pooling ops on NCHW tensors, PyTorch semantics (the CPU kernels as reference).

* ``max_pool2d``: padding reads as -inf and is never chosen; the gradient goes only to the
  element that produced each max, the first in scan order on ties and any NaN winning, as
  PyTorch's CPU kernel does (``val > max || isnan(val)``). ``max_pool2d_backward(x, g)``
  recomputes that argmax, so no index tensor lives between forward and backward.
* ``avg_pool2d``: divisor as ATen's ``AvgPoolKernel``: windows clipped to ``H + pad``
  (``count_include_pad``) or to the input, or ``divisor_override``.
* ``adaptive_avg_pool2d``: window ``[floor(i H / OH), ceil((i + 1) H / OH))``; the output
  (1, 1) case is ``mean`` over (H, W), an exact composite using the reduction kernel.

Output sizes follow ATen's ``pooling_output_shape`` (``ceil_mode`` included), and every
window must overlap the input (a window wholly in padding is rejected when the graph is built).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ..graph.builder import Tensor
from ..graph.ir import TensorType
from . import functional as F
from .registry import OpDef, ShapeError


def pair(v, what: str) -> tuple[int, int]:
    """``v`` as a 2-tuple of ints (an int is repeated), like torch's ``_pair``."""
    if isinstance(v, (tuple, list)):
        if len(v) != 2:
            raise ValueError(f"{what} must be an int or a pair, got {v!r}")
        return (int(v[0]), int(v[1]))
    return (int(v), int(v))


def unbatched(x: Tensor, ndim: int, fn: Callable[[Tensor], Tensor]) -> Tensor:
    """Apply ``fn`` (which expects ``ndim`` dims) to ``x``, adding and removing a batch of one
    when ``x`` has ``ndim - 1`` dims (PyTorch's unbatched inputs)."""
    if x.ndim != ndim - 1:
        return fn(x)
    y = fn(F.reshape(x, (1,) + x.shape))
    return F.reshape(y, y.shape[1:])


def pool_out(size: int, k: int, s: int, p: int, d: int, ceil_mode: bool) -> int:
    """ATen's ``pooling_output_shape`` for one dim."""
    span = size + 2 * p - d * (k - 1) - 1 + (s - 1 if ceil_mode else 0)
    out = span // s + 1
    if ceil_mode and (out - 1) * s >= size + p:
        out -= 1
    return out


def _floating4(x: TensorType) -> None:
    if x.ndim != 4 or not x.dtype.is_floating:
        raise ShapeError(f"input must be a floating [N, C, H, W] tensor, got {x}")


def pool_hw(shape: tuple[int, ...], attrs, dilation) -> tuple[int, int]:
    """(OH, OW) of a pooling of an [N, C, H, W] input; raises ShapeError on bad geometry."""
    k, s, p = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    if min(k) < 1 or min(s) < 1 or min(p) < 0 or min(dilation) < 1:
        raise ShapeError(f"need kernel, stride, dilation >= 1 and padding >= 0, got {attrs}")
    if p[0] > k[0] // 2 or p[1] > k[1] // 2:
        raise ShapeError(f"padding {list(p)} must be at most half the kernel {list(k)}")
    out = []
    for i in range(2):
        n = pool_out(shape[2 + i], k[i], s[i], p[i], dilation[i], attrs["ceil_mode"])
        if n < 1:
            raise ShapeError(f"input {list(shape[2:])} too small for kernel {list(k)}")
        for o in range(n):
            first = o * s[i] - p[i]
            taps = range(first, first + dilation[i] * (k[i] - 1) + 1, dilation[i])
            if not any(0 <= t < shape[2 + i] for t in taps):
                raise ShapeError(f"pooling window {o} along dim {2 + i} lies wholly in padding")
        out.append(n)
    return out[0], out[1]


def _max_type(types, attrs):
    (x,) = types
    _floating4(x)
    oh, ow = pool_hw(x.shape, attrs, attrs["dilation"])
    return TensorType(x.shape[:2] + (oh, ow), x.dtype)


def _max_bwd_type(types, attrs):
    x, g = types
    if g != _max_type([x], attrs):
        raise ShapeError(f"grad_output must be {_max_type([x], attrs)}, got {g}")
    return x


def _avg_type(types, attrs):
    (x,) = types
    _floating4(x)
    oh, ow = pool_hw(x.shape, attrs, (1, 1))
    if attrs["divisor_override"] is not None and attrs["divisor_override"] == 0:
        raise ShapeError("divisor_override must be non-zero")
    return TensorType(x.shape[:2] + (oh, ow), x.dtype)


def _from_grad(types, attrs, fwd) -> TensorType:
    (g,) = types
    x = TensorType(g.shape[:2] + tuple(attrs["input_size"]), g.dtype)
    if g.ndim != 4 or fwd([x], attrs) != g:
        raise ShapeError(f"grad_output {g} does not match input size {attrs['input_size']}")
    return x


def _adaptive_type(types, attrs):
    (x,) = types
    if x.ndim != 4 or not x.dtype.is_floating or min(x.shape[2:]) < 1:
        raise ShapeError(f"input must be a floating [N, C, H, W] tensor, H, W >= 1; got {x}")
    if min(attrs["output_size"]) < 1:
        raise ShapeError(f"output_size must be >= 1, got {attrs['output_size']}")
    return TensorType(x.shape[:2] + tuple(attrs["output_size"]), x.dtype)


# ---- NumPy references -------------------------------------------------------------------------
def _taps(x: np.ndarray, attrs, dilation, fill: float, oh: int, ow: int) -> list[np.ndarray]:
    """Per kernel tap, in scan order (kh outer), the [N, C, OH, OW] values it reads; padding
    (and the far side ``ceil_mode`` reaches) reads ``fill``."""
    (kh_, kw_), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    dh, dw = dilation
    n, c, h, w = x.shape
    hp = max(h + 2 * ph, (oh - 1) * sh + dh * (kh_ - 1) + 1)
    wp = max(w + 2 * pw, (ow - 1) * sw + dw * (kw_ - 1) + 1)
    xp = np.full((n, c, hp, wp), fill, x.dtype)
    xp[:, :, ph : ph + h, pw : pw + w] = x
    return [
        xp[:, :, i * dh : i * dh + sh * (oh - 1) + 1 : sh, j * dw : j * dw + sw * (ow - 1) + 1 : sw]
        for i in range(kh_)
        for j in range(kw_)
    ]


def _argmax(x: np.ndarray, attrs, oh: int, ow: int) -> tuple[np.ndarray, np.ndarray]:
    stack = np.stack(_taps(x, attrs, attrs["dilation"], -np.inf, oh, ow), axis=-1)
    return np.max(stack, axis=-1), np.argmax(stack, axis=-1)  # argmax: first max, first NaN


def max_pool2d_np(xs, attrs):
    x = xs[0]
    oh, ow = pool_hw(x.shape, attrs, attrs["dilation"])
    return _argmax(x, attrs, oh, ow)[0]


def max_pool2d_backward_np(xs, attrs):
    x, g = xs
    n, c, h, w = x.shape
    oh, ow = g.shape[2:]
    _, tap = _argmax(x, attrs, oh, ow)
    kw_ = attrs["kernel_size"][1]
    (sh, sw), (ph, pw), (dh, dw) = attrs["stride"], attrs["padding"], attrs["dilation"]
    ih = np.arange(oh)[:, None] * sh - ph + (tap // kw_) * dh
    iw = np.arange(ow)[None, :] * sw - pw + (tap % kw_) * dw
    plane = (np.arange(n * c) * h * w).reshape(n, c, 1, 1)
    dx = np.zeros(n * c * h * w, np.result_type(x, g))
    np.add.at(dx, (plane + ih * w + iw).ravel(), g.ravel())  # scan order, as PyTorch adds
    return dx.reshape(x.shape)


def _avg_divisor(h: int, w: int, oh: int, ow: int, attrs) -> np.ndarray:
    """[OH, OW] divisors of ATen's avg_pool2d."""
    if attrs["divisor_override"] is not None:
        return np.full((oh, ow), float(attrs["divisor_override"]))
    sizes = []
    for size, o, k, s, p in zip(
        (h, w), (oh, ow), *(attrs[a] for a in ("kernel_size", "stride", "padding"))
    ):
        start = np.arange(o) * s - p
        end = np.minimum(start + k, size + p)
        if attrs["count_include_pad"]:
            sizes.append(end - start)
        else:
            sizes.append(np.minimum(end, size) - np.maximum(start, 0))
    return np.outer(sizes[0], sizes[1]).astype(np.float64)


def avg_pool2d_np(xs, attrs):
    x = xs[0]
    oh, ow = pool_hw(x.shape, attrs, (1, 1))
    total = sum(_taps(x, attrs, (1, 1), 0.0, oh, ow))
    return (total / _avg_divisor(*x.shape[2:], oh, ow, attrs)).astype(x.dtype)


def avg_pool2d_backward_np(xs, attrs):
    (g,) = xs
    (h, w), (kh_, kw_) = attrs["input_size"], attrs["kernel_size"]
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    oh, ow = g.shape[2:]
    share = g / _avg_divisor(h, w, oh, ow, attrs)
    hp = max(h + 2 * ph, (oh - 1) * sh + kh_)
    wp = max(w + 2 * pw, (ow - 1) * sw + kw_)
    dxp = np.zeros(g.shape[:2] + (hp, wp), share.dtype)
    for i in range(kh_):
        for j in range(kw_):
            dxp[:, :, i : i + sh * (oh - 1) + 1 : sh, j : j + sw * (ow - 1) + 1 : sw] += share
    return dxp[:, :, ph : ph + h, pw : pw + w].astype(g.dtype)


def adaptive_bounds(size: int, out: int) -> list[tuple[int, int]]:
    """Window [start, end) of each output index (ATen's start_index / end_index)."""
    return [((i * size) // out, -((-(i + 1) * size) // out)) for i in range(out)]


def adaptive_avg_pool2d_np(xs, attrs):
    x = xs[0]
    oh, ow = attrs["output_size"]
    out = np.zeros(x.shape[:2] + (oh, ow), x.dtype)
    for i, (h0, h1) in enumerate(adaptive_bounds(x.shape[2], oh)):
        for j, (w0, w1) in enumerate(adaptive_bounds(x.shape[3], ow)):
            out[:, :, i, j] = x[:, :, h0:h1, w0:w1].mean(axis=(2, 3))
    return out


def adaptive_avg_pool2d_backward_np(xs, attrs):
    (g,) = xs
    h, w = attrs["input_size"]
    oh, ow = attrs["output_size"]
    dx = np.zeros(g.shape[:2] + (h, w), g.dtype)
    for i, (h0, h1) in enumerate(adaptive_bounds(h, oh)):
        for j, (w0, w1) in enumerate(adaptive_bounds(w, ow)):
            dx[:, :, h0:h1, w0:w1] += g[:, :, i : i + 1, j : j + 1] / ((h1 - h0) * (w1 - w0))
    return dx


def _with_input_size(op: str):
    def grad(node, i, o, g):
        attrs = {**node.attr_dict, "input_size": i[0].shape[2:]}
        return (g.builder.add(op, [g], attrs),)

    return grad


DEFS = [
    OpDef(
        "max_pool2d",
        _max_type,
        max_pool2d_np,
        lambda n, i, o, g: (g.builder.add("max_pool2d_backward", [i[0], g], n.attr_dict),),
        arity=1,
    ),
    OpDef(
        "max_pool2d_backward",
        _max_bwd_type,
        max_pool2d_backward_np,
        differentiable=False,
        arity=2,
    ),
    OpDef("avg_pool2d", _avg_type, avg_pool2d_np, _with_input_size("avg_pool2d_backward"), arity=1),
    OpDef(
        "avg_pool2d_backward",
        lambda t, a: _from_grad(t, a, _avg_type),
        avg_pool2d_backward_np,
        differentiable=False,
        arity=1,
    ),
    OpDef(
        "adaptive_avg_pool2d",
        _adaptive_type,
        adaptive_avg_pool2d_np,
        _with_input_size("adaptive_avg_pool2d_backward"),
        arity=1,
    ),
    OpDef(
        "adaptive_avg_pool2d_backward",
        lambda t, a: _from_grad(t, a, _adaptive_type),
        adaptive_avg_pool2d_backward_np,
        differentiable=False,
        arity=1,
    ),
]


# ---- user-facing functions --------------------------------------------------------------------
def max_pool2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    dilation: int | Sequence[int] = 1,
    ceil_mode: bool = False,
    return_indices: bool = False,
) -> Tensor:
    """2-D max pooling, as torch.nn.functional.max_pool2d.

    Args:
        input: floating [N, C, H, W] (or unbatched [C, H, W]).
        kernel_size: int or (kh, kw); stride defaults to it; padding (-inf, at most half the
            kernel) and dilation ints or pairs; ceil_mode as in PyTorch.
        return_indices: must be False (indices are recomputed by the backward kernel).

    Returns:
        [N, C, OH, OW], sizes by ATen's ``pooling_output_shape``.

    Raises:
        GraphTypeError: bad shapes, padding over half the kernel, or a window wholly in padding.
        NotImplementedError: for ``return_indices=True``.
    """
    if return_indices:
        raise NotImplementedError("max_pool2d(return_indices=True) is not supported")
    k = pair(kernel_size, "kernel_size")
    attrs = {
        "kernel_size": k,
        "stride": k if stride is None else pair(stride, "stride"),
        "padding": pair(padding, "padding"),
        "dilation": pair(dilation, "dilation"),
        "ceil_mode": bool(ceil_mode),
    }
    return unbatched(input, 4, lambda x: x.builder.add("max_pool2d", [x], attrs))


def avg_pool2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    kernel_size: int | Sequence[int],
    stride: int | Sequence[int] | None = None,
    padding: int | Sequence[int] = 0,
    ceil_mode: bool = False,
    count_include_pad: bool = True,
    divisor_override: int | None = None,
) -> Tensor:
    """2-D average pooling, as torch.nn.functional.avg_pool2d (zero padding, at most half the
    kernel; divisor per ATen: the window clipped to the padded input when
    ``count_include_pad``, else to the input, or ``divisor_override``).

    Returns:
        [N, C, OH, OW] for input [N, C, H, W] (or unbatched [C, H, W] -> [C, OH, OW]).

    Raises:
        GraphTypeError: bad shapes or padding, a window wholly in padding, divisor 0.
    """
    k = pair(kernel_size, "kernel_size")
    attrs = {
        "kernel_size": k,
        "stride": k if stride is None else pair(stride, "stride"),
        "padding": pair(padding, "padding"),
        "ceil_mode": bool(ceil_mode),
        "count_include_pad": bool(count_include_pad),
        "divisor_override": None if divisor_override is None else int(divisor_override),
    }
    return unbatched(input, 4, lambda x: x.builder.add("avg_pool2d", [x], attrs))


def adaptive_avg_pool2d(input: Tensor, output_size: int | Sequence[int | None]) -> Tensor:  # noqa: A002
    """Adaptive average pooling, as torch.nn.functional.adaptive_avg_pool2d.

    Output cell (i, j) averages rows ``[floor(i H / OH), ceil((i + 1) H / OH))`` and the
    same for columns. ``output_size`` may hold None (keep that input size). Output (1, 1)
    (global average pooling) lowers to ``mean`` over (H, W).

    Returns:
        [N, C, OH, OW] for input [N, C, H, W] (or unbatched [C, H, W]).

    Raises:
        GraphTypeError: non-4-d or non-floating input, sizes < 1.
    """

    def run(x: Tensor) -> Tensor:
        size = output_size if isinstance(output_size, (tuple, list)) else (output_size,) * 2
        if len(size) != 2 or x.ndim != 4:
            raise ValueError(f"adaptive_avg_pool2d: need [N, C, H, W] and a pair, got {x!r}")
        size = tuple(x.shape[2 + i] if s is None else int(s) for i, s in enumerate(size))
        if size == (1, 1):
            return F.mean(x, (2, 3), keepdim=True)
        if size == x.shape[2:]:
            return x
        return x.builder.add("adaptive_avg_pool2d", [x], {"output_size": size})

    return unbatched(input, 4, run)


__all__ = ["adaptive_avg_pool2d", "avg_pool2d", "max_pool2d", "pair", "pool_out", "unbatched"]

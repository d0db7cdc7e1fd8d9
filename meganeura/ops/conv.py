"""Convolution ops (NCHW, PyTorch semantics) and the conv/pool family's op list.

``conv2d(x [N, C, H, W], w [OC, C/groups, KH, KW][, bias [OC]])`` with symmetric zero padding,
stride, dilation and groups; ``OH = (H + 2 ph - dh (KH - 1) - 1) // sh + 1`` (torch.nn.Conv2d
docs). Its exact gradients are two dedicated ops with their own kernels:
``conv2d_backward_input(g, w)`` (the transposed convolution; attr ``input_size`` because
strided convolutions lose H and W) and ``conv2d_backward_weight(x, g)`` (attr ``kernel_size``,
never differentiated again); the bias gradient is ``sum(g, (0, 2, 3))``.
``conv2d_backward_input`` is also the transposed convolution users call
(``ops.conv_transpose``), so it has a gradient rule itself: conv2d and
conv2d_backward_weight again. ``conv1d`` is ``conv2d`` over ``H = 1`` through free reshape
views; both check their arguments as given (``conv_type``, over one or two spatial dims)
before any node exists, so a bad ``conv1d`` call reports its 3-D shapes, never the 4-D
``conv2d`` it lowers to. Attributes stored in nodes are canonical: 2-tuples of ints and an int.

``DEFS`` also carries the pooling ops of ``ops.pool``, so ``ops/__init__`` lists one family.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph.builder import Tensor, op_error
from ..graph.ir import TensorType
from . import functional as F
from .pool import DEFS as POOL_DEFS
from .pool import unbatched
from .registry import OpDef, ShapeError


def out_size(size: int, k: int, s: int, p: int, d: int) -> int:
    """Output length of a convolution along one dim (torch.nn.Conv2d docs)."""
    return (size + 2 * p - d * (k - 1) - 1) // s + 1


def _geometry(attrs) -> tuple[tuple[int, int], ...]:
    return attrs["stride"], attrs["padding"], attrs["dilation"]


def _check_attrs(attrs) -> None:
    s, p, d = _geometry(attrs)
    if min(s) < 1 or min(d) < 1 or min(p) < 0 or attrs["groups"] < 1:
        raise ShapeError(f"need stride >= 1, dilation >= 1, padding >= 0, groups >= 1; got {attrs}")


def _out_hw(hw, khw, attrs) -> tuple[int, int]:
    s, p, d = _geometry(attrs)
    out = tuple(out_size(hw[i], khw[i], s[i], p[i], d[i]) for i in range(2))
    if min(out) < 1:
        raise ShapeError(
            f"input {list(hw)} padded by {list(p)} is smaller than the dilated kernel "
            f"{[d[i] * (khw[i] - 1) + 1 for i in range(2)]}"
        )
    return out


def _floating4(t: TensorType, what: str) -> None:
    if t.ndim != 4 or not t.dtype.is_floating:
        raise ShapeError(f"{what} must be a floating 4-d tensor, got {t}")


# The layouts as the user writes them, by number of spatial dims (PyTorch's names).
INPUT_LAYOUT = {1: "[N, C, L]", 2: "[N, C, H, W]"}
UNBATCHED_LAYOUT = {1: "[C, L]", 2: "[C, H, W]"}
WEIGHT_LAYOUT = {
    1: "[out_channels, in_channels/groups, kernel_size]",
    2: "[out_channels, in_channels/groups, kH, kW]",
}


def _sizes(v: Sequence[int]) -> str:
    """Per-dim sizes as the user wrote them: ``5`` for one spatial dim, ``[5, 5]`` for two."""
    return str(v[0]) if len(v) == 1 else str(list(v))


def conv_type(
    x: TensorType,
    w: TensorType,
    bias: TensorType | None,
    stride: tuple[int, ...],
    padding: tuple[int, ...],
    dilation: tuple[int, ...],
    groups: int,
) -> TensorType:
    """Result type of a convolution over ``x.ndim - 2`` spatial dims (1: conv1d, 2: conv2d).

    Raises:
        ShapeError: worded in that many dims, with the shapes as given.
    """
    k = x.ndim - 2
    if not x.dtype.is_floating:
        raise ShapeError(f"input must be floating, got {x}")
    if w.ndim != x.ndim:
        raise ShapeError(f"weight must be {x.ndim}-d {WEIGHT_LAYOUT[k]}, got {w}")
    if x.dtype is not w.dtype:
        raise ShapeError(f"input and weight dtypes differ: {x.dtype} vs {w.dtype}")
    for name, v, low in (("stride", stride, 1), ("padding", padding, 0), ("dilation", dilation, 1)):
        if min(v) < low:
            raise ShapeError(f"{name} must be >= {low}, got {_sizes(v)}")
    if groups < 1:
        raise ShapeError(f"groups must be >= 1, got {groups}")
    c, (oc, cg), ks = x.shape[1], w.shape[:2], w.shape[2:]
    if c != cg * groups:
        per = f"{cg} * groups={groups} = {cg * groups}" if groups > 1 else f"{cg}"
        raise ShapeError(f"weight {list(w.shape)} expects {per} input channels, the input has {c}")
    if oc % groups:
        raise ShapeError(f"groups={groups} does not divide the weight's {oc} output channels")
    if min(w.shape) < 1:
        raise ShapeError(f"weight {list(w.shape)} has an empty dim")
    if bias is not None and (bias.shape != (oc,) or bias.dtype is not x.dtype):
        raise ShapeError(f"bias must be {x.dtype}[{oc}], one per output channel, got {bias}")
    size = x.shape[2:]
    out = tuple(out_size(size[i], ks[i], stride[i], padding[i], dilation[i]) for i in range(k))
    if min(out) < 1:
        span = [dilation[i] * (ks[i] - 1) + 1 for i in range(k)]
        what = "length" if k == 1 else "size"
        raise ShapeError(
            f"input {what} {_sizes(size)} padded by {_sizes(padding)} on each side is smaller "
            f"than the dilated kernel {_sizes(span)}"
        )
    return TensorType(x.shape[:1] + (oc,) + out, x.dtype)


def _conv_type(types, attrs):
    if len(types) not in (2, 3):
        raise ShapeError(f"takes (input, weight[, bias]), got {len(types)} operands")
    x, w = types[:2]
    _floating4(x, "input")
    _floating4(w, "weight")
    s, p, d = _geometry(attrs)
    return conv_type(x, w, types[2] if len(types) == 3 else None, s, p, d, attrs["groups"])


def _bwd_input_type(types, attrs):
    g, w = types
    _floating4(g, "grad_output")
    _floating4(w, "weight")
    _check_attrs(attrs)
    h, wd = attrs["input_size"]
    oc, cg, kh, kw = w.shape
    want = (g.shape[0], oc) + _out_hw((h, wd), (kh, kw), attrs)
    if g.shape != want or oc % attrs["groups"]:
        raise ShapeError(f"expected grad_output {list(want)}, got {list(g.shape)}")
    return TensorType((g.shape[0], cg * attrs["groups"], h, wd), w.dtype)


def _bwd_weight_type(types, attrs):
    x, g = types
    _floating4(x, "input")
    _floating4(g, "grad_output")
    _check_attrs(attrs)
    n, c, h, wd = x.shape
    kh, kw = attrs["kernel_size"]
    groups = attrs["groups"]
    oc = g.shape[1]
    want = (n, oc) + _out_hw((h, wd), (kh, kw), attrs)
    if g.shape != want or c % groups or oc % groups:
        raise ShapeError(
            f"expected grad_output {list(want)} (groups {groups}), got {list(g.shape)}"
        )
    return TensorType((oc, c // groups, kh, kw), x.dtype)


# ---- NumPy references (float64-safe: dtypes follow the operands) ------------------------------
def _tap(xp: np.ndarray, kh: int, kw: int, oh: int, ow: int, attrs) -> np.ndarray:
    """The strided view of padded input ``xp`` that kernel tap (kh, kw) multiplies."""
    (sh, sw), _, (dh, dw) = _geometry(attrs)
    return xp[
        :, :, kh * dh : kh * dh + sh * (oh - 1) + 1 : sh, kw * dw : kw * dw + sw * (ow - 1) + 1 : sw
    ]


def _pad(x: np.ndarray, attrs) -> np.ndarray:
    ph, pw = attrs["padding"]
    return np.pad(x, ((0, 0), (0, 0), (ph, ph), (pw, pw)))


def conv2d_np(xs, attrs) -> np.ndarray:
    x, w = xs[0], xs[1]
    n, c, _, _ = x.shape
    oc, cg, kh_, kw_ = w.shape
    g = attrs["groups"]
    oh, ow = _out_hw(x.shape[2:], (kh_, kw_), attrs)
    xp = _pad(x, attrs)
    wg = w.reshape(g, oc // g, cg, kh_, kw_)
    out = np.zeros((n, g, oc // g, oh * ow), np.result_type(x, w))
    for kh in range(kh_):
        for kw in range(kw_):
            patch = _tap(xp, kh, kw, oh, ow, attrs).reshape(n, g, cg, oh * ow)
            out += wg[:, :, :, kh, kw] @ patch
    out = out.reshape(n, oc, oh, ow)
    return out + xs[2][:, None, None] if len(xs) == 3 else out


def conv2d_backward_input_np(xs, attrs) -> np.ndarray:
    gout, w = xs
    n, oc, oh, ow = gout.shape
    _, cg, kh_, kw_ = w.shape
    g = attrs["groups"]
    h, wd = attrs["input_size"]
    ph, pw = attrs["padding"]
    gg = gout.reshape(n, g, oc // g, oh * ow)
    wg = w.reshape(g, oc // g, cg, kh_, kw_)
    dxp = np.zeros((n, g * cg, h + 2 * ph, wd + 2 * pw), np.result_type(gout, w))
    for kh in range(kh_):
        for kw in range(kw_):
            part = np.swapaxes(wg[:, :, :, kh, kw], 1, 2) @ gg
            _tap(dxp, kh, kw, oh, ow, attrs)[...] += part.reshape(n, g * cg, oh, ow)
    return dxp[:, :, ph : ph + h, pw : pw + wd]


def conv2d_backward_weight_np(xs, attrs) -> np.ndarray:
    x, gout = xs
    n, c, _, _ = x.shape
    _, oc, oh, ow = gout.shape
    g = attrs["groups"]
    kh_, kw_ = attrs["kernel_size"]
    xp = _pad(x, attrs)
    gg = gout.reshape(n, g, oc // g, oh * ow)
    dw = np.zeros((g, oc // g, c // g, kh_, kw_), np.result_type(x, gout))
    for kh in range(kh_):
        for kw in range(kw_):
            patch = _tap(xp, kh, kw, oh, ow, attrs).reshape(n, g, c // g, oh * ow)
            dw[..., kh, kw] = (gg @ np.swapaxes(patch, 2, 3)).sum(0)
    return dw.reshape(oc, c // g, kh_, kw_)


def _conv_grad(node, i, o, g):
    x, w = i[0], i[1]
    b = x.builder
    attrs = node.attr_dict
    dx = b.add("conv2d_backward_input", [g, w], {**attrs, "input_size": x.shape[2:]})
    dw = b.add("conv2d_backward_weight", [x, g], {**attrs, "kernel_size": w.shape[2:]})
    if len(i) == 2:
        return (dx, dw)
    return (dx, dw, F.sum(g, (0, 2, 3)))


def _bwd_input_grad(node, i, o, g):
    """``conv2d_backward_input`` is linear in both operands (it is the transposed
    convolution): its adjoint in the gradient is conv2d, in the weight the weight gradient
    of a conv2d of ``g`` producing the operand."""
    gout, w = i
    attrs = {k: v for k, v in node.attr_dict.items() if k != "input_size"}
    dg = g.builder.add("conv2d", [g, w], attrs)
    dw = g.builder.add("conv2d_backward_weight", [g, gout], {**attrs, "kernel_size": w.shape[2:]})
    return (dg, dw)


DEFS = [
    OpDef("conv2d", _conv_type, conv2d_np, _conv_grad),
    OpDef(
        "conv2d_backward_input",
        _bwd_input_type,
        conv2d_backward_input_np,
        _bwd_input_grad,
        arity=2,
    ),
    OpDef(
        "conv2d_backward_weight",
        _bwd_weight_type,
        conv2d_backward_weight_np,
        differentiable=False,
        arity=2,
    ),
    *POOL_DEFS,
]


# ---- user-facing functions --------------------------------------------------------------------
def _ints(v, what: str, n: int) -> tuple[int, ...]:
    """``v`` as ``n`` ints: an int is repeated, a tuple or list must have ``n`` entries."""
    if isinstance(v, (tuple, list)):
        if len(v) != n:
            raise ValueError(f"{what} must be an int or a {n}-tuple, got {v!r}")
        return tuple(int(e) for e in v)
    return (int(v),) * n


def _padding(padding, kernel: Sequence[int], dilation: Sequence[int], stride) -> tuple[int, ...]:
    """Padding per spatial dim (one per entry of ``kernel``) from an int, a tuple,
    ``"valid"`` or ``"same"``."""
    n = len(kernel)
    if padding == "valid":
        return (0,) * n
    if padding == "same":
        if max(stride) != 1:
            raise ValueError("padding='same' needs stride 1 (as in PyTorch)")
        total = [dilation[i] * (kernel[i] - 1) for i in range(n)]
        if any(t % 2 for t in total):
            raise ValueError(
                f"padding='same' with kernel_size {_sizes(kernel)} and dilation "
                f"{_sizes(dilation)} needs asymmetric padding, which is not supported; pad "
                "explicitly"
            )
        return tuple(t // 2 for t in total)
    if isinstance(padding, str):
        raise ValueError(f"padding must be an int, a tuple, 'valid' or 'same', got {padding!r}")
    return _ints(padding, "padding", n)


def _conv_attrs(
    fn: str, input: Tensor, weight: Tensor, bias, stride, padding, dilation, groups, k: int
) -> dict:
    """The canonical attrs (``k``-tuples) of a ``k``-d convolution call, after checking the
    operands as the user gave them (an unbatched input included).

    Raises:
        GraphTypeError: for shapes, dtypes, channel or group counts, or an input smaller than
            the dilated kernel; ValueError: for a malformed stride/padding/dilation; both
            naming ``fn``, its operands, its arguments and the user's line.
    """
    operands = [input, weight] if bias is None else [input, weight, bias]
    args = {"stride": stride, "padding": padding, "dilation": dilation, "groups": groups}
    for name, t in zip(("input", "weight", "bias"), operands):
        if not isinstance(t, Tensor):
            raise op_error(fn, operands, args, f"{name} must be a Tensor, got {t!r}")
    x = input.type
    if x.ndim == k + 1:  # unbatched, as PyTorch accepts: checked as a batch of one
        x = TensorType((1,) + x.shape, x.dtype)
    try:
        if x.ndim != k + 2:
            raise ShapeError(
                f"input must be {INPUT_LAYOUT[k]} or unbatched {UNBATCHED_LAYOUT[k]}, got "
                f"{input.type}"
            )
        if weight.ndim != k + 2:
            raise ShapeError(f"weight must be {k + 2}-d {WEIGHT_LAYOUT[k]}, got {weight.type}")
        s, d = _ints(stride, "stride", k), _ints(dilation, "dilation", k)
        p = _padding(padding, weight.shape[2:], d, s)
        g = int(groups)
        conv_type(x, weight.type, None if bias is None else bias.type, s, p, d, g)
    except ShapeError as e:
        raise op_error(fn, operands, args, str(e)) from None
    except ValueError as e:
        raise op_error(fn, operands, args, str(e), ValueError) from None
    return {"stride": s, "padding": p, "dilation": d, "groups": g}


def conv2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    """2-D convolution (cross-correlation), as torch.nn.functional.conv2d.

    Args:
        input: floating [N, C, H, W] (or unbatched [C, H, W]).
        weight: [OC, C / groups, KH, KW], same dtype.
        bias: optional [OC], added per output channel inside the kernel.
        stride, dilation: int or (h, w), >= 1.
        padding: int or (h, w) zeros on both sides, or ``"valid"`` / ``"same"`` (stride 1,
            even total padding only).
        groups: input and output channels both divide into this many groups.

    Returns:
        [N, OC, OH, OW] with ``OH = (H + 2 ph - dh (KH - 1) - 1) // sh + 1`` (PyTorch docs).

    Raises:
        GraphTypeError: for mismatched shapes, dtypes or channel/group counts, or an input
            smaller than the dilated kernel.
        ValueError: for a padding spec that cannot be expressed symmetrically.
        Both name ``conv2d``, the operands as given and the caller's line.
    """
    attrs = _conv_attrs("conv2d", input, weight, bias, stride, padding, dilation, groups, 2)
    ops = [weight] if bias is None else [weight, bias]
    return unbatched(input, 4, lambda x: x.builder.add("conv2d", [x, *ops], attrs))


def conv1d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] | str = 0,
    dilation: int | Sequence[int] = 1,
    groups: int = 1,
) -> Tensor:
    """1-D convolution, as torch.nn.functional.conv1d: ``conv2d`` over a height of 1.

    Args:
        input: floating [N, C, L] (or unbatched [C, L]).
        weight: [OC, C / groups, K]; bias: optional [OC].
        stride, padding, dilation: ints (or 1-tuples); padding may be ``"valid"``/``"same"``.

    Returns:
        [N, OC, OL], ``OL = (L + 2 p - d (K - 1) - 1) // s + 1``.

    Raises:
        GraphTypeError / ValueError: as for ``conv2d``, worded in 1-D terms: they name
            ``conv1d`` and the 3-D shapes given, never the 4-D ``conv2d`` it lowers to.
    """
    a = _conv_attrs("conv1d", input, weight, bias, stride, padding, dilation, groups, 1)
    attrs = {
        "stride": (1, *a["stride"]),
        "padding": (0, *a["padding"]),
        "dilation": (1, *a["dilation"]),
        "groups": a["groups"],
    }
    w4 = F.reshape(weight, (weight.shape[0], weight.shape[1], 1, weight.shape[2]))
    ops = [w4] if bias is None else [w4, bias]

    def run(x: Tensor) -> Tensor:
        x4 = F.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2]))
        y = x.builder.add("conv2d", [x4, *ops], attrs)
        return F.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))

    return unbatched(input, 3, run)

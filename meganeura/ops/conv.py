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
views. Attributes stored in nodes are canonical: 2-tuples of ints and an int.

``DEFS`` also carries the pooling ops of ``ops.pool``, so ``ops/__init__`` lists one family.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..graph.builder import Tensor
from ..graph.ir import TensorType
from . import functional as F
from .pool import DEFS as POOL_DEFS
from .pool import pair, unbatched
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


def _conv_type(types, attrs):
    if len(types) not in (2, 3):
        raise ShapeError(f"takes (input, weight[, bias]), got {len(types)} operands")
    x, w = types[:2]
    _floating4(x, "input")
    _floating4(w, "weight")
    _check_attrs(attrs)
    g = attrs["groups"]
    n, c, h, wd = x.shape
    oc, cg, kh, kw = w.shape
    if x.dtype is not w.dtype:
        raise ShapeError(f"input and weight dtypes differ: {x.dtype} vs {w.dtype}")
    if c != cg * g or oc % g or min(oc, cg, kh, kw) < 1:
        raise ShapeError(
            f"expected weight [OC, {c // g if c % g == 0 else '?'}, KH, KW] with OC divisible "
            f"by groups={g} for input channels {c}, got weight {list(w.shape)}"
        )
    if len(types) == 3 and (types[2].shape != (oc,) or types[2].dtype is not x.dtype):
        raise ShapeError(f"bias must be {x.dtype}[{oc}], got {types[2]}")
    oh, ow = _out_hw((h, wd), (kh, kw), attrs)
    return TensorType((n, oc, oh, ow), x.dtype)


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
def _padding(padding, kernel: Sequence[int], dilation: tuple[int, int], stride) -> tuple[int, int]:
    if padding == "valid":
        return (0, 0)
    if padding == "same":
        if max(stride) != 1:
            raise ValueError("padding='same' needs stride 1 (as in PyTorch)")
        total = [dilation[i] * (kernel[i] - 1) for i in range(2)]
        if any(t % 2 for t in total):
            raise ValueError(
                f"padding='same' with kernel {list(kernel)} and dilation {list(dilation)} "
                "needs asymmetric padding, which is not supported; pad explicitly"
            )
        return (total[0] // 2, total[1] // 2)
    return pair(padding, "padding")


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
    """
    stride, dilation = pair(stride, "stride"), pair(dilation, "dilation")
    attrs = {
        "stride": stride,
        "padding": _padding(padding, weight.shape[2:], dilation, stride),
        "dilation": dilation,
        "groups": int(groups),
    }
    ops = [weight] if bias is None else [weight, bias]
    return unbatched(input, 4, lambda x: x.builder.add("conv2d", [x, *ops], attrs))


def _one(v, what: str) -> int:
    if isinstance(v, (tuple, list)):
        if len(v) != 1:
            raise ValueError(f"{what} must be an int or a 1-tuple, got {v!r}")
        v = v[0]
    return int(v)


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
        GraphTypeError / ValueError: as for ``conv2d``.
    """
    if weight.ndim != 3:
        raise ValueError(f"conv1d weight must be [OC, C/groups, K], got {weight!r}")
    pad = padding if isinstance(padding, str) else (0, _one(padding, "padding"))
    w4 = F.reshape(weight, (weight.shape[0], weight.shape[1], 1, weight.shape[2]))

    def run(x: Tensor) -> Tensor:
        if x.ndim != 3:
            raise ValueError(f"conv1d input must be [N, C, L], got {x!r}")
        y = conv2d(
            F.reshape(x, (x.shape[0], x.shape[1], 1, x.shape[2])),
            w4,
            bias,
            (1, _one(stride, "stride")),
            pad,
            (1, _one(dilation, "dilation")),
            groups,
        )
        return F.reshape(y, (y.shape[0], y.shape[1], y.shape[3]))

    return unbatched(input, 3, run)

"""Conv1d, Conv2d and ConvTranspose2d, as torch.nn (``torch/nn/modules/conv.py``): same
arguments, defaults, attribute values (tuples), parameter shapes and initialization.

Padding: ints or tuples; ``'valid'``; ``'same'`` (stride 1) with PyTorch's split of an odd total,
the extra row/column after the input (``total // 2`` before, the rest after), done as an
explicit pad when it is asymmetric. ``padding_mode`` 'reflect', 'replicate' and 'circular' pad
by gathering rows and columns with host-computed indices (``index_select``: exact values, and
the gradient sums back into the source positions, as ``F.pad`` does in PyTorch).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np

from .. import functional as F
from .. import init
from ..module import Module
from ..parameter import Parameter

PADDING_MODES = ("zeros", "reflect", "replicate", "circular")


def _ntuple(v, n: int, what: str) -> tuple[int, ...]:
    if isinstance(v, Sequence):
        t = tuple(int(x) for x in v)
        if len(t) != n:
            raise ValueError(f"{what} must be an int or a {n}-tuple, got {v!r}")
        return t
    return (int(v),) * n


def _gather_pad(x, pads: Sequence[tuple[int, int]], mode: str):
    """Pad the trailing ``len(pads)`` dims of ``x`` by (before, after) ``pads`` in ``mode``
    (torch.nn.functional.pad's 'reflect', 'replicate' or 'circular')."""
    first = x.ndim - len(pads)
    for k, (lo, hi) in enumerate(pads):
        if lo == hi == 0:
            continue
        n = x.shape[first + k]
        pos = np.arange(-lo, n + hi)
        if mode == "circular":
            if lo > n or hi > n:
                raise ValueError(f"circular padding {lo, hi} is larger than the size {n}")
            idx = pos % n
        elif mode == "replicate":
            idx = np.clip(pos, 0, n - 1)
        else:  # reflect, the edge not repeated
            if lo >= n or hi >= n:
                raise ValueError(f"reflect padding {lo, hi} must be smaller than the size {n}")
            idx = np.abs(pos)
            idx = np.where(idx > n - 1, 2 * (n - 1) - idx, idx)
        x = F.index_select(x, first + k, idx.astype(np.int32))
    return x


class _ConvNd(Module):
    """Shared part of the convolutions; ``_n`` is the number of spatial dims."""

    _n = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size,
        stride,
        padding,
        dilation,
        transposed: bool,
        output_padding,
        groups: int,
        bias: bool,
        padding_mode: str,
        dtype=None,
    ) -> None:
        super().__init__()
        n = self._n
        if groups <= 0:
            raise ValueError("groups must be a positive integer")
        if in_channels % groups:
            raise ValueError("in_channels must be divisible by groups")
        if out_channels % groups:
            raise ValueError("out_channels must be divisible by groups")
        kernel_size = _ntuple(kernel_size, n, "kernel_size")
        stride = _ntuple(stride, n, "stride")
        dilation = _ntuple(dilation, n, "dilation")
        if isinstance(padding, str):
            if padding not in ("same", "valid"):
                raise ValueError(
                    f"Invalid padding string {padding!r}, should be one of {{'same', 'valid'}}"
                )
            if padding == "same" and any(s != 1 for s in stride):
                raise ValueError("padding='same' is not supported for strided convolutions")
        else:
            padding = _ntuple(padding, n, "padding")
        if padding_mode not in PADDING_MODES:
            raise ValueError(
                f"padding_mode must be one of {set(PADDING_MODES)}, but got "
                f"padding_mode='{padding_mode}'"
            )
        self.in_channels, self.out_channels = int(in_channels), int(out_channels)
        self.kernel_size, self.stride, self.padding = kernel_size, stride, padding
        self.dilation, self.transposed = dilation, transposed
        self.output_padding = _ntuple(output_padding, n, "output_padding")
        self.groups, self.padding_mode = int(groups), padding_mode
        # (before, after) per spatial dim, first dim first (PyTorch keeps it reversed, for F.pad).
        if padding == "same":
            totals = [d * (k - 1) for d, k in zip(dilation, kernel_size)]
            self._pads = tuple((t // 2, t - t // 2) for t in totals)
        elif padding == "valid":
            self._pads = ((0, 0),) * n
        else:
            self._pads = tuple((p, p) for p in padding)
        if transposed:
            shape = (self.in_channels, self.out_channels // groups, *kernel_size)
        else:
            shape = (self.out_channels, self.in_channels // groups, *kernel_size)
        self.weight = Parameter(shape=shape, dtype=dtype)
        if bias:
            self.bias = Parameter(shape=(self.out_channels,), dtype=dtype)
        else:
            self.register_parameter("bias", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            fan_in, _ = init.calculate_fan_in_and_fan_out(self.weight.shape)
            bound = 1 / math.sqrt(fan_in) if fan_in > 0 else 0
            init.uniform_(self.bias, -bound, bound)

    def _conv_forward(self, input, weight, bias, conv):  # noqa: A002
        symmetric = all(lo == hi for lo, hi in self._pads)
        if self.padding_mode == "zeros" and symmetric:
            padding = tuple(lo for lo, _ in self._pads)
            return conv(input, weight, bias, self.stride, padding, self.dilation, self.groups)
        if self.padding_mode == "zeros":
            flat = [p for lo_hi in reversed(self._pads) for p in lo_hi]
            input = F.pad(input, flat)
        else:
            input = _gather_pad(input, self._pads, self.padding_mode)
        zero = (0,) * self._n
        return conv(input, weight, bias, self.stride, zero, self.dilation, self.groups)

    def extra_repr(self) -> str:
        s = (
            f"{self.in_channels}, {self.out_channels}, kernel_size={self.kernel_size}, "
            f"stride={self.stride}"
        )
        if self.padding != (0,) * self._n:
            s += f", padding={self.padding}"
        if self.dilation != (1,) * self._n:
            s += f", dilation={self.dilation}"
        if self.output_padding != (0,) * self._n:
            s += f", output_padding={self.output_padding}"
        if self.groups != 1:
            s += f", groups={self.groups}"
        if self._parameters["bias"] is None:
            s += ", bias=False"
        if self.padding_mode != "zeros":
            s += f", padding_mode={self.padding_mode}"
        return s


class Conv1d(_ConvNd):
    """1-D convolution (cross-correlation) over [N, C_in, L] (``torch.nn.Conv1d``).

    Shapes: input floating [N, C_in, L] or [C_in, L] -> [N, C_out, L_out],
    ``L_out = (L + pad_before + pad_after - dilation (K - 1) - 1) // stride + 1``;
    weight [C_out, C_in / groups, K], bias [C_out].
    Initialization as PyTorch's ``reset_parameters``: weight ``kaiming_uniform_(a=sqrt(5))``,
    i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = C_in / groups * K; bias the same.

    Raises:
        ValueError: groups not dividing the channels, a bad padding string, 'same' with a
            stride, or an unknown padding_mode.
    """

    _n = 1

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int],
        stride: int | tuple[int] = 1,
        padding: int | tuple[int] | str = 0,
        dilation: int | tuple[int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        dtype=None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation,
            False, 0, groups, bias, padding_mode, dtype,
        )  # fmt: skip

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return self._conv_forward(input, self.weight, self.bias, F.conv1d)


class Conv2d(_ConvNd):
    """2-D convolution (cross-correlation) over [N, C_in, H, W] (``torch.nn.Conv2d``).

    Shapes: input floating [N, C_in, H, W] or [C_in, H, W] -> [N, C_out, H_out, W_out],
    ``H_out = (H + pad_before + pad_after - dilation[0] (K[0] - 1) - 1) // stride[0] + 1``
    (PyTorch docs); weight [C_out, C_in / groups, kH, kW], bias [C_out].
    Initialization as PyTorch's ``reset_parameters``: weight ``kaiming_uniform_(a=sqrt(5))``,
    i.e. U(-1/sqrt(fan_in), 1/sqrt(fan_in)) with fan_in = C_in / groups * kH * kW; bias the
    same.

    Raises:
        ValueError: groups not dividing the channels, a bad padding string, 'same' with a
            stride, or an unknown padding_mode.
    """

    _n = 2

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] | str = 0,
        dilation: int | tuple[int, int] = 1,
        groups: int = 1,
        bias: bool = True,
        padding_mode: str = "zeros",
        dtype=None,
    ) -> None:
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation,
            False, 0, groups, bias, padding_mode, dtype,
        )  # fmt: skip

    def forward(self, input):  # noqa: A002
        return self._conv_forward(input, self.weight, self.bias, F.conv2d)


class ConvTranspose2d(_ConvNd):
    """2-D transposed convolution (the gradient of conv2d with respect to its input;
    ``torch.nn.ConvTranspose2d``).

    Shapes: input floating [N, C_in, H, W] or [C_in, H, W] -> [N, C_out, H_out, W_out],
    ``H_out = (H - 1) stride[0] - 2 padding[0] + dilation[0] (kH - 1) + output_padding[0] + 1``
    (PyTorch docs); weight [C_in, C_out / groups, kH, kW] (in and out swapped against
    Conv2d's), bias [C_out]. Initialization as PyTorch's: ``kaiming_uniform_(a=sqrt(5))`` with
    PyTorch's fan_in of this layout, ``weight.shape[1] * kH * kW`` = C_out / groups * kH * kW,
    for both weight and bias bounds.

    ``forward(input, output_size=None)``: ``output_size`` ([H_out, W_out], optionally with
    the leading N, C) picks the output_padding that reaches it, as PyTorch.

    Raises:
        ValueError: groups not dividing the channels, a padding string, a padding_mode other
            than 'zeros' (as PyTorch), or an ``output_size`` out of reach.
    """

    def __init__(
        self,
        in_channels: int,
        out_channels: int,
        kernel_size: int | tuple[int, int],
        stride: int | tuple[int, int] = 1,
        padding: int | tuple[int, int] = 0,
        output_padding: int | tuple[int, int] = 0,
        groups: int = 1,
        bias: bool = True,
        dilation: int | tuple[int, int] = 1,
        padding_mode: str = "zeros",
        dtype=None,
    ) -> None:
        if padding_mode != "zeros":
            raise ValueError(f'Only "zeros" padding mode is supported for {type(self).__name__}')
        if isinstance(padding, str):
            raise ValueError(f"{type(self).__name__} takes int or tuple padding, not {padding!r}")
        super().__init__(
            in_channels, out_channels, kernel_size, stride, padding, dilation,
            True, output_padding, groups, bias, padding_mode, dtype,
        )  # fmt: skip

    def _output_padding(self, input, output_size) -> tuple[int, ...]:  # noqa: A002
        if output_size is None:
            return self.output_padding
        n = self._n
        size = [int(s) for s in output_size]
        if len(size) == input.ndim:
            size = size[-n:]
        if len(size) != n:
            raise ValueError(
                f"ConvTranspose{n}D: for {input.ndim}D input, output_size must have {n} or "
                f"{input.ndim} elements (got {len(output_size)})"
            )
        spatial = input.shape[-n:]
        lo = [
            (spatial[d] - 1) * self.stride[d] - 2 * self.padding[d]
            + self.dilation[d] * (self.kernel_size[d] - 1) + 1
            for d in range(n)
        ]  # fmt: skip
        hi = [lo[d] + self.stride[d] - 1 for d in range(n)]
        if any(not lo[d] <= size[d] <= hi[d] for d in range(n)):
            raise ValueError(
                f"requested an output size of {size}, but valid sizes range from {lo} to {hi} "
                f"(for an input of {list(spatial)})"
            )
        return tuple(size[d] - lo[d] for d in range(n))

    def forward(self, input, output_size=None):  # noqa: A002
        return F.conv_transpose2d(
            input, self.weight, self.bias, self.stride, self.padding,
            self._output_padding(input, output_size), self.groups, self.dilation,
        )  # fmt: skip


__all__ = ["Conv1d", "Conv2d", "ConvTranspose2d"]

"""Pooling layers, as torch.nn (``torch/nn/modules/pooling.py``): MaxPool1d/2d, AvgPool1d/2d,
AdaptiveAvgPool1d/2d. Attributes keep the values given (an int stays an int), as PyTorch's do;
the 1-d layers run the 2-d ops over a height of 1."""

from __future__ import annotations

from .. import functional as F
from ..module import Module


def _one(v) -> int:
    return int(v[0]) if isinstance(v, (tuple, list)) else int(v)


def _as_2d(x, fn):
    """Run the 2-d op ``fn`` on [N, C, L] (or [C, L]) viewed as [N, C, 1, L]."""
    y = fn(F.unsqueeze(x, -2))
    return F.squeeze(y, -2)


class _MaxPoolNd(Module):
    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        dilation=1,
        return_indices: bool = False,
        ceil_mode: bool = False,
    ) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding, self.dilation = padding, dilation
        self.return_indices, self.ceil_mode = return_indices, ceil_mode

    def extra_repr(self) -> str:
        return (
            f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}, "
            f"dilation={self.dilation}, ceil_mode={self.ceil_mode}"
        )


class MaxPool2d(_MaxPoolNd):
    """2-D max pooling (``torch.nn.MaxPool2d``).

    Shapes: input floating [N, C, H, W] or [C, H, W] -> [N, C, H_out, W_out],
    ``H_out = (H + 2 padding - dilation (kernel - 1) - 1) // stride + 1`` (rounded up with
    ``ceil_mode``, PyTorch docs); padding counts as -inf; stride defaults to kernel_size.

    Raises:
        NotImplementedError: ``return_indices=True`` (at forward).
    """

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return F.max_pool2d(
            input, self.kernel_size, self.stride, self.padding, self.dilation,
            self.ceil_mode, self.return_indices,
        )  # fmt: skip


class MaxPool1d(_MaxPoolNd):
    """1-D max pooling (``torch.nn.MaxPool1d``): [N, C, L] or [C, L] -> [N, C, L_out], sizes
    as ``MaxPool2d``'s along L.

    Raises:
        NotImplementedError: ``return_indices=True`` (at forward).
    """

    def forward(self, input):  # noqa: A002
        if self.return_indices:
            raise NotImplementedError("max_pool1d(return_indices=True) is not supported")
        args = [(1, _one(v)) for v in (self.kernel_size, self.stride)]
        pad, dil = (0, _one(self.padding)), (1, _one(self.dilation))
        return _as_2d(input, lambda x: F.max_pool2d(x, *args, pad, dil, self.ceil_mode))


class AvgPool2d(Module):
    """2-D average pooling (``torch.nn.AvgPool2d``).

    Shapes: input floating [N, C, H, W] or [C, H, W] -> [N, C, H_out, W_out],
    ``H_out = (H + 2 padding - kernel) // stride + 1`` (rounded up with ``ceil_mode``);
    zero padding; the divisor is the window clipped to the padded input
    (``count_include_pad=True``) or to the input, or ``divisor_override`` (ATen's rule).
    """

    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
        divisor_override: int | None = None,
    ) -> None:
        super().__init__()
        self.kernel_size = kernel_size
        self.stride = stride if stride is not None else kernel_size
        self.padding, self.ceil_mode = padding, ceil_mode
        self.count_include_pad, self.divisor_override = count_include_pad, divisor_override

    def forward(self, input):  # noqa: A002
        return F.avg_pool2d(
            input, self.kernel_size, self.stride, self.padding, self.ceil_mode,
            self.count_include_pad, self.divisor_override,
        )  # fmt: skip

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


class AvgPool1d(Module):
    """1-D average pooling (``torch.nn.AvgPool1d``): [N, C, L] or [C, L] -> [N, C, L_out]."""

    def __init__(
        self,
        kernel_size,
        stride=None,
        padding=0,
        ceil_mode: bool = False,
        count_include_pad: bool = True,
    ) -> None:
        super().__init__()
        self.kernel_size = _tuple1(kernel_size)
        self.stride = _tuple1(stride if stride is not None else kernel_size)
        self.padding = _tuple1(padding)
        self.ceil_mode, self.count_include_pad = ceil_mode, count_include_pad

    def forward(self, input):  # noqa: A002
        k, s = ((1, _one(v)) for v in (self.kernel_size, self.stride))
        p = (0, _one(self.padding))
        return _as_2d(
            input, lambda x: F.avg_pool2d(x, k, s, p, self.ceil_mode, self.count_include_pad)
        )

    def extra_repr(self) -> str:
        return f"kernel_size={self.kernel_size}, stride={self.stride}, padding={self.padding}"


def _tuple1(v) -> tuple[int]:
    # PyTorch's AvgPool1d stores _single(...) tuples (MaxPool1d keeps the values as given).
    return tuple(v) if isinstance(v, (tuple, list)) else (v,)


class _AdaptiveAvgPoolNd(Module):
    def __init__(self, output_size) -> None:
        super().__init__()
        self.output_size = output_size

    def extra_repr(self) -> str:
        return f"output_size={self.output_size}"


class AdaptiveAvgPool2d(_AdaptiveAvgPoolNd):
    """Adaptive average pooling to ``output_size`` (``torch.nn.AdaptiveAvgPool2d``).

    Shapes: input floating [N, C, H, W] or [C, H, W] -> [N, C, OH, OW]; cell (i, j) averages
    rows ``[floor(i H / OH), ceil((i + 1) H / OH))`` and likewise columns. ``output_size`` is
    an int, a pair, or a pair holding None (keep that input size).
    """

    def forward(self, input):  # noqa: A002
        return F.adaptive_avg_pool2d(input, self.output_size)


class AdaptiveAvgPool1d(_AdaptiveAvgPoolNd):
    """Adaptive average pooling to length ``output_size`` (``torch.nn.AdaptiveAvgPool1d``):
    [N, C, L] or [C, L] -> [N, C, output_size]."""

    def forward(self, input):  # noqa: A002
        size = (1, _one(self.output_size))
        return _as_2d(input, lambda x: F.adaptive_avg_pool2d(x, size))


__all__ = [
    "AdaptiveAvgPool1d",
    "AdaptiveAvgPool2d",
    "AvgPool1d",
    "AvgPool2d",
    "MaxPool1d",
    "MaxPool2d",
]

"""LayerNorm, RMSNorm and GroupNorm, as torch.nn (``torch/nn/modules/normalization.py``):
same arguments, defaults, parameter names and shapes; weight ones and bias zeros at init."""

from __future__ import annotations

from .. import functional as F
from .. import init
from ..module import Module
from ..parameter import Parameter


def _shape(normalized_shape) -> tuple[int, ...]:
    if isinstance(normalized_shape, int):
        return (normalized_shape,)
    return tuple(int(s) for s in normalized_shape)


def register_affine(module: Module, shape: tuple[int, ...], affine: bool, bias: bool, dtype):
    """Register a norm's ``weight`` and ``bias`` of ``shape`` (None when absent, as torch)."""
    module.register_parameter("weight", Parameter(shape=shape, dtype=dtype) if affine else None)
    has_bias = affine and bias
    module.register_parameter("bias", Parameter(shape=shape, dtype=dtype) if has_bias else None)


def reset_affine(module: Module) -> None:
    """weight = 1 and bias = 0 where present (torch's norms' ``reset_parameters``)."""
    if module.weight is not None:
        init.ones_(module.weight)
    if module.bias is not None:
        init.zeros_(module.bias)


class LayerNorm(Module):
    """``y = (x - mean) / sqrt(var + eps) * weight + bias`` over the trailing
    ``normalized_shape`` dims, biased variance (``torch.nn.LayerNorm``; Ba et al. 2016).

    Shapes: input floating [*, *normalized_shape], output alike; weight and bias
    ``normalized_shape`` (absent when ``elementwise_affine=False``; bias absent when
    ``bias=False``).
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float = 1e-5,
        elementwise_affine: bool = True,
        bias: bool = True,
        dtype=None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        register_affine(self, self.normalized_shape, elementwise_affine, bias, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return F.layer_norm(input, self.normalized_shape, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, "
            f"elementwise_affine={self.elementwise_affine}, "
            f"bias={self._parameters['bias'] is not None}"
        )


class RMSNorm(Module):
    """``y = x / sqrt(mean(x^2) + eps) * weight`` over the trailing ``normalized_shape`` dims
    (``torch.nn.RMSNorm``; Zhang & Sennrich 2019).

    Shapes: input floating [*, *normalized_shape], output alike; weight ``normalized_shape``
    (absent when ``elementwise_affine=False``). ``eps=None`` means the machine epsilon of the
    computing dtype, as in PyTorch: float32's (1.19e-7) here, since kernels compute in f32.
    """

    def __init__(
        self,
        normalized_shape: int | tuple[int, ...],
        eps: float | None = None,
        elementwise_affine: bool = True,
        dtype=None,
    ) -> None:
        super().__init__()
        self.normalized_shape = _shape(normalized_shape)
        self.eps, self.elementwise_affine = eps, elementwise_affine
        if elementwise_affine:
            self.weight = Parameter(shape=self.normalized_shape, dtype=dtype)
        else:
            self.register_parameter("weight", None)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        if self.elementwise_affine:
            init.ones_(self.weight)

    def forward(self, x):
        return F.rms_norm(x, self.normalized_shape, self.weight, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.normalized_shape}, eps={self.eps}, elementwise_affine={self.elementwise_affine}"
        )


class GroupNorm(Module):
    """Group normalization (``torch.nn.GroupNorm``; Wu & He 2018): the C channels of
    [N, C, *] split into ``num_groups`` consecutive groups, each (sample, group) normalized by
    its mean and biased variance, then ``weight[c] * y + bias[c]``.

    Shapes: input floating [N, C, *], output alike; weight and bias [C] (absent when
    ``affine=False``; bias absent when ``bias=False``).

    Raises:
        ValueError: ``num_groups`` does not divide ``num_channels``.
    """

    def __init__(
        self,
        num_groups: int,
        num_channels: int,
        eps: float = 1e-5,
        affine: bool = True,
        dtype=None,
        *,
        bias: bool = True,
    ) -> None:
        super().__init__()
        if num_channels % num_groups:
            raise ValueError("num_channels must be divisible by num_groups")
        self.num_groups, self.num_channels = int(num_groups), int(num_channels)
        self.eps, self.affine = eps, affine
        register_affine(self, (self.num_channels,), affine, bias, dtype)
        self.reset_parameters()

    def reset_parameters(self) -> None:
        reset_affine(self)

    def forward(self, input):  # noqa: A002
        return F.group_norm(input, self.num_groups, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return (
            f"{self.num_groups}, {self.num_channels}, eps={self.eps}, affine={self.affine}, "
            f"bias={self._parameters['bias'] is not None}"
        )


__all__ = ["GroupNorm", "LayerNorm", "RMSNorm"]

"""Upsample, UpsamplingNearest2d and UpsamplingBilinear2d, as torch.nn
(``torch/nn/modules/upsampling.py``): thin modules over ``F.interpolate``."""

from __future__ import annotations

from .. import functional as F
from ..module import Module


class Upsample(Module):
    """Resize the spatial dims to ``size`` or by ``scale_factor`` (``torch.nn.Upsample``).

    Shapes: floating [N, C, *spatial] -> [N, C, *spatial'] with ``spatial'[i] = size[i]`` or
    ``floor(spatial[i] * scale_factor[i])``; ``mode`` 'nearest', 'linear' (3-d input),
    'bilinear' (4-d), 'trilinear' (5-d) or 'area', with ``align_corners`` and
    ``recompute_scale_factor`` as in ``F.interpolate`` (PyTorch's semantics).
    ``scale_factor`` is stored as float (a tuple of floats), as PyTorch stores it.

    Raises:
        ValueError / NotImplementedError: what ``F.interpolate`` raises (at forward).
    """

    def __init__(
        self,
        size=None,
        scale_factor=None,
        mode: str = "nearest",
        align_corners: bool | None = None,
        recompute_scale_factor: bool | None = None,
    ) -> None:
        super().__init__()
        self.name = type(self).__name__
        self.size = size
        if isinstance(scale_factor, tuple):
            self.scale_factor = tuple(float(f) for f in scale_factor)
        else:
            self.scale_factor = float(scale_factor) if scale_factor else None
        self.mode, self.align_corners = mode, align_corners
        self.recompute_scale_factor = recompute_scale_factor

    def forward(self, input):  # noqa: A002 - PyTorch's name
        return F.interpolate(
            input, self.size, self.scale_factor, self.mode, self.align_corners,
            recompute_scale_factor=self.recompute_scale_factor,
        )  # fmt: skip

    def extra_repr(self) -> str:
        if self.scale_factor is not None:
            info = f"scale_factor={self.scale_factor!r}"
        else:
            info = f"size={self.size!r}"
        return f"{info}, mode={self.mode!r}"


class UpsamplingNearest2d(Upsample):
    """``Upsample(size, scale_factor, mode='nearest')`` (``torch.nn.UpsamplingNearest2d``)."""

    def __init__(self, size=None, scale_factor=None) -> None:
        super().__init__(size, scale_factor, mode="nearest")


class UpsamplingBilinear2d(Upsample):
    """``Upsample(size, scale_factor, mode='bilinear', align_corners=True)``
    (``torch.nn.UpsamplingBilinear2d``)."""

    def __init__(self, size=None, scale_factor=None) -> None:
        super().__init__(size, scale_factor, mode="bilinear", align_corners=True)


__all__ = ["Upsample", "UpsamplingBilinear2d", "UpsamplingNearest2d"]

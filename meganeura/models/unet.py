"""The conv U-Net of workload W5 (``docs/workloads.md``): conv_in 3x3 -> per level a ResBlock
(skip kept) and a stride-2 3x3 down-convolution except at the deepest level -> a middle
ResBlock -> per level from the deepest: nearest 2x upsample (not at the deepest), concat with
the skip, ResBlock -> GroupNorm -> SiLU -> conv_out 3x3. ResBlock = GN -> SiLU -> conv3x3 ->
GN -> SiLU -> conv3x3 plus the input (through a 1x1 conv when the channels change). No conv
biases, no attention, no timestep.

Shapes: f32 [N, in_channels, H, W] -> f32 [N, out_channels, H, W], H and W divisible by
2^(levels - 1).
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import nn
from ..nn import functional as F


@dataclass(frozen=True)
class UNetConfig:
    in_channels: int = 4
    out_channels: int = 4
    base_channels: int = 64
    channel_mult: tuple[int, ...] = (1, 2, 4)
    num_groups: int = 16
    eps: float = 1e-5


SMALL = UNetConfig()
TINY = UNetConfig(base_channels=32, num_groups=8)


class ResBlock(nn.Module):
    def __init__(self, cin: int, cout: int, groups: int, eps: float) -> None:
        super().__init__()
        self.norm1 = nn.GroupNorm(groups, cin, eps=eps)
        self.conv1 = nn.Conv2d(cin, cout, 3, padding=1, bias=False)
        self.norm2 = nn.GroupNorm(groups, cout, eps=eps)
        self.conv2 = nn.Conv2d(cout, cout, 3, padding=1, bias=False)
        self.skip = nn.Conv2d(cin, cout, 1, bias=False) if cin != cout else nn.Identity()

    def forward(self, x):
        h = self.conv1(F.silu(self.norm1(x)))
        h = self.conv2(F.silu(self.norm2(h)))
        return h + self.skip(x)


class UNet(nn.Module):
    """The W5 U-Net (``SMALL``: base 64, 16 groups; ``TINY``: base 32, 8 groups)."""

    def __init__(self, cfg: UNetConfig = SMALL) -> None:
        super().__init__()
        self.config = cfg
        g, eps = cfg.num_groups, cfg.eps
        chans = [cfg.base_channels * m for m in cfg.channel_mult]
        self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1, bias=False)
        self.down = nn.ModuleList()
        self.downsample = nn.ModuleList()
        cin = chans[0]
        for i, c in enumerate(chans):
            self.down.append(ResBlock(cin, c, g, eps))
            if i < len(chans) - 1:
                self.downsample.append(nn.Conv2d(c, c, 3, stride=2, padding=1, bias=False))
            cin = c
        self.mid = ResBlock(cin, cin, g, eps)
        self.up = nn.ModuleList()
        for c in reversed(chans):
            self.up.append(ResBlock(cin + c, c, g, eps))
            cin = c
        self.upsample = nn.Upsample(scale_factor=2, mode="nearest")
        self.norm_out = nn.GroupNorm(g, cin, eps=eps)
        self.conv_out = nn.Conv2d(cin, cfg.out_channels, 3, padding=1, bias=False)

    def forward(self, x):
        h = self.conv_in(x)
        skips = []
        for i, block in enumerate(self.down):
            h = block(h)
            skips.append(h)
            if i < len(self.downsample):
                h = self.downsample[i](h)
        h = self.mid(h)
        for i, block in enumerate(self.up):
            if i > 0:
                h = self.upsample(h)
            h = block(F.cat([h, skips.pop()], dim=1))
        return self.conv_out(F.silu(self.norm_out(h)))

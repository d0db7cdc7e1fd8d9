"""W5: the conv U-Net of ``docs/workloads.md`` (``meganeura.models.unet``) against
:func:`torch_unet`, the same structure and state-dict names in PyTorch. Training: MSE to a
noise target with Adam lr 1e-3 on both sides; also the tiny U-Net, batch 4 x 20 steps per
timed call."""

from __future__ import annotations

from .base import Case, Workload
from .weights import sin_input


def torch_unet(cfg):
    """PyTorch U-Net of ``cfg`` (``meganeura.models.unet.UNetConfig``), meganeura's names."""
    import torch
    from torch import nn
    from torch.nn import functional as F

    class ResBlock(nn.Module):
        def __init__(self, cin, cout, groups, eps):
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
        def __init__(self):
            super().__init__()
            g, eps = cfg.num_groups, cfg.eps
            chans = [cfg.base_channels * m for m in cfg.channel_mult]
            self.conv_in = nn.Conv2d(cfg.in_channels, chans[0], 3, padding=1, bias=False)
            self.down, self.downsample = nn.ModuleList(), nn.ModuleList()
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
                    h = F.interpolate(h, scale_factor=2, mode="nearest")
                h = block(torch.cat([h, skips.pop()], dim=1))
            return self.conv_out(F.silu(self.norm_out(h)))

    return UNet()


class UNetWorkload(Workload):
    id, name, title = "w5", "unet", "conv U-Net"
    paper = {
        "fwd": ("fwd_small_b2", 2.6, 1.5),
        "train": ("train_small_b2", 9.2, 6.8),
        "first_s": 15,
    }

    def cfg(self, size, quick):
        from meganeura.models.unet import UNetConfig

        if quick:
            return UNetConfig(base_channels=8, num_groups=4)
        return UNetConfig() if size == "small" else UNetConfig(base_channels=32, num_groups=8)

    def cases(self, quick):
        adam = ("adam", 1e-3)
        return [
            Case("fwd_small_b2", "fwd", {"size": "small", "batch": 2}),
            Case("fwd_small_b1", "fwd", {"size": "small", "batch": 1}),
            Case("train_small_b2", "train", {"size": "small", "batch": 2}, adam),
            Case("fwdbwd_small_b2", "fwdbwd", {"size": "small", "batch": 2}, adam),
            Case(
                "train_tiny_b4x20",
                "train_steps",
                {"size": "tiny", "batch": 4, "steps": 3 if quick else 20},
                adam,
            ),
        ]

    def build_ours(self, case, quick):
        import meganeura as mn
        from meganeura.models.unet import UNet

        mn.manual_seed(0)
        m = UNet(self.cfg(case.params["size"], quick))
        return m.train() if case.trains else m.eval()

    def build_torch(self, case, quick):
        m = torch_unet(self.cfg(case.params["size"], quick))
        return m.train() if case.trains else m.eval()

    def batch(self, case, quick):
        side = 16 if quick else 32
        x = sin_input((case.params["batch"], 4, side, side), 1.0)
        if case.kind == "fwd":
            return (x,)
        return x, sin_input(x.shape, 5.0)

    def ours_loss(self, model, x, noise):
        import meganeura.nn.functional as F

        return F.mse_loss(model(x), noise)

    def torch_loss(self, m, x, noise):
        import torch

        return torch.nn.functional.mse_loss(m(x).float(), noise)

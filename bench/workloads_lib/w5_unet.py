"""W5: the conv U-Net of ``docs/workloads.md`` (``meganeura.models.unet``) against
:func:`torch_unet` (the tests' PyTorch twin, same state-dict names). Training: MSE to a
noise target with Adam lr 1e-3 on both sides; also the tiny U-Net, batch 4 x 20 steps per
timed call."""

from __future__ import annotations

from .base import Case, Workload
from .weights import sin_input


def torch_unet(cfg):
    """PyTorch U-Net of ``cfg`` (``meganeura.models.unet.UNetConfig``), meganeura's names: the
    tests' independent twin, ``W5UNet`` of ``tests/nn/port_sources.py``."""
    import torch

    from tests.nn.port_sources import define

    W5UNet = define(torch.nn, torch.nn.functional, torch)["W5UNet"]
    return W5UNet(
        cfg.in_channels,
        cfg.out_channels,
        cfg.base_channels,
        cfg.channel_mult,
        cfg.num_groups,
        cfg.eps,
    )


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

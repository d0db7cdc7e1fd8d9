"""The conv U-Net of workload W5 (``meganeura.models.unet``) at its own depth -- three levels,
channel multipliers 1, 2, 4 -- against its hand-written torch twin (``tests/nn/port_sources``'s
``W5UNet``: torch Conv2d, GroupNorm, SiLU, nearest Upsample) with the gates of
``docs/workloads.md``: forward, MSE loss, per-parameter gradients and one Adam step (lr 1e-3,
the workload's optimizer), strict and fast. ``tests/nn/test_ports.py`` covers the two-level
port with AdamW; the published configs are checked by their parameter counts, without
compiling. torch runs in float64 on the float32 weights and inputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.models.unet import SMALL, TINY, UNet, UNetConfig
from meganeura.nn import init

from ..nn.port_sources import define
from . import gates

W5UNet = define(torch.nn, torch.nn.functional, torch)["W5UNet"]
CFG = UNetConfig(base_channels=8, channel_mult=(1, 2, 4), num_groups=4)
LR = 1e-3


@pytest.mark.parametrize(
    ("cfg", "count"), [(SMALL, 5_294_080), (TINY, 1_326_080)], ids=["small", "tiny"]
)
def test_published_parameter_counts(cfg, count):
    with init.empty_weights():
        model = UNet(cfg)
    assert sum(p.numel() for p in model.parameters()) == count


def _pair():
    torch.manual_seed(5)
    ref = W5UNet(CFG.in_channels, CFG.out_channels, CFG.base_channels, CFG.channel_mult, 4)
    g = torch.Generator().manual_seed(6)
    with torch.no_grad():
        for m in ref.modules():
            if isinstance(m, torch.nn.GroupNorm):
                m.weight.copy_(torch.rand(m.weight.shape, generator=g) + 0.5)
                m.bias.copy_(torch.rand(m.bias.shape, generator=g) - 0.5)
    ours = UNet(CFG)
    result = ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    return ours, ref.double()


def _loss(model, x, target):
    return F.mse_loss(model(x), target)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_w5_unet_matches_torch(gpu_device, precision):
    """Forward (eval program), loss, gradients and one Adam step (lr 1e-3) against torch."""
    tol = gates.STRICT if precision == "strict" else gates.FAST
    ours, ref = _pair()
    rng = np.random.default_rng(7)
    x = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    target = rng.standard_normal((2, 4, 8, 8)).astype(np.float32)
    xt, tt = (torch.from_numpy(a.astype(np.float64)) for a in (x, target))

    with torch.no_grad():
        want = ref(xt).numpy()
    errs = {"forward": gates.check_forward(mn.compile(ours, precision=precision)(x), want, tol)}

    before = {k: v.astype(np.float64) for k, v in ours.state_dict().items()}
    tr = mn.Trainer(ours, mn.optim.Adam(lr=LR), _loss, precision=precision, device=gpu_device)
    loss, grads = tr.step(x, target, return_grads=True)
    opt = torch.optim.Adam(ref.parameters(), lr=LR)
    want_loss = torch.nn.functional.mse_loss(ref(xt), tt)
    want_loss.backward()
    want_grads = {k: p.grad.numpy().copy() for k, p in ref.named_parameters()}
    opt.step()
    after = {k: v.detach().numpy().copy() for k, v in ref.state_dict().items()}
    errs["loss"] = gates.check_loss(loss, want_loss.item(), tol)
    errs.update(gates.check_grads(grads, want_grads, tol))
    errs.update(gates.check_step(before, ours.state_dict(), after, tol))
    print(f"W5 U-Net ({precision}): {errs}")

"""Fast mode and f16's range (issue 11, item 5): values a user computes by hand that exceed
65504 (squares of activations near 800, sums of exponentials, pow, a hand-written variance)
stay finite and match torch float32, on the graph API, through ``mn.compile(model, x,
precision="fast")`` and through the Trainer. Before the range rule of ``passes.ranges`` each
of these stored an intermediate as f16 and returned inf.

Tolerance: fast mode stores activations as f16 (11 significant bits), so results are compared
with a relative tolerance of 1e-2, the one ``test_fast_mode.py`` uses for whole models.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import elementwise as E
from meganeura.training import compile_for

RTOL = 1e-2
pytestmark = pytest.mark.gpu


def _need_f16(device) -> None:
    if "shader-f16" not in device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")


def _x(scale: float, shape=(4, 16), seed: int = 0) -> np.ndarray:
    return (np.random.default_rng(seed).uniform(0.5, 1.0, shape) * scale).astype(np.float32)


def _run(graph, feeds, params, device) -> dict:
    program, session = compile_for(graph, CompileOptions(precision="fast"), device)
    assert program.meta["precision"] == "fast"
    with session:
        session.load_state_dict(params, strict=False)
        return session.run(feeds, [name for name, _ in graph.outputs])


def test_graph_squares_exponentials_and_pow_stay_finite(gpu_device):
    _need_f16(gpu_device)
    b = GraphBuilder()
    x = b.input("x", (4, 16))
    w = b.parameter("w", (16, 16))
    h = x @ w  # an activation of about 800 (an f16 value: fine)
    centered = h - F.mean(h, 1, keepdim=True)
    b.output("sq", F.sum(h * h, 1))  # h * h: 640000
    b.output("pw", F.mean(E.pow(centered, 2.0), 1))  # a hand-written variance
    b.output("ex", F.sum(F.exp(h * 0.015), 1))  # exp(12) = 162755
    b.output("rms", h / F.sqrt(F.mean(h * h, 1, keepdim=True)))  # back in range: f16 again
    xv, wv = _x(100.0), np.eye(16, dtype=np.float32) * 8
    got = _run(b.build(), {"x": xv}, {"w": wv}, gpu_device)
    ht = torch.from_numpy(xv) @ torch.from_numpy(wv)
    want = {
        "sq": (ht * ht).sum(1),
        "pw": ((ht - ht.mean(1, keepdim=True)) ** 2).mean(1),
        "ex": torch.exp(ht * 0.015).sum(1),
        "rms": ht / torch.sqrt((ht * ht).mean(1, keepdim=True)),
    }
    for k, v in want.items():
        assert np.all(np.isfinite(got[k])), k
        np.testing.assert_allclose(got[k], v.numpy(), rtol=RTOL, err_msg=k)


class _HandNorm(mn.nn.Module):
    """A hand-written variance and softmax, as users write them before reaching for F.*."""

    def __init__(self):
        super().__init__()
        self.fc = mn.nn.Linear(16, 16)

    def forward(self, x):
        h = self.fc(x)
        d = h - h.mean(-1, keepdim=True)
        var = (d * d).mean(-1, keepdim=True)
        e = F.exp(h * 0.015)
        return var, e / e.sum(-1, keepdim=True)


def test_module_compiled_fast_keeps_hand_written_variance_finite(gpu_device):
    _need_f16(gpu_device)
    mn.manual_seed(0)
    model = _HandNorm()
    w = np.eye(16, dtype=np.float32) * 8
    b = np.zeros(16, np.float32)
    model.load_state_dict({"fc.weight": w, "fc.bias": b})
    x = _x(100.0, seed=1)
    var, p = mn.compile(model, x, precision="fast", device=gpu_device)(x)
    ht = torch.from_numpy(x) @ torch.from_numpy(w).T
    want_var = ((ht - ht.mean(-1, keepdim=True)) ** 2).mean(-1, keepdim=True)
    want_p = torch.softmax(ht * 0.015, -1)
    assert np.all(np.isfinite(var)) and np.all(np.isfinite(p))
    np.testing.assert_allclose(var, want_var.numpy(), rtol=RTOL)
    np.testing.assert_allclose(p, want_p.numpy(), rtol=RTOL)


def test_trainer_fast_squared_error_of_large_residuals(gpu_device):
    """A squared-error loss written by hand on residuals near 800: the loss and the update
    match torch float32 (before: the squares were stored f16, the loss was inf)."""
    _need_f16(gpu_device)
    mn.manual_seed(0)
    model = mn.nn.Linear(16, 4)
    w0 = np.random.default_rng(3).uniform(-0.1, 0.1, (4, 16)).astype(np.float32)
    model.load_state_dict({"weight": w0, "bias": np.zeros(4, np.float32)})

    def loss_fn(model, x, y):
        r = model(x) - y
        return (r * r).sum() / r.numel()

    trainer = mn.Trainer(model, mn.optim.SGD(lr=1e-6), loss_fn, precision="fast", device=gpu_device)
    x, y = _x(1.0, (8, 16), seed=4), _x(800.0, (8, 4), seed=5)
    loss = trainer.step(x, y)
    wt = torch.tensor(w0, requires_grad=True)
    r = torch.from_numpy(x) @ wt.T - torch.from_numpy(y)
    lt = (r * r).sum() / r.numel()
    lt.backward()
    assert np.isfinite(loss)
    np.testing.assert_allclose(loss, lt.item(), rtol=RTOL)
    w1 = model.state_dict()["weight"]
    np.testing.assert_allclose(w1, (wt - 1e-6 * wt.grad).detach().numpy(), rtol=RTOL)

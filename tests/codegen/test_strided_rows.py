"""Long strided rows, few of them (``rowwise.rows.narrowed``, the norms' weight-gradient
channel sums): fewer rows per workgroup and more threads per row until the GPU has workgroups
enough (a layer norm's weight gradient over 1500 rows of 384 channels: 48 workgroups instead
of 12), against float64 torch autograd with the narrowing on and off."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura.nn.functional as F
from meganeura.codegen.wgsl.rowwise import rows
from meganeura.codegen.wgsl.rowwise.rows import RowPlan, narrowed, plan_rows
from meganeura.graph.builder import GraphBuilder


@pytest.fixture
def narrow():
    """``rows.set_narrow_strided``, restored to on after the test."""
    yield rows.set_narrow_strided
    rows.set_narrow_strided(True)


def test_plans(narrow):
    def plan(n_rows, row_len):
        return narrowed(plan_rows(n_rows, row_len, False), n_rows, row_len)

    assert plan(384, 1500) == RowPlan(8, 32)  # 48 workgroups, 32 threads a channel
    assert plan(384, 128) == RowPlan(32, 8)  # short rows: as before
    assert plan(4096, 1500) == RowPlan(32, 8)  # rows enough: as before
    assert plan(20, 5000) == RowPlan(8, 32)  # never below 8 rows a workgroup
    assert narrowed(RowPlan(1, 256), 384, 1500) == RowPlan(1, 256)  # contiguous: untouched
    narrow(False)
    assert plan(384, 1500) == RowPlan(32, 8)


@pytest.mark.gpu
@pytest.mark.parametrize("on", [True, False], ids=["narrow", "wide"])
def test_layer_norm_weight_gradients(on, narrow, gpu_device):
    """dweight = sum over rows of g * xhat and dbias = sum of g (the channel sums), 700 rows
    of 96 channels, against float64 torch autograd."""
    from meganeura.compile import CompileOptions, compile
    from meganeura.optim import HYPER_INPUT, SGD
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    narrow(on)
    rng = np.random.default_rng(5)
    xs, ws, bs = (700, 96), (96,), (96,)
    params = {
        "x": (rng.standard_normal(xs) * 2 + 1).astype(np.float32),
        "w": rng.standard_normal(ws).astype(np.float32),
        "b": rng.standard_normal(bs).astype(np.float32),
    }
    r = rng.standard_normal(xs).astype(np.float32)
    b = GraphBuilder()
    x, w, bias = (b.parameter(n, params[n].shape) for n in ("x", "w", "b"))
    y = F.layer_norm(x, (96,), w, bias)
    b.output("loss", F.sum(y * b.input("r", xs)))
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True)
    program = compile(b.build(), options, device_limits(gpu_device))
    (sums,) = [d for d in program.dispatches if "layer_norm_weight_backward" in d.name]
    assert sums.grid[0] == (12 if on else 3)  # 96 channels, 8 or 32 a workgroup
    with Session(program, gpu_device) as sess:
        sess.load_state_dict(params)
        got = sess.run({"r": r, HYPER_INPUT: opt.hyper(0, opt.lr)}, ["w.grad", "b.grad"])
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()}
    out = torch.nn.functional.layer_norm(t["x"], (96,), t["w"], t["b"])
    (out * torch.tensor(r, dtype=torch.float64)).sum().backward()
    for name, p in (("w.grad", t["w"]), ("b.grad", t["b"])):
        want = p.grad.numpy()
        np.testing.assert_allclose(got[name], want, rtol=0, atol=1e-5 * np.abs(want).max())

"""Norms computing their input from a split-K convolution's partials (``codegen.wgsl.norm
.conv_prologue``): the conv's summing dispatch goes, values bit-identical to the program with it
(a conv -> train-mode batch_norm -> relu training step: loss, gradients, running statistics; a
conv -> group_norm -> silu forward in strict and fast mode and training step), and against
float64 torch; which convs qualify; the partials' lifetime; counts on the H200's limits.

GPU tests force split-K conv plans (lavapipe's own plans never split: ``conv.gemm.force_plan``)
and compare programs compiled with the feature on and off (``conv_prologue.set_enabled``).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.codegen.kernel import H200_LIMITS, Limits, ScratchRef, ValueRef
from meganeura.codegen.wgsl.conv.gemm import force_plan
from meganeura.codegen.wgsl.norm import conv_prologue
from meganeura.compile import CompileOptions, compile
from meganeura.nn import BatchNorm2d, Conv2d, GroupNorm, Module
from meganeura.nn.compiled import trace_call

CIN, COUT = 16, 12
# (x's spatial side, forced splits): 6x6 planes are read as vec4 units; 5x5 as scalars, with
# more than 8 splits (the summing kernel's four lanes per element)
CASES = {"vec4_s4": (6, 4), "scalar_s12": (5, 12)}


@pytest.fixture(autouse=True)
def _switch():
    yield
    conv_prologue.set_enabled(True)


class ConvBN(Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = Conv2d(CIN, COUT, 3, padding=1, bias=False)
        self.bn = BatchNorm2d(COUT)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x)))


class ConvGN(Module):
    def __init__(self) -> None:
        super().__init__()
        self.conv = Conv2d(CIN, COUT, 3, padding=1)  # with a bias: the sum adds it
        self.gn = GroupNorm(4, COUT)
        # the training loss reads silu through a 1x1 conv (as the U-Net's next conv does), so
        # the silu pairs with the group_norm (``passes.fuse_norm``) rather than join the loss
        self.head = Conv2d(COUT, COUT, 1, bias=False)

    def forward(self, x):
        return F.silu(self.gn(self.conv(x)))


def _mse(model, x, t):
    y = model(x)
    return F.mse_loss(model.head(y) if isinstance(model, ConvGN) else y, t)


def _model(cls):
    mn.manual_seed(0)
    model = cls()
    r = np.random.default_rng(3)
    state = {
        k: (r.standard_normal(v.shape) * (0.2 if v.ndim > 1 else 0.5) + (k.endswith("weight")
            and v.ndim == 1)).astype(np.float32)
        for k, v in model.state_dict().items() if "running" not in k and "tracked" not in k
    }  # fmt: skip
    model.load_state_dict(state, strict=False)
    return model


def _data(side: int, seed: int = 1):
    r = np.random.default_rng(seed)
    x = (r.standard_normal((2, CIN, side, side)) + 0.5).astype(np.float32)
    return x, r.standard_normal((2, COUT, side, side)).astype(np.float32)


def _step(cls, on: bool, gpu_device, x, t, splits: int, precision: str = "strict"):
    """(loss, gradients, state after one SGD step) with the feature ``on``."""
    conv_prologue.set_enabled(on)
    model = _model(cls)
    with force_plan(splits=splits):
        opt = mn.optim.SGD(lr=0.1)
        tr = mn.Trainer(model, opt, _mse, device=gpu_device, precision=precision)
        loss, grads = tr.step(x, t, return_grads=True)
        state = tr.state_dict()
    conv_prologue.set_enabled(True)
    return loss, grads, state


def _torch(cls, x, t):
    """Float64 torch: (loss, gradients, running statistics after the step) of ``cls``."""
    ours = _model(cls).state_dict()
    conv = torch.nn.Conv2d(CIN, COUT, 3, padding=1, bias=cls is ConvGN).double()
    norm = torch.nn.BatchNorm2d(COUT) if cls is ConvBN else torch.nn.GroupNorm(4, COUT)
    act = torch.nn.ReLU() if cls is ConvBN else torch.nn.SiLU()
    head = [torch.nn.Conv2d(COUT, COUT, 1, bias=False).double()] if cls is ConvGN else []
    net = torch.nn.Sequential(conv, norm.double(), act, *head).train()
    names = {"conv": "0", "bn": "1", "gn": "1", "head": "3"}
    net.load_state_dict(
        {names[k.split(".")[0]] + k[k.index(".") :]: torch.tensor(v) for k, v in ours.items()}
    )
    y = net(torch.tensor(x, dtype=torch.float64))
    loss = torch.nn.functional.mse_loss(y, torch.tensor(t, dtype=torch.float64))
    loss.backward()
    inv = {"0": "conv", "1": "bn" if cls is ConvBN else "gn", "3": "head"}
    grads = {inv[k[0]] + k[1:]: p.grad.numpy() for k, p in net.named_parameters()}
    stats = {inv[k[0]] + k[1:]: v.numpy() for k, v in net.state_dict().items() if "running" in k}
    return loss.item(), grads, stats


def _assert_exact(a, b):
    assert a[0] == b[0]
    assert a[1].keys() == b[1].keys() and a[2].keys() == b[2].keys()
    for name in a[1]:
        np.testing.assert_array_equal(a[1][name], b[1][name], err_msg=name)
    for name in a[2]:
        np.testing.assert_array_equal(a[2][name], b[2][name], err_msg=name)


def _assert_torch(ours, want):
    np.testing.assert_allclose(ours[0], want[0], rtol=1e-5)
    for name, g in want[1].items():
        scale = float(np.max(np.abs(g)))
        np.testing.assert_allclose(ours[1][name], g, rtol=0, atol=1e-4 * scale, err_msg=name)
    for name, v in want[2].items():
        np.testing.assert_allclose(ours[2][name], v, rtol=1e-5, atol=1e-6, err_msg=name)


def _kinds(cls, on: bool, limits: Limits, splits: int | None, side: int = 6) -> list[str]:
    """Dispatch names of ``cls``'s training step compiled for ``limits``."""
    return [d.name for d in _dispatches(cls, on, limits, splits, side)]


def _dispatches(cls, on: bool, limits: Limits, splits: int | None, side: int = 6) -> list:
    """The dispatches of ``cls``'s training step compiled for ``limits``."""
    conv_prologue.set_enabled(on)
    model = _model(cls)
    x, t = _data(side)
    traced = trace_call(model, lambda x, t: _mse(model, x, t), (x, t), {}, "loss")
    options = CompileOptions(loss="loss", optimizer=mn.optim.SGD(lr=0.1))
    with force_plan(splits=splits):
        program = compile(traced.graph, options, limits)
    conv_prologue.set_enabled(True)
    return list(program.dispatches)


def _check_kernel(gpu_device, cls, case: str) -> None:
    """The program with the feature sums the partials in the norm kernel, as vec4 loads
    (6x6 planes) or with the summing kernel's four lanes (12 splits)."""
    from meganeura.training import device_limits

    side, splits = CASES[case]
    name = "conv2d+batch_norm" if cls is ConvBN else "conv2d+group_norm+silu"
    (k,) = [d for d in _dispatches(cls, True, device_limits(gpu_device), splits, side)
            if "conv2d+" in d.name]  # fmt: skip
    assert k.name.split()[1] == name
    assert ("vec4<f32>(0.0)" in k.wgsl) == (side % 2 == 0)
    assert ("s0_3" in k.wgsl) == (splits > 8)


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("cls", [ConvBN, ConvGN], ids=["batch_norm", "group_norm"])
def test_training_step_bit_identical(gpu_device, cls, case):
    """conv -> batch_norm (train) -> relu, and conv (with bias) -> group_norm -> silu, one SGD
    step: loss, every gradient, the updated parameters (and batch_norm's running statistics),
    bit for bit; and against float64 torch."""
    _check_kernel(gpu_device, cls, case)
    side, splits = CASES[case]
    x, t = _data(side)
    on = _step(cls, True, gpu_device, x, t, splits)
    off = _step(cls, False, gpu_device, x, t, splits)
    _assert_exact(on, off)
    _assert_torch(on, _torch(cls, x, t))


@pytest.mark.gpu
@pytest.mark.parametrize("cls", [ConvBN, ConvGN], ids=["batch_norm", "group_norm"])
def test_fast_mode_training_step_bit_identical(gpu_device, cls):
    """The fast mode: x stored as f16 by the norm kernel (its backward reads it), normalized
    as that f16; bit for bit against the program with the summing dispatch."""
    from meganeura.training import device_limits

    if not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    x, t = _data(6)
    on = _step(cls, True, gpu_device, x, t, 4, "fast")
    off = _step(cls, False, gpu_device, x, t, 4, "fast")
    _assert_exact(on, off)
    assert np.isfinite(on[0])


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_group_norm_silu_forward_bit_identical(gpu_device, precision):
    """The forward alone (x read by the norm only, so never stored), strict and fast mode
    (f16 storage: x normalized as the f16 it would have been stored as)."""
    from meganeura.training import device_limits

    if precision == "fast" and not device_limits(gpu_device).shader_f16:
        pytest.skip("the adapter has no shader-f16")
    x, _ = _data(6)
    got = []
    for on in (True, False):
        conv_prologue.set_enabled(on)
        model = _model(ConvGN)
        with force_plan(splits=4):
            got.append(mn.compile(model, precision=precision, device=gpu_device)(x))
    conv_prologue.set_enabled(True)
    np.testing.assert_array_equal(got[0], got[1])
    ref = _model(ConvGN).state_dict()
    w, b = (torch.tensor(ref[f"conv.{k}"], dtype=torch.float64) for k in ("weight", "bias"))
    y = torch.nn.functional.conv2d(torch.tensor(x, dtype=torch.float64), w, b, padding=1)
    gw, gb = (torch.tensor(ref[f"gn.{k}"], dtype=torch.float64) for k in ("weight", "bias"))
    want = torch.nn.functional.silu(torch.nn.functional.group_norm(y, 4, gw, gb)).numpy()
    tol = 1e-4 if precision == "strict" else 3e-2
    np.testing.assert_allclose(got[0], want, rtol=tol, atol=tol)


@pytest.mark.parametrize("cls", [ConvBN, ConvGN], ids=["batch_norm", "group_norm"])
def test_sum_gone_and_partials_live_until_the_norm_on_h200_limits(cls):
    """Compiled without a GPU for the H200, splits forced: the conv's summing dispatch goes,
    the norm binds its partials (a ``ScratchRef`` owned by the conv) and stores x (its
    backward reads it)."""
    from meganeura.schedule.schedule import schedule

    off = _kinds(cls, False, H200_LIMITS, 4)
    on = _kinds(cls, True, H200_LIMITS, 4)
    sums = [sum(n.endswith("conv2d sum_splits") for n in p) for p in (off, on)]
    assert sums[0] - sums[1] == 1 and len(off) - len(on) == 1  # ConvGN's head keeps its own
    kernel = [n for n in on if "conv2d+" in n]
    assert len(kernel) == 1 and kernel[0].split()[1].startswith("conv2d+")
    conv_prologue.set_enabled(True)
    model = _model(cls)
    x, t = _data(6)
    graph = trace_call(model, model.forward, (x,), {}).graph
    with force_plan(splits=4):
        sched = schedule(graph, H200_LIMITS, fuse=True)
    names = [ks.name for _, ks in sched.dispatches]
    (pos,) = [i for i, n in enumerate(names) if "conv2d+" in n]
    ks = sched.dispatches[pos][1]
    (ref,) = [b for b in ks.bindings if isinstance(b, ScratchRef)]
    conv = next(n.id for n in graph.nodes if n.op == "conv2d")  # the first: the norm's
    assert ref.owner == conv and ref.key == "partials" and not ref.write
    (iv,) = [i for i in sched.intervals if i.key == (conv, "partials")]
    assert iv.end == pos and iv.start < pos
    # the forward alone: the group_norm is x's only reader, so x is never stored; the
    # batch_norm's running statistics read it after the norm, so it is stored there
    stored = any(isinstance(b, ValueRef) and b.node == conv for b in ks.bindings)
    assert stored == (cls is ConvBN)


def test_the_switch_and_an_unsplit_conv_keep_the_summing_dispatch():
    """Off, or a conv whose plan does not split K: nothing changes."""
    assert _kinds(ConvBN, True, H200_LIMITS, 1) == _kinds(ConvBN, False, H200_LIMITS, 1)
    assert not any("conv2d+" in n for n in _kinds(ConvBN, True, H200_LIMITS, 1))

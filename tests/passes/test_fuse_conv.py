"""Conv epilogues (``passes.fuse_conv``, ``codegen.wgsl.conv.epilogue``): elementwise groups
reading a conv2d alone run in the conv's store. A small ResNet-like block (conv -> eval BN ->
ReLU, a strided 3x3, a 1x1 downsample and a residual add) compiled with the feature on and off:
strict f32 bit-identical, split-K and unsplit conv plans, against float64 torch; fast mode
(f16 storage) within a tolerance (the conv's value skips its f16 rounding); which groups
anchor; a training step unchanged; dispatch counts on the H200's limits.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import meganeura.nn as mnn
import meganeura.nn.functional as F
from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.conv.gemm import force_plan
from meganeura.compile import CompileOptions
from meganeura.nn.compiled import trace_call
from meganeura.nn.parameter import Buffer, Parameter
from meganeura.passes import fuse_conv

from ..codegen.harness import compile_both, run_identical

RNG = np.random.default_rng(17)


class Block(mnn.Module):
    """A bottleneck: 1x1 (with bias) -> BN -> ReLU, 3x3 stride 2 -> BN -> ReLU, 1x1 -> BN,
    plus a 1x1 stride-2 downsample -> BN, added, ReLU."""

    def __init__(self, cin: int = 32, planes: int = 16) -> None:
        super().__init__()
        self.conv1 = mnn.Conv2d(cin, planes, 1, bias=True)
        self.bn1 = mnn.BatchNorm2d(planes)
        self.conv2 = mnn.Conv2d(planes, planes, 3, stride=2, padding=1, bias=False)
        self.bn2 = mnn.BatchNorm2d(planes)
        self.conv3 = mnn.Conv2d(planes, 4 * planes, 1, bias=False)
        self.bn3 = mnn.BatchNorm2d(4 * planes)
        self.down = mnn.Conv2d(cin, 4 * planes, 1, stride=2, bias=False)
        self.bnd = mnn.BatchNorm2d(4 * planes)

    def forward(self, x):
        h = F.relu(self.bn1(self.conv1(x)))
        h = F.relu(self.bn2(self.conv2(h)))
        return F.relu(self.bn3(self.conv3(h)) + self.bnd(self.down(x)))


def _block(train: bool = False) -> tuple[Block, dict[str, np.ndarray]]:
    model = Block()
    state = model.state_dict()
    for k, v in state.items():
        if k.endswith(("running_mean", "bias")):
            state[k] = RNG.uniform(-0.5, 0.5, v.shape).astype(np.float32)
        elif k.endswith(("running_var", ".weight")) and "bn" in k:
            state[k] = RNG.uniform(0.5, 2.0, v.shape).astype(np.float32)
    model.load_state_dict(state)
    return (model.train() if train else model.eval()), model.state_dict()


def _both(graph, options, limits):
    """(program with conv epilogues, program without)."""
    return compile_both(fuse_conv.set_enabled, graph, options, limits)


def _reference(state: dict[str, np.ndarray], x: np.ndarray) -> np.ndarray:
    """The block in float64 torch (eval BatchNorm)."""
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in state.items()}

    def bn(y, p):
        return TF.batch_norm(y, t[f"{p}.running_mean"], t[f"{p}.running_var"],
                             t[f"{p}.weight"], t[f"{p}.bias"], False, 0.0, 1e-5)  # fmt: skip

    xt = torch.tensor(x, dtype=torch.float64)
    h = torch.relu(bn(TF.conv2d(xt, t["conv1.weight"], t["conv1.bias"]), "bn1"))
    h = torch.relu(bn(TF.conv2d(h, t["conv2.weight"], stride=2, padding=1), "bn2"))
    y = bn(TF.conv2d(h, t["conv3.weight"]), "bn3") + bn(
        TF.conv2d(xt, t["down.weight"], stride=2), "bnd"
    )
    return torch.relu(y).numpy()


def _kinds(program) -> list[str]:
    return [
        " ".join(w for w in d.name.split() if not w.startswith("%")) for d in program.dispatches
    ]


@pytest.mark.gpu
@pytest.mark.parametrize("splits", [1, 3, 9], ids=["unsplit", "split3", "split9"])
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_block_in_conv_epilogues_matches_the_program_without(gpu_device, splits, precision):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    model, state = _block()
    x = RNG.standard_normal((2, 32, 9, 9)).astype(np.float32)
    traced = trace_call(model, model.forward, (x,), {})
    with force_plan(splits=splits):
        on, off = _both(traced.graph, CompileOptions(precision=precision), limits)
    # the two BN + ReLU groups and the residual one (both BNs, the add, the ReLU) run in
    # the stores of conv1, conv2 and conv3; the downsample, computed after bn3's members,
    # keeps its store. Forced to split, conv1, conv2 and the downsample split K (conv3's K
    # is one step): the groups run in the summing dispatches of conv1 and conv2 (conv2's
    # with four lanes an element when forced to 9 splits, ``gemm.LANES_FROM_SPLITS``).
    assert len(off.dispatches) - len(on.dispatches) == 3
    assert all(k.startswith("conv2d") for k in _kinds(on))
    names = [d.name for d in on.dispatches]
    assert sum("+" in n and n.endswith("gemm") for n in names) == 3
    assert sum("+" in n and n.endswith("sum_splits") for n in names) == (0 if splits == 1 else 2)
    assert sum(n.endswith("sum_splits") for n in names) == (0 if splits == 1 else 3)
    got = []
    for program in (on, off):
        with Session(program, gpu_device) as s:
            s.load_state_dict(state, strict=False)
            got.append(s.run({"x": x}, ["output"])["output"])
    want = _reference(state, x)
    if precision == "strict":
        np.testing.assert_array_equal(got[0], got[1])
        np.testing.assert_allclose(got[0], want, rtol=1e-4, atol=1e-4)
    else:  # the conv value is no longer rounded to f16 before the BatchNorm: close, not equal
        np.testing.assert_allclose(got[0], got[1], rtol=2e-2, atol=2e-2)
        np.testing.assert_allclose(got[0], want, rtol=3e-2, atol=3e-2)


class Residual(mnn.Module):
    """U-Net's residual block without norms: conv2(silu(conv1(x))) + skip(x), the first conv
    read by the SiLU alone (and its backward), the second by the add alone."""

    def __init__(self) -> None:
        super().__init__()
        self.conv1 = mnn.Conv2d(8, 16, 3, padding=1, bias=True)
        self.conv2 = mnn.Conv2d(16, 16, 3, padding=1, bias=True)
        self.skip = mnn.Conv2d(8, 16, 1, bias=False)

    def forward(self, x):
        return self.conv2(F.silu(self.conv1(x))) + self.skip(x)


@pytest.mark.gpu
@pytest.mark.parametrize("net", ["batch_norm", "residual"])
def test_training_gradients_are_unchanged(gpu_device, net):
    """Train-mode BatchNorm reads the conv: no group anchors, the same dispatches. In the
    residual block the add reading conv2 alone runs in conv2's store (the backward reads
    neither): one dispatch fewer. The gradients are the same bit for bit either way."""
    from meganeura.optim import HYPER_INPUT, SGD
    from meganeura.training import device_limits

    model = _block(train=True)[0] if net == "batch_norm" else Residual().train()
    x = RNG.standard_normal((2, 32 if net == "batch_norm" else 8, 9, 9)).astype(np.float32)

    def loss(x):
        y = model(x)
        return F.mean(y * y)

    traced = trace_call(model, loss, (x,), {}, "loss")
    objs = traced.trace.objects
    trainable = tuple(n for n, o in objs.items() if isinstance(o, Parameter))
    opt = SGD(lr=0.0)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True, trainable=trainable)
    on, off = _both(traced.graph, options, device_limits(gpu_device))
    if net == "batch_norm":
        assert [d.name for d in on.dispatches] == [d.name for d in off.dispatches]
    else:
        assert len(off.dispatches) - len(on.dispatches) == 1
    names = [f"{n}.grad" for n in trainable] + ["loss"]
    feeds = {"x": x, HYPER_INPUT: opt.hyper(0, opt.lr)}
    state = {n: o.data for n, o in objs.items() if isinstance(o, (Parameter, Buffer))}
    run_identical(gpu_device, (on, off), feeds, names, state, strict=False)


def test_which_groups_anchor():
    """A conv read by a second kernel, or a graph output, keeps its store and its readers'
    group keeps its own kernel; a lone add reading a conv joins it."""
    from meganeura.graph.builder import GraphBuilder
    from meganeura.ops import functional as OF
    from meganeura.ops.conv import conv2d

    b = GraphBuilder()
    x = b.input("x", (1, 4, 6, 6))
    w = [b.parameter(f"w{i}", (4, 4, 3, 3)) for i in range(3)]
    c0 = conv2d(x, w[0], padding=(1, 1))
    b.output("a", OF.relu(c0 * 2.0))  # anchors on c0
    c1 = conv2d(x, w[1], padding=(1, 1))
    b.output("b", OF.relu(c1) + 1.0)
    b.output("c1", c1)  # an output: c1 is stored, its group stays apart
    c2 = conv2d(x, w[2], padding=(1, 1))
    b.output("d", c2 + x)  # a lone add joins c2
    graph = b.build()
    on, off = _both(graph, CompileOptions(), H200_LIMITS)
    names = [d.name for d in on.dispatches]
    assert len(off.dispatches) - len(on.dispatches) == 2
    assert sum(n.endswith("conv2d gemm") and "+" in n for n in names) == 2
    assert sum(n.endswith("relu+add") for n in names) == 1  # c1's group, apart


def test_resnet50_eval_dispatch_counts_on_h200_limits():
    """ResNet-50's eval forward at batch 1 (BatchNorm folded): every one of its 49 BatchNorm
    + ReLU (+ residual add) groups runs in a conv's store, 139 dispatches -> 90."""
    import meganeura as mn
    from meganeura.models.resnet import ResNet, ResNetConfig

    mn.manual_seed(0)
    model = ResNet(ResNetConfig("bottleneck", (3, 4, 6, 3), 1000)).eval()
    x = np.zeros((1, 3, 224, 224), np.float32)
    traced = trace_call(model, model.forward, (x,), {})
    on, off = _both(traced.graph, CompileOptions(shared_parameters=True), H200_LIMITS)
    assert (len(off.dispatches), len(on.dispatches)) == (139, 90)
    assert not any(k.startswith(("add", "relu")) for k in _kinds(on))


@pytest.mark.gpu
def test_epilogue_sums_a_deferred_split_k_product(gpu_device):
    """``conv(x) + reshape(z @ W.T)`` with the matmul forced to split K: the add runs in the
    conv's store and sums the matmul's partials itself (``matmul.deferred``), so neither the
    conv nor the product is stored; values bit-identical to the program without."""
    from meganeura.codegen.wgsl.matmul import deferred
    from meganeura.codegen.wgsl.matmul.plan import force_plan as force_matmul_plan
    from meganeura.graph.builder import GraphBuilder
    from meganeura.ops import functional as OF
    from meganeura.ops.conv import conv2d
    from meganeura.training import device_limits

    b = GraphBuilder()
    x = b.input("x", (2, 4, 6, 6))
    z = b.input("z", (2 * 8, 96))
    y = conv2d(x, b.parameter("w", (8, 4, 3, 3)), padding=(1, 1))
    p = OF.reshape(OF.linear(z, b.parameter("v", (36, 96))), (2, 8, 6, 6))
    b.output("y", OF.relu(y + p))
    graph = b.build()
    force_matmul_plan("64x64x16/s4")
    try:
        on, off = _both(graph, CompileOptions(), device_limits(gpu_device))
    finally:
        force_matmul_plan(None)
        deferred.set_enabled(True)
    names = [d.name for d in on.dispatches]
    assert not any(n.endswith("sum_splits") for n in names), names
    assert any("conv2d gemm" in n and "+" in n for n in names)
    assert len(off.dispatches) - len(on.dispatches) == 1
    feeds = {
        "x": RNG.standard_normal((2, 4, 6, 6)).astype(np.float32),
        "z": RNG.standard_normal((16, 96)).astype(np.float32),
    }
    params = {
        "w": (RNG.standard_normal((8, 4, 3, 3)) * 0.3).astype(np.float32),
        "v": (RNG.standard_normal((36, 96)) * 0.1).astype(np.float32),
    }
    got = run_identical(gpu_device, (on, off), feeds, ["y"], params)["y"]
    want = TF.conv2d(torch.tensor(feeds["x"], dtype=torch.float64),
                     torch.tensor(params["w"], dtype=torch.float64), padding=1).numpy()  # fmt: skip
    want = np.maximum(want + (feeds["z"].astype(np.float64) @ params["v"].T).reshape(want.shape), 0)
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=1e-4)


class GroupedBlock(mnn.Module):
    """conv (``groups`` groups, bias) -> eval BN -> ReLU, then a residual add."""

    def __init__(self, groups: int) -> None:
        super().__init__()
        self.conv = mnn.Conv2d(8, 8, 3, padding=1, groups=groups, bias=True)
        self.bn = mnn.BatchNorm2d(8)

    def forward(self, x):
        return F.relu(self.bn(self.conv(x))) + x


@pytest.mark.gpu
@pytest.mark.parametrize("groups", [2, 8], ids=["groups2", "depthwise"])
def test_grouped_conv_epilogue_maps_channels(gpu_device, groups):
    """Output channel ``grp * OCg + row``: a grouped and a depthwise conv (the 16x256 tile)
    with a per-channel BatchNorm in their store, bit-identical to the program without."""
    from meganeura.training import device_limits

    model = GroupedBlock(groups)
    state = model.state_dict()
    for k, v in state.items():
        lo, hi = (0.5, 2.0) if k.endswith(("running_var", "bn.weight")) else (-0.5, 0.5)
        if "bn" in k or k.endswith("bias"):
            state[k] = RNG.uniform(lo, hi, v.shape).astype(np.float32)
    model.load_state_dict(state)
    model.eval()
    x = RNG.standard_normal((2, 8, 7, 7)).astype(np.float32)
    traced = trace_call(model, model.forward, (x,), {})
    with force_plan("narrow" if groups == 8 else None):
        on, off = _both(traced.graph, CompileOptions(), device_limits(gpu_device))
    assert len(off.dispatches) - len(on.dispatches) == 1
    assert all(c["plan"].startswith("16x256" if groups == 8 else "") for c in on.meta["convs"])
    state = model.state_dict()
    got = run_identical(gpu_device, (on, off), {"x": x}, ["output"], state, strict=False)
    t = {k: torch.tensor(v, dtype=torch.float64) for k, v in state.items()}
    xt = torch.tensor(x, dtype=torch.float64)
    y = TF.conv2d(xt, t["conv.weight"], t["conv.bias"], padding=1, groups=groups)
    y = TF.batch_norm(y, t["bn.running_mean"], t["bn.running_var"], t["bn.weight"],
                      t["bn.bias"], False, 0.0, 1e-5)  # fmt: skip
    np.testing.assert_allclose(got["output"], (torch.relu(y) + xt).numpy(), rtol=1e-4, atol=1e-4)

"""Convolution and pooling kernels beyond the op database: the 128x128 tiling, split-K in every
GEMM role, folded grids, the emitted WGSL's shape, and an end-to-end training step through
``meganeura.training.Trainer`` against PyTorch."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.conv import lowering
from meganeura.codegen.wgsl.conv.gemm import LARGE, NARROW, SMALL, Gemm, plan_splits
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.conv import conv2d
from meganeura.ops.pool import avg_pool2d, max_pool2d

from .harness import run

rng = np.random.default_rng(11)


def _conv_graph(x_shape, w_shape, **kw):
    """conv2d (with bias) and both gradient ops fed by an input ``g``."""
    b = GraphBuilder()
    x, w = b.input("x", x_shape), b.input("w", w_shape)
    y = b.output("y", conv2d(x, w, b.input("b", w_shape[:1]), **kw))
    g = b.input("g", y.shape)
    attrs = y.node.attr_dict
    dx = b.add("conv2d_backward_input", [g, w], {**attrs, "input_size": x_shape[2:]})
    dw = b.add("conv2d_backward_weight", [x, g], {**attrs, "kernel_size": w_shape[2:]})
    b.output("dx", dx)
    b.output("dw", dw)
    return b.build_unverified(), (y.id, dx.id, dw.id)


def _torch_conv(feeds, **kw):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k in "xw") for k, v in feeds.items()}
    y = TF.conv2d(t["x"], t["w"], t["b"], **kw)
    y.backward(t["g"])
    return y.detach().numpy(), t["x"].grad.numpy(), t["w"].grad.numpy()


def _rel(a, b):
    return float(np.abs(a - b).max() / np.abs(b).max())


@pytest.mark.gpu
@pytest.mark.parametrize(
    "x_shape,w_shape,kw",
    [
        # few tiles, long K: every GEMM role splits K (forward and both gradients)
        ((2, 64, 16, 16), (64, 64, 3, 3), dict(padding=1)),
        # stride phases of the input gradient: taps reaching no phase (1x1, stride 2, padded),
        # one tap per phase (stride 3, dilation 2), every tap in one phase (stride 2,
        # dilation 2), and a plane smaller than the stride
        ((1, 5, 11, 10), (3, 5, 1, 1), dict(stride=2, padding=1)),
        ((2, 3, 14, 11), (4, 3, 3, 3), dict(stride=3, padding=2, dilation=2)),
        ((1, 4, 9, 8), (2, 4, 3, 2), dict(stride=2, padding=1, dilation=2)),
        ((2, 3, 1, 5), (4, 3, 1, 3), dict(stride=(2, 3))),
    ],
    ids=["split_k", "stride2_1x1_padded", "stride3_dilation2", "stride2_dilation2", "tiny"],
)
def test_conv_kernels_against_torch(x_shape, w_shape, kw):
    graph, (y, dx, dw) = _conv_graph(x_shape, w_shape, **kw)
    feeds = {
        "x": rng.standard_normal(x_shape).astype(np.float32),
        "w": (rng.standard_normal(w_shape) / np.sqrt(np.prod(w_shape[1:]))).astype(np.float32),
        "b": rng.standard_normal(w_shape[:1]).astype(np.float32),
    }
    feeds["g"] = rng.standard_normal(graph[y].type.shape).astype(np.float32)
    res = run(graph, feeds)
    want = _torch_conv(feeds, **kw)
    for nid, ref in zip((y, dx, dw), want, strict=True):
        assert _rel(res.values[nid], ref) <= 1e-5, (graph[nid].op, _rel(res.values[nid], ref))
    names = [k.name for k in res.kernels]
    if x_shape[2] == 16:
        assert sum("sum_splits" in n for n in names) == 3, names
    if w_shape[2:] == (1, 1) and kw.get("stride") == 2:  # 3 of 4 phases are reached by no tap
        # the merged phases' dispatch stores their zeros (conv/phases.py), else a zero pass
        zeros = "gemm phases" if lowering.MERGE_PHASES else "zero_phases"
        assert sum(zeros in n for n in names) == 1, names


@pytest.mark.gpu
def test_conv_forward_with_128x128_tiles():
    """M = 256 channels by N = 128 * 128 pixels: enough tiles for the 8x8-per-thread tiling."""
    b = GraphBuilder()
    x, w = b.input("x", (1, 2, 128, 128)), b.input("w", (256, 2, 3, 3))
    y = b.output("y", conv2d(x, w, padding=1))
    feeds = {
        "x": rng.standard_normal((1, 2, 128, 128)).astype(np.float32),
        "w": rng.standard_normal((256, 2, 3, 3)).astype(np.float32),
    }
    res = run(b.build(), feeds)
    assert "acc131" in res.kernels[0].wgsl  # 8x8 outputs per thread
    ref = TF.conv2d(*(torch.tensor(v, dtype=torch.float64) for v in feeds.values()), padding=1)
    assert _rel(res.values[y.id], ref.numpy()) <= 1e-5


def test_split_plan_keeps_whole_k_steps_and_covers_k():
    limits = Limits()
    for m, n, k in [(64, 147, 50176), (8, 8, 100000), (64, 64, 600), (1, 1, 511)]:
        for t in (SMALL, LARGE, NARROW):
            splits, per = plan_splits(Gemm(m, n, k, 1), t, limits)
            assert per % t.bk == 0 and (splits - 1) * per < k <= splits * per
    assert plan_splits(Gemm(64, 147, 50176, 1), SMALL, limits)[0] > 1


def test_cpu_adapter_never_splits_and_takes_large_tiles():
    from meganeura.codegen.wgsl.conv.gemm import choose_tiling

    cpu = Limits(cpu=True)
    for m, n, k in [(64, 147, 50176), (8, 8, 100000), (1, 1, 511)]:
        assert plan_splits(Gemm(m, n, k, 1), SMALL, cpu) == (1, -(-k // SMALL.bk) * SMALL.bk)
    assert choose_tiling(Gemm(128, 256, 64, 1), cpu=True) is LARGE
    assert choose_tiling(Gemm(128, 256, 64, 1)) is SMALL  # 2 tiles: too few for a GPU
    assert choose_tiling(Gemm(16, 4096, 64, 1), cpu=True) is NARROW


@pytest.mark.gpu
def test_pooling_and_conv_with_folded_grids():
    """A tiny per-dimension workgroup limit forces every kernel's grid to fold into 2-D/3-D."""
    b = GraphBuilder()
    x = b.input("x", (2, 3, 20, 20))
    w = b.input("w", (5, 3, 3, 3))
    y = F.relu(conv2d(x, w, padding=1))
    p = max_pool2d(y, 3, 2, 1)
    q = avg_pool2d(y, 2)
    loss = F.sum(p) + F.sum(q)
    b.output("loss", loss)
    from meganeura.autodiff import differentiate

    graph, grads = differentiate(b.build_unverified(), "loss", [x.id, w.id])
    b2 = GraphBuilder(graph)
    b2.output("gx", b2.tensor(grads[x.id]))
    b2.output("gw", b2.tensor(grads[w.id]))
    graph = b2.build_unverified()
    feeds = {
        "x": rng.standard_normal((2, 3, 20, 20)).astype(np.float32),
        "w": rng.standard_normal((5, 3, 3, 3)).astype(np.float32),
    }
    from .harness import device_limits

    lim = device_limits()
    small = Limits(7, lim.max_workgroup_storage_size, 256, lim.max_storage_buffer_binding_size)
    res = run(graph, feeds, limits=small)
    assert any(k.grid[1] > 1 for k in res.kernels if "pool" in k.name)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in feeds.items()}
    ty = torch.relu(TF.conv2d(t["x"], t["w"], padding=1))
    tl = TF.max_pool2d(ty, 3, 2, 1).sum() + TF.avg_pool2d(ty, 2).sum()
    tl.backward()
    out = graph.output_dict
    assert _rel(res.values[out["loss"]], tl.detach().numpy()) <= 1e-5
    assert _rel(res.values[out["gx"]], t["x"].grad.numpy()) <= 1e-5
    assert _rel(res.values[out["gw"]], t["w"].grad.numpy()) <= 1e-5


@pytest.mark.gpu
def test_pools_with_windows_too_large_to_unroll():
    """9x9 windows (81 taps > UNROLL_TAPS) take the looped paths, forward and backward."""
    from meganeura.autodiff import differentiate

    b = GraphBuilder()
    x = b.input("x", (2, 3, 19, 17))
    p = max_pool2d(x, 9, 3, 4)
    q = avg_pool2d(x, 9, 2, 4, ceil_mode=True, count_include_pad=False)
    rp, rq = b.input("rp", p.shape), b.input("rq", q.shape)
    b.output("loss", F.sum(p * rp) + F.sum(q * rq))
    graph, grads = differentiate(b.build_unverified(), "loss", [x.id])
    b2 = GraphBuilder(graph)
    b2.output("gx", b2.tensor(grads[x.id]))
    graph = b2.build_unverified()
    feeds = {"x": np.round(rng.standard_normal((2, 3, 19, 17)), 1).astype(np.float32)}  # ties
    feeds["rp"] = rng.standard_normal(p.shape).astype(np.float32)
    feeds["rq"] = rng.standard_normal(q.shape).astype(np.float32)
    res = run(graph, feeds)
    assert any("for (var th" in k.wgsl for k in res.kernels)
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=k == "x") for k, v in feeds.items()}
    tl = (TF.max_pool2d(t["x"], 9, 3, 4) * t["rp"]).sum() + (
        TF.avg_pool2d(t["x"], 9, 2, 4, ceil_mode=True, count_include_pad=False) * t["rq"]
    ).sum()
    tl.backward()
    out = graph.output_dict
    assert _rel(res.values[out["loss"]], tl.detach().numpy()) <= 1e-5
    assert _rel(res.values[out["gx"]], t["x"].grad.numpy()) <= 1e-5


def test_gemm_wgsl_is_unrolled_with_named_accumulators():
    from meganeura.codegen.wgsl.conv import gemm

    graph, (y, dx, dw) = _conv_graph((2, 16, 9, 9), (32, 16, 3, 3), padding=1)
    with gemm.force_plan(deep=False):  # one-deep prefetch: one barrier a K step, one after
        kernels = [k for nid in (y, dx, dw) for k in lower(graph, nid, Limits())]
    for k in kernels:
        assert "inf" not in k.wgsl.lower() and "nan" not in k.wgsl.lower()
        assert "array<f32, " not in k.wgsl.split("fn main")[1]  # no private arrays
        if k.name.endswith("gemm"):
            assert re.search(r"acc\d\d\d \+= a\d\.[xyzw] \* b\d;", k.wgsl)
            assert k.wgsl.count("workgroupBarrier") == 2


def test_conv_type_errors_name_the_problem():
    from meganeura.graph.builder import GraphTypeError

    b = GraphBuilder()
    x = b.input("x", (1, 4, 5, 5))
    with pytest.raises(GraphTypeError, match="groups"):
        conv2d(x, b.input("w", (6, 3, 3, 3)), groups=2)
    with pytest.raises(GraphTypeError, match="smaller than the dilated kernel"):
        conv2d(x, b.input("w2", (6, 4, 3, 3)), dilation=3)
    with pytest.raises(GraphTypeError, match="bias"):
        conv2d(x, b.input("w3", (6, 4, 3, 3)), b.input("bias", (5,)))
    with pytest.raises(GraphTypeError, match="half the kernel"):
        max_pool2d(x, 2, padding=2)
    with pytest.raises(ValueError, match="asymmetric"):
        conv2d(x, b.input("w4", (6, 4, 2, 2)), padding="same")


# ---- end to end: conv -> relu -> max_pool -> linear -> cross_entropy through the Trainer ----
N, C, H, CLASSES = 4, 2, 8, 3


def _net_graph():
    b = GraphBuilder()
    x = b.input("x", (N, C, H, H))
    y = b.input("y", (N,), DType.i32)
    h = conv2d(x, b.parameter("conv.weight", (4, C, 3, 3)), b.parameter("conv.bias", (4,)), 1, 1)
    h = max_pool2d(F.relu(h), 2)
    logits = F.linear(
        F.flatten(h, 1),
        b.parameter("fc.weight", (CLASSES, 4 * (H // 2) ** 2)),
        b.parameter("fc.bias", (CLASSES,)),
    )
    b.output("loss", F.cross_entropy(logits, y))
    return b.build()


def _torch_step(params, x, y, lr):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    h = TF.max_pool2d(
        torch.relu(
            TF.conv2d(
                torch.tensor(x, dtype=torch.float64), t["conv.weight"], t["conv.bias"], padding=1
            )
        ),
        2,
    )
    logits = TF.linear(h.flatten(1), t["fc.weight"], t["fc.bias"])
    TF.cross_entropy(logits, torch.tensor(y, dtype=torch.long)).backward()
    return {k: (v - lr * v.grad).detach().numpy() for k, v in t.items()}  # fmt: skip


@pytest.mark.gpu
def test_conv_net_trains_through_trainer(gpu_device):
    from meganeura.optim import SGD
    from meganeura.training import Trainer

    params = {
        "conv.weight": rng.standard_normal((4, C, 3, 3)) * 0.3,
        "conv.bias": rng.standard_normal(4) * 0.1,
        "fc.weight": rng.standard_normal((CLASSES, 4 * (H // 2) ** 2)) * 0.2,
        "fc.bias": np.zeros(CLASSES),
    }
    params = {k: v.astype(np.float32) for k, v in params.items()}
    x = rng.standard_normal((N, C, H, H)).astype(np.float32)
    y = np.array([0, 2, 1, 2], np.int32)
    lr = 0.03
    tr = Trainer(_net_graph(), SGD(lr=lr), device=gpu_device)
    tr.load_parameters(params)
    losses = [float(tr.step({"x": x, "y": y})["loss"])]
    after_one = tr.parameters()
    want = _torch_step(params, x, y, lr)
    for k, w in want.items():
        update, ref = after_one[k] - params[k], w - params[k]
        err = float(np.linalg.norm(update - ref) / np.linalg.norm(ref))
        assert err <= 1e-5, (k, err)
    losses += [float(tr.step({"x": x, "y": y})["loss"]) for _ in range(4)]
    assert all(b < a for a, b in zip(losses, losses[1:])), losses

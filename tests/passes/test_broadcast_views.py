"""passes.broadcast_views: a nearest-2x upsample concatenated with a skip needs no copy kernels.

A U-Net-like decoder block (silu, nearest 2x upsample through ``interpolate``, the ops the
U-Net uses, ``cat`` with a skip, a 3x3 conv; forward and the gradients of a training step):
bit-identical with and without the rule on the GPU, against torch float64, dispatch counts
(no GPU) of the block and of the W5 U-Net, and the refinement rule on its own."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import reads
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.activation import silu
from meganeura.ops.conv import conv2d
from meganeura.ops.indexing import cat
from meganeura.ops.indexing import slice as slice_
from meganeura.ops.resample import interpolate
from meganeura.passes import broadcast_views

LIMITS = Limits(max_storage_buffers_per_shader_stage=32)
N, C, S, H, W, CO = 2, 8, 4, 3, 5, 6  # batch, up channels, skip channels, low-res H x W, out


def _graph(train: bool):
    """``out = conv3x3(cat([up2(silu(h)), skip]))``; with ``train`` also the gradients of
    ``sum(out * w)`` for h, skip and the conv weight as outputs."""
    b = GraphBuilder()
    h = b.parameter("h", (N, C, H, W))
    skip = b.parameter("skip", (N, S, 2 * H, 2 * W))
    weight = b.parameter("weight", (CO, C + S, 3, 3))
    up = interpolate(silu(h), scale_factor=2.0, mode="nearest")
    out = conv2d(cat([up, skip], 1), weight, padding=1)
    b.output("out", out)
    if not train:
        return b.build()
    w = b.input("w", out.shape)
    b.output("loss", F.sum(out * w))
    graph, grads = differentiate(b.build(), "loss", ["h", "skip", "weight"])
    gb = GraphBuilder(graph)
    for n in ("h", "skip", "weight"):
        gb.output(f"d{n}", gb.tensor(grads[graph.find(n).id]))
    return gb.build()


def _data(seed=3):
    rng = np.random.default_rng(seed)
    params = {
        "h": rng.standard_normal((N, C, H, W)).astype(np.float32),
        "skip": rng.standard_normal((N, S, 2 * H, 2 * W)).astype(np.float32),
        "weight": (0.2 * rng.standard_normal((CO, C + S, 3, 3))).astype(np.float32),
    }
    return params, {"w": rng.standard_normal((N, CO, 2 * H, 2 * W)).astype(np.float32)}


def _torch(params, feeds):
    t = {k: torch.tensor(v, dtype=torch.float64, requires_grad=True) for k, v in params.items()}
    up = torch.nn.functional.interpolate(torch.nn.functional.silu(t["h"]), scale_factor=2.0)
    out = torch.nn.functional.conv2d(torch.cat([up, t["skip"]], 1), t["weight"], padding=1)
    (out * torch.tensor(feeds["w"], dtype=torch.float64)).sum().backward()
    return {"out": out.detach().numpy(), **{f"d{k}": t[k].grad.numpy() for k in t}}


def _names(program):
    return [d.name.split()[1] for d in program.dispatches]


def _compile(graph, options, limits, on: bool):
    broadcast_views.set_enabled(on)
    try:
        return compile(graph, options, limits)
    finally:
        broadcast_views.set_enabled(True)


def test_block_dispatch_counts():
    for train in (False, True):
        graph = _graph(train)
        off = _names(_compile(graph, CompileOptions(), LIMITS, False))
        on = _names(_compile(graph, CompileOptions(), LIMITS, True))
        assert off.count("broadcast_to") == 2, off
        assert "broadcast_to" not in on, on
        # backward: the cat's gradient is sliced; the upsample's gradient sums its slice in
        # place (the skip's slice is read by silu_backward, an elementwise op: a copy still)
        assert (off.count("slice"), on.count("slice")) == ((2, 1) if train else (0, 0))
        assert len(off) - len(on) == (3 if train else 2), (off, on)


def test_reads_report_the_buffer_broadcast():
    graph = _graph(False)
    node = next(n for n in graph.nodes if n.op == "cat")
    act = next(n for n in graph.nodes if n.op == "silu")
    assert act.id in reads(graph, node.id)
    view = broadcast_views.read_view(graph, node.inputs[0])
    assert view == (act.id, (N, C, H, 2, W, 2), (C * H * W, H * W, W, 0, 1, 0), 0)
    broadcast_views.set_enabled(False)
    try:
        assert act.id not in reads(graph, node.id)
        assert broadcast_views.read_view(graph, node.inputs[0]) is None
    finally:
        broadcast_views.set_enabled(True)


def test_refinement_rule():
    b = GraphBuilder()
    x = b.parameter("x", (2, 3))
    y = F.broadcast_to(F.reshape(x, (2, 1, 3)), (4, 2, 2, 3))
    z = F.reshape(y, (8, 6))
    bad = F.reshape(F.broadcast_to(F.reshape(x, (1, 6)), (2, 6)), (3, 4))  # 6 | 4 not nested
    b.output("z", z)
    b.output("bad", bad)
    g = b.build()
    xid = g.find("x").id
    assert broadcast_views.read_view(g, z.id) == (xid, (4, 2, 2, 3), (0, 3, 0, 1), 0)
    assert broadcast_views.read_view(g, bad.id) is None
    assert broadcast_views.read_view(g, xid) is None  # no copy on the chain: a plain read


def test_slices_in_the_chain():
    b = GraphBuilder()
    x = b.parameter("x", (2, 6, 4))
    cut = F.reshape(slice_(x, 1, 1, 5, 2), (2, 2, 2, 2))
    rows = slice_(x, 2, 1, 3)
    # a cut of a dim made of several factors (a merge): no view (conservative)
    split = slice_(F.reshape(x, (12, 4)), 0, 2, 12)
    for name, t in (("cut", cut), ("rows", rows), ("split", split)):
        b.output(name, t)
    g = b.build()
    xid = g.find("x").id
    # rows 1 and 3 of dim 1 (stride 8 after the step 2), from offset 4
    assert broadcast_views.read_view(g, cut.id) == (xid, (2, 2, 2, 2), (24, 8, 2, 1), 4)
    assert broadcast_views.read_view(g, rows.id) == (xid, (2, 6, 2), (24, 4, 1), 1)
    assert broadcast_views.read_view(g, split.id) is None


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("train", [False, True], ids=["forward", "train"])
def test_values_bit_identical_and_match_torch(train, precision, gpu_device):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    graph = _graph(train)
    params, feeds = _data()
    fetch = ["out", "dh", "dskip", "dweight"] if train else ["out"]
    got = {}
    for on in (True, False):
        program = _compile(graph, CompileOptions(precision=precision), limits, on)
        assert ("broadcast_to" in _names(program)) != on
        with Session(program, gpu_device) as sess:
            sess.load_state_dict(params)
            got[on] = sess.run(feeds if train else {}, fetch)
    want = _torch(params, feeds)
    tol = 1e-4 if precision == "strict" else 3e-2  # fast: f16 storage
    for name in fetch:
        # copies do not change values (f16 ones neither: they move f16 values)
        np.testing.assert_array_equal(got[True][name], got[False][name], err_msg=name)
        np.testing.assert_allclose(got[True][name], want[name], rtol=tol, atol=tol, err_msg=name)


def test_unet_dispatch_counts_on_h200_limits():
    import bench.dispatch_counts as dc

    counts = {}
    for on in (False, True):
        broadcast_views.set_enabled(on)
        try:
            counts[on] = [dc.kind(d.name) for d in dc.unet_fwd(True).dispatches]
        finally:
            broadcast_views.set_enabled(True)
    assert counts[False].count("broadcast_to") == 4 and "broadcast_to" not in counts[True]
    assert len(counts[False]) - len(counts[True]) == 4


@pytest.mark.gpu
def test_reductions_of_slices_and_broadcasts(gpu_device):
    """Reductions read a strided slice (offset, step) and a broadcast in place: the same
    values as the copies give, and NumPy's. A reduction that would fold a contiguous operand
    in vec4 units keeps its copy (the vec4 path sums in another order)."""
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    b = GraphBuilder()
    x = b.parameter("x", (3, 8, 5))
    stepped = slice_(x, 1, 1, 7, 2)  # [3, 3, 5] from offset 5, rows 2 apart
    wide = F.broadcast_to(F.reshape(x, (3, 8, 1, 5)), (3, 8, 4, 5))
    b.output("sum", F.sum(stepped, 1))
    b.output("mean", F.mean(F.reshape(slice_(x, 2, 1, 5), (3, 32)), 1))  # vec4: a copy
    b.output("amax", F.amax(wide, 2))
    b.output("sum_all", F.sum(slice_(wide, 2, 1, 3), (0, 2)))
    graph = b.build()
    xs = np.random.default_rng(4).standard_normal((3, 8, 5)).astype(np.float32)
    want = {
        "sum": xs[:, 1:7:2].sum(1),
        "mean": xs[:, :, 1:].mean((1, 2)),
        "amax": xs,
        "sum_all": 2 * xs.sum(0),
    }
    got = {}
    for on in (True, False):
        program = _compile(graph, CompileOptions(), device_limits(gpu_device), on)
        names = _names(program)
        copies = (names.count("slice"), names.count("broadcast_to"))
        assert copies == ((1, 0) if on else (3, 1)), names
        with Session(program, gpu_device) as sess:
            sess.load_state_dict({"x": xs})
            got[on] = sess.run({}, list(want))
    for name, value in want.items():
        np.testing.assert_array_equal(got[True][name], got[False][name], err_msg=name)
        np.testing.assert_allclose(got[True][name], value, rtol=1e-5, atol=1e-5, err_msg=name)

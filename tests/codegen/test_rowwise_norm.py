"""The normalizations on the row archetype (``codegen/wgsl/norm/team.py``): group_norm and
batch_norm (training) forward, input and weight gradients and running statistics, and
layer_norm / rms_norm in chunked mode, in register mode and in chunked mode (forced on small
rows by lowering ``rowwise.MAX_UNITS`` and ``MAX_TEAM``), through both team reductions; values
against float64 torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.rowwise import team as rowwise
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.norm import batch_norm, group_norm, layer_norm, rms_norm

from ..ids import shape_id
from .harness import device_limits, has_subgroups, run

RNG = np.random.default_rng(7)
TF = torch.nn.functional

# (shape, groups): vec4 units (H*W % 4 == 0) and scalar ones, groups shorter than a team,
# one channel per group, no spatial dims, ragged tails.
GN_SHAPES = [
    ((2, 8, 4, 4), 2),
    ((2, 6, 5), 3),
    ((1, 4, 9, 9), 1),
    ((3, 4, 7), 4),
    ((2, 6), 2),
    ((2, 64, 8, 9), 4),
    ((1, 32, 32, 32), 1),
]
BN_SHAPES = [(4, 3, 4, 4), (3, 5, 17), (2, 3, 33), (1, 4, 20), (5, 2, 6, 6)]


def _limits(subgroups: bool):
    lim = device_limits()
    if subgroups and not has_subgroups():
        pytest.skip("device has no subgroup feature")
    return dataclasses.replace(lim, subgroups=subgroups)


@pytest.fixture(params=["registers", "chunked"])
def mode(request, monkeypatch):
    if request.param == "chunked":
        # Teams of at most 32 threads (4 subgroups of lavapipe's 8) walking chunks of 2 units
        # per thread: most shapes below get full chunks and a partial one.
        monkeypatch.setattr(rowwise, "MAX_UNITS", 2)
        monkeypatch.setattr(rowwise, "MAX_TEAM", 32)
    return request.param


def _graph(kind, shape, groups):
    b = GraphBuilder()
    c = shape[1]
    x = b.input("x", shape)
    w, bias, up = b.input("w", (c,)), b.input("b", (c,)), b.input("up", shape)
    if kind == "group_norm":
        y = group_norm(x, groups, w, bias, eps=1e-5)
    else:
        stats = [b.state(n, (c,)) for n in ("bn.running_mean", "bn.running_var")]
        y = batch_norm(x, *stats, w, bias, training=True, momentum=0.25, eps=1e-5)
    b.output("y", y)
    loss = b.output("loss", F.sum(y * up))
    g, grads = differentiate(b.build(), loss.id, [x.id, w.id, bias.id])
    return g, y.id, grads


def _torch(kind, groups, xs, ws, bs, ups):
    tx, tw, tb = (torch.from_numpy(a).double().requires_grad_(True) for a in (xs, ws, bs))
    if kind == "group_norm":
        y = TF.group_norm(tx, groups, tw, tb, 1e-5)
    else:
        y = TF.batch_norm(tx, None, None, tw, tb, True, 0.25, 1e-5)
    (y * torch.from_numpy(ups).double()).sum().backward()
    return y.detach().numpy(), tx.grad.numpy(), tw.grad.numpy(), tb.grad.numpy()


def _check(kind, shape, groups, lim, offset=0.0):
    g, y_id, grads = _graph(kind, shape, groups)
    c = shape[1]
    for nd in g.nodes:
        if nd.op.startswith(kind):
            ks = lower(g, nd.id, lim)
            assert any("fn hsum" in k.wgsl for k in ks), nd.op
            shuffles = any("subgroupShuffleXor" in k.wgsl for k in ks)
            assert shuffles is (lim.subgroups and "var<workgroup>" in ks[0].wgsl), nd.op
    xs = (RNG.standard_normal(shape) * 2 + offset).astype(np.float32)
    ws = (1 + 0.2 * RNG.standard_normal(c)).astype(np.float32)
    bs = RNG.standard_normal(c).astype(np.float32)
    ups = RNG.standard_normal(shape).astype(np.float32)
    state = {"bn.running_mean": np.zeros(c, np.float32), "bn.running_var": np.ones(c, np.float32)}
    feeds = {"x": xs, "w": ws, "b": bs, "up": ups}
    got = run(g, feeds, state=state if kind == "batch_norm" else None, limits=lim)
    want = _torch(kind, groups, xs, ws, bs, ups)
    ours = [got.values[y_id]] + [got.values[grads[i]] for i in sorted(grads)]
    for name, o, w in zip(("y", "dx", "dw", "db"), ours, want, strict=True):
        scale = np.abs(w).max()
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=2e-5 * scale, err_msg=name)
    if kind == "batch_norm":
        xd = xs.astype(np.float64).swapaxes(0, 1).reshape(c, -1)
        np.testing.assert_allclose(got.state["bn.running_mean"], 0.25 * xd.mean(1), rtol=1e-5,
                                   atol=1e-6 * (1 + abs(offset)))  # fmt: skip
        np.testing.assert_allclose(got.state["bn.running_var"], 0.75 + 0.25 * xd.var(1, ddof=1),
                                   rtol=1e-5)  # fmt: skip


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize(
    "shape,groups", GN_SHAPES, ids=[f"{shape_id(s)}-groups{g}" for s, g in GN_SHAPES]
)
def test_group_norm(subgroups, mode, shape, groups):
    _check("group_norm", shape, groups, _limits(subgroups), offset=20.0)


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize("shape", BN_SHAPES, ids=shape_id)
def test_batch_norm(subgroups, mode, shape):
    _check("batch_norm", shape, None, _limits(subgroups), offset=-10.0)


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows,n", [(3, 700), (2, 1029), (4, 1040)])
def test_row_norms_chunked(subgroups, kind, rows, n, monkeypatch):
    monkeypatch.setattr(rowwise, "MAX_UNITS", 2)
    monkeypatch.setattr(rowwise, "MAX_TEAM", 32)
    lim = _limits(subgroups)
    b = GraphBuilder()
    x, w, up = b.input("x", (rows, n)), b.input("w", (n,)), b.input("up", (rows, n))
    if kind == "layer_norm":
        y = layer_norm(x, n, w, b.input("b", (n,)), eps=1e-5)
    else:
        y = rms_norm(x, n, w, eps=1e-5)
    b.output("y", y)
    loss = b.output("loss", F.sum(y * up))
    g, grads = differentiate(b.build(), loss.id, [x.id, w.id])
    for nd in g.nodes:
        if nd.op in (kind, f"{kind}_backward"):
            assert "for (var cb" in lower(g, nd.id, lim)[0].wgsl
    xs = RNG.standard_normal((rows, n)) * 3 + (0.0 if kind == "rms_norm" else 30.0)
    feeds = {"x": xs.astype(np.float32), "w": (1 + 0.2 * RNG.standard_normal(n)).astype(np.float32),
             "up": RNG.standard_normal((rows, n)).astype(np.float32),
             "b": RNG.standard_normal(n).astype(np.float32)}  # fmt: skip
    if kind == "rms_norm":
        del feeds["b"]
    got = run(g, feeds, limits=lim)
    t = {k: torch.from_numpy(v).double().requires_grad_(True) for k, v in feeds.items()}
    if kind == "layer_norm":
        ty = TF.layer_norm(t["x"], (n,), t["w"], t["b"], 1e-5)
    else:
        ty = TF.rms_norm(t["x"], (n,), t["w"], 1e-5)
    (ty * t["up"]).sum().backward()
    pairs = [
        (got.values[y.id], ty.detach().numpy()),
        (got.values[grads[x.id]], t["x"].grad.numpy()),
        (got.values[grads[w.id]], t["w"].grad.numpy()),
    ]
    for name, (o, want) in zip(("y", "dx", "dw"), pairs, strict=True):
        np.testing.assert_allclose(o, want, rtol=1e-4, atol=2e-5 * np.abs(want).max(), err_msg=name)

"""The team row kernels (``codegen/wgsl/rowwise/team.py``): softmax, log_softmax, layer_norm and
rms_norm forward and backward over contiguous rows, through both team reductions (subgroup
shuffles and the workgroup-memory tree), for row lengths that give teams of 1 to 256 threads,
vec4 and scalar units, partial last units and several rows per workgroup; values against
float64 torch."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.rowwise import team as rowwise
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.functional import log_softmax, softmax
from meganeura.ops.norm import layer_norm, rms_norm

from .harness import device_limits, has_subgroups, run

RNG = np.random.default_rng(3)
# (rows, n): teams of 1 (n = 3), 2 (n = 7, scalar units), 4, 32, 128 and 256 threads, a
# partial last unit slot (n = 1500), more than one unit per thread (n = 4100, scalar units).
SHAPES = [(5, 3), (9, 7), (3, 64), (7, 384), (4, 576), (3, 1500), (2, 4100), (2, 4096)]


def _limits(subgroups: bool):
    lim = device_limits()
    if subgroups and not has_subgroups():
        pytest.skip("device has no subgroup feature")
    return dataclasses.replace(lim, subgroups=subgroups)


def _x(rows, n, offset=0.0):
    return (RNG.standard_normal((rows, n)) * 3 + offset).astype(np.float32)


def _team_kernel(graph, nid, limits) -> bool:
    ks = lower(graph, nid, limits)
    return len(ks) == 1 and "fn hsum" in ks[0].wgsl


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize("op", ["softmax", "log_softmax"])
@pytest.mark.parametrize("rows,n", SHAPES)
def test_softmax_rows(subgroups, op, rows, n):
    lim = _limits(subgroups)
    b = GraphBuilder()
    x = b.input("x", (rows, n))
    y = (softmax if op == "softmax" else log_softmax)(x, -1)
    b.output("y", y)
    g = b.build()
    assert _team_kernel(g, y.id, lim)
    assert ("subgroupShuffleXor" in lower(g, y.id, lim)[0].wgsl) is (subgroups and n > 3)
    xs = _x(rows, n) * 10
    got = run(g, {"x": xs}, limits=lim).values[y.id]
    want = getattr(torch, op)(torch.from_numpy(xs).double(), -1).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6 * np.abs(want).max())


def _norm_graph(kind, rows, n, backward):
    b = GraphBuilder()
    x = b.input("x", (rows, n))
    w = b.input("w", (n,))
    gy = b.input("gy", (rows, n))
    if kind == "layer_norm":
        bias = b.input("bias", (n,))
        y = layer_norm(x, (n,), w, bias, eps=1e-5)
    else:
        y = rms_norm(x, (n,), w, eps=1e-5)
    b.output("y", y)
    if backward:
        from meganeura.autodiff import differentiate
        from meganeura.ops import functional as F

        b.output("loss", F.sum(y * gy))
        g0 = b.build()
        g, grads = differentiate(g0, "loss", [x.id])
        return g, grads[x.id]
    return b.build(), y.id


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize("kind", ["layer_norm", "rms_norm"])
@pytest.mark.parametrize("rows,n", SHAPES)
def test_norm_rows_forward_and_backward(subgroups, kind, rows, n):
    lim = _limits(subgroups)
    g, dx = _norm_graph(kind, rows, n, backward=True)
    nodes = [nd for nd in g.nodes if nd.op in (kind, f"{kind}_backward")]
    assert len(nodes) == 2
    for nd in nodes:
        assert _team_kernel(g, nd.id, lim), nd.op
    xs = _x(rows, n, offset=50.0)  # a large common offset: the shift must cancel it
    ws = (1 + 0.1 * RNG.standard_normal(n)).astype(np.float32)
    bs = RNG.standard_normal(n).astype(np.float32)
    gys = RNG.standard_normal((rows, n)).astype(np.float32)
    feeds = {"x": xs, "w": ws, "gy": gys}
    if kind == "layer_norm":
        feeds["bias"] = bs
    got = run(g, feeds, limits=lim)
    tx = torch.from_numpy(xs).double().requires_grad_(True)
    tw = torch.from_numpy(ws).double()
    if kind == "layer_norm":
        ty = torch.nn.functional.layer_norm(tx, (n,), tw, torch.from_numpy(bs).double(), 1e-5)
    else:
        ty = torch.nn.functional.rms_norm(tx, (n,), tw, 1e-5)
    (ty * torch.from_numpy(gys).double()).sum().backward()
    y_id = next(nd.id for nd in g.nodes if nd.op == kind)
    want_y, want_dx = ty.detach().numpy(), tx.grad.numpy()
    np.testing.assert_allclose(got.values[y_id], want_y, rtol=1e-5, atol=2e-5)
    scale = np.abs(want_dx).max()
    np.testing.assert_allclose(got.values[dx], want_dx, rtol=1e-4, atol=1e-4 * scale)


def test_rows_too_long_for_registers_use_the_general_kernels():
    lim = device_limits()
    n = 4 * rowwise.MAX_UNITS * min(rowwise.MAX_TEAM, lim.max_invocations_per_workgroup) + 4
    b = GraphBuilder()
    x = b.input("x", (2, n))
    y = softmax(x, -1)
    b.output("y", y)
    g = b.build()
    assert not _team_kernel(g, y.id, lim)
    xs = _x(2, n)
    got = run(g, {"x": xs}, limits=lim).values[y.id]
    want = torch.softmax(torch.from_numpy(xs).double(), -1).numpy()
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=1e-9)

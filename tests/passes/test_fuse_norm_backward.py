"""layer_norm / rms_norm backward in fewer kernels (``passes/fuse_norm.py``,
``codegen/wgsl/norm/lowering.py::lower_norm_backward_act``): the input gradient's team kernel
leaves the row statistics in the weight gradient's scratch, so the weight gradient's own
statistics kernel goes and only its column sums run (with layer_norm's bias gradient's ``sum``
of g taken by them too). Which groups form, the dispatches left, that the fused program
computes what the unfused one does (bit for bit, but the bias gradient's sums, which run in
another order), and its values against float64 torch autograd."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits, ScratchRef
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.norm import layer_norm, rms_norm
from meganeura.passes.fuse_norm import plan_norm_activation
from meganeura.schedule.schedule import needed_nodes, schedule

from ..ids import shape_id

RNG = np.random.default_rng(7)
TF = torch.nn.functional


def _graph(kind: str, shape, nd: int = 1):
    """``sum(norm(x) * up)`` with the gradients of x, w (and b for layer_norm) as outputs;
    ``nd`` trailing dims normalized."""
    b = GraphBuilder()
    ns = tuple(shape[-nd:])
    x = b.input("x", shape)
    w = b.input("w", ns)
    leaves = [x, w]
    if kind == "layer_norm":
        bias = b.input("b", ns)
        leaves.append(bias)
        y = layer_norm(x, ns, w, bias, eps=1e-5)
    else:
        y = rms_norm(x, ns, w, eps=1e-6)
    b.output("y", y)
    up = b.input("up", shape)
    loss = b.output("loss", F.sum(y * up))
    g, gr = differentiate(b.build(), loss.id, [v.id for v in leaves])
    gb = GraphBuilder(g)
    for name, leaf in zip(("dx", "dw", "db"), leaves, strict=False):
        gb.output(name, gb.tensor(gr[leaf.id]))
    return gb.build()


def _feeds(kind: str, shape, nd: int = 1) -> dict:
    ns = tuple(shape[-nd:])
    feeds = {
        "x": (RNG.standard_normal(shape) * 2 + 3.0).astype(np.float32),
        "w": (1 + 0.2 * RNG.standard_normal(ns)).astype(np.float32),
        "up": RNG.standard_normal(shape).astype(np.float32),
    }
    if kind == "layer_norm":
        feeds["b"] = RNG.standard_normal(ns).astype(np.float32)
    return feeds


KINDS = ["layer_norm", "rms_norm"]


@pytest.mark.parametrize("kind", KINDS)
def test_groups_form_and_dispatches_left(kind):
    g = _graph(kind, (3, 5, 12))
    groups = plan_norm_activation(g, needed_nodes(g))
    ops = [tuple(g[m].op for m in grp.members) for grp in groups]
    want = (f"{kind}_backward", f"{kind}_weight_backward") + (("sum",) * (kind == "layer_norm"))
    assert ops == [want]
    (grp,) = groups
    assert grp.anchor == grp.members[0]
    dispatches = schedule(g, Limits(), fuse=True).dispatches
    names = [ks.name.split(maxsplit=1)[1] for _, ks in dispatches]
    assert [n for n in names if "norm" in n] == [
        kind,
        f"{kind}_backward",
        f"{kind}_weight_backward reduce",
    ]
    assert sum(n == "sum" for n in names) == 1  # the loss's; the bias gradient's went
    # The two kernels bind one scratch (the dispatch's node owns it): the statistics the first
    # writes, the second reads.
    scratch = [
        [r.slot(nid) for r in ks.bindings if isinstance(r, ScratchRef)]
        for nid, ks in dispatches
        if nid == grp.sink
    ]
    assert len(scratch) == 2 and scratch[0] == scratch[1] and len(scratch[0]) == 1


def test_layer_norm_two_dims_takes_the_bias_sum():
    g = _graph("layer_norm", (2, 3, 4, 5), nd=2)
    ops = [tuple(g[m].op for m in grp.members) for grp in plan_norm_activation(g, needed_nodes(g))]
    assert ops == [("layer_norm_backward", "layer_norm_weight_backward", "sum")]


# (shape, normalized dims, mode): one-team kernels in register mode (vec4 and scalar rows,
# rows not a multiple of anything), the same walking chunks (teams capped, below), one row,
# columns of 64 rows or more (the column sums' strided walk: 210 rows, unrolled; 613 rows,
# summed in blocks), and a 1-D input (no leading dims: layer_norm's bias gradient is g itself).
CASES = [
    ((4, 6, 16), 1, "team"),
    ((7, 13), 1, "team"),
    ((3, 5, 37), 1, "team"),
    ((2, 3, 4, 5), 2, "team"),
    ((5, 200), 1, "chunked"),
    ((3, 131), 1, "chunked"),
    ((1, 24), 1, "team"),
    ((3, 70, 24), 1, "team"),
    ((1, 613, 12), 1, "team"),
    ((9,), 1, "team"),
]
IDS = [f"{shape_id(s)}-nd{nd}-{m}" for s, nd, m in CASES]


def _chunked(monkeypatch, mode: str) -> None:
    from meganeura.codegen.wgsl.rowwise import team as rowwise

    if mode == "chunked":
        monkeypatch.setattr(rowwise, "MAX_UNITS", 2)
        monkeypatch.setattr(rowwise, "MAX_TEAM", 32)


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,nd,mode", CASES, ids=IDS)
def test_fused_equals_unfused(gpu_device, kind, precision, shape, nd, mode, monkeypatch):
    """dx and dw bit for bit; db (layer_norm) within 1e-6 of its largest element: the column
    sums add g in their own order where the sum kernel had another."""
    import meganeura.schedule.schedule as sched
    from meganeura.training import compile_for

    _chunked(monkeypatch, mode)
    feeds = _feeds(kind, shape, nd)
    outs = ["y", "dx", "dw"] + ["db"] * (kind == "layer_norm")
    got = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(sched, "plan_norm_activation", lambda *a, **k: ())
        options = CompileOptions(precision=precision)
        prog, sess = compile_for(_graph(kind, shape, nd), options, gpu_device)
        names = [d.name for d in prog.dispatches]
        assert any("weight_backward stats" in n for n in names) is not fuse, names
        if mode == "chunked":
            (bwd,) = [d for d in prog.dispatches if d.name.endswith(f"{kind}_backward")]
            assert "for (var cb" in bwd.wgsl
        got.append(sess.run(feeds, outs))
    for k in outs:
        if k == "db":
            tol = 1e-6 * np.abs(got[1][k]).max()
            np.testing.assert_allclose(got[0][k], got[1][k], rtol=1e-5, atol=tol, err_msg=k)
        else:
            np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)


@pytest.mark.gpu
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("shape,nd,mode", CASES[1:5] + CASES[-1:], ids=IDS[1:5] + IDS[-1:])
def test_fused_values_match_torch(gpu_device, kind, shape, nd, mode, monkeypatch):
    from meganeura.training import compile_for

    _chunked(monkeypatch, mode)
    feeds = _feeds(kind, shape, nd)
    prog, sess = compile_for(_graph(kind, shape, nd), CompileOptions(), gpu_device)
    assert not any("stats" in d.name for d in prog.dispatches)
    outs = ["y", "dx", "dw"] + ["db"] * (kind == "layer_norm")
    got = sess.run(feeds, outs)
    t = {k: torch.from_numpy(v).double().requires_grad_(k != "up") for k, v in feeds.items()}
    ns = tuple(shape[-nd:])
    if kind == "layer_norm":
        ty = TF.layer_norm(t["x"], ns, t["w"], t["b"], 1e-5)
    else:
        ty = TF.rms_norm(t["x"], ns, t["w"], 1e-6)
    (ty * t["up"]).sum().backward()
    want = {"y": ty.detach(), "dx": t["x"].grad, "dw": t["w"].grad}
    if kind == "layer_norm":
        want["db"] = t["b"].grad
    for k, w in want.items():
        w = np.asarray(w)
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=2e-5 * np.abs(w).max(), err_msg=k)


# ---- the residual add: a pre-norm block's input gradient -------------------------------------
def _residual_graph(kind: str, shape, extra_reader: bool = False):
    """``sum((x + norm(x)) * up)``: x's gradient is ``up + norm_backward(...)``, one add whose
    other operand is ``up`` itself; ``extra_reader`` makes the norm's input gradient an output
    too (so the add must stay apart)."""
    b = GraphBuilder()
    x = b.input("x", shape)
    w = b.input("w", shape[-1:])
    leaves = [x, w]
    if kind == "layer_norm":
        bias = b.input("b", shape[-1:])
        leaves.append(bias)
        norm = layer_norm(x, shape[-1:], w, bias, eps=1e-5)
    else:
        norm = rms_norm(x, shape[-1:], w, eps=1e-6)
    up = b.input("up", shape)
    loss = b.output("loss", F.sum((x + norm) * up))
    g, gr = differentiate(b.build(), loss.id, [v.id for v in leaves])
    gb = GraphBuilder(g)
    for name, leaf in zip(("dx", "dw", "db"), leaves, strict=False):
        gb.output(name, gb.tensor(gr[leaf.id]))
    if extra_reader:
        (bwd,) = [n.id for n in g.nodes if n.op == f"{kind}_backward"]
        gb.output("dnorm", gb.tensor(bwd))
    return gb.build()


@pytest.mark.parametrize("kind", KINDS)
def test_the_residual_add_joins_the_input_gradient(kind):
    g = _residual_graph(kind, (3, 5, 12))
    (grp,) = plan_norm_activation(g, needed_nodes(g))
    ops = [g[m].op for m in grp.members]
    assert f"{kind}_backward" in ops and "add" in ops and f"{kind}_weight_backward" in ops
    names = [ks.name.split(maxsplit=1)[1] for _, ks in schedule(g, Limits(), fuse=True).dispatches]
    assert f"{kind}_backward+add" in names and "add" not in names
    # read elsewhere, the input gradient is stored and the add stays its own kernel
    g2 = _residual_graph(kind, (3, 5, 12), extra_reader=True)
    (grp2,) = plan_norm_activation(g2, needed_nodes(g2))
    assert "add" not in [g2[m].op for m in grp2.members]


def test_the_residual_switch_keeps_the_add_apart(monkeypatch):
    from meganeura.passes import fuse_norm

    monkeypatch.setattr(fuse_norm, "RESIDUAL", [False])
    g = _residual_graph("rms_norm", (3, 5, 12))
    names = [ks.name.split(maxsplit=1)[1] for _, ks in schedule(g, Limits(), fuse=True).dispatches]
    assert "add" in names and "rms_norm_backward+add" not in names


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize(
    "shape,nd,mode", [CASES[0], CASES[2], CASES[4]], ids=[IDS[0], IDS[2], IDS[4]]
)
def test_residual_fused_equals_unfused(gpu_device, kind, precision, shape, nd, mode, monkeypatch):
    """x's gradient (the add's value) bit for bit, in register and chunked team kernels."""
    from meganeura.passes import fuse_norm
    from meganeura.training import compile_for

    _chunked(monkeypatch, mode)
    feeds = _feeds(kind, shape)
    outs = ["loss", "dx", "dw"]
    got = []
    for on in (True, False):
        monkeypatch.setattr(fuse_norm, "RESIDUAL", [on])
        prog, sess = compile_for(
            _residual_graph(kind, shape), CompileOptions(precision=precision), gpu_device
        )
        names = [d.name.split(maxsplit=1)[1] for d in prog.dispatches]
        assert (f"{kind}_backward+add" in names) is on, names
        got.append(sess.run(feeds, outs))
    for k in outs:
        np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)
    # and the values themselves, against float64 torch
    t = {k: torch.from_numpy(v).double().requires_grad_(k in ("x", "w")) for k, v in feeds.items()}
    if kind == "layer_norm":
        tn = TF.layer_norm(t["x"], shape[-1:], t["w"], t["b"], 1e-5)
    else:
        tn = TF.rms_norm(t["x"], shape[-1:], t["w"], 1e-6)
    ((t["x"] + tn) * t["up"]).sum().backward()
    tol = 1e-4 if precision == "strict" else 2e-2
    for k, w in (("dx", t["x"].grad), ("dw", t["w"].grad)):
        w = np.asarray(w)
        np.testing.assert_allclose(got[0][k], w, rtol=tol, atol=tol * np.abs(w).max(), err_msg=k)

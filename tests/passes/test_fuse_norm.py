"""group_norm + SiLU as one kernel (``passes/fuse_norm.py``, ``codegen/wgsl/norm/team.py``
``store_normalized``): which pairs form, that y is stored only when something else reads it,
and the values of the fused program (forward and the gradients through it) against float64
torch autograd, in one-team and split (``norm/split.py``) kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits, ValueRef
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.activation import silu
from meganeura.ops.conv import conv2d
from meganeura.ops.norm import group_norm
from meganeura.passes.fuse_norm import plan_norm_activation
from meganeura.schedule.schedule import needed_nodes, schedule

from ..ids import shape_id

RNG = np.random.default_rng(5)
TF = torch.nn.functional


def _graph(shape, groups, grads: bool):
    """conv2d(silu(group_norm(x)), up) summed, as in a U-Net's residual block (an elementwise
    reader would take the SiLU into its own group, a matmul's epilogue the SiLU gradient);
    with ``grads`` the graph outputs dx, dw, db too."""
    b = GraphBuilder()
    c = shape[1]
    x = b.input("x", shape)
    w, bias = b.input("w", (c,)), b.input("b", (c,))
    y = silu(group_norm(x, groups, w, bias, eps=1e-5))
    b.output("y", y)
    if not grads:
        return b.build()
    up = b.input("up", (4, c, 3, 3))
    loss = b.output("loss", F.sum(conv2d(y, up, padding=1)))
    g, gr = differentiate(b.build(), loss.id, [x.id, w.id, bias.id])
    gb = GraphBuilder(g)
    for name, leaf in zip(("dx", "dw", "db"), (x, w, bias), strict=True):
        gb.output(name, gb.tensor(gr[leaf.id]))
    return gb.build()


@pytest.mark.parametrize("grads", [False, True], ids=["forward", "training"])
def test_groups_form_and_store_only_what_is_read(grads):
    g = _graph((2, 8, 4, 4), 2, grads)
    groups = plan_norm_activation(g, needed_nodes(g))
    ops = [tuple(g[m].op for m in grp.members) for grp in groups]
    bwd = ("silu_backward", "group_norm_backward", "group_norm_weight_backward", "sum")
    assert ops == [("group_norm", "silu")] + [bwd] * grads
    for grp in groups:
        assert g[grp.anchor].op in ("group_norm", "group_norm_backward")
        # In training silu_backward reads y; the channel sums read g from memory.
        assert grp.outputs == (grp.members if grads else grp.members[1:])
    dispatches = schedule(g, Limits(), fuse=True).dispatches
    names = [ks.name.split(maxsplit=1)[1] for _, ks in dispatches]
    want = ["group_norm+silu"]
    if grads:
        want += ["silu_backward+group_norm_backward", "group_norm_weight_backward reduce"]
    assert [n for n in names if "norm" in n or "silu" in n] == want
    for grp in groups:
        kernels = [ks for nid, ks in dispatches if nid == grp.sink]
        bound = {r.node for ks in kernels for r in ks.bindings if isinstance(r, ValueRef)}
        written = {
            r.node for ks in kernels for r in ks.bindings if isinstance(r, ValueRef) and r.write
        }
        assert written == set(grp.outputs)
        assert not (set(grp.members) - set(grp.outputs)) & bound  # no storage for the rest


_MODE = {None: "team", 0: "team_chunked"}
# (shape, groups, chunks): one-team kernels in register mode, the same walking chunks (teams
# capped at 32 threads, below), and the split kernels.
CASES = [
    ((2, 16, 6, 6), 4, None),
    ((1, 8, 7, 5), 2, None),
    ((1, 8, 16, 17), 2, 0),
    ((2, 64, 32, 32), 8, 4),
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,groups,chunks",
    CASES,
    ids=[f"{shape_id(s)}-g{g}-{_MODE.get(p, f'split{p}')}" for s, g, p in CASES],
)
def test_fused_values_match_torch(gpu_device, shape, groups, chunks, monkeypatch):
    from meganeura.codegen.wgsl.norm import split
    from meganeura.codegen.wgsl.rowwise import team as rowwise
    from meganeura.training import compile_for

    monkeypatch.setattr(split, "FORCE_CHUNKS", chunks or None)
    if chunks == 0:
        monkeypatch.setattr(rowwise, "MAX_UNITS", 2)
        monkeypatch.setattr(rowwise, "MAX_TEAM", 32)
    c = shape[1]
    feeds = {
        "x": (RNG.standard_normal(shape) * 2 + 5.0).astype(np.float32),
        "w": (1 + 0.2 * RNG.standard_normal(c)).astype(np.float32),
        "b": RNG.standard_normal(c).astype(np.float32),
        "up": RNG.standard_normal((4, c, 3, 3)).astype(np.float32),
    }
    prog, sess = compile_for(_graph(shape, groups, True), CompileOptions(), gpu_device)
    names = [d.name for d in prog.dispatches]
    assert sum("group_norm+silu" in n for n in names) == (2 if chunks else 1), names
    assert sum("silu_backward+group_norm_backward" in n for n in names) == (2 if chunks else 1)
    assert not any("stats" in n for n in names)  # the weight gradient reads the pair's
    if chunks == 0:
        (fused,) = [d for d in prog.dispatches if "group_norm_backward" in d.name]
        assert "for (var cb" in fused.wgsl
    got = sess.run(feeds, ["y", "dx", "dw", "db"])
    t = {k: torch.from_numpy(v).double().requires_grad_(k != "up") for k, v in feeds.items()}
    ty = TF.silu(TF.group_norm(t["x"], groups, t["w"], t["b"], 1e-5))
    TF.conv2d(ty, t["up"], padding=1).sum().backward()
    want = {"y": ty.detach().numpy(), "dx": t["x"].grad, "dw": t["w"].grad, "db": t["b"].grad}
    for k, w in want.items():
        w = np.asarray(w)
        np.testing.assert_allclose(got[k], w, rtol=1e-4, atol=2e-5 * np.abs(w).max(), err_msg=k)


@pytest.mark.gpu
def test_forward_only_stores_the_activation_alone(gpu_device):
    from meganeura.training import compile_for

    shape, groups = (2, 12, 5, 4), 3
    prog, sess = compile_for(_graph(shape, groups, False), CompileOptions(), gpu_device)
    assert [d.name.split()[-1] for d in prog.dispatches] == ["group_norm+silu"]
    x = (RNG.standard_normal(shape) * 3 - 4.0).astype(np.float32)
    w = (1 + 0.2 * RNG.standard_normal(shape[1])).astype(np.float32)
    b = RNG.standard_normal(shape[1]).astype(np.float32)
    got = sess.run({"x": x, "w": w, "b": b}, ["y"])["y"]
    t = [torch.from_numpy(a).double() for a in (x, w, b)]
    want = TF.silu(TF.group_norm(t[0], groups, t[1], t[2], 1e-5)).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-4, atol=2e-5 * np.abs(want).max())


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
@pytest.mark.parametrize("chunks", [None, 4], ids=["team", "split4"])
def test_fused_equals_unfused(gpu_device, precision, chunks, monkeypatch):
    """The groups compute what the kernels they replace compute, bit for bit on lavapipe, also
    in the fast mode (y and g rounded to their f16 storage before use, stored or not); except
    the sums a group takes in another order: the bias gradient (the channel sums' team
    reduction instead of the sum kernel's) and the weight gradient of split groups (its
    statistics are the input gradient's merged partials, not the one-team statistics
    kernel's)."""
    import meganeura.schedule.schedule as sched
    from meganeura.codegen.wgsl.norm import split
    from meganeura.training import compile_for

    monkeypatch.setattr(split, "FORCE_CHUNKS", chunks)
    shape, groups, c = (2, 16, 8, 8), 4, 16
    feeds = {
        "x": (RNG.standard_normal(shape) * 2 + 5.0).astype(np.float32),
        "w": (1 + 0.2 * RNG.standard_normal(c)).astype(np.float32),
        "b": RNG.standard_normal(c).astype(np.float32),
        "up": RNG.standard_normal((4, c, 3, 3)).astype(np.float32),
    }
    got = []
    for fuse in (True, False):
        if not fuse:
            monkeypatch.setattr(sched, "plan_norm_activation", lambda *a, **k: ())
        options = CompileOptions(precision=precision)
        prog, sess = compile_for(_graph(shape, groups, True), options, gpu_device)
        assert any("+group_norm_backward" in d.name for d in prog.dispatches) is fuse
        got.append(sess.run(feeds, ["y", "dx", "dw", "db"]))
    for k in got[1]:
        if k == "db" or (k == "dw" and chunks):
            tol = 1e-6 * np.abs(got[1][k]).max()  # the sums cancel: scale to the largest
            np.testing.assert_allclose(got[0][k], got[1][k], rtol=1e-5, atol=tol, err_msg=k)
        else:
            np.testing.assert_array_equal(got[0][k], got[1][k], err_msg=k)

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
from meganeura.ops.norm import group_norm
from meganeura.passes.fuse_norm import plan_norm_activation
from meganeura.schedule.schedule import needed_nodes, schedule

from ..ids import shape_id

RNG = np.random.default_rng(5)
TF = torch.nn.functional


def _graph(shape, groups, grads: bool):
    """silu(group_norm(x)) @ up summed (a matmul reads the SiLU, as a conv does in a U-Net; an
    elementwise reader would take the SiLU into its own group); with ``grads`` the graph
    outputs dx, dw, db too."""
    b = GraphBuilder()
    c = shape[1]
    x = b.input("x", shape)
    w, bias = b.input("w", (c,)), b.input("b", (c,))
    y = silu(group_norm(x, groups, w, bias, eps=1e-5))
    b.output("y", y)
    if not grads:
        return b.build()
    up = b.input("up", (shape[-1], shape[-1]))
    loss = b.output("loss", F.sum(F.matmul(y, up)))
    g, gr = differentiate(b.build(), loss.id, [x.id, w.id, bias.id])
    gb = GraphBuilder(g)
    for name, leaf in zip(("dx", "dw", "db"), (x, w, bias), strict=True):
        gb.output(name, gb.tensor(gr[leaf.id]))
    return gb.build()


@pytest.mark.parametrize("grads", [False, True], ids=["forward", "training"])
def test_pair_forms_and_stores_y_only_when_read(grads):
    g = _graph((2, 8, 4, 4), 2, grads)
    (grp,) = plan_norm_activation(g, needed_nodes(g))
    norm, act = grp.members
    assert (g[norm].op, g[act].op, grp.anchor) == ("group_norm", "silu", norm)
    assert grp.outputs == ((norm, act) if grads else (act,))  # silu_backward reads y
    dispatches = schedule(g, Limits(), fuse=True).dispatches
    names = [ks.name for _, ks in dispatches]
    assert sum("group_norm+silu" in n for n in names) == 1
    assert not any(n.split()[-1] == "silu" for n in names)
    (fused,) = [ks for _, ks in dispatches if "group_norm+silu" in ks.name]
    bound = {r.node for r in fused.bindings if isinstance(r, ValueRef) and r.write}
    assert bound == set(grp.outputs)


CASES = [((2, 16, 6, 6), 4, None), ((1, 8, 7, 5), 2, None), ((2, 64, 32, 32), 8, 4)]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,groups,chunks", CASES, ids=[f"{shape_id(s)}-g{g}-p{p}" for s, g, p in CASES]
)
def test_fused_values_match_torch(gpu_device, shape, groups, chunks, monkeypatch):
    from meganeura.codegen.wgsl.norm import split
    from meganeura.training import compile_for

    monkeypatch.setattr(split, "FORCE_CHUNKS", chunks)
    c = shape[1]
    feeds = {
        "x": (RNG.standard_normal(shape) * 2 + 5.0).astype(np.float32),
        "w": (1 + 0.2 * RNG.standard_normal(c)).astype(np.float32),
        "b": RNG.standard_normal(c).astype(np.float32),
        "up": RNG.standard_normal((shape[-1], shape[-1])).astype(np.float32),
    }
    prog, sess = compile_for(_graph(shape, groups, True), CompileOptions(), gpu_device)
    names = [d.name for d in prog.dispatches]
    assert sum("group_norm+silu" in n for n in names) == (2 if chunks else 1), names
    got = sess.run(feeds, ["y", "dx", "dw", "db"])
    t = {k: torch.from_numpy(v).double().requires_grad_(k != "up") for k, v in feeds.items()}
    ty = TF.silu(TF.group_norm(t["x"], groups, t["w"], t["b"], 1e-5))
    (ty @ t["up"]).sum().backward()
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

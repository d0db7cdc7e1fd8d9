"""Normalization, dropout and loss kernels beyond the op database (``tests/opinfo/norm.py``,
``tests/opinfo/loss.py``): batch_norm's running statistics through real training steps
against torch, dropout exactly against its NumPy reference and statistically against torch,
long groups and folded grids, the log1p tail of binary_cross_entropy_with_logits, and the
argument errors of the user functions."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.codegen.kernel import Limits
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.ops import functional as F
from meganeura.ops.dropout import dropout, keep_mask
from meganeura.ops.loss import binary_cross_entropy_with_logits, cross_entropy
from meganeura.ops.norm import batch_norm, group_norm, layer_norm, rms_norm

from ..ids import shape_id
from .harness import check, run

rng = np.random.default_rng(11)


# ---- batch_norm: running statistics through training steps ----------------------------------
def _bn_model(shape, momentum):
    b = GraphBuilder()
    x = b.input("x", shape)
    target = b.input("target", shape)
    c = shape[1]
    w, bias = b.parameter("bn.weight", (c,)), b.parameter("bn.bias", (c,))
    rm, rv = b.state("bn.running_mean", (c,)), b.state("bn.running_var", (c,))
    y = batch_norm(x, rm, rv, w, bias, training=True, momentum=momentum)
    b.output("loss", F.mean((y - target) * (y - target)))
    return b.build()


@pytest.mark.gpu
@pytest.mark.parametrize("shape", [(4, 3), (1, 3, 5, 5), (6, 2, 33)], ids=shape_id)
def test_batch_norm_training_updates_running_stats_like_torch(gpu_device, shape):
    from meganeura.optim import SGD
    from meganeura.training import Trainer

    c, momentum, lr = shape[1], 0.3, 0.5
    tr = Trainer(_bn_model(shape, momentum), SGD(lr=lr), device=gpu_device)
    w0, b0 = rng.uniform(0.5, 1.5, c).astype(np.float32), rng.standard_normal(c).astype(np.float32)
    tr.load_parameters({"bn.weight": w0, "bn.bias": b0})
    tr.session.write("bn.running_var", np.ones(c, np.float32))  # PyTorch's initial value

    bn = {1: torch.nn.BatchNorm1d, 2: torch.nn.BatchNorm1d, 3: torch.nn.BatchNorm2d}
    module = bn[len(shape) - 1](c, momentum=momentum).double()
    with torch.no_grad():
        module.weight.copy_(torch.from_numpy(w0))
        module.bias.copy_(torch.from_numpy(b0))
    opt = torch.optim.SGD(module.parameters(), lr=lr)
    for step in range(2):
        x = (rng.standard_normal(shape) * 2 + 3).astype(np.float32)
        t = rng.standard_normal(shape).astype(np.float32)
        loss = tr.step({"x": x, "target": t})["loss"]
        opt.zero_grad()
        tloss = ((module(torch.from_numpy(x).double()) - torch.from_numpy(t)) ** 2).mean()
        tloss.backward()
        opt.step()
        np.testing.assert_allclose(loss, tloss.item(), rtol=1e-5, err_msg=f"step {step}")
        for name, ref in [
            ("bn.running_mean", module.running_mean),
            ("bn.running_var", module.running_var),
            ("bn.weight", module.weight),
            ("bn.bias", module.bias),
        ]:
            got = tr.session.read(name)
            np.testing.assert_allclose(got, ref.detach().numpy(), rtol=2e-5, atol=1e-6,
                                       err_msg=f"{name} after step {step}")  # fmt: skip

    # eval mode reads the statistics the training steps left
    b = GraphBuilder()
    x = b.input("x", shape)
    st = [b.input(n, (c,)) for n in ("mean", "var", "w", "b")]
    b.output("y", batch_norm(x, st[0], st[1], st[2], st[3], training=False))
    xs = rng.standard_normal(shape).astype(np.float32)
    feeds = {"x": xs, "mean": tr.session.read("bn.running_mean"),
             "var": tr.session.read("bn.running_var"), "w": tr.session.read("bn.weight"),
             "b": tr.session.read("bn.bias")}  # fmt: skip
    got = run(b.build(), feeds).values[-1]
    module.eval()
    with torch.no_grad():
        want = module(torch.from_numpy(xs).double()).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


# ---- dropout ----------------------------------------------------------------------------------
def _dropout_graph(shape, p):
    b = GraphBuilder()
    x = b.input("x", shape)
    seed = b.input("seed", (), DType.u32)
    y = b.output("y", dropout(x, p, True, seed=seed))
    loss = F.sum(y * b.input("g", shape))
    from meganeura.autodiff import differentiate

    graph, grads = differentiate(b.build_unverified(), loss.id, [x.id])
    return graph, y.id, grads[x.id]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "shape,p",
    [((5000,), 0.5), ((3, 257), 0.1), ((7, 11, 13), 0.8)],
    ids=["5000-p0.5", "3x257-p0.1", "7x11x13-p0.8"],
)
def test_dropout_matches_numpy_reference_exactly(shape, p):
    graph, y_id, dx_id = _dropout_graph(shape, p)
    x = rng.standard_normal(shape).astype(np.float32)
    g = rng.standard_normal(shape).astype(np.float32)
    scale = np.float32(1.0 / (1.0 - p))
    for seed in (0, 1, 2**32 - 1):
        res = run(graph, {"x": x, "g": g, "seed": np.uint32(seed)})
        mask = keep_mask(seed, shape, p)
        np.testing.assert_array_equal(res.values[y_id], np.where(mask, x * scale, 0))
        np.testing.assert_array_equal(res.values[dx_id], np.where(mask, g * scale, 0))


@pytest.mark.gpu
@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_dropout_statistics_match_torch(p):
    n = 200_000
    graph, y_id, _ = _dropout_graph((n,), p)
    x = np.ones(n, np.float32)
    masks = [run(graph, {"x": x, "g": x, "seed": np.uint32(s)}).values[y_id] != 0 for s in (7, 8)]
    sigma = np.sqrt(p * (1 - p) / n)
    for m in masks:
        assert abs(m.mean() - (1 - p)) < 5 * sigma
    torch.manual_seed(0)
    kept_torch = (torch.nn.functional.dropout(torch.ones(n), p) != 0).double().mean().item()
    assert abs(masks[0].mean() - kept_torch) < 8 * sigma
    # neighbouring seeds give independent masks: agreement p^2 + (1-p)^2
    agree = (masks[0] == masks[1]).mean()
    assert abs(agree - (p * p + (1 - p) ** 2)) < 8 * sigma
    # neighbouring elements are independent too (no stripes from the index hash)
    both = (masks[0][1:] & masks[0][:-1]).mean()
    assert abs(both - (1 - p) ** 2) < 8 * sigma


def test_dropout_identity_cases_and_errors():
    b = GraphBuilder()
    x = b.input("x", (4,))
    assert dropout(x, 0.5, training=False) is x
    assert dropout(x, 0.0, training=True) is x
    with pytest.raises(ValueError, match="seed"):
        dropout(x, 0.5)
    with pytest.raises(ValueError, match=r"\[0, 1\]"):
        dropout(x, 1.5, seed=b.input("seed", (), DType.u32))
    with pytest.raises(ValueError, match="u32"):
        dropout(x, 0.5, seed=b.input("s32", (), DType.i32))


# ---- long groups, folded grids ----------------------------------------------------------------
@pytest.mark.gpu
def test_long_groups_are_accurate():
    """Groups of 2^15 (layer_norm row, batch_norm channel) with a large offset, against
    float64: the shifted two-pass statistics keep f32 accuracy."""
    b = GraphBuilder()
    x = b.input("x", (2, 32768))
    xb = b.input("xb", (8, 2, 4096))
    b.output("ln", layer_norm(x, 32768))
    b.output("bn", batch_norm(xb, None, None, training=True))
    xs = (100.0 + rng.standard_normal((2, 32768))).astype(np.float32)
    xbs = (-50.0 + 0.5 * rng.standard_normal((8, 2, 4096))).astype(np.float32)
    graph = b.build()
    res = run(graph, {"x": xs, "xb": xbs})
    ln = torch.nn.functional.layer_norm(torch.from_numpy(xs).double(), (32768,))
    bn = torch.nn.functional.batch_norm(torch.from_numpy(xbs).double(), None, None, training=True)
    got = {name: res.values[i] for name, i in graph.outputs}
    for name, want in (("ln", ln), ("bn", bn)):
        want = want.numpy()
        err = np.abs(got[name] - want).max() / np.abs(want).max()
        assert err < 1e-5, (name, err)


@pytest.mark.gpu
def test_many_groups_on_a_folded_grid():
    """More workgroups than the (artificially small) per-dimension limit."""
    b = GraphBuilder()
    x = b.input("x", (300, 70))
    w = b.input("w", (70,))
    xg = b.input("xg", (40, 8, 65))
    y = layer_norm(x, 70, w) + 0.0
    z = group_norm(xg, 4)
    r = rms_norm(x, 70, w)
    stats = [b.state(n, (8,)) for n in ("bn.running_mean", "bn.running_var")]
    bn = batch_norm(F.permute(xg, (2, 1, 0)), *stats, training=True)
    loss = F.sum(y * y) + F.sum(z * b.input("r", xg.shape)) + F.sum(r) + F.sum(bn * bn * bn)
    b.output("loss", loss)
    from meganeura.autodiff import differentiate

    graph, _ = differentiate(b.build_unverified(), loss.id, [x.id, w.id, xg.id])
    feeds = {
        "x": rng.standard_normal((300, 70)).astype(np.float32),
        "w": rng.standard_normal(70).astype(np.float32),
        "xg": rng.standard_normal((40, 8, 65)).astype(np.float32),
        "r": rng.standard_normal((40, 8, 65)).astype(np.float32),
    }
    state = {"bn.running_mean": np.zeros(8, np.float32), "bn.running_var": np.ones(8, np.float32)}
    res = check(
        graph, feeds, state=state, rtol=1e-4, limits=Limits(max_workgroups_per_dimension=16)
    )
    assert any(k.grid[1] > 1 for k in res.kernels)


# ---- losses -----------------------------------------------------------------------------------
@pytest.mark.gpu
def test_bce_with_logits_keeps_the_log1p_tail():
    """Per element relative accuracy where the loss is exp(-|x|)-sized (t = 1, x >> 0)."""
    x = np.array([0.0, 1e-3, 5.0, 17.0, 30.0, 80.0, -30.0, -80.0], np.float32)
    t = np.array([0.5, 1.0, 1.0, 1.0, 1.0, 1.0, 0.0, 0.0], np.float32)
    b = GraphBuilder()
    out = binary_cross_entropy_with_logits(b.input("x", x.shape), b.input("t", t.shape),
                                           reduction="none")  # fmt: skip
    b.output("l", out)
    got = run(b.build(), {"x": x, "t": t}).values[out.id]
    xd, td = x.astype(np.float64), t.astype(np.float64)
    want = np.maximum(xd, 0) - xd * td + np.log1p(np.exp(-np.abs(xd)))
    assert (want > 0).all()
    np.testing.assert_allclose(got, want, rtol=2e-6)
    # torch agrees where float64 itself keeps the tail (it rounds log(1 + 1e-35) to 0)
    tw = torch.nn.functional.binary_cross_entropy_with_logits(
        torch.from_numpy(xd), torch.from_numpy(td), reduction="none"
    ).numpy()
    np.testing.assert_allclose(got[:6], tw[:6], rtol=2e-6)


def test_loss_argument_errors():
    b = GraphBuilder()
    logits = b.input("logits", (4, 5))
    with pytest.raises(ValueError, match="reduction"):
        cross_entropy(logits, b.input("t", (4,), DType.i32), reduction="avg")
    with pytest.raises(ValueError, match="label_smoothing"):
        cross_entropy(logits, b.input("t2", (4,), DType.i32), label_smoothing=1.5)
    with pytest.raises(ValueError, match="probability targets"):
        cross_entropy(logits, b.input("p", (4, 6)))
    with pytest.raises(ValueError, match=r"shaped \[4\]"):  # torch: ValueError too
        cross_entropy(logits, b.input("t3", (5,), DType.i32))
    with pytest.raises(GraphTypeError, match="i32"):
        cross_entropy(logits, b.input("t4", (4,), DType.u32))


def test_norm_argument_errors():
    b = GraphBuilder()
    x = b.input("x", (2, 6, 5))
    with pytest.raises(ValueError, match="trailing"):
        layer_norm(x, (6,))
    with pytest.raises(ValueError, match="shape"):
        layer_norm(x, 5, b.input("w", (6,)))
    with pytest.raises(ValueError, match="divide"):
        group_norm(x, 4)
    with pytest.raises(ValueError, match="more than 1 value"):
        batch_norm(b.input("x1", (1, 3)), None, None, training=True)
    with pytest.raises(ValueError, match="eval mode"):
        batch_norm(x, None, None, training=False)
    with pytest.raises(ValueError, match="state"):
        batch_norm(x, b.input("m", (6,)), b.input("v", (6,)), training=True)
    with pytest.raises(GraphTypeError, match="weight"):
        b.add("layer_norm", [x, b.input("w2", (4,)), b.constant(0.0)],
              {"normalized_ndim": 1, "eps": 1e-5})  # fmt: skip
    with pytest.raises(GraphTypeError, match="more than 1 value"):
        b.add("batch_norm_update_stats", [b.input("x2", (1, 6)), *(b.state(n, (6,)) for n in "ab")],
              {"momentum": 0.1})  # fmt: skip

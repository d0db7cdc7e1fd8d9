"""The functional losses (``meganeura/ops/loss.py``) and ``one_hot`` against torch.

Each case is one call written for both ``torch.nn.functional`` and ``meganeura.nn.functional``
(the same names and arguments); values and gradients (of the float inputs) are compared in
float64 on the NumPy interpreter, and every case's forward runs once more in one traced
program on the GPU (f32). Class-index targets are int64 for torch and i32 here.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import meganeura as mn
import meganeura.nn.functional as MF
from meganeura.autodiff import differentiate
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret

pytestmark = pytest.mark.filterwarnings("ignore:.*(size_average|reduction).*:UserWarning")
_rng = np.random.default_rng(77)


def _logits(*shape):
    return _rng.standard_normal(shape) * 2


def _labels(n_classes, shape, ignored=()):
    t = _rng.integers(0, n_classes, shape)
    for i in ignored:
        t.reshape(-1)[i] = -100
    return t


def _probs(*shape, dim=1):
    p = _rng.random(shape) + 0.05
    return p / p.sum(axis=dim, keepdims=True)


X = _logits(6, 5)
T = _labels(5, (6,), ignored=(1, 4))
XK = _logits(3, 4, 2, 5)  # [N, C, d1, d2]
TK = _labels(4, (3, 2, 5), ignored=(0, 7))
W = _rng.uniform(0.2, 2.0, 5)
WK = _rng.uniform(0.2, 2.0, 4)
PROB = _rng.uniform(0.02, 0.98, (4, 3))
Y01 = (_rng.random((4, 3)) < 0.5).astype(np.float64)
Y = _rng.standard_normal((4, 3)) * 2
Y[0, :2] = PROB[0, :2]  # ties at d = 0
LP = np.log(_probs(4, 3))
TP = _probs(4, 3)
TP[1, 0] = 0.0  # xlogy's zero target
POSW = _rng.uniform(0.5, 3.0, 3)

ARRAYS = {
    "x": X, "t": T, "xk": XK, "tk": TK, "w": W, "wk": WK, "p": PROB, "y01": Y01, "y": Y,
    "lp": LP, "tp": TP, "posw": POSW, "xu": X[0], "tu": np.array(T[0]), "pk": _probs(3, 4, 2, 5),
}  # fmt: skip

CASES = {
    "nll_mean": lambda M, a: M.nll_loss(M.log_softmax(a["x"], 1), a["t"]),
    "nll_weight_sum": lambda M, a: M.nll_loss(a["x"], a["t"], a["w"], reduction="sum"),
    "nll_weight_mean": lambda M, a: M.nll_loss(a["x"], a["t"], a["w"]),
    "nll_none_kdim": lambda M, a: M.nll_loss(a["xk"], a["tk"], reduction="none"),
    "nll_weight_kdim": lambda M, a: M.nll_loss(a["xk"], a["tk"], a["wk"]),
    "nll_ignore_class": lambda M, a: M.nll_loss(a["x"], a["t"] * 0 + 2, ignore_index=3),
    "nll_unbatched": lambda M, a: M.nll_loss(a["xu"], a["tu"] * 0 + 3),
    "nll_legacy_flags": lambda M, a: M.nll_loss(a["x"], a["t"], size_average=False),
    "ce_kdim_mean": lambda M, a: M.cross_entropy(a["xk"], a["tk"]),
    "ce_kdim_none": lambda M, a: M.cross_entropy(a["xk"], a["tk"], reduction="none"),
    "ce_unbatched": lambda M, a: M.cross_entropy(a["xu"], a["tu"] * 0 + 1),
    "ce_weight": lambda M, a: M.cross_entropy(a["x"], a["t"], a["w"]),
    "ce_weight_smoothing": lambda M, a: M.cross_entropy(
        a["x"], a["t"], a["w"], label_smoothing=0.2
    ),
    "ce_weight_smoothing_sum": lambda M, a: M.cross_entropy(
        a["x"], a["t"], a["w"], reduction="sum", label_smoothing=0.3
    ),
    "ce_weight_smoothing_none_kdim": lambda M, a: M.cross_entropy(
        a["xk"], a["tk"], a["wk"], reduction="none", label_smoothing=0.1
    ),
    "ce_probs_kdim_weight": lambda M, a: M.cross_entropy(
        a["xk"], a["pk"], a["wk"], label_smoothing=0.1
    ),
    "ce_legacy_reduce_false": lambda M, a: M.cross_entropy(a["x"], a["t"], reduce=False),
    "bce_mean": lambda M, a: M.binary_cross_entropy(a["p"], a["y01"]),
    "bce_weight_none": lambda M, a: M.binary_cross_entropy(
        a["p"], a["tp"], a["posw"], reduction="none"
    ),
    "bce_logits_pos_weight": lambda M, a: M.binary_cross_entropy_with_logits(
        a["y"], a["p"], pos_weight=a["posw"]
    ),
    "bce_logits_pos_weight_weight_sum": lambda M, a: M.binary_cross_entropy_with_logits(
        a["y"], a["y01"], a["posw"], reduction="sum", pos_weight=a["posw"] * 2
    ),
    "mse_none": lambda M, a: M.mse_loss(a["y"], a["p"], reduction="none"),
    "l1_sum": lambda M, a: M.l1_loss(a["y"], a["p"], reduction="sum"),
    "smooth_l1": lambda M, a: M.smooth_l1_loss(a["y"], a["p"]),
    "smooth_l1_beta": lambda M, a: M.smooth_l1_loss(a["y"], a["p"], beta=0.5, reduction="none"),
    "smooth_l1_beta0": lambda M, a: M.smooth_l1_loss(a["y"], a["p"], beta=0.0, reduction="sum"),
    "huber": lambda M, a: M.huber_loss(a["y"], a["p"]),
    "huber_delta": lambda M, a: M.huber_loss(a["y"], a["p"], reduction="none", delta=2.0),
    "kl_mean": lambda M, a: M.kl_div(a["lp"], a["tp"]),
    "kl_batchmean": lambda M, a: M.kl_div(a["lp"], a["tp"], reduction="batchmean"),
    "kl_none": lambda M, a: M.kl_div(a["lp"], a["tp"], reduction="none"),
    "kl_log_target_sum": lambda M, a: M.kl_div(
        a["lp"], a["lp"] * 0.5, reduction="sum", log_target=True
    ),
    "one_hot": lambda M, a: M.one_hot(M.relu(a["tk"]), 4),
}


WEIGHTS = ("w", "wk", "posw")  # class weights: torch gives them no gradient


def _torch_args(requires_grad: bool):
    out = {}
    for k, v in ARRAYS.items():
        t = torch.from_numpy(np.array(v))
        if t.dtype == torch.float64 and requires_grad and k not in WEIGHTS:
            t.requires_grad_(True)
        out[k] = t
    return out


def _dtype(a: np.ndarray) -> DType:
    return DType.f32 if a.dtype.kind == "f" else DType.i32


def _graph(name):
    b = GraphBuilder()
    a = {k: b.input(k, np.shape(v), _dtype(np.asarray(v))) for k, v in ARRAYS.items()}
    out = CASES[name](MF, a)
    b.output("out", out)
    return b, a, out


def _feeds():
    return {k: np.asarray(v, np.float64 if np.asarray(v).dtype.kind == "f" else np.int32)
            for k, v in ARRAYS.items()}  # fmt: skip


@pytest.mark.parametrize("name", list(CASES))
def test_value_and_gradients_match_torch(name):
    b, a, out = _graph(name)
    ta = _torch_args(requires_grad=True)
    want = CASES[name](TF, ta)
    w = want.detach().numpy()
    assert out.shape == w.shape and (out.dtype is DType.i32) == (w.dtype.kind == "i")
    floats = [k for k in ARRAYS if np.asarray(ARRAYS[k]).dtype.kind == "f" and k not in WEIGHTS]
    if not out.dtype.is_floating:  # one_hot
        vals, _, _ = interpret(b.build_unverified(), _feeds())
        np.testing.assert_array_equal(vals[out.id], w)
        return
    r = np.random.default_rng(3).standard_normal(out.shape)
    b.output("loss", MF.sum(out * b.input("_r", out.shape)))
    g2, grads = differentiate(b.build_unverified(), "loss", floats)
    vals, _, _ = interpret(g2, {**_feeds(), "_r": r}, float64=True)
    np.testing.assert_allclose(vals[out.id], w, rtol=1e-10, atol=1e-12)
    (want * torch.from_numpy(r)).sum().backward()
    got = {g2.nodes[wid].name: vals[gid] for wid, gid in grads.items()}
    for k in floats:
        tg = ta[k].grad
        expect = np.zeros(np.shape(ARRAYS[k])) if tg is None else tg.numpy()
        mine = got.get(k, 0 * expect)
        # kl_div's target gradient at target 0: torch's xlogy gives NaN, ours the finite limit
        ok = np.isfinite(expect)
        assert np.isfinite(mine).all() and (ok.all() or name.startswith("kl")), k
        np.testing.assert_allclose(mine[ok], expect[ok], rtol=1e-9, atol=1e-11, err_msg=k)


def test_every_target_ignored_gives_zero_not_nan():
    b = GraphBuilder()
    x, t, w = b.input("x", (3, 4)), b.input("t", (3,), DType.i32), b.input("w", (4,))
    b.output("nll", MF.nll_loss(x, t, w))
    b.output("ce", MF.cross_entropy(x, t, w, label_smoothing=0.1))
    g = b.build()
    feeds = {"x": np.ones((3, 4)), "t": np.full(3, -100, np.int32), "w": np.ones(4)}
    vals, _, _ = interpret(g, feeds)
    assert all(vals[v] == 0.0 for _, v in g.outputs)


def test_argument_errors():
    b = GraphBuilder()
    x, t = b.input("x", (3, 4)), b.input("t", (4,), DType.i32)
    with pytest.raises(ValueError, match="shaped"):
        MF.nll_loss(x, t)
    with pytest.raises(ValueError, match="num_classes"):
        MF.one_hot(t)
    with pytest.raises(ValueError, match="reduction"):
        MF.kl_div(x, x, reduction="avg")
    with pytest.raises(ValueError, match="beta"):
        MF.smooth_l1_loss(x, x, beta=-1.0)


class _All(mn.nn.Module):
    def forward(self, **a):
        return {name: fn(MF, a) for name, fn in CASES.items()}


@pytest.mark.gpu
def test_every_case_on_the_gpu(gpu_device):
    ta = _torch_args(requires_grad=False)
    out = _All()(**{k: np.asarray(v) for k, v in ARRAYS.items()})
    for name, fn in CASES.items():
        want = fn(TF, ta).numpy()
        if want.dtype.kind == "i":
            np.testing.assert_array_equal(out[name], want, err_msg=name)
        else:
            np.testing.assert_allclose(out[name], want, rtol=2e-5, atol=2e-6, err_msg=name)

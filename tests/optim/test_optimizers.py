"""Optimizer steps computed by the NumPy interpreter over the training graph
(``build_training_graph``: forward, backward, clipping, update) against torch.optim in
float32 on the same small MLP with cross-entropy (no GPU).

Each step feeds ``optim.hyper = optimizer.hyper(step, lr)`` and carries parameters and
optimizer state from one interpretation to the next, as the runtime does on the GPU.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from meganeura.compile import CompileOptions, build_training_graph
from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.graph.ir import Graph
from meganeura.ops import functional as F
from meganeura.optim import HYPER_INPUT, SGD, Adam, AdamW, Optimizer

BATCH, SIZES = 6, (8, 16, 4)
MAX_STEPS = 3


def _mlp() -> Graph:
    b = GraphBuilder()
    x = b.input("x", (BATCH, SIZES[0]))
    y = b.input("y", (BATCH,), i32)
    w1 = b.parameter("fc1.weight", (SIZES[1], SIZES[0]))
    b1 = b.parameter("fc1.bias", (SIZES[1],))
    w2 = b.parameter("fc2.weight", (SIZES[2], SIZES[1]))
    b2 = b.parameter("fc2.bias", (SIZES[2],))
    logits = F.linear(F.relu(F.linear(x, w1, b1)), w2, b2)
    b.output("loss", F.cross_entropy(logits, y))
    return b.build()


def _init() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    out = {}
    for k in range(len(SIZES) - 1):
        n_in, n_out = SIZES[k], SIZES[k + 1]
        bound = 1 / np.sqrt(n_in)
        out[f"fc{k + 1}.weight"] = rng.uniform(-bound, bound, (n_out, n_in)).astype(np.float32)
        out[f"fc{k + 1}.bias"] = rng.uniform(-bound, bound, (n_out,)).astype(np.float32)
    return out


GRAPH = _mlp()
INIT = _init()
_rng = np.random.default_rng(1)
XS = _rng.standard_normal((MAX_STEPS, BATCH, SIZES[0])).astype(np.float32)
YS = _rng.integers(0, SIZES[-1], (MAX_STEPS, BATCH)).astype(np.int32)


def run_meganeura(opt: Optimizer, steps: int, max_grad_norm: float | None):
    g = build_training_graph(
        GRAPH, CompileOptions(loss="loss", optimizer=opt, max_grad_norm=max_grad_norm)
    )
    assert g.find(HYPER_INPUT).type.shape == (opt.hyper_size,)
    params, state, norms = dict(INIT), {}, []
    for step in range(steps):
        feed = {"x": XS[step], "y": YS[step], HYPER_INPUT: opt.hyper(step, opt.lr)}
        vals, params, state = interpret(g, feed, params, state)
        if max_grad_norm is not None:
            norms.append(float(vals[g.output_dict["grad_norm"]]))
    return params, state, norms


def run_torch(opt: Optimizer, steps: int, max_grad_norm: float | None):
    tp = {k: torch.nn.Parameter(torch.from_numpy(v.copy())) for k, v in INIT.items()}
    cfg = opt.config()  # the settings under PyTorch's names
    topt = getattr(torch.optim, cfg.pop("type"))(list(tp.values()), **cfg)
    norms = []
    for step in range(steps):
        x = torch.from_numpy(XS[step])
        h = torch.relu(torch.nn.functional.linear(x, tp["fc1.weight"], tp["fc1.bias"]))
        logits = torch.nn.functional.linear(h, tp["fc2.weight"], tp["fc2.bias"])
        loss = torch.nn.functional.cross_entropy(logits, torch.from_numpy(YS[step]).long())
        topt.zero_grad()
        loss.backward()
        if max_grad_norm is not None:
            norms.append(float(torch.nn.utils.clip_grad_norm_(tp.values(), max_grad_norm)))
        topt.step()
    params = {k: v.detach().numpy() for k, v in tp.items()}
    state = {
        f"{k}.{s}": t.numpy()
        for k, v in tp.items()
        for s, t in topt.state[v].items()
        if s != "step"
    }
    return params, state, norms


OPTIMIZERS = {
    "sgd": SGD(lr=0.1),
    "sgd_momentum": SGD(lr=0.1, momentum=0.9),
    "sgd_momentum_dampening": SGD(lr=0.1, momentum=0.9, dampening=0.3),
    "sgd_nesterov_weight_decay": SGD(lr=0.1, momentum=0.9, nesterov=True, weight_decay=0.05),
    "sgd_maximize": SGD(lr=0.1, momentum=0.5, maximize=True),
    "adam": Adam(lr=1e-2),
    "adam_weight_decay": Adam(lr=1e-2, weight_decay=0.1),
    "adamw": AdamW(lr=1e-2, weight_decay=0.1),
    "adam_betas_eps_maximize": Adam(lr=1e-2, betas=(0.8, 0.99), eps=1e-6, maximize=True),
}


@pytest.mark.parametrize("steps", [1, 3])
@pytest.mark.parametrize("max_grad_norm", [None, 0.25], ids=["noclip", "clip"])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_matches_torch(name, max_grad_norm, steps):
    opt = OPTIMIZERS[name]
    params, state, norms = run_meganeura(opt, steps, max_grad_norm)
    want_params, want_state, want_norms = run_torch(opt, steps, max_grad_norm)
    assert params.keys() == want_params.keys()
    for k, want in want_params.items():
        assert params[k].dtype == np.float32
        assert np.max(np.abs(want - INIT[k])) > 1e-4, f"{k} did not move"
        np.testing.assert_allclose(params[k], want, rtol=1e-6, atol=1e-7, err_msg=k)
    assert state.keys() == want_state.keys()
    for k, want in want_state.items():
        scale = np.max(np.abs(want))
        assert scale > 0, k
        assert np.max(np.abs(state[k] - want)) <= 1e-6 * scale, k
    if max_grad_norm is not None:
        assert want_norms[0] > max_grad_norm  # clipping is active
        np.testing.assert_allclose(norms, want_norms, rtol=1e-6)


def test_state_names_and_hyper_vectors():
    g = build_training_graph(GRAPH, CompileOptions(loss="loss", optimizer=Adam()))
    names = {n.name for n in g.leaves("state")}
    assert names == {f"{p}.{s}" for p in INIT for s in ("exp_avg", "exp_avg_sq")}
    assert not build_training_graph(GRAPH, CompileOptions(loss="loss", optimizer=SGD())).leaves(
        "state"
    )
    np.testing.assert_array_equal(SGD(lr=0.5).hyper(0, 0.5), np.array([0.5, 1.0], np.float32))
    np.testing.assert_array_equal(SGD(lr=0.5).hyper(4, 0.25), np.array([0.25, 0.0], np.float32))
    h = Adam(betas=(0.9, 0.999)).hyper(1, 0.01)  # t = 2
    np.testing.assert_allclose(h, [0.01, 0.01 / (1 - 0.9**2), np.sqrt(1 - 0.999**2)], rtol=1e-7)
    assert h.dtype == np.float32


def test_trainable_subset_updates_only_those():
    opt = SGD(lr=0.1)
    g = build_training_graph(
        GRAPH, CompileOptions(loss="loss", optimizer=opt, trainable=("fc2.weight",))
    )
    feed = {"x": XS[0], "y": YS[0], HYPER_INPUT: opt.hyper(0, opt.lr)}
    _, params, _ = interpret(g, feed, INIT)
    for k in INIT:
        changed = not np.array_equal(params[k], INIT[k])
        assert changed == (k == "fc2.weight"), k
    with pytest.raises(ValueError, match="fc3.weight"):
        build_training_graph(
            GRAPH, CompileOptions(loss="loss", optimizer=opt, trainable=("fc3.weight",))
        )


@pytest.mark.parametrize(
    "make",
    [
        lambda: SGD(lr=0.1, nesterov=True),
        lambda: SGD(lr=0.1, momentum=0.9, dampening=0.1, nesterov=True),
        lambda: SGD(lr=-0.1),
        lambda: SGD(lr=0.1, momentum=-0.9),
        lambda: SGD(lr=0.1, weight_decay=-1e-4),
        lambda: Adam(lr=-1e-3),
        lambda: AdamW(lr=-1e-3),
        lambda: Adam(betas=(1.0, 0.999)),
        lambda: Adam(betas=(0.9, -0.1)),
        lambda: Adam(eps=-1e-8),
    ],
    ids=[
        "nesterov_no_momentum",
        "nesterov_dampening",
        "sgd_negative_lr",
        "sgd_negative_momentum",
        "sgd_negative_weight_decay",
        "adam_negative_lr",
        "adamw_negative_lr",
        "adam_beta1_one",
        "adam_beta2_negative",
        "adam_negative_eps",
    ],
)
def test_invalid_settings_raise(make):
    with pytest.raises(ValueError):
        make()


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_negative_weight_decay_raises(cls):
    with pytest.raises(ValueError):
        torch.optim.Adam([torch.zeros(1, requires_grad=True)], weight_decay=-0.1)
    with pytest.raises(ValueError):
        cls(weight_decay=-0.1)


@pytest.mark.parametrize("max_grad_norm", [0.0, -1.0])
def test_max_grad_norm_must_be_positive(max_grad_norm):
    opts = CompileOptions(loss="loss", optimizer=SGD(), max_grad_norm=max_grad_norm)
    with pytest.raises(ValueError, match="max_grad_norm"):
        build_training_graph(GRAPH, opts)


def test_training_needs_loss_and_optimizer():
    with pytest.raises(ValueError):
        build_training_graph(GRAPH, CompileOptions(loss="loss"))
    with pytest.raises(ValueError):
        build_training_graph(GRAPH, CompileOptions(optimizer=SGD()))

"""The fast mode (``CompileOptions(precision="fast")``: f16 storage, f32 accumulation) on the
three model families, against strict f32 on the same weights and data.

Forward: the logits of a forward-only fast program (activations and parameters stored f16)
against the strict program's, relative error ``max|fast - strict| / max|strict|`` <= 1e-2.
Gradients: one SGD step with lr = 1 from the same parameters in a fast and a strict training
program; ``before - after`` is each parameter's gradient (parameters stay f32 master weights in
training, so the difference is exact to f32 rounding); every gradient's cosine similarity
with strict's must be >= 0.99. Also: the fallback to strict without ``shader-f16``, a
state_dict round trip through f16 parameter storage, and fast training lowering the loss.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest

from meganeura import manual_seed
from meganeura.codegen.kernel import Limits
from meganeura.compile import CompileOptions, PrecisionFallbackWarning, compile
from meganeura.models.convnet import build_convnet
from meganeura.models.mlp import build_mlp
from meganeura.models.transformer import TransformerConfig, build_transformer
from meganeura.optim import SGD, AdamW
from meganeura.runtime.slots import InputError
from meganeura.training import Trainer, compile_for

FWD_RTOL, GRAD_COS = 1e-2, 0.99


def _need_f16(device) -> None:
    if "shader-f16" not in device.features:
        pytest.skip("the adapter lacks shader-f16: fast mode compiles strict here")


def _logits(graph, params, feeds, precision, device) -> np.ndarray:
    program, session = compile_for(graph, CompileOptions(precision=precision), device)
    assert program.meta["precision"] == precision
    with session:
        session.load_state_dict(params, strict=False)  # running stats keep their init
        return session.run(feeds, ["logits"])["logits"]


def _grads(graph, params, feeds, precision, device) -> tuple[dict, float]:
    """(gradient of every parameter, loss) from one SGD step with lr = 1."""
    tr = Trainer(graph, SGD(lr=1.0), device=device, precision=precision)
    assert tr.program.meta["precision"] == precision
    tr.load_parameters(params)
    loss = float(tr.step(feeds)["loss"])
    after = tr.parameters()
    tr.session.close()
    return {k: params[k].astype(np.float64) - after[k] for k in after}, loss


def _rel(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a - b).max() / np.abs(b).max())


def _cos(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1).astype(np.float64), b.reshape(-1).astype(np.float64)
    return float(a @ b / (np.linalg.norm(a) * np.linalg.norm(b)))


def _compare(build, params, fwd_feeds, train_feeds, device) -> None:
    """Assert the forward and gradient bounds; print the figures (pytest -s shows them)."""
    strict = _logits(build(False), params, fwd_feeds, "strict", device)
    fast = _logits(build(False), params, fwd_feeds, "fast", device)
    err = _rel(fast, strict)
    assert 0 < err <= FWD_RTOL, err  # 0 would mean nothing was stored as f16
    g_strict, loss_strict = _grads(build(True), params, train_feeds, "strict", device)
    g_fast, loss_fast = _grads(build(True), params, train_feeds, "fast", device)
    assert abs(loss_fast - loss_strict) <= FWD_RTOL * abs(loss_strict)
    cos = {k: _cos(g_fast[k], g_strict[k]) for k in g_strict if np.any(g_strict[k])}
    print(
        f"fwd rel {err:.2e}, loss {loss_fast:.6f} vs {loss_strict:.6f}, "
        f"min cos {min(cos.values()):.6f}"
    )
    assert len(cos) >= 2 and min(cos.values()) >= GRAD_COS, sorted(
        cos.items(), key=lambda kv: kv[1]
    )[:3]


@pytest.mark.gpu
def test_mlp_fast_matches_strict(gpu_device):
    _need_f16(gpu_device)
    rng = np.random.default_rng(0)
    manual_seed(0)
    params = build_mlp(64).state_dict()
    x = rng.standard_normal((64, 784)).astype(np.float32)
    y = rng.integers(0, 10, 64).astype(np.int32)
    _compare(
        lambda labels: build_mlp(64, labels=labels).graph,
        params,
        {"x": x},
        {"x": x, "y": y},
        gpu_device,
    )


@pytest.mark.gpu
def test_transformer_fast_matches_strict(gpu_device):
    _need_f16(gpu_device)
    cfg = TransformerConfig()
    rng = np.random.default_rng(1)
    manual_seed(1)
    params = build_transformer(2, 32, cfg).state_dict()
    ids = rng.integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
    labels = rng.integers(0, cfg.vocab_size, (2, 32)).astype(np.int32)
    _compare(
        lambda lab: build_transformer(2, 32, cfg, labels=lab).graph,
        params,
        {"input_ids": ids},
        {"input_ids": ids, "labels": labels},
        gpu_device,
    )


@pytest.mark.gpu
def test_convnet_fast_matches_strict(gpu_device):
    _need_f16(gpu_device)
    rng = np.random.default_rng(2)
    manual_seed(2)
    params = build_convnet(16).state_dict()
    x = rng.standard_normal((16, 1, 28, 28)).astype(np.float32)
    y = rng.integers(0, 10, 16).astype(np.int32)
    # training-mode BatchNorm in both programs: batch statistics, as the gradients use
    _compare(
        lambda labels: build_convnet(16, labels=labels).graph,
        params,
        {"x": x},
        {"x": x, "y": y},
        gpu_device,
    )


def test_fast_without_shader_f16_compiles_strict():
    graph = build_mlp(8, (16, 8, 4)).graph
    with pytest.warns(PrecisionFallbackWarning):
        p = compile(graph, CompileOptions(precision="fast"), Limits(shader_f16=False))
    assert p.meta["precision"] == "strict" and p.meta["precision_requested"] == "fast"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        strict = compile(graph, CompileOptions(), Limits(shader_f16=False))
    assert [d.wgsl for d in p.dispatches] == [d.wgsl for d in strict.dispatches]
    assert not any("f16" in d.wgsl for d in p.dispatches)


def test_fast_program_binds_f16_and_keeps_master_weights():
    graph = build_mlp(8, (16, 8, 4)).graph
    limits = Limits(shader_f16=True)
    infer = compile(graph, CompileOptions(precision="fast"), limits)
    assert infer.meta["precision"] == "fast"
    assert all(s.dtype.name == "f16" and s.host.name == "f32" for s in infer.parameters.values())
    assert infer.inputs["x"].dtype.name == "f32" and infer.outputs["logits"].dtype.name == "f32"
    assert any("enable f16;" in d.wgsl and "array<f16>" in d.wgsl for d in infer.dispatches)
    train = compile(graph, CompileOptions(loss="loss", optimizer=AdamW(), precision="fast"), limits)
    assert all(s.dtype.name == "f32" for s in (*train.parameters.values(), *train.state.values()))
    assert any("array<f16>" in d.wgsl for d in train.dispatches)
    # every optimizer update reads f32 only (master weights, f32 gradients)
    assert all("f16" not in d.wgsl for d in train.dispatches if "update" in d.name)


@pytest.mark.gpu
def test_fast_state_dict_round_trip(gpu_device):
    _need_f16(gpu_device)
    manual_seed(3)
    net = build_mlp(4, (16, 8, 4), labels=False)
    params = net.state_dict()
    params["fc1.bias"][:3] = [0.1, 1e-4, 3.0]  # 0.1 and 1e-4 are not f16 numbers
    program, session = compile_for(net.graph, CompileOptions(precision="fast"), gpu_device)
    with session:
        session.load_state_dict(params)
        state = session.state_dict()
        assert set(state) == set(params)
        for k, v in params.items():
            assert state[k].dtype == np.float32
            np.testing.assert_array_equal(state[k], v.astype(np.float16).astype(np.float32))
        assert state["fc1.bias"][0] != np.float32(0.1)  # really stored as f16
        session.load_state_dict(state)  # f16-exact values survive a second trip unchanged
        assert all(np.array_equal(session.read(k), state[k]) for k in state)
        too_big = dict(params, **{"fc2.bias": np.full(4, 1e5, np.float32)})
        with pytest.raises(InputError, match="exceeds"):
            session.load_state_dict(too_big)
        with pytest.raises(InputError, match="dtype"):
            session.load_state_dict({k: v.astype(np.float16) for k, v in params.items()})


@pytest.mark.gpu
def test_fast_training_lowers_the_loss(gpu_device):
    _need_f16(gpu_device)
    rng = np.random.default_rng(4)
    manual_seed(4)
    net = build_mlp(64, (32, 64, 4))
    w = rng.standard_normal((32, 4))
    x = rng.standard_normal((64, 32)).astype(np.float32)
    y = (x @ w).argmax(1).astype(np.int32)  # a learnable labelling
    tr = Trainer(net.graph, AdamW(lr=1e-2), device=gpu_device, precision="fast")
    assert tr.program.meta["precision"] == "fast"
    tr.load_parameters(net.state_dict())
    losses = [float(tr.step({"x": x, "y": y})["loss"]) for _ in range(30)]
    assert np.isfinite(losses).all()
    assert losses[-1] < 0.5 * losses[0], losses

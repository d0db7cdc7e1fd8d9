"""The main job end to end on the embedded MNIST subset (GPU; lavapipe on CI)."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura import manual_seed
from meganeura.cli import main
from meganeura.data.mnist import load_mnist, standardize
from meganeura.io.checkpoint import CheckpointError, load_checkpoint
from meganeura.models.mlp import build_mlp
from meganeura.optim import AdamW
from meganeura.recipes.mnist import MnistConfig, _meta, init_model, loss_fn, predict, train
from meganeura.training import Trainer

pytestmark = pytest.mark.gpu


def test_one_epoch_learns_and_predict_reloads(gpu_device, tmp_path):
    cfg = MnistConfig(epochs=1, out=str(tmp_path))
    s = train(cfg, device=gpu_device, progress=False)
    assert s["steps"] == 4000 // 64
    assert s["test_accuracy"] >= 0.80, s["test_accuracy"]  # torch, same recipe: ~0.86
    assert s["losses"][0][1] > 2.0 and s["final_loss"] < 1.0
    assert [step for step, _ in s["losses"]] == list(range(0, 62, 10))  # every 10th step
    mem = s["memory"]
    assert 0 < mem["planned_bytes"] < mem["naive_bytes"]
    r = predict(s["checkpoint"], device=gpu_device)
    assert r["n"] == 1000 and r["test_accuracy"] == pytest.approx(s["test_accuracy"])
    assert (tmp_path / "loss.png").stat().st_size > 1000


def test_resume_continues_bit_identically(gpu_device, tmp_path):
    full = train(MnistConfig(epochs=2, out=str(tmp_path / "a")), device=gpu_device, progress=False)
    train(MnistConfig(epochs=1, out=str(tmp_path / "b")), device=gpu_device, progress=False)
    resumed = train(
        MnistConfig(epochs=2, out=str(tmp_path / "b")),
        resume=str(tmp_path / "b" / "checkpoint.safetensors"),
        device=gpu_device,
        progress=False,
    )
    assert resumed["losses"] == full["losses"]
    a, _ = load_checkpoint(full["checkpoint"])
    b, _ = load_checkpoint(resumed["checkpoint"])
    assert a.keys() == b.keys()
    for k in a:
        assert np.array_equal(a[k], b[k]), k


def test_cli_train_and_predict(gpu_device, tmp_path, capsys):
    assert main(["train", "mnist", "--epochs", "1", "--out", str(tmp_path), "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "test accuracy:" in out and "planned" in out
    ckpt = str(tmp_path / "checkpoint.safetensors")
    assert main(["predict", "--checkpoint", ckpt, "--count", "5"]) == 0
    out = capsys.readouterr().out
    acc = float(out.split("test accuracy:")[1].split("%")[0])
    assert acc >= 80.0


BAD_META = {
    "epoch_string": {"epoch": "1"},
    "epoch_negative": {"epoch": -1},
    "epoch_missing": {"epoch": None},
    "data_rng_garbage": {"data_rng": {"bit_generator": "PCG64", "state": 3}},
    # NumPy itself accepts a float uinteger (issue 11, item 6)
    "data_rng_float": {
        "data_rng": {**np.random.default_rng(1).bit_generator.state, "uinteger": 2.5}
    },
    "losses_string": {"losses": [[0, "2.3"]]},
    "other_hidden": {"sizes": [784, 64, 10]},
}


@pytest.mark.parametrize("case", list(BAD_META))
def test_resume_checks_the_recipe_metadata_before_loading(tmp_path, case):
    cfg = MnistConfig(epochs=2, out=str(tmp_path))
    trainer = Trainer(init_model(cfg), AdamW(lr=cfg.lr), loss_fn)
    meta = _meta(cfg, 1, np.random.default_rng(1), [], 0.1, 0.3)
    ckpt = tmp_path / "bad.safetensors"
    trainer.save(ckpt, {**meta, **BAD_META[case]})
    with pytest.raises(CheckpointError, match="sizes|epoch|data_rng|losses"):
        train(cfg, resume=str(ckpt), progress=False)


def test_predict_reads_a_graph_trainer_checkpoint(gpu_device, tmp_path):
    """A checkpoint of the graph trainer (written before the recipe used modules: the same
    parameter names, optimizer state under other keys) still classifies."""
    cfg = MnistConfig(hidden=16, out=str(tmp_path))
    data = load_mnist(seed=cfg.seed)
    x, mean, std = standardize(data.x_train)
    manual_seed(0)
    net = build_mlp(64, cfg.sizes)
    tr = Trainer(net.graph, AdamW(lr=1e-2), device=gpu_device)
    tr.load_parameters(net.state_dict())
    for i in range(0, 640, 64):
        tr.step({"x": x[i : i + 64], "y": data.y_train[i : i + 64]})
    ckpt = tmp_path / "graph.safetensors"
    tr.save(ckpt, _meta(cfg, 1, np.random.default_rng(1), [], mean, std))
    r = predict(str(ckpt), device=gpu_device)
    p = {k: v.astype(np.float64) for k, v in tr.parameters().items()}
    x_test, _, _ = standardize(data.x_test, mean, std)
    h = np.maximum(x_test @ p["fc1.weight"].T + p["fc1.bias"], 0)
    ref = (h @ p["fc2.weight"].T + p["fc2.bias"]).argmax(1)
    assert r["test_accuracy"] == pytest.approx(float((ref == data.y_test).mean()), abs=2e-3)
    assert r["test_accuracy"] > 0.5  # ten steps of AdamW at lr 1e-2 learn something

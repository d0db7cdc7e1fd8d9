"""The main job end to end on the embedded MNIST subset (GPU; lavapipe on CI)."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.cli import main
from meganeura.io.checkpoint import load_checkpoint
from meganeura.recipes.mnist import MnistConfig, predict, train

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

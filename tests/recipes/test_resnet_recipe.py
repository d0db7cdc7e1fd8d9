"""``meganeura train resnet`` on a tiny synthetic ImageFolder, then ``meganeura classify`` with
its checkpoint and with a bare state dict, and a resumed run equal to an uninterrupted one (GPU;
lavapipe on CI); the image preprocessing and the embedded digits on the host."""

from __future__ import annotations

import numpy as np
import pytest
from safetensors.numpy import save_file

from meganeura.cli import main
from meganeura.data.images import IMAGENET_MEAN, IMAGENET_STD, load_digits, preprocess
from meganeura.io.checkpoint import CheckpointError, load_checkpoint
from meganeura.models.resnet import resnet
from meganeura.recipes.resnet import ResNetTrainConfig, infer_config, train

PIL = pytest.importorskip("PIL.Image")

COLORS = {"blue": (30, 40, 200), "red": (210, 30, 20)}


def _image_folder(root, per_class: int = 4):
    rng = np.random.default_rng(0)
    for name, color in COLORS.items():
        (root / name).mkdir(parents=True)
        for i in range(per_class):
            noise = rng.normal(0, 25, (36, 44, 3))
            a = np.clip(np.array(color)[None, None] + noise, 0, 255).astype(np.uint8)
            PIL.fromarray(a).save(root / name / f"{i}.png")
        (root / name / "notes.txt").write_text("not an image")  # skipped by suffix
    return root


def _classify_lines(out: str) -> list[tuple[float, str]]:
    rows = [ln.split() for ln in out.splitlines() if ln.startswith("  ")]
    return [(float(r[0].rstrip("%")), r[1]) for r in rows]


@pytest.mark.gpu
def test_cli_train_resnet_then_classify(gpu_device, tmp_path, capsys):
    data = _image_folder(tmp_path / "images")
    out = tmp_path / "run"
    args = ["train", "resnet", "--data", str(data), "--width", "8", "--image-size", "64"]
    args += ["--epochs", "1", "--batch-size", "4", "--log-every", "1", "--out", str(out)]
    assert main([*args, "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "data: 7 training / 1 held-out images, 2 classes" in printed
    assert "steps: 1 " in printed  # 7 images, batches of 4, the remainder dropped
    ckpt = out / "checkpoint.safetensors"
    tensors, meta = load_checkpoint(ckpt)
    assert meta["classes"] == ["blue", "red"] and meta["arch"] == "resnet18"
    assert meta["preprocess"]["crop"] == 64 and len(meta["accuracy"]) == 1
    assert tensors["fc.weight"].shape == (2, 512 // 8)
    try:
        import matplotlib  # noqa: F401

        assert (out / "loss.png").stat().st_size > 1000
        assert (out / "accuracy.png").stat().st_size > 1000
    except ImportError:
        pass

    image = str(data / "red" / "0.png")
    assert main(["classify", image, "--checkpoint", str(ckpt)]) == 0
    printed = capsys.readouterr().out
    rows = _classify_lines(printed)
    assert printed.startswith(f"{image}:")
    assert sorted(name for _, name in rows) == ["blue", "red"]  # top-5 of 2 classes: both
    assert sum(p for p, _ in rows) == pytest.approx(100.0, abs=0.02)
    assert rows[0][0] >= rows[1][0]

    # a bare state dict (no recipe metadata): arch from the shapes, names from --labels,
    # torchvision's ImageNet preprocessing (224 crop)
    bare = tmp_path / "bare.safetensors"
    save_file({k: v for k, v in tensors.items() if not k.startswith("optimizer/")}, bare)
    labels = tmp_path / "labels.txt"
    labels.write_text("azure\ncrimson\n")
    args = ["classify", image, "--checkpoint", str(bare), "--labels", str(labels)]
    assert main([*args, "--top-k", "1"]) == 0
    rows = _classify_lines(capsys.readouterr().out)
    assert len(rows) == 1 and rows[0][1] in ("azure", "crimson")
    missing = str(tmp_path / "missing.png")
    assert main(["classify", missing, "--checkpoint", str(ckpt)]) == 2
    assert capsys.readouterr().err == f"meganeura classify: no image file {missing!r}\n"


@pytest.mark.gpu
def test_resume_continues_bit_identically(gpu_device, tmp_path):
    data = str(_image_folder(tmp_path / "images"))

    def run(out, epochs, resume=None):
        cfg = ResNetTrainConfig(
            width=8, image_size=64, epochs=epochs, batch_size=4, log_every=1, data=data, out=out
        )
        return train(cfg, resume=resume, device=gpu_device, progress=False)

    full = run(str(tmp_path / "a"), 2)
    run(str(tmp_path / "b"), 1)
    with pytest.raises(CheckpointError, match="pass the --arch, --width and --data"):
        train(
            ResNetTrainConfig(width=16, epochs=2, data=data, out=str(tmp_path / "c")),
            resume=str(tmp_path / "b" / "checkpoint.safetensors"),
            device=gpu_device,
            progress=False,
        )
    resumed = run(str(tmp_path / "b"), 2, str(tmp_path / "b" / "checkpoint.safetensors"))
    assert resumed["steps"] == full["steps"] == 2
    assert resumed["losses"] == full["losses"] and resumed["accuracy"] == full["accuracy"]
    a, _ = load_checkpoint(full["checkpoint"])
    b, _ = load_checkpoint(resumed["checkpoint"])
    assert a.keys() == b.keys()
    for k in a:
        np.testing.assert_array_equal(a[k], b[k], err_msg=k)


def test_preprocess_is_torchvisions_eval_transform():
    # Resize(256) keeps the aspect ratio (shorter side 256), CenterCrop(224), ToTensor,
    # Normalize: a constant image gives (c / 255 - mean) / std in every pixel.
    img = PIL.fromarray(np.full((50, 100, 3), (10, 128, 250), np.uint8))
    x = preprocess(img)
    assert x.shape == (3, 224, 224) and x.dtype == np.float32
    want = (np.array([10, 128, 250]) / 255 - np.array(IMAGENET_MEAN)) / np.array(IMAGENET_STD)
    np.testing.assert_allclose(x[:, 100, 100], want, rtol=1e-6)
    # the crop is centered: a left half black, right half white image 512 wide -> the crop
    # of the 256-high resize (512 wide) spans columns 144..367, its middle at the edge
    a = np.zeros((256, 512, 3), np.uint8)
    a[:, 256:] = 255
    x = preprocess(PIL.fromarray(a))
    assert x[0, 0, 111] < 0 < x[0, 0, 112]
    with pytest.raises(ValueError, match="need 1 <= crop <= resize"):
        preprocess(img, 32, 64)


def test_digits_and_infer_config():
    train, test = load_digits(32)
    assert train.x.shape == (4000, 3, 32, 32) and test.x.shape == (1000, 3, 32, 32)
    assert train.classes == tuple("0123456789") and set(np.unique(train.y)) == set(range(10))
    np.testing.assert_array_equal(train.x[:, 0, :2], train.x[:, 0, :2].min())  # zero padding
    state = resnet("resnet18", num_classes=7, width=4).state_dict()
    assert infer_config(state) == ("resnet18", 4, 7)

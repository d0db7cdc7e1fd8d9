"""User errors of the commands: one line on stderr naming the input, what was expected and what
was found, exit status 2, no traceback, and no model loaded or program compiled first (host
only: every check here runs before the device is touched)."""

from __future__ import annotations

import wave
from types import SimpleNamespace

import numpy as np
import pytest

from meganeura import cli
from meganeura.cli import main
from meganeura.recipes.resnet import ResNetTrainConfig, check_config, load_data

PIL = pytest.importorskip("PIL.Image")


class _NoDevice:
    """Stands in for the adapter: the checks under test fail before it is used."""

    name = "no device"
    pipelines = SimpleNamespace(compiled=0, hits=0, shader_seconds=0.0, pipeline_seconds=0.0)


def _err(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.count("\n") == 1, err
    return err.strip()


def _wav(path, frames: int) -> str:
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes(np.zeros(frames, "<i2").tobytes())
    return str(path)


def test_transcribe_rejects_an_empty_wav_before_loading_the_model(tmp_path, capsys):
    empty = _wav(tmp_path / "empty.wav", 0)
    assert main(["transcribe", empty, "--model", str(tmp_path / "no-model")]) == 2
    assert _err(capsys) == (
        f"meganeura transcribe: {empty}: the WAV file holds no audio samples (0 frames)"
    )


@pytest.mark.parametrize(
    ("name", "found"),
    [
        ("folder", "is a folder, expected a WAV file"),
        ("missing.wav", "does not exist"),
        ("text.wav", "is not a WAV file: it starts with b'hello'"),
    ],
    ids=["folder", "missing", "not_wav"],
)
def test_transcribe_names_an_unreadable_file(tmp_path, capsys, name, found):
    (tmp_path / "folder").mkdir()
    (tmp_path / "text.wav").write_text("hello")
    path = str(tmp_path / name)
    assert main(["transcribe", path]) == 2
    err = _err(capsys)
    assert err.startswith(f"meganeura transcribe: cannot read {path}: ") and found in err


def test_transcribe_rejects_max_new_tokens_below_one(tmp_path, capsys):
    speech = _wav(tmp_path / "a.wav", 160)
    assert main(["transcribe", speech, "--max-new-tokens", "0"]) == 2
    assert _err(capsys) == "meganeura transcribe: --max-new-tokens must be >= 1, got 0"


def test_embed_errors_exit_2(tmp_path, capsys):
    assert main(["embed", "--batch-size", "0", "a"]) == 2
    assert _err(capsys) == "meganeura embed: --batch-size must be >= 1, got 0"
    assert main(["embed"]) == 2
    assert _err(capsys) == "meganeura embed: give one or more texts, or --file with one per line"
    blank = tmp_path / "blank.txt"
    blank.write_text("\n  \n")
    assert main(["embed", "--file", str(blank)]) == 2
    assert _err(capsys).endswith(f"(--file {blank} has no non-blank line)")
    assert main(["embed", "--similarity", "a"]) == 2
    assert _err(capsys) == "meganeura embed: --similarity needs two or more texts, got 1"
    missing = tmp_path / "missing.txt"
    assert main(["embed", "--file", str(missing)]) == 2
    assert _err(capsys) == f"meganeura embed: --file {missing}: no such file"
    assert main(["embed", "--file", str(tmp_path)]) == 2
    assert _err(capsys) == (
        f"meganeura embed: --file {tmp_path}: is a folder, expected a UTF-8 text file"
    )
    latin1 = tmp_path / "latin1.txt"
    latin1.write_bytes("caf\xe9\n".encode("latin-1"))
    assert main(["embed", "--file", str(latin1)]) == 2
    assert _err(capsys) == (
        f"meganeura embed: --file {latin1}: not UTF-8 text (byte 0xe9 at offset 3)"
    )


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("arch", "34", "--arch: unknown architecture '34'"),
        ("width", 0, "--width must be >= 1, got 0"),
        ("image_size", 0, "--image-size must be >= 1, got 0"),
        ("epochs", 0, "--epochs must be >= 1, got 0"),
        ("batch_size", -1, "--batch-size must be >= 1, got -1"),
        ("lr", 0.0, "--lr must be > 0, got 0.0"),
    ],
    ids=["arch", "width", "image_size", "epochs", "batch_size", "lr"],
)
def test_resnet_check_config(field, value, message):
    with pytest.raises(ValueError, match=message):
        check_config(ResNetTrainConfig(**{field: value}))


def test_resnet_data_needs_two_classes(tmp_path):
    (tmp_path / "cat").mkdir()
    PIL.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / "cat" / "0.png")
    with pytest.raises(ValueError, match=r"two or more class subfolders, found 1 \(cat\)"):
        load_data(ResNetTrainConfig(data=str(tmp_path), image_size=8))


@pytest.mark.parametrize("case", ["empty", "missing", "junk"])
def test_train_resnet_bad_data_exits_2(tmp_path, capsys, monkeypatch, case):
    monkeypatch.setattr(cli, "_device", lambda args: _NoDevice())
    data = tmp_path / "data"
    if case != "missing":
        data.mkdir()
    if case == "junk":
        (data / "a").mkdir()
        (data / "a" / "x.jpg").write_text("not a jpeg")
    argv = ["train", "resnet", "--data", str(data), "--out", str(tmp_path / "run")]
    assert main([*argv, "--no-progress"]) == 2
    capsys.readouterr()  # the "device:" line
    assert main([*argv, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("meganeura train resnet: ")
    want = {
        "empty": f"{data}: no images in class subfolders",
        "missing": f"no image folder {str(data)!r}",
        "junk": f"{data / 'a' / 'x.jpg'}: not an image file Pillow can read",
    }[case]
    assert want in err


def test_read_image_names_a_truncated_file(tmp_path):
    from meganeura.data.images import read_image

    good = tmp_path / "good.png"
    pixels = np.random.default_rng(0).integers(0, 256, (64, 64), np.uint8)
    PIL.fromarray(pixels).save(good)  # grayscale: read as RGB
    assert read_image(good).mode == "RGB"
    bad = tmp_path / "bad.png"
    bad.write_bytes(good.read_bytes()[:2000])  # the header whole, the pixel data cut
    with pytest.raises(ValueError, match=f"{bad}: a corrupt or truncated image"):
        read_image(bad)


@pytest.mark.parametrize("case", ["resnet", "bare", "missing"])
def test_predict_rejects_a_checkpoint_not_of_train_mnist(tmp_path, capsys, monkeypatch, case):
    from safetensors.numpy import save_file

    from meganeura.io.checkpoint import save_checkpoint

    monkeypatch.setattr(cli, "_device", lambda args: _NoDevice())
    ckpt = tmp_path / "ckpt.safetensors"
    tensors = {"fc.weight": np.zeros((2, 4), np.float32)}
    if case == "resnet":
        save_checkpoint(ckpt, tensors, {"model": "resnet", "arch": "resnet18"})
    elif case == "bare":
        save_file(tensors, ckpt)
    assert main(["predict", "--checkpoint", str(ckpt)]) == 2
    err = _err(capsys)
    want = {
        "resnet": f"{ckpt}: not a checkpoint of train mnist (no 'sizes' in its metadata; "
        "it holds a 'resnet' model)",
        "bare": f"{ckpt}: no 'meganeura' metadata",
        "missing": f"checkpoint {ckpt} does not exist",
    }[case]
    assert err.startswith("meganeura predict: ") and want in err


def test_train_resnet_checks_resume_before_compiling(tmp_path):
    from meganeura.io.checkpoint import CheckpointError, save_checkpoint
    from meganeura.recipes.resnet import train

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        PIL.fromarray(np.zeros((8, 8, 3), np.uint8)).save(tmp_path / name / "0.png")
    ckpt = tmp_path / "mnist.safetensors"
    save_checkpoint(ckpt, {"fc1.weight": np.zeros((2, 2), np.float32)}, {"model": "mlp"})
    cfg = ResNetTrainConfig(data=str(tmp_path), image_size=8, out=str(tmp_path / "run"))
    with pytest.raises(CheckpointError, match="pass the --arch, --width and --data"):
        train(cfg, resume=str(ckpt), device=_NoDevice(), progress=False)


@pytest.mark.parametrize(
    ("flag", "value", "message"),
    [
        ("--batch-size", "0", "--batch-size must be >= 1, got 0"),  # was a ZeroDivisionError
        ("--epochs", "0", "--epochs must be >= 1, got 0"),  # was the untrained accuracy
        ("--data", "MISSING", "MNIST file not found"),
    ],
    ids=["batch_size_0", "epochs_0", "data_missing"],
)
def test_train_mnist_bad_settings_exit_2(tmp_path, capsys, monkeypatch, flag, value, message):
    monkeypatch.setattr(cli, "_device", lambda args: _NoDevice())
    value = value.replace("MISSING", str(tmp_path))
    argv = ["train", "mnist", flag, value, "--out", str(tmp_path / "run"), "--no-progress"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and err.startswith("meganeura train mnist: ")
    assert message in err


def test_unknown_adapter_exits_2(capsys):
    assert main(["--adapter", "no-such-adapter-0x5eed", "info"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.startswith("meganeura info: no ")  # no adapter matches ... (or none at all)


def test_embed_warns_of_a_truncated_text():
    from meganeura.recipes.embed import truncation_notes

    tokenizer = SimpleNamespace(encode=lambda text, add_special_tokens: [0] * (len(text) + 2))
    encoder = SimpleNamespace(max_seq_length=8, tokenizer=tokenizer)
    assert truncation_notes(encoder, ["abcdef", "abcdefg", "x"]) == [
        "warning: text [1] has 9 tokens; only its first 8 (max_seq_length, [CLS] and [SEP] "
        "included) are embedded"
    ]


def test_out_must_be_a_folder(tmp_path):
    from meganeura.recipes.mnist import MnistConfig
    from meganeura.recipes.mnist import check_config as check_mnist

    out = tmp_path / "file"
    out.write_text("")
    for check, cfg in ((check_config, ResNetTrainConfig), (check_mnist, MnistConfig)):
        with pytest.raises(ValueError, match=f"--out {out}: is a file, expected a folder"):
            check(cfg(out=str(out)))
        check(cfg(out=str(tmp_path / "new")))

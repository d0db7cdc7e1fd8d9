"""Checkpoint round trips, error reporting and atomic saves (no GPU)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy
from hypothesis import given, settings
from hypothesis import strategies as st

from meganeura.io import checkpoint
from meganeura.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint


def _state() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(3)
    return {
        "fc1.weight": rng.standard_normal((16, 8)).astype(np.float32),
        "fc1.bias": rng.standard_normal(16).astype(np.float32),
        "adam.step": np.array(7, dtype=np.int64),
        "mask": np.array([True, False, True]),
        "half": np.arange(5, dtype=np.float16),
    }


def _expected(tensors: dict[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], np.dtype]]:
    return {name: (value.shape, value.dtype) for name, value in tensors.items()}


def _rng_used(seed: int) -> np.random.Generator:
    rng = np.random.default_rng(seed)
    rng.standard_normal(17)  # advance, so the state is not a fresh seed's
    return rng


def test_round_trip_tensors_and_metadata(tmp_path):
    tensors = _state()
    rng = _rng_used(2024)
    metadata = {
        "step": 1234,
        "epoch": 3,
        "loss": 0.125,
        "config": {"lr": 0.01, "schedule": "cosine", "layers": [784, 128, 10]},
        "rng": rng.bit_generator.state,
        "note": "unicode ✓",
        "nothing": None,
    }
    # The PCG64 state holds 128-bit integers, beyond float64 and int64: JSON must keep them exact.
    assert metadata["rng"]["state"]["state"] > 2**64
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tensors, metadata)

    loaded, meta = load_checkpoint(path, expected=_expected(tensors))
    assert loaded.keys() == tensors.keys()
    for name, value in tensors.items():
        assert loaded[name].dtype == value.dtype and loaded[name].shape == value.shape
        np.testing.assert_array_equal(loaded[name], value)
        assert loaded[name].flags.writeable
    assert meta == metadata

    restored = np.random.default_rng()
    restored.bit_generator.state = meta["rng"]
    np.testing.assert_array_equal(restored.random(8), rng.random(8))


def test_plain_safetensors_readers_see_the_tensors(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"w": np.eye(3, dtype=np.float32)}, {"step": 1})
    np.testing.assert_array_equal(safetensors.numpy.load_file(path)["w"], np.eye(3))


def test_non_contiguous_tensor_is_saved_by_value(tmp_path):
    base = np.arange(12, dtype=np.float32).reshape(3, 4)
    path = tmp_path / "c.safetensors"
    save_checkpoint(path, {"t": base.T}, {})
    np.testing.assert_array_equal(load_checkpoint(path)[0]["t"], base.T)


@settings(max_examples=25, deadline=None)
@given(
    metadata=st.dictionaries(
        st.text(max_size=8),
        st.recursive(
            st.none()
            | st.booleans()
            | st.integers(min_value=-(2**130), max_value=2**130)
            | st.floats(allow_nan=False)
            | st.text(max_size=10),
            lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(), inner),
            max_leaves=10,
        ),
        max_size=5,
    )
)
def test_any_json_metadata_round_trips(tmp_path_factory, metadata):
    path = tmp_path_factory.mktemp("prop") / "m.safetensors"
    save_checkpoint(path, {"x": np.zeros(1, np.float32)}, metadata)
    assert load_checkpoint(path)[1] == metadata


def test_unserializable_metadata_fails_before_writing(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    with pytest.raises(TypeError, match="JSON"):
        save_checkpoint(path, {"x": np.zeros(1)}, {"loss": np.float32(1.0)})
    assert not path.exists() and os.listdir(tmp_path) == []


# --- errors ---------------------------------------------------------------------------------


def test_missing_file(tmp_path):
    path = tmp_path / "nope.safetensors"
    with pytest.raises(CheckpointError, match=r"nope\.safetensors does not exist"):
        load_checkpoint(path)


def test_missing_and_unknown_keys_are_listed(tmp_path):
    tensors = _state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tensors, {"step": 0})
    expected = _expected(tensors)
    del expected["mask"]
    expected["fc2.weight"] = ((10, 16), np.dtype(np.float32))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, expected=expected)
    message = str(info.value)
    assert str(path) in message
    assert "missing keys ['fc2.weight']" in message
    assert "unknown keys ['mask']" in message


def test_shape_and_dtype_mismatch_name_the_key(tmp_path):
    tensors = _state()
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, tensors, {"step": 0})
    expected = _expected(tensors)
    expected["fc1.weight"] = ((8, 16), np.dtype(np.float32))
    expected["fc1.bias"] = ((16,), np.dtype(np.float64))
    with pytest.raises(CheckpointError) as info:
        load_checkpoint(path, expected=expected)
    message = str(info.value)
    assert "'fc1.weight': expected float32[8, 16], got float32[16, 8]" in message
    assert "'fc1.bias': expected float64[16], got float32[16]" in message
    assert "half" not in message  # matching keys are not reported


@pytest.mark.parametrize("fraction", [0.5, 0.9, 0.01])
def test_truncated_file(tmp_path, fraction):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, _state(), {"step": 5})
    raw = path.read_bytes()
    path.write_bytes(raw[: int(len(raw) * fraction)])
    with pytest.raises(CheckpointError, match="corrupt or truncated") as info:
        load_checkpoint(path)
    assert str(path) in str(info.value)


@pytest.mark.parametrize(
    "content",
    [
        pytest.param(b"", id="empty"),
        pytest.param(b"garbage" * 100, id="text"),
        # Fixed-seed bytes, not os.urandom: random bytes in the id made every collection differ.
        pytest.param(np.random.default_rng(4096).bytes(4096), id="random_4096_bytes"),
    ],
)
def test_garbage_file(tmp_path, content):
    path = tmp_path / "junk.safetensors"
    path.write_bytes(content)
    with pytest.raises(CheckpointError, match=r"junk\.safetensors"):
        load_checkpoint(path)


def test_foreign_safetensors_without_metadata(tmp_path):
    path = tmp_path / "other.safetensors"
    safetensors.numpy.save_file({"w": np.ones(2, np.float32)}, path)
    with pytest.raises(CheckpointError, match="no 'meganeura' metadata"):
        load_checkpoint(path)


def test_corrupt_metadata_json(tmp_path):
    path = tmp_path / "bad.safetensors"
    payload = safetensors.numpy.save({"w": np.ones(2, np.float32)}, metadata={"meganeura": "{"})
    path.write_bytes(payload)
    with pytest.raises(CheckpointError, match="not valid JSON"):
        load_checkpoint(path)


def test_checkpoint_error_is_a_value_error():
    assert issubclass(CheckpointError, ValueError)


# --- atomicity ------------------------------------------------------------------------------


def test_crash_mid_save_keeps_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    old = {"w": np.full((64, 64), 1.0, np.float32)}
    save_checkpoint(path, old, {"step": 1})
    old_bytes = path.read_bytes()

    def crash_half_way(f, payload):
        f.write(payload[: len(payload) // 2])
        raise OSError("disk full")

    monkeypatch.setattr(checkpoint, "_write_payload", crash_half_way)
    with pytest.raises(OSError, match="disk full"):
        save_checkpoint(path, {"w": np.full((64, 64), 2.0, np.float32)}, {"step": 2})

    assert path.read_bytes() == old_bytes
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]  # no temporary file left behind
    tensors, meta = load_checkpoint(path)
    assert meta == {"step": 1} and float(tensors["w"][0, 0]) == 1.0


def test_interrupt_before_rename_keeps_old_checkpoint(tmp_path, monkeypatch):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"w": np.zeros(3, np.float32)}, {"step": 1})

    def interrupted(src, dst):
        raise KeyboardInterrupt

    monkeypatch.setattr(checkpoint.os, "replace", interrupted)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, {"w": np.ones(3, np.float32)}, {"step": 2})
    monkeypatch.undo()
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert load_checkpoint(path)[1] == {"step": 1}


def test_save_replaces_existing_and_metadata_is_one_json_string(tmp_path):
    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"w": np.zeros(3, np.float32)}, {"step": 1})
    save_checkpoint(path, {"w": np.ones(3, np.float32), "b": np.ones(1, np.int32)}, {"step": 2})
    tensors, meta = load_checkpoint(path)
    assert meta == {"step": 2} and sorted(tensors) == ["b", "w"]
    raw = path.read_bytes()
    header = json.loads(raw[8 : 8 + int.from_bytes(raw[:8], "little")])
    assert header["__metadata__"] == {"meganeura": '{"step": 2}'}


def _partial_name(target: str, random_part: str = "k1ll3d_x") -> str:
    return f".{target}.meganeura-partial-{random_part}.tmp"


@pytest.mark.skipif(os.name != "posix", reason="stale temporaries are cleaned on POSIX")
def test_a_save_killed_mid_write_leaves_a_temporary_the_next_save_removes(tmp_path):
    """Issue 11, item 10c: a killed save cannot clean up after itself; the next one does."""
    import signal
    import subprocess
    import sys

    path = tmp_path / "ckpt.safetensors"
    save_checkpoint(path, {"w": np.zeros(3, np.float32)}, {"step": 1})
    script = f"""
import os, signal
import numpy as np
from meganeura.io import checkpoint
def killed(f, payload):
    f.write(payload[: len(payload) // 2])
    f.flush()
    os.kill(os.getpid(), signal.SIGKILL)
checkpoint._write_payload = killed
checkpoint.save_checkpoint({str(path)!r}, {{"w": np.ones(1 << 16, np.float32)}}, {{"step": 2}})
"""
    root = Path(__file__).resolve().parents[2]  # imports this checkout's meganeura
    proc = subprocess.run([sys.executable, "-c", script], cwd=root, check=False)
    assert proc.returncode == -signal.SIGKILL
    stale = [n for n in os.listdir(tmp_path) if n != "ckpt.safetensors"]
    assert len(stale) == 1 and stale[0].startswith(".ckpt.safetensors.meganeura-partial-")
    assert (tmp_path / stale[0]).stat().st_size > 0
    assert load_checkpoint(path)[1] == {"step": 1}  # the old checkpoint is intact

    save_checkpoint(path, {"w": np.ones(3, np.float32)}, {"step": 3})
    assert os.listdir(tmp_path) == ["ckpt.safetensors"]
    assert load_checkpoint(path)[1] == {"step": 3}


@pytest.mark.skipif(os.name != "posix", reason="stale temporaries are cleaned on POSIX")
def test_cleaning_spares_users_files_and_a_concurrent_save(tmp_path):
    import fcntl

    kept = [
        "ckpt.safetensors.tmp",
        ".ckpt.safetensors.abc123.tmp",  # mkstemp's name before the tag existed
        "notes.meganeura-partial-abc.tmp",  # no leading dot and target
        _partial_name("ckpt.safetensors", "with-dash"),
    ]
    for name in kept:
        (tmp_path / name).write_bytes(b"user data")
    os.symlink(tmp_path / kept[0], tmp_path / _partial_name("link"))
    stale = _partial_name("other.safetensors")
    (tmp_path / stale).write_bytes(b"half a checkpoint")
    live = tmp_path / _partial_name("ckpt.safetensors", "live")
    live.write_bytes(b"being written")
    with open(live, "rb") as f:  # another process's save, in the middle of its write
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        save_checkpoint(tmp_path / "ckpt.safetensors", {"w": np.ones(2, np.float32)}, {})
        assert live.read_bytes() == b"being written"
    assert not (tmp_path / stale).exists()
    for name in kept:
        assert (tmp_path / name).read_bytes() == b"user data", name
    assert os.path.islink(tmp_path / _partial_name("link"))
    save_checkpoint(tmp_path / "ckpt.safetensors", {"w": np.ones(2, np.float32)}, {})
    assert not live.exists()  # its writer is gone (lock released): stale now

"""MNIST loading, IDX files, standardization and batching (no GPU)."""

from __future__ import annotations

import gzip
import hashlib
from pathlib import Path

import numpy as np
import pytest

from meganeura.data import mnist
from meganeura.data.mnist import (
    iterate_batches,
    load_mnist,
    num_batches,
    read_idx,
    standardize,
    write_idx,
)

EMBEDDED = Path(mnist.__file__).with_name(mnist.EMBEDDED_FILE)


@pytest.fixture(scope="module")
def splits() -> mnist.MnistSplits:
    return load_mnist(seed=0)


def _row_digests(images: np.ndarray) -> set[bytes]:
    return {hashlib.sha1(img.tobytes()).digest() for img in images}


# --- embedded subset -------------------------------------------------------------------------


def test_embedded_file_matches_provenance():
    # MNIST_PROVENANCE.md records this digest; a rebuilt file must reproduce it byte for byte.
    digest = hashlib.sha256(EMBEDDED.read_bytes()).hexdigest()
    provenance = EMBEDDED.with_name("MNIST_PROVENANCE.md").read_text()
    assert digest in provenance


def test_embedded_split_sizes_dtypes_and_ranges(splits):
    assert splits.x_train.shape == (4000, 28, 28) and splits.x_train.dtype == np.uint8
    assert splits.x_test.shape == (1000, 28, 28) and splits.x_test.dtype == np.uint8
    assert splits.y_train.shape == (4000,) and splits.y_train.dtype == np.int32
    assert splits.y_test.shape == (1000,) and splits.y_test.dtype == np.int32
    labels = np.concatenate([splits.y_train, splits.y_test])
    assert labels.min() == 0 and labels.max() == 9
    # The subset holds 500 digits per class; the split redistributes them but loses none.
    np.testing.assert_array_equal(np.bincount(labels, minlength=10), [500] * 10)
    # A random split keeps every class well represented in the test set (expected 100 each).
    assert np.bincount(splits.y_test, minlength=10).min() > 60
    assert splits.x_train.max() == 255 and splits.x_train.min() == 0


def test_embedded_split_is_disjoint_and_covers_all(splits):
    train, test = _row_digests(splits.x_train), _row_digests(splits.x_test)
    assert not train & test
    with np.load(EMBEDDED) as npz:
        assert train | test == _row_digests(npz["images"])


def test_embedded_split_is_deterministic_per_seed(splits):
    again = load_mnist(seed=0)
    np.testing.assert_array_equal(again.x_train, splits.x_train)
    np.testing.assert_array_equal(again.y_test, splits.y_test)
    other = load_mnist(seed=1)
    assert not np.array_equal(other.y_train, splits.y_train)


def test_embedded_labels_match_images(splits):
    # Labels travel with their images: the same image appears with the same label in the file.
    with np.load(EMBEDDED) as npz:
        by_digest = {
            hashlib.sha1(img.tobytes()).digest(): int(lab)
            for img, lab in zip(npz["images"], npz["labels"], strict=True)
        }
    for img, lab in zip(splits.x_test[:50], splits.y_test[:50], strict=True):
        assert by_digest[hashlib.sha1(img.tobytes()).digest()] == lab


# --- standardize -----------------------------------------------------------------------------


def test_standardize_train_stats_and_reuse(splits):
    x, mean, std = standardize(splits.x_train)
    assert x.shape == (4000, 784) and x.dtype == np.float32
    assert abs(float(x.mean(dtype=np.float64))) < 1e-5
    assert abs(float(x.std(dtype=np.float64)) - 1.0) < 1e-5
    # The statistics of MNIST digits (torchvision uses 0.1307, 0.3081 for the full set).
    assert 0.12 < mean < 0.14 and 0.29 < std < 0.32
    x_test, mean2, std2 = standardize(splits.x_test, mean, std)
    assert (mean2, std2) == (mean, std)
    expected = (splits.x_test.reshape(1000, -1) / 255.0 - mean) / std
    np.testing.assert_allclose(x_test, expected, rtol=1e-5, atol=1e-5)


def test_standardize_known_values():
    images = np.array([[[0, 255]], [[255, 0]]], dtype=np.uint8)  # pixels/255: 0, 1, 1, 0
    x, mean, std = standardize(images)
    assert (mean, std) == (0.5, 0.5)
    np.testing.assert_array_equal(x, [[-1.0, 1.0], [1.0, -1.0]])


def test_standardize_rejects_bad_input():
    with pytest.raises(TypeError, match="uint8"):
        standardize(np.zeros((2, 28, 28), dtype=np.float32))
    with pytest.raises(ValueError, match="together"):
        standardize(np.zeros((2, 28, 28), dtype=np.uint8), mean=0.1)
    with pytest.raises(ValueError, match="std must be positive"):
        standardize(np.zeros((2, 28, 28), dtype=np.uint8))


# --- IDX files -------------------------------------------------------------------------------


def _write_mnist_dir(root: Path, n_train: int, n_test: int, gz: bool) -> mnist.MnistSplits:
    rng = np.random.default_rng(7)
    arrays = mnist.MnistSplits(
        x_train=rng.integers(0, 256, (n_train, 28, 28), dtype=np.uint8),
        y_train=rng.integers(0, 10, n_train).astype(np.int32),
        x_test=rng.integers(0, 256, (n_test, 28, 28), dtype=np.uint8),
        y_test=rng.integers(0, 10, n_test).astype(np.int32),
    )
    suffix = ".gz" if gz else ""
    for key, name in mnist.IDX_FILES.items():
        write_idx(root / f"{name}{suffix}", getattr(arrays, key).astype(np.uint8))
    return arrays


@pytest.mark.parametrize("gz", [False, True], ids=["raw", "gz"])
def test_idx_directory_round_trip(tmp_path, gz):
    written = _write_mnist_dir(tmp_path, n_train=12, n_test=5, gz=gz)
    loaded = load_mnist(tmp_path, seed=123)
    for key in ("x_train", "y_train", "x_test", "y_test"):
        np.testing.assert_array_equal(getattr(loaded, key), getattr(written, key))
    assert loaded.y_train.dtype == np.int32 and loaded.x_test.dtype == np.uint8
    if gz:
        # Really compressed: the gzip magic, not a raw IDX header.
        raw = (tmp_path / "train-images-idx3-ubyte.gz").read_bytes()
        assert raw[:2] == b"\x1f\x8b"


def test_idx_header_bytes(tmp_path):
    path = tmp_path / "labels-idx1-ubyte"
    write_idx(path, np.array([3, 1, 4], dtype=np.uint8))
    # 0x00000801 is the magic of MNIST label files; then the big-endian count 3.
    assert path.read_bytes() == bytes.fromhex("0000080100000003030104")


@pytest.mark.parametrize("dtype", [np.uint8, np.int8, np.int16, np.int32, np.float32, np.float64])
def test_idx_round_trip_dtypes(tmp_path, dtype):
    array = (np.arange(24) - 7).astype(dtype).reshape(2, 3, 4)
    write_idx(tmp_path / "a.idx.gz", array)
    back = read_idx(tmp_path / "a.idx.gz")
    assert back.dtype == np.dtype(dtype) and back.shape == (2, 3, 4)
    np.testing.assert_array_equal(back, array)


def test_write_idx_rejects_unsupported(tmp_path):
    with pytest.raises(ValueError, match="int64; allowed: uint8, int8"):
        write_idx(tmp_path / "a.idx", np.zeros(3, dtype=np.int64))
    with pytest.raises(ValueError, match="1..255 dimensions, got 0"):
        write_idx(tmp_path / "a.idx", np.array(5, dtype=np.uint8))
    assert not (tmp_path / "a.idx").exists()


def test_missing_idx_file_lists_candidates(tmp_path):
    _write_mnist_dir(tmp_path, 4, 2, gz=False)
    (tmp_path / "t10k-labels-idx1-ubyte").unlink()
    with pytest.raises(FileNotFoundError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert "t10k-labels-idx1-ubyte" in message and "t10k-labels-idx1-ubyte.gz" in message


def test_bad_magic_names_file(tmp_path):
    _write_mnist_dir(tmp_path, 4, 2, gz=False)
    path = tmp_path / "train-images-idx3-ubyte"
    path.write_bytes(b"\x12\x34" + path.read_bytes()[2:])
    with pytest.raises(ValueError, match="train-images-idx3-ubyte.*1234"):
        load_mnist(tmp_path)


def test_truncated_file_names_file_and_sizes(tmp_path):
    _write_mnist_dir(tmp_path, 4, 2, gz=True)
    path = tmp_path / "t10k-images-idx3-ubyte.gz"
    raw = gzip.decompress(path.read_bytes())
    path.write_bytes(gzip.compress(raw[:-10]))
    expected = 16 + 2 * 28 * 28
    with pytest.raises(ValueError) as info:
        load_mnist(tmp_path)
    message = str(info.value)
    assert "t10k-images-idx3-ubyte.gz" in message and "truncated" in message
    assert f"{expected - 10} bytes, expected {expected}" in message


def test_corrupt_gzip_names_file(tmp_path):
    path = tmp_path / "x.gz"
    path.write_bytes(gzip.compress(b"\x00\x00\x08\x01\x00\x00\x00\x05abcde")[:-12])
    with pytest.raises(ValueError, match="x.gz"):
        read_idx(path)


def test_image_label_count_mismatch(tmp_path):
    _write_mnist_dir(tmp_path, 4, 2, gz=False)
    write_idx(tmp_path / "train-labels-idx1-ubyte", np.zeros(3, dtype=np.uint8))
    with pytest.raises(ValueError, match="4 images but .*train-labels-idx1-ubyte has 3 labels"):
        load_mnist(tmp_path)


def test_wrong_image_size_is_rejected(tmp_path):
    _write_mnist_dir(tmp_path, 4, 2, gz=False)
    write_idx(tmp_path / "t10k-images-idx3-ubyte", np.zeros((2, 14, 14), dtype=np.uint8))
    with pytest.raises(ValueError, match=r"t10k-images-idx3-ubyte.*\(2, 14, 14\)"):
        load_mnist(tmp_path)


# --- batches ---------------------------------------------------------------------------------


@pytest.mark.parametrize("n,batch_size", [(10, 3), (12, 4), (5, 8), (0, 2), (1000, 64)])
def test_batches_drop_last_cover_each_index_once(n, batch_size):
    rng = np.random.default_rng(0)
    batches = list(iterate_batches(n, batch_size, rng))
    assert len(batches) == n // batch_size == num_batches(n, batch_size)
    assert all(b.shape == (batch_size,) and b.dtype == np.int64 for b in batches)
    seen = np.concatenate(batches) if batches else np.array([], dtype=np.int64)
    assert len(np.unique(seen)) == len(seen) == n - n % batch_size
    assert seen.size == 0 or (seen.min() >= 0 and seen.max() < n)


def test_batches_keep_last_and_no_shuffle():
    batches = list(iterate_batches(7, 3, np.random.default_rng(0), shuffle=False, drop_last=False))
    assert [b.tolist() for b in batches] == [[0, 1, 2], [3, 4, 5], [6]]
    assert num_batches(7, 3, drop_last=False) == 3


def test_batches_shuffle_differs_per_epoch_and_is_seeded():
    rng = np.random.default_rng(42)
    epoch1 = np.concatenate(list(iterate_batches(100, 10, rng)))
    epoch2 = np.concatenate(list(iterate_batches(100, 10, rng)))
    assert not np.array_equal(epoch1, epoch2)
    assert not np.array_equal(epoch1, np.arange(100))
    replay = np.concatenate(list(iterate_batches(100, 10, np.random.default_rng(42))))
    np.testing.assert_array_equal(replay, epoch1)


def test_batches_validate_eagerly():
    with pytest.raises(ValueError, match="batch_size"):
        iterate_batches(10, 0, np.random.default_rng(0))

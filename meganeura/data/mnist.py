"""MNIST on the host: loading, standardization and fixed-shape mini-batches.

Role in the pipeline: the data side of the MNIST workload. Everything here is NumPy on the host;
the runtime uploads the batches this module produces.

Invariants:
    * Images are uint8 [N, 28, 28] and labels int32 [N] with values in 0..9, whatever the source.
    * The embedded default is the 5,000-digit subset in ``mnist_5k.npz`` (see
      ``MNIST_PROVENANCE.md``), split 4,000 train / 1,000 test by a seeded permutation, so a seed
      always gives the same split. A ``data_dir`` gives the official 60,000 / 10,000 split.
    * Compiled programs have fixed shapes, so training batches all have exactly ``batch_size`` rows
      (``drop_last=True``); the remainder of an epoch is skipped, not padded.

IDX format (http://yann.lecun.com/exdb/mnist/): a big-endian header ``0x00 0x00 <type> <ndim>``,
then ``ndim`` big-endian uint32 sizes, then the data in row-major big-endian order.
"""

from __future__ import annotations

import gzip
import importlib.resources
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np

__all__ = [
    "MnistSplits",
    "iterate_batches",
    "load_mnist",
    "num_batches",
    "read_idx",
    "standardize",
    "write_idx",
]

EMBEDDED_FILE = "mnist_5k.npz"
EMBEDDED_TRAIN = 4000
EMBEDDED_TEST = 1000

IDX_FILES = {
    "x_train": "train-images-idx3-ubyte",
    "y_train": "train-labels-idx1-ubyte",
    "x_test": "t10k-images-idx3-ubyte",
    "y_test": "t10k-labels-idx1-ubyte",
}

# IDX type byte -> NumPy dtype, big-endian as the format stores it.
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(np.uint8),
    0x09: np.dtype(np.int8),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}
_IDX_CODES: dict[np.dtype, int] = {dt.newbyteorder("="): code for code, dt in _IDX_DTYPES.items()}


@dataclass(frozen=True)
class MnistSplits:
    """A train/test split of MNIST.

    Attributes:
        x_train: uint8 [N_train, 28, 28], pixel intensities 0..255.
        y_train: int32 [N_train], digits 0..9.
        x_test: uint8 [N_test, 28, 28].
        y_test: int32 [N_test].
    """

    x_train: np.ndarray
    y_train: np.ndarray
    x_test: np.ndarray
    y_test: np.ndarray


def _open_maybe_gzip(path: Path, mode: str):
    return gzip.open(path, mode) if path.suffix == ".gz" else open(path, mode)


def write_idx(path: str | Path, array: np.ndarray) -> None:
    """Write an array as an IDX file, gzip-compressed when ``path`` ends in ``.gz``.

    Args:
        path: destination file.
        array: 1 to 255 dimensions of uint8, int8, int16, int32, float32 or float64.

    Raises:
        ValueError: a dtype or rank that IDX cannot hold.
    """
    array = np.asarray(array)
    code = _IDX_CODES.get(array.dtype.newbyteorder("="))
    if code is None:
        allowed = ", ".join(str(dt) for dt in _IDX_CODES)
        raise ValueError(f"IDX cannot store dtype {array.dtype}; allowed: {allowed}")
    if not 1 <= array.ndim <= 255:
        raise ValueError(f"IDX needs 1..255 dimensions, got {array.ndim}")
    header = bytes([0, 0, code, array.ndim]) + np.asarray(array.shape, dtype=">u4").tobytes()
    with _open_maybe_gzip(Path(path), "wb") as f:
        f.write(header)
        f.write(np.ascontiguousarray(array, dtype=_IDX_DTYPES[code]).tobytes())


def read_idx(path: str | Path) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed) into a native-endian array.

    Args:
        path: the file; a ``.gz`` suffix means gzip.

    Returns:
        The array with the shape from the header, native byte order.

    Raises:
        FileNotFoundError: ``path`` does not exist.
        ValueError: bad magic number, unknown type byte, or a data size that disagrees with the
            header (truncated or trailing bytes). The message names the file.
    """
    path = Path(path)
    try:
        with _open_maybe_gzip(path, "rb") as f:
            raw = f.read()
    except FileNotFoundError:
        raise
    except (OSError, EOFError) as e:  # a corrupt or truncated gzip stream
        raise ValueError(f"{path}: cannot read ({e})") from e
    if len(raw) < 4 or raw[0] != 0 or raw[1] != 0 or raw[2] not in _IDX_DTYPES:
        raise ValueError(
            f"{path}: not an IDX file: magic bytes {raw[:4].hex() or '(empty)'}, "
            "expected 0000<type><ndim> with type in 08,09,0b,0c,0d,0e"
        )
    dtype, ndim = _IDX_DTYPES[raw[2]], raw[3]
    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{path}: truncated header: {len(raw)} bytes, expected {header_len}")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    expected = header_len + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "trailing bytes"
        raise ValueError(
            f"{path}: {what}: {len(raw)} bytes, expected {expected} for shape {shape} {dtype}"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="), copy=True)


def _find_idx(data_dir: Path, name: str) -> Path:
    candidates = [data_dir / name, data_dir / f"{name}.gz"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(
        f"MNIST file not found; looked for {', '.join(str(c) for c in candidates)}"
    )


def _check_pair(x: np.ndarray, y: np.ndarray, x_path: Path, y_path: Path) -> None:
    """Validate one (images, labels) pair read from IDX files; messages name the files."""
    if x.dtype != np.uint8 or x.ndim != 3 or x.shape[1:] != (28, 28):
        raise ValueError(f"{x_path}: expected uint8 [N, 28, 28] images, got {x.dtype} {x.shape}")
    if y.dtype != np.uint8 or y.ndim != 1:
        raise ValueError(f"{y_path}: expected uint8 [N] labels, got {y.dtype} {y.shape}")
    if len(x) != len(y):
        raise ValueError(f"{x_path} has {len(x)} images but {y_path} has {len(y)} labels")
    if y.size and y.max() > 9:
        raise ValueError(f"{y_path}: labels must be 0..9, found {int(y.max())}")


def _load_idx_dir(data_dir: Path) -> MnistSplits:
    paths = {key: _find_idx(data_dir, name) for key, name in IDX_FILES.items()}
    arrays = {key: read_idx(path) for key, path in paths.items()}
    for split in ("train", "test"):
        _check_pair(
            arrays[f"x_{split}"], arrays[f"y_{split}"], paths[f"x_{split}"], paths[f"y_{split}"]
        )
    return MnistSplits(
        x_train=arrays["x_train"],
        y_train=arrays["y_train"].astype(np.int32),
        x_test=arrays["x_test"],
        y_test=arrays["y_test"].astype(np.int32),
    )


def _load_embedded(seed: int) -> MnistSplits:
    resource = importlib.resources.files("meganeura.data").joinpath(EMBEDDED_FILE)
    with resource.open("rb") as f, np.load(f) as npz:
        images, labels = npz["images"], npz["labels"]
    n = EMBEDDED_TRAIN + EMBEDDED_TEST
    if images.shape != (n, 28, 28) or labels.shape != (n,):
        raise ValueError(
            f"embedded {EMBEDDED_FILE}: expected images {(n, 28, 28)} and labels {(n,)}, "
            f"got {images.shape} and {labels.shape}; rebuild with scripts/build_mnist_subset.py"
        )
    # The file is sorted by class, so the split must come from a permutation, not a slice.
    order = np.random.default_rng(seed).permutation(n)
    train, test = order[:EMBEDDED_TRAIN], order[EMBEDDED_TRAIN:]
    return MnistSplits(
        x_train=images[train],
        y_train=labels[train].astype(np.int32),
        x_test=images[test],
        y_test=labels[test].astype(np.int32),
    )


def load_mnist(data_dir: str | Path | None = None, seed: int = 0) -> MnistSplits:
    """Load MNIST as uint8 images and int32 labels.

    Args:
        data_dir: ``None`` for the embedded 5,000-digit subset (500 per class) split 4,000 train /
            1,000 test; otherwise a folder with the four standard IDX files
            (``train-images-idx3-ubyte``, ``train-labels-idx1-ubyte``, ``t10k-images-idx3-ubyte``,
            ``t10k-labels-idx1-ubyte``, each optionally with ``.gz``), used with their official
            split.
        seed: seeds ``np.random.default_rng`` for the embedded split; ignored with ``data_dir``.

    Returns:
        MnistSplits with x uint8 [N, 28, 28] and y int32 [N].

    Raises:
        FileNotFoundError: an IDX file is missing; the message lists the paths tried.
        ValueError: an IDX file is malformed (bad magic, truncated, wrong shape, labels > 9), or
            image and label counts differ; the message names the file.
    """
    if data_dir is None:
        return _load_embedded(seed)
    data_dir = Path(data_dir)
    if not data_dir.is_dir():
        raise FileNotFoundError(f"MNIST data_dir {data_dir} is not a directory")
    return _load_idx_dir(data_dir)


def standardize(
    images_uint8: np.ndarray, mean: float | None = None, std: float | None = None
) -> tuple[np.ndarray, float, float]:
    """Flatten and standardize images: ``((pixels / 255) - mean) / std``.

    Like torchvision's ``Normalize((0.1307,), (0.3081,))`` after ``ToTensor()``, but with the
    scalar statistics computed from the data: call it on the training set without ``mean``/``std``,
    then on the test set with the returned values, so both use training statistics.

    Args:
        images_uint8: uint8 [N, 28, 28] (or any [N, ...]) pixel intensities 0..255.
        mean: mean of the scaled training pixels; give together with ``std`` or neither.
        std: population standard deviation (ddof=0) of the scaled training pixels.

    Returns:
        ``(x, mean, std)``: x float32 [N, H*W]; mean and std as Python floats.

    Raises:
        TypeError: ``images_uint8`` is not uint8.
        ValueError: only one of ``mean``/``std`` given, or ``std`` is not positive.
    """
    images_uint8 = np.asarray(images_uint8)
    if images_uint8.dtype != np.uint8:
        raise TypeError(f"standardize expects uint8 pixels, got {images_uint8.dtype}")
    if (mean is None) != (std is None):
        raise ValueError("give mean and std together (training statistics) or neither")
    x = images_uint8.reshape(len(images_uint8), -1).astype(np.float32) / np.float32(255.0)
    if mean is None:
        # Accumulate in float64: a float32 sum over 47M pixels loses digits in the mean.
        mean = float(x.mean(dtype=np.float64))
        std = float(x.std(dtype=np.float64))
    if not std > 0:
        raise ValueError(f"std must be positive, got {std}")
    x -= np.float32(mean)
    x /= np.float32(std)
    return x, float(mean), float(std)


def num_batches(n: int, batch_size: int, drop_last: bool = True) -> int:
    """Number of batches ``iterate_batches`` yields per epoch (for progress bars)."""
    return n // batch_size if drop_last else -(-n // batch_size)


def iterate_batches(
    n: int,
    batch_size: int,
    rng: np.random.Generator,
    shuffle: bool = True,
    drop_last: bool = True,
) -> Iterator[np.ndarray]:
    """Yield the index arrays of one epoch of mini-batches.

    Arguments are checked when called, not at the first ``next()``.

    Args:
        n: dataset size.
        batch_size: rows per batch; compiled programs have this as a fixed dimension.
        rng: draws the epoch's permutation when ``shuffle``; advanced once per call.
        shuffle: a fresh permutation per epoch, else ``0..n-1`` in order.
        drop_last: skip the final ``n % batch_size`` indices so every batch is full.

    Returns:
        An iterator of int64 index arrays [batch_size] (the last may be shorter only when
        ``drop_last`` is False). Each index appears at most once per epoch.

    Raises:
        ValueError: ``n < 0`` or ``batch_size < 1``.
    """
    if n < 0 or batch_size < 1:
        raise ValueError(f"need n >= 0 and batch_size >= 1, got n={n}, batch_size={batch_size}")
    order = rng.permutation(n) if shuffle else np.arange(n, dtype=np.int64)
    stop = n - n % batch_size if drop_last else n
    return (order[i : i + batch_size] for i in range(0, stop, batch_size))

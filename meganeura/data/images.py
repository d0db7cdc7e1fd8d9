"""Images on the host for the vision recipes: reading files, torchvision-style preprocessing,
ImageFolder datasets and the embedded digits.

Role in the pipeline: the data side of ``recipes.resnet`` and ``meganeura classify``. Every
function returns NumPy; the runtime uploads what they produce.

Invariants:
    * Preprocessed images are f32 [3, S, S] (a batch: [N, 3, S, S]) in NCHW order, RGB,
      ``(pixel / 255 - mean) / std`` per channel, as torchvision's ``ToTensor`` and
      ``Normalize`` give.
    * ``preprocess`` is torchvision's ImageNet evaluation transform: ``Resize(resize)`` (the
      shorter side to ``resize``, bilinear, aspect kept), ``CenterCrop(crop)``, ``ToTensor``,
      ``Normalize(mean, std)`` (torchvision reference scripts, classification/presets.py).
      PIL's bilinear resize with antialiasing is what torchvision's PIL path uses.
    * An ImageFolder is ``root/<class>/<image>``: classes are the subfolder names, sorted, and
      class ``i`` is the ``i``-th of them (torchvision.datasets.ImageFolder); files whose
      suffix is not an image suffix are skipped.
    * Reading images needs Pillow, which matplotlib (the ``plot`` extra) brings; without it
      ``read_image`` raises an ImportError saying how to install it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np

IMAGENET_MEAN = (0.485, 0.456, 0.406)
IMAGENET_STD = (0.229, 0.224, 0.225)
IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".ppm", ".bmp", ".pgm", ".tif", ".tiff", ".webp")


def _pil():
    try:
        from PIL import Image
    except ImportError:
        raise ImportError(
            "reading images needs Pillow: pip install pillow (or pip install 'meganeura[vision]')"
        ) from None
    return Image


def read_image(path: str | Path):
    """The image at ``path`` as an RGB ``PIL.Image``.

    Raises:
        ImportError: Pillow is not installed (the message says how to install it).
        FileNotFoundError: no such file.
        ValueError: the file is not an image Pillow can read, or a corrupt or truncated one
            (the message names it).
    """
    image = _pil()
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"no image file {str(path)!r}")
    try:
        with image.open(path) as im:
            return im.convert("RGB")
    except image.UnidentifiedImageError:
        raise ValueError(f"{path}: not an image file Pillow can read") from None
    except (OSError, SyntaxError) as e:  # Pillow's errors of a truncated or corrupt file
        raise ValueError(f"{path}: a corrupt or truncated image: {e}") from None


def preprocess(
    img,
    resize: int = 256,
    crop: int = 224,
    mean: tuple[float, ...] = IMAGENET_MEAN,
    std: tuple[float, ...] = IMAGENET_STD,
) -> np.ndarray:
    """torchvision's evaluation transform of an RGB ``PIL.Image`` (module docstring).

    Returns:
        f32 [3, crop, crop].

    Raises:
        ValueError: ``crop > resize`` or a size < 1.
    """
    if min(resize, crop) < 1 or crop > resize:
        raise ValueError(f"need 1 <= crop <= resize, got resize {resize} and crop {crop}")
    w, h = img.size
    scale = resize / min(w, h)
    size = (max(resize, round(w * scale)), max(resize, round(h * scale)))
    img = img.resize(size, _pil().Resampling.BILINEAR)
    left, top = (size[0] - crop) // 2, (size[1] - crop) // 2
    img = img.crop((left, top, left + crop, top + crop))
    x = np.asarray(img, np.float32).transpose(2, 0, 1) / 255.0
    m = np.asarray(mean, np.float32)[:, None, None]
    s = np.asarray(std, np.float32)[:, None, None]
    return ((x - m) / s).astype(np.float32)


@dataclass(frozen=True)
class ImageDataset:
    """Preprocessed images ``x`` f32 [N, 3, S, S], labels ``y`` int32 [N] indexing
    ``classes``."""

    x: np.ndarray
    y: np.ndarray
    classes: tuple[str, ...]


def load_image_folder(
    root: str | Path, size: int, mean=IMAGENET_MEAN, std=IMAGENET_STD
) -> ImageDataset:
    """Every image of the ImageFolder ``root``, resized (shorter side) and center-cropped to
    ``size`` and normalized (``preprocess(img, size, size, mean, std)``), in memory.

    Raises:
        FileNotFoundError: ``root`` is not a folder.
        ValueError: it has no class subfolder with an image (the message names it), or an
            image Pillow cannot read.
        ImportError: Pillow is not installed.
    """
    root = Path(root)
    if not root.is_dir():
        raise FileNotFoundError(f"no image folder {str(root)!r}")
    classes, xs, ys = [], [], []
    for folder in sorted(p for p in root.iterdir() if p.is_dir()):
        files = sorted(
            f for f in folder.iterdir() if f.is_file() and f.suffix.lower() in IMAGE_SUFFIXES
        )
        if not files:
            continue
        for f in files:
            xs.append(preprocess(read_image(f), size, size, mean, std))
            ys.append(len(classes))
        classes.append(folder.name)
    if not xs:
        raise ValueError(
            f"{root}: no images in class subfolders (expected root/<class>/<image>, suffixes "
            f"{', '.join(IMAGE_SUFFIXES)})"
        )
    return ImageDataset(np.stack(xs), np.asarray(ys, np.int32), tuple(classes))


def load_digits(size: int = 32, seed: int = 0, mean=IMAGENET_MEAN, std=IMAGENET_STD):
    """The embedded handwritten digits (the 5,000-image MNIST subset of ``data.mnist``) as
    RGB images: 28x28 gray zero-padded to 32x32, then resized to ``size`` (nearest) when it
    differs, repeated over 3 channels and normalized like ``preprocess``; classes ``"0"`` to
    ``"9"``.

    Returns:
        (train, test) ImageDatasets of 4,000 and 1,000 images (``load_mnist``'s split).
    """
    from .mnist import load_mnist

    d = load_mnist(seed=seed)

    def convert(images: np.ndarray) -> np.ndarray:
        x = np.pad(images.astype(np.float32) / 255.0, ((0, 0), (2, 2), (2, 2)))
        if size != 32:
            idx = (np.arange(size) * 32) // size
            x = x[:, idx][:, :, idx]
        m = np.asarray(mean, np.float32)[None, :, None, None]
        s = np.asarray(std, np.float32)[None, :, None, None]
        return ((x[:, None] - m) / s).astype(np.float32)

    classes = tuple(str(i) for i in range(10))
    return (
        ImageDataset(convert(d.x_train), d.y_train.astype(np.int32), classes),
        ImageDataset(convert(d.x_test), d.y_test.astype(np.int32), classes),
    )


def split(ds: ImageDataset, test_fraction: float, seed: int) -> tuple[ImageDataset, ImageDataset]:
    """(train, test) by a seeded permutation; the test part has ``round(N * fraction)``
    images (at least one when N > 1; none when N == 1)."""
    n = len(ds.y)
    k = min(max(1, round(n * test_fraction)), n - 1) if n > 1 else 0
    perm = np.random.default_rng(seed).permutation(n)
    te, tr = perm[:k], perm[k:]
    return (
        ImageDataset(ds.x[tr], ds.y[tr], ds.classes),
        ImageDataset(ds.x[te], ds.y[te], ds.classes),
    )

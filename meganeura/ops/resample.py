"""Resampling: nearest-neighbour upsampling by whole-number factors, as a composite.

``upsample_nearest2d`` / ``interpolate(mode="nearest")`` view x [N, C, H, W] as
[N, C, H, 1, W, 1], ``broadcast_to`` [N, C, H, sh, W, sw] (one copy kernel) and reshape to
[N, C, H sh, W sw], which is exactly ``out[.., h, w] = x[.., h // sh, w // sw]``. No op of its
own: the gradient is the block sum autodiff derives from ``broadcast_to`` (one reduction).
"""

from __future__ import annotations

from collections.abc import Sequence

from ..graph.builder import Tensor
from . import functional as F
from .pool import pair, unbatched


def upsample_nearest2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    size: int | Sequence[int] | None = None,
    scale_factor: int | Sequence[int] | None = None,
) -> Tensor:
    """Nearest-neighbour upsampling by integer factors: ``out[.., h, w] = x[.., h // sh, w // sw]``
    (torch.nn.functional.interpolate(mode="nearest") for such factors).

    Args:
        input: [N, C, H, W] (or [C, H, W]).
        size: output (H', W'), integer multiples of (H, W); or
        scale_factor: int or (sh, sw), whole numbers >= 1.

    Raises:
        ValueError: neither or both given, or factors that are not whole numbers.
    """
    if (size is None) == (scale_factor is None):
        raise ValueError("upsample_nearest2d: give exactly one of size and scale_factor")

    def run(x: Tensor) -> Tensor:
        n, c, h, w = x.shape
        if size is not None:
            oh, ow = pair(size, "size")
            if oh % h or ow % w or oh < h or ow < w:
                raise ValueError(f"size {(oh, ow)} is not a whole multiple of {(h, w)}")
            fh, fw = oh // h, ow // w
        else:
            sf = scale_factor if isinstance(scale_factor, (tuple, list)) else (scale_factor,) * 2
            if len(sf) != 2 or any(float(f) != int(f) or int(f) < 1 for f in sf):
                raise ValueError(f"scale_factor must be whole numbers >= 1, got {scale_factor!r}")
            fh, fw = int(sf[0]), int(sf[1])
        if (fh, fw) == (1, 1):
            return x
        y = F.broadcast_to(F.reshape(x, (n, c, h, 1, w, 1)), (n, c, h, fh, w, fw))
        return F.reshape(y, (n, c, h * fh, w * fw))

    return unbatched(input, 4, run)


def interpolate(
    input: Tensor,  # noqa: A002 - PyTorch's name
    size: int | Sequence[int] | None = None,
    scale_factor: float | Sequence[float] | None = None,
    mode: str = "nearest",
) -> Tensor:
    """torch.nn.functional.interpolate for ``mode="nearest"`` and whole-number factors on
    4-d input (see ``upsample_nearest2d``).

    Raises:
        NotImplementedError: other modes or input ranks.
    """
    if mode != "nearest" or input.ndim != 4:
        raise NotImplementedError(f"interpolate supports mode='nearest' on 4-d input, got {mode!r}")
    return upsample_nearest2d(input, size, scale_factor)

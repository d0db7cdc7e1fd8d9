"""Dropout with a counter-based hash RNG: the mask is a pure function of (seed, element index).

No RNG state lives on the GPU: element ``i`` of a dropout with seed ``s`` (a u32[] value the
host feeds each step) is kept when ``hash(s, i) >= threshold``, where
  * ``pcg(v)`` is the PCG-RXS-M-XS permutation of u32 (Jarzynski & Olano, "Hash Functions for
    GPU Rendering", JCGT 9(3), 2020): ``st = v * 747796405 + 2891336453;
    w = ((st >> ((st >> 28) + 4)) ^ st) * 277803737; pcg = (w >> 22) ^ w`` (all mod 2^32);
  * ``hash(s, i) = pcg(pcg(i) ^ pcg(s))``: two rounds on the index, keyed by the hashed seed,
    so neighbouring seeds give unrelated masks;
  * ``threshold = min(round(p * 2^32), 2^32 - 1)``, so a keep has probability
    ``1 - threshold / 2^32`` (``1 - p`` to within 2^-32).
Kept elements are scaled by ``1 / (1 - p)`` (rounded to the input's dtype), the others are
``x * 0`` (0, or NaN for a NaN or +-inf element), as torch.nn.functional.dropout in training
mode computes ``x * mask * scale``. The same (seed, index) gives the same mask in
the WGSL kernel, in this NumPy reference and in the backward, which is dropout of the upstream
gradient with the same seed (the same mask and scale), so no mask is ever stored.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor
from ..graph.ir import TensorType
from .registry import OpDef, ShapeError

PCG_MUL, PCG_INC, PCG_OUT = 747796405, 2891336453, 277803737


def threshold(p: float) -> int:
    """The u32 threshold below which a hash drops its element."""
    return min(int(round(p * 2**32)), 2**32 - 1)


def pcg_np(v: np.ndarray) -> np.ndarray:
    """PCG-RXS-M-XS of each u32 (wrapping arithmetic)."""
    v = np.asarray(v, np.uint32)
    st = v * np.uint32(PCG_MUL) + np.uint32(PCG_INC)
    w = ((st >> ((st >> np.uint32(28)) + np.uint32(4))) ^ st) * np.uint32(PCG_OUT)
    return (w >> np.uint32(22)) ^ w


def keep_mask(seed: int, shape: tuple[int, ...], p: float) -> np.ndarray:
    """The bool keep-mask of a dropout with ``seed`` over a row-major tensor of ``shape``."""
    n = int(np.prod(shape, dtype=np.int64))
    key = pcg_np(np.array([int(seed) % 2**32], np.uint32))[0]
    h = pcg_np(pcg_np(np.arange(n, dtype=np.uint32)) ^ key)
    return (h >= np.uint32(threshold(p))).reshape(shape)


def _dropout_type(types, attrs):
    x, seed = types
    if not x.dtype.is_floating:
        raise ShapeError(f"expects a floating-point input, got {x}")
    if seed != TensorType((), DType.u32):
        raise ShapeError(f"seed must be u32[], got {seed}")
    p = attrs["p"]
    if not (isinstance(p, float) and 0.0 < p < 1.0):
        raise ShapeError(f"p must be a float in (0, 1) (0 and 1 need no op), got {p!r}")
    return x


def _dropout_np(xs, a):
    x, seed = np.asarray(xs[0]), int(np.asarray(xs[1]))
    scale = np.asarray(1.0 / (1.0 - a["p"]), x.dtype)
    with np.errstate(invalid="ignore"):  # a dropped inf is NaN (0 * inf), as torch's
        return np.where(keep_mask(seed, x.shape, a["p"]), x * scale, x * np.zeros((), x.dtype))


def _dropout_grad(node, i, o, g):
    return (g.builder.add("dropout", [g, i[1]], node.attr_dict), None)


DEFS = [OpDef("dropout", _dropout_type, _dropout_np, _dropout_grad, arity=2)]


def dropout(
    input: Tensor,  # noqa: A002
    p: float = 0.5,
    training: bool = True,
    *,
    seed: Tensor | None = None,
) -> Tensor:
    """Zero each element with probability ``p`` and scale the rest by ``1 / (1 - p)``
    (torch.nn.functional.dropout; Srivastava et al., JMLR 2014).

    The mask is a hash of (seed, element index) (see the module docstring), so it is
    reproducible: feed a new ``seed`` each step for fresh masks.

    Args:
        input: floating tensor of any shape.
        p: drop probability in [0, 1].
        training: when False (or when p == 0) the input is returned unchanged.
        seed: u32[] tensor (usually a graph input fed each step); required when training
            with 0 < p < 1, except inside a traced ``Module.forward``, where each dropout
            gets its own seed input that the compiled call feeds a fresh random value.

    Returns:
        A tensor like ``input`` (zeros when p == 1, as PyTorch).

    Raises:
        ValueError: p outside [0, 1], or a missing or non-u32[] seed.
    """
    p = float(p)
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    if not training or p == 0.0:
        return input
    if p == 1.0:
        return input * 0.0
    if seed is None:
        from ..nn.tracing import current_trace

        trace = current_trace()
        if trace is not None and trace.builder is input.builder:
            seed = trace.seed()
    if not isinstance(seed, Tensor) or seed.type != TensorType((), DType.u32):
        raise ValueError(f"dropout in training needs a u32[] seed tensor, got {seed!r}")
    return input.builder.add("dropout", [input, seed], {"p": p})

"""Op-database entry for ``quantized_linear`` (``meganeura/ops/quantized.py``) and, through its
gradient, ``quantized_linear_backward``.

The reference decodes the packed words with torch integer ops, from GGUF's block definitions
(Q8_0: ``d * int8``; Q4_1: ``d * nibble + m``, byte j holding weights j and j + 16), not through
meganeura's NumPy code. Samples: both kernels (GEMV for <= 8 rows, tiled beyond), batched
inputs, an odd out_features, one block per row, an odd number of blocks (half a Q8_0 scale
word unused), and subnormal f16 scales (weights of magnitude 1e-4). The packed words are fed
as i32 (the op's other accepted dtype), so the kernels' bitcasts are exercised too.
"""

from __future__ import annotations

import numpy as np
import torch

from meganeura.ops import quant_formats as qf
from meganeura.ops.quantized import quantized_linear

from . import OpInfo, Sample


def _halves(words: torch.Tensor) -> torch.Tensor:
    """int64 u32 words [r, c] -> float64 [r, 2c]: their f16 halves, low half first."""
    h = (words[..., None] >> torch.tensor([0, 16])) & 0xFFFF
    h = torch.where(h >= 2**15, h - 2**16, h).to(torch.int16).reshape(words.shape[0], -1)
    return h.view(torch.float16).double()


def _bytes(words: torch.Tensor) -> torch.Tensor:
    """int64 u32 words [r, c] -> their bytes [r, 4c] (int64 0..255), little-endian."""
    b = (words[..., None] >> torch.tensor([0, 8, 16, 24])) & 0xFF
    return b.reshape(words.shape[0], -1)


def torch_dequantize(qweight, scales, qtype: str) -> torch.Tensor:
    """float64 W [out, in] from the packed words (int64 tensors holding i32 bit patterns)."""
    q, s = qweight & 0xFFFFFFFF, scales & 0xFFFFFFFF
    out = q.shape[0]
    b = _bytes(q)
    if qtype == "q8_0":
        nb = b.shape[1] // 32
        signed = torch.where(b >= 128, b - 256, b).double().reshape(out, nb, 32)
        d = _halves(s)[:, :nb, None]
        return (signed * d).reshape(out, -1)
    nb = b.shape[1] // 16
    b = b.reshape(out, nb, 16)
    vals = torch.cat([b & 15, b >> 4], dim=2).double()
    dm = _halves(s).reshape(out, nb, 2)
    return (dm[..., :1] * vals + dm[..., 1:]).reshape(out, -1)


def _ref(x, qweight, scales, qtype):
    return x @ torch_dequantize(qweight, scales, qtype).T


# (x shape, out_features, weight scale, name)
CASES = [
    ((1, 64), 40, 0.1, "gemv_1"),
    ((2, 3, 96), 37, 0.1, "gemv_batched_odd_blocks"),
    ((8, 32), 1, 1.0, "gemv_one_block"),
    ((2, 9, 64), 65, 0.1, "tiled_18_rows"),
    ((70, 96), 67, 1e-4, "tiled_subnormal_scales"),
    ((3, 160), 9, 1e-4, "gemv_subnormal_scales"),
]


def _samples(rng):
    out = []
    for qtype in ("q8_0", "q4_1"):
        for xs, nout, scale, name in CASES:
            w = (rng.normal(size=(nout, xs[-1])) * scale).astype(np.float32)
            w[0, :32] = 0  # an all-zero block: d = 0 (and m = 0)
            qw, sc = qf.pack_blocks(qf.quantize_blocks(w, qtype), w.shape, qtype)
            args = (rng.normal(size=xs), qw.view(np.int32), sc.view(np.int32), qtype)
            out.append(Sample(args, name=f"{qtype}_{name}", grad=(0,)))
    return out


ENTRIES: list[OpInfo] = [
    OpInfo(
        "quantized_linear",
        quantized_linear,
        _ref,
        _samples,
        ("quantized_linear", "quantized_linear_backward"),
    ),
]

"""GGUF's Q8_0 and Q4_1 weight blocks on the host: quantize, repack for the GPU, dequantize.

Pure NumPy (the optional ``gguf`` package is never needed). The block formats are ggml's
(``ggml-common.h``; the Python twin is ``gguf.quants``), 32 weights of one row per block:

  * Q8_0, 34 bytes: f16 ``d`` then 32 int8 ``q``; weight ``i`` is ``d * q[i]``.
    Quantizing: ``d = max|x| / 127``, ``q = round_half_away(x / d)`` (with ``1/d`` in f32).
  * Q4_1, 20 bytes: f16 ``d``, f16 ``m``, then 16 bytes ``qs``; byte ``j`` holds weight ``j``
    in its low nibble and weight ``j + 16`` in its high nibble; weight ``i`` is
    ``d * q[i] + m``. Quantizing: ``d = (max - min) / 15``, ``m = min``,
    ``q = clip(trunc((x - min) / d + 0.5), 0, 15)``.

GGUF blocks are not 4-byte aligned (34 and 20 bytes), and WGSL reads storage only in 32-bit
words, so the GPU keeps each weight matrix ``W [out, in]`` (``in`` a multiple of 32) as two
u32 arrays with the same bytes regrouped (no precision lost, memory as GGUF's):

  * ``qweight``: the ``q`` bytes of each row, in GGUF's order, as little-endian u32 words:
    Q8_0 ``[out, in / 4]`` (word ``w`` holds weights 4w .. 4w+3 in bytes 0..3), Q4_1
    ``[out, in / 8]`` (block b's ``qs`` are words 4b .. 4b+3: nibble order as above);
  * ``scales``: the f16 values as u32 words: Q8_0 ``[out, ceil(in / 64)]`` holding block
    2w's ``d`` in the low half of word w and block 2w+1's in the high half (0 past the row);
    Q4_1 ``[out, in / 32]`` with ``d`` in the low and ``m`` in the high half.

Bytes per weight: Q8_0 34/32 = 1.0625, Q4_1 20/32 = 0.625 (f32: 4).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

QK = 32  # weights per block (ggml's QK8_0 and QK4_1)


@dataclass(frozen=True)
class QFormat:
    """One block format: GGUF's type id, bytes per block, u32 words of ``q`` per block and
    block scales per u32 word of ``scales``."""

    name: str
    ggml_type: int
    block_bytes: int
    q_words: int
    blocks_per_scale_word: int

    def qweight_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, in_features // QK * self.q_words)

    def scales_shape(self, out_features: int, in_features: int) -> tuple[int, int]:
        return (out_features, -(-(in_features // QK) // self.blocks_per_scale_word))

    def bytes_per_weight(self) -> float:
        return self.block_bytes / QK


FORMATS = {
    "q8_0": QFormat("q8_0", ggml_type=8, block_bytes=34, q_words=8, blocks_per_scale_word=2),
    "q4_1": QFormat("q4_1", ggml_type=3, block_bytes=20, q_words=4, blocks_per_scale_word=1),
}


def qformat(qtype: str) -> QFormat:
    """The format named ``qtype``: "q8_0" or "q4_1" (ggml's names "Q8_0", "Q4_1" too).

    Raises:
        ValueError: for any other name.
    """
    key = qtype.lower() if isinstance(qtype, str) else qtype
    if key not in FORMATS:
        raise ValueError(f"qtype must be one of {sorted(FORMATS)}, got {qtype!r}")
    return FORMATS[key]


def check_in_features(in_features: int, what: str = "in_features") -> None:
    """Raises ValueError unless ``in_features`` is a positive multiple of 32 (one block)."""
    if in_features <= 0 or in_features % QK:
        raise ValueError(
            f"{what} must be a positive multiple of {QK} (the GGUF block size), got {in_features}"
        )


def _round_half_away(v: np.ndarray) -> np.ndarray:
    return np.sign(v) * np.floor(np.abs(v) + np.float32(0.5))


def quantize_blocks(weight: np.ndarray, qtype: str) -> np.ndarray:
    """Quantize ``weight [out, in]`` (float32; ``in`` a multiple of 32) with ggml's rules.

    Returns:
        uint8 ``[out, in / 32 * block_bytes]``: the GGUF tensor data, row by row.

    Raises:
        ValueError: for a weight that is not 2-D, an ``in`` not a multiple of 32, or an
            unknown qtype.
    """
    fmt = qformat(qtype)
    w = np.asarray(weight, dtype=np.float32)
    if w.ndim != 2:
        raise ValueError(f"weight must be 2-D [out_features, in_features], got shape {w.shape}")
    check_in_features(w.shape[1], "weight.shape[1] (in_features)")
    out, n = w.shape
    x = w.reshape(-1, QK)
    with np.errstate(divide="ignore", invalid="ignore"):
        if fmt.name == "q8_0":
            d = np.abs(x).max(axis=1, keepdims=True) / np.float32(127)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            # |x * inv| <= 127 up to f32 rounding, so the int8 cast cannot wrap
            q = _round_half_away(x * inv).astype(np.int8).view(np.uint8)
            head = d.astype(np.float16).view(np.uint8)
        else:
            lo = x.min(axis=1, keepdims=True)
            d = (x.max(axis=1, keepdims=True) - lo) / np.float32(15)
            inv = np.where(d == 0, np.float32(0), np.float32(1) / d).astype(np.float32)
            q = np.trunc((x - lo) * inv + np.float32(0.5)).astype(np.uint8).clip(0, 15)
            q = q[:, :16] | (q[:, 16:] << np.uint8(4))
            head = np.concatenate(
                [d.astype(np.float16).view(np.uint8), lo.astype(np.float16).view(np.uint8)], axis=1
            )
    return np.concatenate([head, q], axis=1).reshape(out, n // QK * fmt.block_bytes)


def _blocks_view(blocks: np.ndarray, shape: tuple[int, int], fmt: QFormat) -> np.ndarray:
    """``blocks`` as uint8 [out * in / 32, block_bytes], after checking its size."""
    out, n = shape
    check_in_features(n, "shape[1] (in_features)")
    raw = np.ascontiguousarray(np.asarray(blocks)).view(np.uint8).reshape(-1)
    want = out * n // QK * fmt.block_bytes
    if raw.size != want:
        raise ValueError(
            f"{fmt.name} blocks of a [{out}, {n}] weight need {want} bytes, got {raw.size}"
        )
    return raw.reshape(-1, fmt.block_bytes)


def pack_blocks(
    blocks: np.ndarray, shape: tuple[int, int], qtype: str
) -> tuple[np.ndarray, np.ndarray]:
    """Regroup GGUF blocks of a weight ``[out, in]`` into the GPU's (qweight, scales) u32
    arrays (module docstring). The bytes are copied unchanged.

    Raises:
        ValueError: for a byte count that does not match ``shape``, an ``in`` not a multiple
            of 32, or an unknown qtype.
    """
    fmt = qformat(qtype)
    out, n = (int(s) for s in shape)
    b = _blocks_view(blocks, (out, n), fmt)
    nb = n // QK
    if fmt.name == "q8_0":
        q = b[:, 2:]
        halves = b[:, :2].reshape(out, nb, 2)
        if nb % 2:
            halves = np.concatenate([halves, np.zeros((out, 1, 2), np.uint8)], axis=1)
    else:
        q = b[:, 4:]
        halves = b[:, :4]
    qweight = np.ascontiguousarray(q).reshape(out, -1).view("<u4").astype(np.uint32)
    scales = np.ascontiguousarray(halves).reshape(out, -1).view("<u4").astype(np.uint32)
    return qweight, scales


def unpack_blocks(qweight: np.ndarray, scales: np.ndarray, qtype: str) -> np.ndarray:
    """Inverse of ``pack_blocks``: uint8 GGUF blocks ``[out, in / 32 * block_bytes]``."""
    fmt = qformat(qtype)
    out = qweight.shape[0]
    per_block = 4 * fmt.q_words  # bytes of q per block
    q = np.ascontiguousarray(qweight, dtype="<u4").view(np.uint8).reshape(out, -1, per_block)
    nb = q.shape[1]
    s = np.ascontiguousarray(scales, dtype="<u4").view(np.uint8).reshape(out, -1)
    head = s[:, : 2 * nb].reshape(out, nb, 2) if fmt.name == "q8_0" else s.reshape(out, nb, 4)
    return np.concatenate([head, q], axis=2).reshape(out, -1)


def dequantize_packed(qweight: np.ndarray, scales: np.ndarray, qtype: str) -> np.ndarray:
    """The float32 weight ``[out, in]`` held by packed (qweight, scales), computed as
    ``gguf.quants.dequantize`` does (``d * q`` and ``d * q + m`` in float32)."""
    fmt = qformat(qtype)
    out = qweight.shape[0]
    q = np.ascontiguousarray(qweight, dtype="<u4").view(np.uint8).reshape(out, -1)
    halves = np.ascontiguousarray(scales, dtype="<u4").view("<f2").astype(np.float32)
    if fmt.name == "q8_0":
        nb = q.shape[1] // QK
        d = halves.reshape(out, -1)[:, :nb, None]
        return (q.view(np.int8).reshape(out, nb, QK).astype(np.float32) * d).reshape(out, -1)
    nb = q.shape[1] // 16
    dm = halves.reshape(out, nb, 2)
    qs = q.reshape(out, nb, 16)
    vals = np.concatenate([qs & 0x0F, qs >> 4], axis=2).astype(np.float32)
    return (dm[:, :, :1] * vals + dm[:, :, 1:]).reshape(out, -1)

"""GGUF Q8_0 / Q4_1 blocks on the host (``meganeura/ops/quant_formats.py``): our quantizer
against ggml's rules as the ``gguf`` package implements them (byte for byte), dequantization
against ``gguf.quants.dequantize``, the packed layout's byte count, and bad input. No GPU."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.ops import quant_formats as qf

QTYPES = ["q8_0", "q4_1"]
rng = np.random.default_rng(5)


def _awkward(out: int, n: int) -> np.ndarray:
    """Normal weights plus the blocks quantizers get wrong: all zero, constant (Q4_1's
    d = 0), exact rounding ties (d = 1 and values k + 0.5: Q8_0 with max 127, Q4_1 with range
    [0, 15]), negative zeros, one huge value beside tiny ones (subnormal-f16 scales)."""
    w = rng.normal(size=(out, n)).astype(np.float32)
    w[0, :32] = 0
    w[0, 32:64] = 0.75
    if n >= 128:
        w[1, 64:96] = np.arange(32, dtype=np.float32) - 15.5
        w[1, 64] = 127
        w[1, 96:128] = np.arange(32, dtype=np.float32) % 15 + 0.5
        w[1, 96], w[1, 97] = 0, 15
    w[1, :32] = -0.0
    w[2, :32] *= 1e-5
    w[2, 32] = 1e4
    return w


def _gguf():
    gguf_quants = pytest.importorskip("gguf.quants")
    from gguf.constants import GGMLQuantizationType as T

    return gguf_quants, {"q8_0": T.Q8_0, "q4_1": T.Q4_1}


@pytest.mark.parametrize("qtype", QTYPES)
@pytest.mark.parametrize("shape", [(3, 128), (5, 96), (4, 576)], ids=["3x128", "5x96", "4x576"])
def test_quantize_matches_gguf_bytes(qtype, shape):
    gq, types = _gguf()
    w = _awkward(*shape)
    ours = qf.quantize_blocks(w, qtype)
    want = gq.quantize(w, types[qtype])
    assert ours.dtype == np.uint8 and ours.shape == want.shape
    np.testing.assert_array_equal(ours, want)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_matches_gguf(qtype):
    gq, types = _gguf()
    w = _awkward(6, 160)  # 5 blocks a row: the last Q8_0 scale word is half used
    blocks = gq.quantize(w, types[qtype])
    qweight, scales = qf.pack_blocks(blocks, w.shape, qtype)
    np.testing.assert_array_equal(
        qf.dequantize_packed(qweight, scales, qtype), gq.dequantize(blocks, types[qtype])
    )
    np.testing.assert_array_equal(qf.unpack_blocks(qweight, scales, qtype), blocks)


@pytest.mark.parametrize("qtype", QTYPES)
def test_dequantize_by_definition(qtype):
    """Without gguf: one block decoded by hand from the GGUF block definition."""
    d, m = np.float16(0.5), np.float16(-1.25)
    if qtype == "q8_0":
        q = np.arange(-16, 16, dtype=np.int8)
        block = np.concatenate([np.array([d]).view(np.uint8), q.view(np.uint8)])
        want = np.float32(d) * q.astype(np.float32)
    else:
        q = np.arange(32, dtype=np.uint8) % 16
        packed = q[:16] | (q[16:] << 4)
        block = np.concatenate([np.array([d, m]).view(np.uint8), packed.astype(np.uint8)])
        want = np.float32(d) * q.astype(np.float32) + np.float32(m)
    qweight, scales = qf.pack_blocks(block, (1, 32), qtype)
    np.testing.assert_array_equal(qf.dequantize_packed(qweight, scales, qtype)[0], want)


@pytest.mark.parametrize("qtype", QTYPES)
def test_quantization_error_bound(qtype):
    """|w - dequantize(quantize(w))| <= d / 2 per block, up to the f16 rounding of d (and m)."""
    w = rng.normal(size=(8, 256)).astype(np.float32)
    qweight, scales = qf.pack_blocks(qf.quantize_blocks(w, qtype), w.shape, qtype)
    err = np.abs(qf.dequantize_packed(qweight, scales, qtype) - w).reshape(-1, 32).max(axis=1)
    blocks = w.reshape(-1, 32)
    if qtype == "q8_0":
        d = np.abs(blocks).max(axis=1) / 127
        bound = d / 2 + 127 * d * 2.0**-11
    else:
        d = (blocks.max(axis=1) - blocks.min(axis=1)) / 15
        bound = d / 2 + 15 * d * 2.0**-11 + np.abs(blocks.min(axis=1)) * 2.0**-11
    assert np.all(err <= bound * (1 + 1e-6))


@pytest.mark.parametrize(
    "qtype,q_shape,s_shape,bytes_per_weight",
    [("q8_0", (7, 144), (7, 9), 1.0625), ("q4_1", (7, 72), (7, 18), 0.625)],
    ids=["q8_0", "q4_1"],
)
def test_packed_shapes_and_memory(qtype, q_shape, s_shape, bytes_per_weight):
    w = rng.normal(size=(7, 576)).astype(np.float32)
    qweight, scales = qf.pack_blocks(qf.quantize_blocks(w, qtype), w.shape, qtype)
    assert qweight.dtype == np.uint32 and scales.dtype == np.uint32
    assert qweight.shape == q_shape and scales.shape == s_shape
    assert (qweight.nbytes + scales.nbytes) / w.size == bytes_per_weight
    assert qf.qformat(qtype).bytes_per_weight() == bytes_per_weight


def test_bad_input_errors():
    with pytest.raises(ValueError, match=r"multiple of 32.*got 40"):
        qf.quantize_blocks(np.zeros((2, 40), np.float32), "q8_0")
    with pytest.raises(ValueError, match="2-D"):
        qf.quantize_blocks(np.zeros(64, np.float32), "q8_0")
    with pytest.raises(ValueError, match=r"qtype must be one of \['q4_1', 'q8_0'\], got 'q4_0'"):
        qf.quantize_blocks(np.zeros((2, 64), np.float32), "q4_0")
    with pytest.raises(
        ValueError, match=r"q4_1 blocks of a \[2, 64\] weight need 80 bytes, got 68"
    ):
        qf.pack_blocks(np.zeros(68, np.uint8), (2, 64), "q4_1")

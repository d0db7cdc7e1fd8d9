"""Op-database entries for the attention family (``meganeura/ops/attention.py``).

scaled_dot_product_attention samples: sequence lengths 1, 3, 7, 64 and 129; head dims 8 and 64
(plus 6 with Dv 3, not multiples of 4); cross attention (Lq != Lk both ways, causal too, with
PyTorch's top-left alignment); grouped-query heads 6/2 and 9/3; additive masks with -inf
entries, of shapes [Lk], [B, 1, Lq, Lk] and [B, H, Lq, Lk], including fully masked rows;
an explicit scale; large logits. The mask is never differentiated (it gets no gradient).

Fully masked rows are where we differ from PyTorch on purpose (zeros, not NaN): the reference
runs torch's own SDPA with those rows' masks replaced by 0 and then zeroes the rows, so their
outputs and gradients are exactly zero on both sides.

sdpa_dropout (``dropout_p > 0``: the explicit path, differentiated by autodiff) samples: no
mask; causal grouped-query cross attention (Lq 5 < Lk 9); a mask with a fully masked row and
Dv 3; dropout_p = 1 (zeros). The reference is PyTorch's math formula with the keep mask of
``meganeura.ops.dropout.keep_mask`` for the [B, Hq, Lq, Lk] probabilities.

sdpa_kv_length (a runtime key count ``kv_length``, decoding with a KV cache; forward only, it
has no gradient) samples: decode (Lq 1) and chunked prefill after a cache (Lq 4), B 2 with
different lengths per sequence, GQA 9/3, D 64, causal (lower-right) and not, with a bool
left-padding mask or an additive per-head mask with -inf padding, a scalar length, lengths 0
and past Lk (clamped), and ``causal_lower_right(Lq, Lk)`` as attn_mask. The reference is torch
SDPA per sequence on the keys it keeps, with an explicit lower-right mask (a row with no key
gives zeros).

apply_rotary_emb samples: L 1, 3, 7, 129; D 2, 8, 64; theta 1e4 and 1e5 (SmolLM2); a far
position offset (8000); a 3-d input; a run-time i32 offset, one value or one per batch row.
The reference is HF's ``rotate_half`` formula in float64.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as TF

from meganeura.dtypes import DType
from meganeura.ops.attention import apply_rotary_emb, scaled_dot_product_attention
from meganeura.ops.dropout import keep_mask

from . import OpInfo, Sample

SDPA_OPS = (
    "scaled_dot_product_attention",
    "scaled_dot_product_attention_lse",
    "scaled_dot_product_attention_delta",
    "scaled_dot_product_attention_backward_query",
    "scaled_dot_product_attention_backward_key",
    "scaled_dot_product_attention_backward_value",
)


def _sdpa_ref(q, k, v, attn_mask=None, is_causal=False, scale=None, enable_gqa=False):
    """torch SDPA with fully masked rows giving zeros (and zero gradients) instead of NaN."""
    full = None
    if attn_mask is not None:
        shape = (q.shape[0], q.shape[1], q.shape[2], k.shape[2])
        mask = attn_mask.expand(shape)
        full = torch.isneginf(mask).all(-1, keepdim=True)
        attn_mask = torch.where(full, 0.0, mask)
    out = TF.scaled_dot_product_attention(
        q, k, v, attn_mask, is_causal=is_causal, scale=scale, enable_gqa=enable_gqa
    )
    return out if full is None else torch.where(full, 0.0, out)


def _qkv(rng, b, hq, hkv, lq, lk, d, dv=None, qscale=1.0):
    return (
        rng.standard_normal((b, hq, lq, d)) * qscale,
        rng.standard_normal((b, hkv, lk, d)),
        rng.standard_normal((b, hkv, lk, dv or d)),
    )


def _mask(rng, shape, p_inf=0.3):
    m = rng.standard_normal(shape)
    m[rng.random(shape) < p_inf] = -np.inf
    return m


def _sdpa_samples(rng):
    def s(name, dims, mask=None, grad=(0, 1, 2), rtol=None, qscale=1.0, **kw):
        args = _qkv(rng, *dims, qscale=qscale) + (() if mask is None else (mask,))
        return Sample(args, kw, name, grad, rtol)

    m_bcast = _mask(rng, (2, 1, 7, 9))
    m_bcast[1, 0, 4, :] = -np.inf  # a fully masked row
    m_full = _mask(rng, (1, 2, 3, 64))
    m_full[0, 1, 0, :] = -np.inf
    m_keys = np.zeros(129)
    m_keys[100:] = -np.inf  # key padding
    m_gqa = _mask(rng, (1, 6, 7, 7), 0.2)
    m_gqa[0, 5, 6, :] = -np.inf
    return [
        s("l1_d8", (1, 2, 2, 1, 1, 8)),
        s("l3_d8_b2", (2, 2, 2, 3, 3, 8)),
        s("l7_d64", (1, 2, 2, 7, 7, 64)),
        s("l64_d64_causal", (1, 2, 2, 64, 64, 64), is_causal=True),
        s("l129_d8_causal", (1, 1, 1, 129, 129, 8), is_causal=True),
        s("cross_lq7_lk129", (1, 2, 2, 7, 129, 8)),
        s("cross_lq64_lk3_d64", (1, 1, 1, 64, 3, 64)),
        s("cross_d6_dv3", (2, 1, 1, 3, 7, 6, 3)),
        s("causal_lq7_lk3", (1, 2, 2, 7, 3, 8), is_causal=True),
        s("causal_lq3_lk7", (1, 2, 2, 3, 7, 8), is_causal=True),
        s("gqa_6_2_causal", (1, 6, 2, 7, 7, 8), is_causal=True, enable_gqa=True),
        s("gqa_9_3_l64_d64", (1, 9, 3, 64, 64, 64), enable_gqa=True),
        s("gqa_9_3_decode", (2, 9, 3, 1, 129, 64), enable_gqa=True),
        s("mask_bcast_full_row", (2, 2, 2, 7, 9, 8), m_bcast),
        s("mask_per_head_full_row", (1, 2, 2, 3, 64, 64), m_full),
        s("mask_key_padding", (1, 2, 2, 3, 129, 8), m_keys),
        s("mask_gqa_6_2", (1, 6, 2, 7, 7, 8), m_gqa, enable_gqa=True),
        s("scale", (1, 2, 2, 7, 9, 8), scale=0.3),
        s("large_logits", (1, 2, 2, 7, 9, 8), qscale=30.0),
    ]


# ---- attention dropout ------------------------------------------------------------------------
DROPOUT_SEED = 97531


def _sdpa_dropout(q, k, v, attn_mask=None, dropout_p=0.0, **kw):
    seed = q.builder.constant(DROPOUT_SEED, DType.u32)
    return scaled_dot_product_attention(q, k, v, attn_mask, dropout_p, seed=seed, **kw)


def _sdpa_dropout_ref(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                      enable_gqa=False):  # fmt: skip
    return sdpa_dropout_math(q, k, v, attn_mask, dropout_p, is_causal, scale, DROPOUT_SEED)


def sdpa_dropout_math(q, k, v, attn_mask, dropout_p, is_causal, scale, seed):
    """PyTorch's math reference of SDPA, its dropout drawing the keep mask of
    ``meganeura.ops.dropout.keep_mask`` for ``seed``; fully masked rows give zeros (our
    rule). Operands are 4-d torch tensors."""
    b, hq, lq, d = q.shape
    lk, group = k.shape[2], hq // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = q @ k.transpose(-2, -1) * (1.0 / math.sqrt(d) if scale is None else scale)
    if attn_mask is not None:
        s = s + attn_mask
    if is_causal:
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool).triu(1), -math.inf)
    full = torch.isneginf(s).all(-1, keepdim=True)
    p = torch.where(full, 0.0, torch.softmax(torch.where(full, 0.0, s), -1))
    keep = torch.from_numpy(keep_mask(seed, (b, hq, lq, lk), dropout_p))
    return torch.where(keep, p / (1.0 - dropout_p), 0.0) @ v


def _sdpa_dropout_samples(rng):
    m = _mask(rng, (1, 1, 3, 6))
    m[0, 0, 1, :] = -np.inf  # a fully masked row
    return [
        Sample(_qkv(rng, 1, 2, 2, 7, 7, 8), {"dropout_p": 0.3}, "p03_l7_d8", (0, 1, 2)),
        Sample(
            _qkv(rng, 2, 4, 2, 5, 9, 8),
            {"dropout_p": 0.2, "is_causal": True, "enable_gqa": True},
            "p02_causal_gqa_cross",
            (0, 1, 2),
        ),
        Sample(
            _qkv(rng, 1, 2, 2, 3, 6, 4, 3) + (m,),
            {"dropout_p": 0.5},
            "p05_mask_full_row_dv3",
            (0, 1, 2),
        ),  # fmt: skip
        Sample(_qkv(rng, 1, 1, 1, 3, 5, 4), {"dropout_p": 1.0}, "p1_zeros", ()),
    ]


def _rope_ref(x, theta=10000.0, position_offset=0):
    if isinstance(position_offset, torch.Tensor) and position_offset.numel() > 1:
        rows = [_rope_ref(x[b : b + 1], theta, int(p)) for b, p in enumerate(position_offset)]
        return torch.cat(rows)
    if isinstance(position_offset, torch.Tensor):
        position_offset = int(position_offset)
    length, dim = x.shape[-2:]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    pos = torch.arange(length, dtype=torch.float64) + position_offset
    emb = torch.outer(pos, inv_freq).repeat(1, 2)
    x1, x2 = x[..., : dim // 2], x[..., dim // 2 :]
    return x * emb.cos() + torch.cat([-x2, x1], dim=-1) * emb.sin()


def _rope_samples(rng):
    def s(name, shape, *extra, **kw):
        return Sample((rng.standard_normal(shape), *extra), kw, name)

    return [
        s("l1_d8", (1, 2, 1, 8)),
        s("l3_d2", (2, 1, 3, 2)),
        s("l7_d64_theta1e5", (1, 3, 7, 64), theta=100000.0),
        s("l129_d64", (1, 2, 129, 64)),
        s("offset_8000", (1, 2, 3, 64), position_offset=8000),
        s("3d", (2, 5, 8)),
        s("tensor_offset", (1, 2, 3, 8), 100000.0, np.array(37, np.int32)),
        s("per_row_offset", (3, 2, 4, 64), 100000.0, np.array([0, 5, 9000], np.int32)),
        s("per_row_offset_decode", (2, 3, 1, 8), 10000.0, np.array([7, 0], np.int32)),
    ]


# ---- attention with a runtime key count ---------------------------------------------------------
def _sdpa_kv(q, k, v, kv_length, attn_mask=None, **kw):
    if isinstance(kv_length, str):  # "lower_right": causal_lower_right as the mask
        from meganeura.nn.attention import causal_lower_right

        bias = causal_lower_right(q.shape[2], k.shape[2])
        return scaled_dot_product_attention(q, k, v, bias, enable_gqa=True)
    return scaled_dot_product_attention(q, k, v, attn_mask, kv_length=kv_length, **kw)


def _sdpa_kv_ref(q, k, v, kv_length, attn_mask=None, is_causal=False, enable_gqa=False):
    """torch SDPA per sequence on its first kv_length[b] keys, causal aligned lower-right
    by an explicit bool mask; rows that see no key give zeros (our rule)."""
    b, _, lq, _ = q.shape
    lk = k.shape[2]
    if isinstance(kv_length, str):
        kv_length, is_causal = torch.tensor(lk), True
    lengths = kv_length.reshape(-1).expand(b).clamp(0, lk)
    rows = []
    for i in range(b):
        n = int(lengths[i])
        keep = torch.ones(lq, n, dtype=torch.bool)
        if is_causal:
            keep = torch.arange(n)[None, :] <= n - lq + torch.arange(lq)[:, None]
        add = torch.zeros(q.shape[1], lq, n, dtype=q.dtype)
        if attn_mask is not None:
            m = attn_mask.expand(b, q.shape[1], lq, lk)[i, :, :, :n]
            if m.dtype == torch.bool:
                keep = keep & m
            else:  # additive: -inf entries are masked, the others added
                keep = keep & ~torch.isneginf(m)
                add = torch.where(torch.isneginf(m), 0.0, m)
        keep = keep.expand(q.shape[1], lq, n)
        full = ~keep.any(-1, keepdim=True)
        if n == 0:
            rows.append(torch.zeros_like(q[i]))
            continue
        bias = torch.where(keep | full, add, -torch.inf)
        out = TF.scaled_dot_product_attention(
            q[i : i + 1], k[i : i + 1, :, :n], v[i : i + 1, :, :n], bias, enable_gqa=True
        )[0]
        rows.append(torch.where(full, 0.0, out))
    return torch.stack(rows)


def _sdpa_kv_samples(rng):
    def s(name, lq, lengths, lk=40, mask=None, **kw):
        args = _qkv(rng, 2, 9, 3, lq, lk, 64) + (np.array(lengths, np.int32),)
        kw = dict(kw, enable_gqa=True)
        return Sample(args + ((mask,) if mask is not None else ()), kw, name)

    pad = np.ones((2, 1, 1, 40), bool)
    pad[0, ..., :3] = False  # sequence 0 is left-padded by 3 slots
    additive = rng.standard_normal((2, 9, 4, 40))
    additive[1, ..., :2] = -np.inf  # sequence 1 is left-padded by 2 slots
    return [
        s("decode", 1, [17, 33]),
        s("decode_causal", 1, [17, 40], is_causal=True),
        s("prefill_chunk_causal", 4, [9, 30], is_causal=True),
        s("prefill_chunk", 4, [9, 30]),
        s("left_pad_causal", 4, [12, 30], mask=pad, is_causal=True),
        s("additive_mask_causal", 4, [12, 30], mask=additive, is_causal=True),
        s("scalar_length", 3, 21, is_causal=True),
        s("zero_and_past_end", 2, [0, 55], lk=9, is_causal=True),
        Sample(_qkv(rng, 2, 9, 3, 5, 12, 64) + ("lower_right",), {}, "causal_lower_right"),
    ]


ENTRIES = [
    OpInfo(
        "scaled_dot_product_attention",
        scaled_dot_product_attention,
        _sdpa_ref,
        _sdpa_samples,
        SDPA_OPS,
    ),
    OpInfo(
        "sdpa_dropout",
        _sdpa_dropout,
        _sdpa_dropout_ref,
        _sdpa_dropout_samples,
        ("matmul", "softmax", "amax", "isneginf", "arange", "dropout"),
    ),
    OpInfo("apply_rotary_emb", apply_rotary_emb, _rope_ref, _rope_samples, ("apply_rotary_emb",)),
    OpInfo(
        "sdpa_kv_length",
        _sdpa_kv,
        _sdpa_kv_ref,
        _sdpa_kv_samples,
        ("scaled_dot_product_attention",),
        differentiable=False,
    ),
]

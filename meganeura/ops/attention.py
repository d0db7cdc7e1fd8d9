"""Attention ops: scaled_dot_product_attention (flash-style, with its backward ops) and rotary
position embeddings.

``scaled_dot_product_attention(q [B,Hq,Lq,D], k [B,Hkv,Lk,D], v [B,Hkv,Lk,Dv], mask?)`` follows
torch.nn.functional.scaled_dot_product_attention: ``softmax(q k^T * scale + mask) v`` with an
additive float mask broadcastable to [B,Hq,Lq,Lk], causal masking aligned top-left (query i
sees keys j <= i, PyTorch's convention) and grouped-query heads (head h reads kv head
h // (Hq / Hkv)). One difference, on purpose: a row whose every score is -inf (fully masked)
gives zeros and zero gradients, where PyTorch gives NaN. An entry counts as masked when its
mask value is exactly -inf or the causal rule excludes it; finite masks, however negative
(HF's finfo.min), are added like any other value.

A node has one output in this IR, so the forward's per-row log-sum-exp is its own node,
``..._lse(q, k, mask?)``, which the backward creates; inference pays nothing for it. With
fusion on, the scheduler has the forward's kernel write it too (FlashAttention-2 saves L in
its forward: Dao 2023, Algorithm 1), at the forward's position (``passes.fuse
.plan_attention_lse``), so no pass over the keys is repeated; unfused, it is one more pass.
Gradients come from dedicated ops (not differentiated again) that
recompute the probabilities ``p = exp(s - lse)`` tile by tile, as FlashAttention-2 does
(Dao 2023, Algorithm 2):
  * ``..._lse(q, k, mask?)`` -> f32[B,Hq,Lq]: per query row the log-sum-exp of its scores
    (0 for a fully masked row, whose probabilities are all zero anyway);
  * ``..._delta(lse, out, g)`` -> f32[B,Hq,Lq,2]: the stats the gradient ops read, per query
    row ``(lse, delta = sum(g * out))``: one cheap pass over out and g;
  * ``..._stats(q, k, out, g, mask?)`` -> f32[B,Hq,Lq,2]: the same stats in one pass over the
    keys (what the backward used before ``_lse``; kept for graphs that name it);
  * ``..._backward_query/key/value`` read it: ``dp = g v^T``, ``ds = p (dp - delta)``,
    ``dq = scale ds k``, ``dk = scale ds^T q``, ``dv = p^T g``; dk and dv sum over the query
    heads that share a kv head; each op recomputes ``q k^T`` (four passes in all, where a
    fused FlashAttention-2 backward makes two; with fusion on, the scheduler has one kernel
    compute the dk and dv ops of an attention together where its plan allows, see
    ``passes.fuse.plan_attention_key_value``: three passes). The mask gets no gradient (it
    is an input or a constant); a mask that is a trainable parameter is treated as a
    constant.

A runtime key count (``kv_length``, decoding with a KV cache): the forward op takes a trailing
i32 operand ``kv_length`` of shape [] or [B] after the optional mask, ``(q, k, v, mask?,
kv_length?)``; keys ``j >= kv_length[b]`` of sequence b are masked and not read (the kernel's key
loop stops there), and with ``is_causal`` the causal rule is aligned lower-right: query i of Lq
sees keys ``j <= kv_length[b] - Lq + i`` (flash-attn's ``flash_attn_with_kvcache(cache_seqlens=)``;
torch.nn.attention.bias.causal_lower_right when kv_length = Lk). Values are clamped to [0, Lk].
It has no gradient (differentiating it raises ValueError): training does not need it.

With ``dropout_p > 0`` the user function does not use these ops: it builds PyTorch's math
reference from matmul, softmax (a masked softmax where masks or causality apply, giving the
same zeros for fully masked rows) and ``dropout``, and autodiff differentiates that.

``apply_rotary_emb(x [..., L, D], offset?)`` rotates the halves of the last dim (HF
``rotate_half``): ``out = x cos + rotate_half(x) sin`` with angle ``pos * theta^(-2i/D)``,
pos = position_offset + offset + l, where the optional i32 operand ``offset`` is [] (or [1]),
or [B] for x [B, ..., L, D]: one first position per batch row (batched decoding of
left-padded prompts).
Its gradient is the transposed rotation: the same op with ``inverse`` (sin negated).
"""

from __future__ import annotations

import math

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor
from ..graph.ir import TensorType
from .registry import OpDef, ShapeError

SDPA = "scaled_dot_product_attention"
STATS = f"{SDPA}_stats"
LSE = f"{SDPA}_lse"
DELTA = f"{SDPA}_delta"
BWD_Q, BWD_K, BWD_V = (f"{SDPA}_backward_{s}" for s in ("query", "key", "value"))
MAX_POSITION = 2**31  # positions are u32 in the kernel; keep clear of the top bit


# ---- type rules -------------------------------------------------------------------------------
def _floating4(t: TensorType, what: str) -> None:
    if t.ndim != 4 or not t.dtype.is_floating:
        raise ShapeError(f"{what} must be a floating [B, H, L, D] tensor, got {t}")


def attention_dims(q: TensorType, k: TensorType, v: TensorType | None, mask: TensorType | None):
    """(B, Hq, Hkv, Lq, Lk, D, Dv) after checking the operands; Dv is None without ``v``."""
    _floating4(q, "query")
    _floating4(k, "key")
    b, hq, lq, d = q.shape
    _, hkv, lk, _ = k.shape
    if k.shape[0] != b or k.shape[3] != d:
        raise ShapeError(f"key must be [{b}, Hkv, Lk, {d}] to match query {q}, got {k}")
    if v is not None:
        _floating4(v, "value")
        if v.shape[:3] != k.shape[:3]:
            raise ShapeError(f"value must be [{b}, {hkv}, {lk}, Dv] to match key {k}, got {v}")
    if hkv == 0 or hq % hkv:
        raise ShapeError(f"query heads ({hq}) must be a multiple of key/value heads ({hkv})")
    if min(lq, lk, d, v.shape[3] if v is not None else 1) == 0:
        raise ShapeError(f"sequence lengths and head dims must be positive: q {q}, k {k}, v {v}")
    if any(t.dtype is not q.dtype for t in (k, v, mask) if t is not None):
        raise ShapeError(f"operands must share one dtype: q {q}, k {k}, v {v}, mask {mask}")
    if mask is not None:
        full = (b, hq, lq, lk)
        pad = (1,) * (4 - mask.ndim) + mask.shape if mask.ndim <= 4 else None
        if pad is None or any(s not in (1, f) for s, f in zip(pad, full)):
            raise ShapeError(f"attn_mask {mask} does not broadcast to [B, Hq, Lq, Lk] = {full}")
    return b, hq, hkv, lq, lk, d, (v.shape[3] if v is not None else None)


def _check_attrs(attrs) -> None:
    if not isinstance(attrs.get("is_causal"), bool):
        raise ShapeError(f"is_causal must be a bool, got {attrs.get('is_causal')!r}")
    scale = attrs.get("scale")
    if not isinstance(scale, float) or not math.isfinite(scale):
        raise ShapeError(f"scale must be a finite float, got {scale!r}")


def _opt(types, n: int):
    """The optional trailing mask operand of an op with ``n`` fixed operands."""
    if len(types) not in (n, n + 1):
        raise ShapeError(f"expects {n} operands and an optional mask, got {len(types)}")
    return types[n] if len(types) == n + 1 else None


def split_extras(types, n: int):
    """(mask, kv_length) of the forward op's trailing operands after its ``n`` fixed ones:
    a floating mask and/or, last, an integer kv_length (each optional)."""
    extra = list(types[n:])
    kvlen = extra.pop() if extra and not extra[-1].dtype.is_floating else None
    if len(extra) > 1:
        raise ShapeError(f"expects {n} operands, a mask and a kv_length, got {len(types)}")
    return (extra[0] if extra else None), kvlen


def _sdpa_type(types, attrs):
    _check_attrs(attrs)
    mask, kvlen = split_extras(types, 3)
    b, hq, _, lq, _, _, dv = attention_dims(*types[:3], mask)
    if kvlen is not None and (kvlen.dtype is not DType.i32 or kvlen.shape not in ((), (b,))):
        raise ShapeError(f"kv_length must be i32[] or i32[{b}], got {kvlen}")
    return TensorType((b, hq, lq, dv), types[0].dtype)


def _stats_type(types, attrs):
    _check_attrs(attrs)
    mask = _opt(types, 4)
    q, k, out, g = types[:4]
    b, hq, _, lq, _, _, _ = attention_dims(q, k, None, mask)
    if out.ndim != 4 or out.shape[:3] != (b, hq, lq) or g != out or out.dtype is not q.dtype:
        raise ShapeError(f"out and its gradient must be [{b}, {hq}, {lq}, Dv], got {out}, {g}")
    return TensorType((b, hq, lq, 2), DType.f32)


def _lse_type(types, attrs):
    _check_attrs(attrs)
    mask = _opt(types, 2)
    b, hq, _, lq, _, _, _ = attention_dims(types[0], types[1], None, mask)
    return TensorType((b, hq, lq), DType.f32)


def _delta_type(types, attrs):
    if len(types) != 3:
        raise ShapeError(f"expects (lse, out, g), got {len(types)} operands")
    lse, out, g = types
    if out.ndim != 4 or not out.dtype.is_floating or g != out:
        raise ShapeError(f"out and its gradient must be one floating [B, H, L, Dv], got {out}, {g}")
    if lse != TensorType(out.shape[:3], DType.f32):
        raise ShapeError(f"lse must be f32{list(out.shape[:3])}, got {lse}")
    return TensorType(out.shape[:3] + (2,), DType.f32)


def _check_backward(q, k, v, g, stats, mask) -> None:
    b, hq, _, lq, _, _, dv = attention_dims(q, k, v, mask)
    if g != TensorType((b, hq, lq, dv), q.dtype):
        raise ShapeError(f"upstream gradient must be [{b}, {hq}, {lq}, {dv}], got {g}")
    if stats != TensorType((b, hq, lq, 2), DType.f32):
        raise ShapeError(f"stats must be f32[{b}, {hq}, {lq}, 2], got {stats}")


def _bwd_type(which: int):
    def rule(types, attrs):
        _check_attrs(attrs)
        mask = _opt(types, 5)
        q, k, v, g, stats = types[:5]
        _check_backward(q, k, v, g, stats, mask)
        return types[which]

    return rule


def _bwd_v_type(types, attrs):
    _check_attrs(attrs)
    mask = _opt(types, 4)
    q, k, g, stats = types[:4]
    v = TensorType(k.shape[:3] + g.shape[3:], k.dtype) if g.ndim == 4 else g
    _check_backward(q, k, v, g, stats, mask)
    return v


# ---- NumPy references (our semantics: fully masked rows are zero) ------------------------------
def _scores(q, k, mask, attrs, kvlen=None):
    """(scores with -inf where masked, masked flags), both [B, Hq, Lq, Lk]; GQA repeats k.
    With ``kvlen`` (per sequence) keys past it are masked and causality is lower-right."""
    group = q.shape[1] // k.shape[1]
    s = q @ np.repeat(k, group, axis=1).swapaxes(-1, -2) * attrs["scale"]
    masked = np.zeros(s.shape, bool)
    if mask is not None:
        mask = np.broadcast_to(mask, s.shape)
        masked |= np.isneginf(mask)
        s = s + np.where(masked, 0, mask)
    lq, lk = s.shape[-2:]
    if kvlen is not None:
        n = np.clip(np.broadcast_to(np.asarray(kvlen, np.int64), (s.shape[0],)), 0, lk)
        n = n[:, None, None, None]
        masked |= np.arange(lk)[None, None, None, :] >= n
        if attrs["is_causal"]:
            last = n - lq + np.arange(lq)[None, None, :, None]
            masked |= np.arange(lk)[None, None, None, :] > last
    elif attrs["is_causal"]:
        masked |= np.arange(lk)[None, :] > np.arange(lq)[:, None]
    return np.where(masked, -np.inf, s), masked


def _softmax_rows(s, masked):
    """(probabilities, log-sum-exp): rows with every entry masked get p = 0 and lse = 0."""
    m = np.max(np.where(masked, -np.inf, s), axis=-1, keepdims=True)
    m = np.where(np.isfinite(m), m, 0)
    e = np.where(masked, 0, np.exp(np.where(masked, 0, s - m)))
    total = e.sum(-1, keepdims=True)
    live = total > 0
    p = e / np.where(live, total, 1)
    lse = np.where(live, m + np.log(np.where(live, total, 1)), 0)
    return p, lse[..., 0]


def _sdpa_np(xs, attrs):
    q, k, v, *extra = xs
    kvlen = extra.pop() if extra and not np.issubdtype(extra[-1].dtype, np.floating) else None
    s, masked = _scores(q, k, extra[0] if extra else None, attrs, kvlen)
    p, _ = _softmax_rows(s, masked)
    return (p @ np.repeat(v, q.shape[1] // k.shape[1], axis=1)).astype(q.dtype)


def _stats_np(xs, attrs):
    q, k, out, g = xs[:4]
    s, masked = _scores(q, k, xs[4] if len(xs) > 4 else None, attrs)
    _, lse = _softmax_rows(s, masked)
    return np.stack([lse, np.sum(g * out, axis=-1)], axis=-1).astype(q.dtype)


def _lse_np(xs, attrs):
    s, masked = _scores(xs[0], xs[1], xs[2] if len(xs) > 2 else None, attrs)
    return _softmax_rows(s, masked)[1].astype(np.result_type(xs[0].dtype, np.float32))


def _delta_np(xs, attrs):
    lse, out, g = xs
    dtype = np.result_type(lse.dtype, out.dtype, np.float32)  # f32, or f64 (interpret float64)
    delta = np.sum(g.astype(dtype) * out.astype(dtype), axis=-1)
    return np.stack([lse.astype(dtype), delta], axis=-1)


def _probs_from_stats(q, k, stats, mask, attrs):
    s, masked = _scores(q, k, mask, attrs)
    lse = stats[..., 0:1].astype(q.dtype)
    return np.where(masked, 0, np.exp(np.where(masked, 0, s - lse)))


def _sum_groups(x, hkv):
    """[B, Hq, L, E] -> [B, Hkv, L, E], summing the query heads that share a kv head."""
    b, hq, n, e = x.shape
    return x.reshape(b, hkv, hq // hkv, n, e).sum(axis=2)


def _ds(q, k, v, g, stats, mask, attrs):
    p = _probs_from_stats(q, k, stats, mask, attrs)
    dp = g @ np.repeat(v, q.shape[1] // k.shape[1], axis=1).swapaxes(-1, -2)
    return p * (dp - stats[..., 1:2].astype(q.dtype))


def _bwd_q_np(xs, attrs):
    q, k, v, g, stats = xs[:5]
    ds = _ds(q, k, v, g, stats, xs[5] if len(xs) > 5 else None, attrs)
    dq = ds @ np.repeat(k, q.shape[1] // k.shape[1], axis=1) * attrs["scale"]
    return dq.astype(q.dtype)


def _bwd_k_np(xs, attrs):
    q, k, v, g, stats = xs[:5]
    ds = _ds(q, k, v, g, stats, xs[5] if len(xs) > 5 else None, attrs)
    return (_sum_groups(ds.swapaxes(-1, -2) @ q, k.shape[1]) * attrs["scale"]).astype(k.dtype)


def _bwd_v_np(xs, attrs):
    q, k, g, stats = xs[:4]
    p = _probs_from_stats(q, k, stats, xs[4] if len(xs) > 4 else None, attrs)
    return _sum_groups(p.swapaxes(-1, -2) @ g, k.shape[1]).astype(k.dtype)


def _sdpa_grad(node, ins, out, g):
    q, k, v, *mask = ins
    if mask and not mask[-1].dtype.is_floating:
        raise ValueError(
            f"{SDPA} %{node.id} at {node.loc or '?'}: attention with kv_length= has no gradient "
            "(it serves decoding with a KV cache); differentiate an attention without it"
        )
    b, a = q.builder, node.attr_dict
    lse = b.add(LSE, [q, k, *mask], a)  # fused into the forward's kernel where it can be
    stats = b.add(DELTA, [lse, out, g])
    dq = b.add(BWD_Q, [q, k, v, g, stats, *mask], a)
    dk = b.add(BWD_K, [q, k, v, g, stats, *mask], a)
    dv = b.add(BWD_V, [q, k, g, stats, *mask], a)
    return (dq, dk, dv, *(None for _ in mask))


# ---- rotary position embedding ----------------------------------------------------------------
def _rope_type(types, attrs):
    x, *offset = types
    if x.ndim < 2 or not x.dtype.is_floating or x.shape[-1] % 2:
        raise ShapeError(f"expects a floating [..., L, D] tensor with D even, got {x}")
    batch = ((x.shape[0],),) if x.ndim >= 3 else ()
    if offset and (offset[0].dtype is not DType.i32 or offset[0].shape not in ((), (1,), *batch)):
        want = f"i32[], i32[1] or i32[{x.shape[0]}] (one per batch row)" if batch else "i32[]"
        raise ShapeError(f"a position offset operand must be {want}, got {offset[0]}")
    theta, start = attrs.get("theta"), attrs.get("position_offset")
    if not isinstance(theta, float) or not theta > 0 or not math.isfinite(theta):
        raise ShapeError(f"theta must be a positive finite float, got {theta!r}")
    if not isinstance(start, int) or not 0 <= start <= MAX_POSITION - x.shape[-2]:
        raise ShapeError(f"position_offset must be an int in [0, 2^31 - L], got {start!r}")
    if not isinstance(attrs.get("inverse"), bool):
        raise ShapeError(f"inverse must be a bool, got {attrs.get('inverse')!r}")
    return x


def rope_angles(length: int, dim: int, theta: float, offset: int) -> np.ndarray:
    """float64 [L, D/2] angles ``(offset + l) * theta^(-2i/D)``."""
    inv_freq = theta ** (-np.arange(dim // 2, dtype=np.float64) * 2 / dim)
    return np.outer(np.arange(length, dtype=np.float64) + offset, inv_freq)


def _rope_np(xs, attrs):
    x = xs[0]
    offsets = np.ravel(xs[1]).astype(np.int64) if len(xs) > 1 else np.zeros(1, np.int64)
    if offsets.size > 1:  # one first position per batch row
        return np.stack(
            [_rope_np([x[b : b + 1], offsets[b : b + 1]], attrs)[0] for b in range(x.shape[0])]
        )
    start = attrs["position_offset"] + int(offsets[0])
    ang = rope_angles(x.shape[-2], x.shape[-1], attrs["theta"], start)
    cos, sin = np.cos(ang), np.sin(ang) * (-1.0 if attrs["inverse"] else 1.0)
    x1, x2 = np.split(x, 2, axis=-1)
    out = np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x.dtype)


def _rope_grad(node, ins, out, g):
    a = dict(node.attr_dict, inverse=not node.attr("inverse"))
    return (g.builder.add("apply_rotary_emb", [g, *ins[1:]], a), *(None for _ in ins[1:]))


DEFS = [
    OpDef(SDPA, _sdpa_type, _sdpa_np, _sdpa_grad),
    OpDef(STATS, _stats_type, _stats_np, differentiable=False),
    OpDef(LSE, _lse_type, _lse_np, differentiable=False),
    OpDef(DELTA, _delta_type, _delta_np, differentiable=False),
    OpDef(BWD_Q, _bwd_type(0), _bwd_q_np, differentiable=False),
    OpDef(BWD_K, _bwd_type(1), _bwd_k_np, differentiable=False),
    OpDef(BWD_V, _bwd_v_type, _bwd_v_np, differentiable=False),
    OpDef("apply_rotary_emb", _rope_type, _rope_np, _rope_grad),
]


# ---- attention with dropout, from existing ops --------------------------------------------------
LOWEST_F32 = -3.4028234663852886e38  # below every finite score: the max of a fully masked row


def _masked_softmax(s: Tensor, masked: Tensor) -> Tensor:
    """Softmax over the last dim of ``s`` where ``masked`` entries count as -inf, with no inf
    arithmetic (compilers may assume floats are finite): a fully masked row gives zeros. The
    row max is a constant to autodiff (the softmax does not depend on it)."""
    from . import functional as F

    m = F.stop_gradient(F.amax(F.where(masked, LOWEST_F32, s), -1, keepdim=True))
    e = F.where(masked, 0.0, F.exp(F.where(masked, 0.0, s - m)))
    total = F.sum(e, -1, keepdim=True)
    return e / F.where(F.greater(total, 0.0), total, 1.0)


def _attention_with_dropout(q, k, v, mask, dropout_p, is_causal, scale, seed) -> Tensor:
    """PyTorch's math reference of SDPA with our masking rules: scores ``q k^T * scale``
    (kv heads shared by ``Hq / Hkv`` query heads through a broadcast batch dim), the finite
    entries of ``mask`` added (it gets no gradient), -inf entries and the causal rule masked,
    softmax, dropout of the probabilities with ``seed`` (``ops.dropout``: the mask is a hash
    of the element index of the [B, Hq, Lq, Lk] probabilities), then ``@ v``."""
    from . import functional as F
    from .creation import arange
    from .dropout import dropout
    from .elementwise import isneginf, logical_or

    b, hq, lq, d = q.shape
    _, hkv, lk, dv = v.shape
    group = hq // hkv
    q5 = F.reshape(q, (b, hkv, group, lq, d))
    k5, v5 = (F.reshape(t, (b, hkv, 1) + t.shape[2:]) for t in (k, v))
    s = F.reshape(F.matmul(q5, F.transpose(k5, -2, -1)), (b, hq, lq, lk)) * scale
    masked = None
    if mask is not None:
        mask = F.stop_gradient(mask)
        masked = isneginf(mask)
        s = s + F.where(masked, 0.0, mask)
    if is_causal:  # key j > query i is masked (top-left aligned, as PyTorch)
        col = F.reshape(arange(lk, builder=q.builder), (1, lk))
        causal = F.greater(col, F.reshape(arange(lq, builder=q.builder), (lq, 1)))
        masked = causal if masked is None else logical_or(masked, causal)
    p = F.softmax(s, -1) if masked is None else _masked_softmax(s, masked)
    p = dropout(p, dropout_p, True, seed=seed)
    out = F.matmul(F.reshape(p, (b, hkv, group, lq, lk)), v5)
    return F.reshape(out, (b, hq, lq, dv))


# ---- user functions ---------------------------------------------------------------------------
def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    scale: float | None = None,
    enable_gqa: bool = False,
    kv_length: Tensor | int | None = None,
    *,
    seed: Tensor | None = None,
) -> Tensor:
    """Attention ``softmax(query key^T * scale + attn_mask) value`` as one fused kernel; with
    ``dropout_p > 0``, dropout on the attention probabilities before ``@ value``.

    Follows torch.nn.functional.scaled_dot_product_attention (PyTorch 2.5+ docs), except that a
    query row whose scores are all -inf gives zeros (and zero gradients), not NaN.

    With ``dropout_p > 0`` attention is computed from existing ops as PyTorch's math
    reference does (matmul, scale, mask, softmax, ``dropout`` seeded by ``seed``, matmul), so
    its gradients come from autodiff; that path stores the [B, Hq, Lq, Lk] scores and
    probabilities (memory quadratic in the length) and runs about ten kernels forward where
    the fused kernel runs one. The dropout mask is ``ops.dropout.keep_mask(seed, (B, Hq, Lq,
    Lk), dropout_p)``. As in PyTorch there is no training flag: pass ``dropout_p=0`` in eval.

    Args:
        query: f32 [B, Hq, Lq, D] (or [Hq, Lq, D]).
        key: f32 [B, Hkv, Lk, D] (same rank as query).
        value: f32 [B, Hkv, Lk, Dv].
        attn_mask: optional mask broadcastable to [B, Hq, Lq, Lk]: additive f32 (-inf
            entries are masked out; it receives no gradient) or bool, True where a query may
            attend (PyTorch's convention), which becomes ``where(mask, 0, -inf)`` in the
            graph. A query row with no True entry gives zeros (as PyTorch 2.13's CPU
            kernels do; its math path gives NaN). Or ``meganeura.nn.attention.
            causal_lower_right(Lq, Lk)`` (torch.nn.attention.bias's): causal aligned
            lower-right, query i sees keys j <= Lk - Lq + i, computed in the kernel (no mask
            tensor; it is ``is_causal=True, kv_length=Lk``).
        dropout_p: probability of zeroing each attention probability, in [0, 1]; kept ones
            are scaled by ``1 / (1 - dropout_p)`` (1 gives zeros).
        is_causal: mask out keys j > i for query i (top-left aligned, as PyTorch). May be
            combined with ``attn_mask`` (PyTorch rejects the combination).
        scale: score scale; default ``1 / sqrt(D)``.
        enable_gqa: allow Hq to be a multiple of Hkv (grouped-query attention); head h reads
            kv head ``h // (Hq // Hkv)``.
        kv_length: the number of valid keys, an i32[] or i32[B] tensor (a graph input fed at
            run time: decoding with a KV cache of Lk slots) or an int: keys j >= kv_length[b]
            are masked and never read (the kernel's key loop stops there, so the work grows
            with the position, not Lk), and ``is_causal`` aligns lower-right: query i sees
            keys j <= kv_length[b] - Lq + i (flash-attn's ``cache_seqlens``). Values are
            clamped to [0, Lk]. No gradient: differentiating the result raises ValueError.
        seed: u32[] tensor (usually a graph input fed a new value each step); required when
            ``0 < dropout_p < 1``.

    Returns:
        f32 [B, Hq, Lq, Dv] (or [Hq, Lq, Dv] for 3-d inputs).

    Raises:
        ValueError: for dropout_p outside [0, 1], a missing or non-u32[] seed with
            0 < dropout_p < 1, Hq != Hkv without enable_gqa, kv_length with dropout_p > 0,
            or causal_lower_right with is_causal or kv_length, or for the wrong Lq and Lk.
        GraphTypeError: for shapes or dtypes other than the above.
    """
    from ..graph.builder import GraphTypeError
    from . import functional as F

    dropout_p = float(dropout_p)
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"{SDPA}: dropout_p must be in [0, 1], got {dropout_p}")
    if 0.0 < dropout_p < 1.0 and (
        not isinstance(seed, Tensor) or seed.type != TensorType((), DType.u32)
    ):
        raise ValueError(
            f"{SDPA}: dropout_p={dropout_p} needs seed=, a u32[] tensor (a graph input fed a "
            f"new value each step), got {seed!r}"
        )
    from .attention_bias import CausalBias

    if isinstance(attn_mask, CausalBias):
        lq, lk = query.shape[-2], key.shape[-2]
        shape = (attn_mask.seq_len_q, attn_mask.seq_len_kv)
        if is_causal or kv_length is not None or shape != (lq, lk):
            raise ValueError(
                f"{SDPA}: {attn_mask!r} takes the place of is_causal and kv_length, for Lq={lq} "
                f"and Lk={lk}; got is_causal={is_causal}, kv_length={kv_length!r}"
            )
        lower_right = attn_mask.lower_right
        attn_mask, is_causal = None, True
        kv_length = lk if lower_right else None
    if kv_length is not None:
        kv_length = _kv_length(query, kv_length, dropout_p)
    if attn_mask is not None and not isinstance(attn_mask, Tensor):
        attn_mask = query.builder._operand(SDPA, attn_mask)  # a NumPy mask while tracing
    if attn_mask is not None and attn_mask.dtype is DType.bool:
        b = query.builder
        attn_mask = F.where(
            attn_mask, b.constant(0.0, query.dtype), b.constant(-math.inf, query.dtype)
        )
    squeeze = query.ndim == 3
    if squeeze:
        query, key, value = (F.reshape(t, (1, *t.shape)) for t in (query, key, value))
    if query.ndim == 4 and key.ndim == 4 and query.shape[1] != key.shape[1] and not enable_gqa:
        raise ValueError(
            f"scaled_dot_product_attention: {query.shape[1]} query heads and {key.shape[1]} "
            f"key/value heads need enable_gqa=True"
        )
    d = query.shape[-1]
    scale = float(scale) if scale is not None else 1.0 / math.sqrt(d) if d else 1.0
    operands = [query, key, value] + ([attn_mask] if attn_mask is not None else [])
    operands += [kv_length] if kv_length is not None else []
    if dropout_p > 0.0:
        try:
            mask_type = None if attn_mask is None else attn_mask.type
            attention_dims(*(t.type for t in operands[:3]), mask_type)
        except ShapeError as e:
            ops = ", ".join(repr(t) for t in operands)
            raise GraphTypeError(f"{SDPA}({ops}, dropout_p={dropout_p}): {e}") from None
        out = _attention_with_dropout(
            query, key, value, attn_mask, dropout_p, bool(is_causal), scale, seed
        )
    else:
        out = query.builder.add(SDPA, operands, {"is_causal": bool(is_causal), "scale": scale})
    return F.reshape(out, out.shape[1:]) if squeeze else out


def _kv_length(query: Tensor, kv_length, dropout_p: float) -> Tensor:
    """``kv_length`` as an i32[] or i32[B] tensor of the query's graph (an int becomes a
    constant, i32[1] a scalar); GraphTypeError for another dtype (the type rule would take a
    floating one for a mask)."""
    from . import functional as F

    if dropout_p > 0.0:
        raise ValueError(f"{SDPA}: kv_length is not supported with dropout_p > 0")
    b = query.builder
    if isinstance(kv_length, (int, np.integer)) and not isinstance(kv_length, bool):
        return b.constant(int(kv_length), DType.i32)
    if not isinstance(kv_length, Tensor):
        kv_length = b._operand(SDPA, kv_length)
    if kv_length.dtype is not DType.i32:
        from ..graph.builder import op_error

        raise op_error(SDPA, [query, kv_length], {}, f"kv_length must be i32, got {kv_length.type}")
    if kv_length.shape == (1,):
        kv_length = F.reshape(kv_length, ())
    return kv_length


def apply_rotary_emb(
    x: Tensor, theta: float = 10000.0, position_offset: int | Tensor = 0
) -> Tensor:
    """Rotary position embedding, HF's half-split convention (``rotate_half``).

    ``out = x * cos + rotate_half(x) * sin`` with ``rotate_half(x) = cat(-x2, x1)`` for the
    halves x1 = x[..., :D/2], x2 = x[..., D/2:], and angle ``pos * theta^(-2i/D)`` for
    frequency i < D/2 at position ``pos = position_offset + l`` (RoFormer, Su et al. 2021;
    transformers' LlamaRotaryEmbedding). cos and sin are computed in the kernel from an exact
    angle reduction (64-bit fixed-point turns), so the error stays ~1e-6 at any position,
    where f32 ``pos * inv_freq`` alone drifts by ~5e-4 rad at position 8192.

    Args:
        x: f32 [..., L, D], D even (usually [B, H, L, D]).
        theta: the RoPE base (10000 for Llama 2, 100000 for SmolLM2).
        position_offset: the first position: an int, or an i32[] tensor fed at run time (for
            decoding with a KV cache), or an i32[B] tensor, one first position per batch
            row b of x [B, ..., L, D] (batched decoding of left-padded prompts: row b's
            positions are ``position_offset[b] + l``). Positions must lie in [0, 2^31).

    Returns:
        f32 tensor of x's shape.

    Raises:
        GraphTypeError: for odd D, a non-floating x, or an offset tensor that is not i32[],
            i32[1] or i32[B].
    """
    attrs = {"theta": float(theta), "inverse": False, "position_offset": 0}
    if isinstance(position_offset, Tensor):
        return x.builder.add("apply_rotary_emb", [x, position_offset], attrs)
    attrs["position_offset"] = int(position_offset)
    return x.builder.add("apply_rotary_emb", [x], attrs)

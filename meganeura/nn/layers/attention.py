"""MultiheadAttention, as ``torch.nn.MultiheadAttention``: PyTorch's parameters (packed
``in_proj_weight`` [3E, E], or ``q/k/v_proj_weight`` when kdim/vdim differ; ``out_proj``),
initialization, arguments and results, so its state dict loads and its outputs match.

The computation follows ``torch.nn.functional.multi_head_attention_forward`` step for step,
laid out batch-first inside: project, append ``bias_k``/``bias_v`` and the zero attention
position, split heads, merge the masks (boolean masks become 0 / -inf, float masks are
added), attend, merge heads, ``out_proj``. With ``need_weights`` (PyTorch's default) or
dropout in train mode the scores are materialized (matmul, softmax, dropout, matmul), as
PyTorch does, so the weights can be returned; otherwise one fused
``scaled_dot_product_attention`` kernel runs.
"""

from __future__ import annotations

import math

import numpy as np

from ...graph.builder import Tensor
from .. import functional as F
from .. import init
from ..module import Module
from ..parameter import Parameter
from ..tracing import current_trace
from .linear import Linear


class NonDynamicallyQuantizableLinear(Linear):
    """``Linear`` under the name PyTorch gives MultiheadAttention's ``out_proj`` (the class
    only marks it for PyTorch's quantization tooling; the computation is Linear's)."""


def _float_mask(mask, like: Tensor):
    """``mask`` as an additive f32 mask: True (masked) -> -inf, False -> 0; float kept."""
    if mask is None:
        return None
    if isinstance(mask, np.ndarray):
        arr = np.where(mask, -np.inf, 0.0) if mask.dtype == np.bool_ else mask
        return current_trace().constant(np.asarray(arr, np.float32))
    if mask.dtype.is_floating:
        return mask
    b = like.builder
    return F.where(mask, b.constant(-math.inf, like.dtype), b.constant(0.0, like.dtype))


class MultiheadAttention(Module):
    """Multi-head attention (``torch.nn.MultiheadAttention``; Vaswani et al. 2017):
    ``out_proj(concat_h softmax(q_h k_h^T / sqrt(head_dim) + mask) v_h)``.

    Shapes (E = embed_dim, H = num_heads, L target and S source lengths, N batch):
        query [L, N, E] ([N, L, E] with ``batch_first``, [L, E] unbatched); key [S, N, kdim],
        value [S, N, vdim] likewise. Parameters: ``in_proj_weight`` [3E, E] when
        kdim == vdim == E, else ``q_proj_weight`` [E, E], ``k_proj_weight`` [E, kdim],
        ``v_proj_weight`` [E, vdim]; ``in_proj_bias`` [3E]; ``out_proj.weight`` [E, E],
        ``out_proj.bias`` [E]; ``bias_k``, ``bias_v`` [1, 1, E] with ``add_bias_kv``.
    Initialization as PyTorch's ``_reset_parameters``: xavier_uniform_ in-projection weights,
    zero ``in_proj_bias`` and ``out_proj.bias``, ``out_proj.weight`` as Linear's,
    xavier_normal_ ``bias_k``/``bias_v``.

    Args:
        embed_dim, num_heads: E and H; E must be divisible by H.
        dropout: drop probability on the attention weights in train mode.
        bias: in- and out-projection biases.
        add_bias_kv: learned key/value appended as one extra source position.
        add_zero_attn: a zero key/value appended as one extra source position.
        kdim, vdim: key and value feature sizes (default E).
        batch_first: inputs and output are [N, L, E].

    Raises:
        ValueError: E not divisible by H.
    """

    def __init__(
        self,
        embed_dim: int,
        num_heads: int,
        dropout: float = 0.0,
        bias: bool = True,
        add_bias_kv: bool = False,
        add_zero_attn: bool = False,
        kdim: int | None = None,
        vdim: int | None = None,
        batch_first: bool = False,
        dtype=None,
    ) -> None:
        super().__init__()
        if embed_dim <= 0 or num_heads <= 0:
            raise ValueError(
                f"embed_dim and num_heads must be greater than 0, got embed_dim={embed_dim} "
                f"and num_heads={num_heads} instead"
            )
        self.embed_dim = int(embed_dim)
        self.kdim = int(kdim) if kdim is not None else self.embed_dim
        self.vdim = int(vdim) if vdim is not None else self.embed_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim
        self.num_heads, self.dropout, self.batch_first = int(num_heads), dropout, batch_first
        self.head_dim = embed_dim // num_heads
        if self.head_dim * num_heads != embed_dim:
            raise ValueError("embed_dim must be divisible by num_heads")
        e = self.embed_dim
        if not self._qkv_same_embed_dim:
            self.q_proj_weight = Parameter(shape=(e, e), dtype=dtype)
            self.k_proj_weight = Parameter(shape=(e, self.kdim), dtype=dtype)
            self.v_proj_weight = Parameter(shape=(e, self.vdim), dtype=dtype)
            self.register_parameter("in_proj_weight", None)
        else:
            self.in_proj_weight = Parameter(shape=(3 * e, e), dtype=dtype)
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        if bias:
            self.in_proj_bias = Parameter(shape=(3 * e,), dtype=dtype)
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = NonDynamicallyQuantizableLinear(e, e, bias=bias, dtype=dtype)
        if add_bias_kv:
            self.bias_k = Parameter(shape=(1, 1, e), dtype=dtype)
            self.bias_v = Parameter(shape=(1, 1, e), dtype=dtype)
        else:
            self.register_parameter("bias_k", None)
            self.register_parameter("bias_v", None)
        self.add_zero_attn = add_zero_attn
        self._reset_parameters()

    def _reset_parameters(self) -> None:
        p = self._parameters
        if self._qkv_same_embed_dim:
            init.xavier_uniform_(p["in_proj_weight"])
        else:
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                init.xavier_uniform_(p[name])
        if p["in_proj_bias"] is not None:
            init.constant_(p["in_proj_bias"], 0.0)
            init.constant_(self.out_proj._parameters["bias"], 0.0)
        if p["bias_k"] is not None:
            init.xavier_normal_(p["bias_k"])
            init.xavier_normal_(p["bias_v"])

    # ------------------------------------------------------------------ forward
    def forward(
        self,
        query,
        key,
        value,
        key_padding_mask=None,
        need_weights: bool = True,
        attn_mask=None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ):
        """Attend from ``query`` to ``key``/``value``.

        Args:
            query, key, value: as in the class docstring (f32).
            key_padding_mask: [N, S] ([S] unbatched); bool (True = ignore that key) or float
                (added to the scores).
            need_weights: also return the attention weights.
            attn_mask: [L, S] or [N * H, L, S] ([H, L, S] unbatched); bool (True = not
                allowed) or float (added).
            average_attn_weights: average the returned weights over heads.
            is_causal: a hint that ``attn_mask`` is the causal mask; as in PyTorch it needs
                ``attn_mask``, and without ``key_padding_mask`` and ``need_weights`` the
                fused kernel's causal masking replaces it.

        Returns:
            ``(attn_output, attn_weights)``: the output shaped like ``query`` with E features;
            the weights [N, L, S] averaged ([N, H, L, S] otherwise; without N unbatched),
            after dropout, or None without ``need_weights``.

        Raises:
            ValueError: inconsistent ranks or shapes.
            RuntimeError: ``is_causal`` without ``attn_mask``.
        """
        batched = query.ndim == 3
        self._check_shapes(query, key, value, key_padding_mask, attn_mask)
        if not batched:
            query, key, value = _same(query, key, value, lambda t: F.unsqueeze(t, 0))
            key_padding_mask = _unsqueeze0(key_padding_mask)
            if attn_mask is not None and attn_mask.ndim == 3:
                attn_mask = _unsqueeze0(attn_mask)  # [H, L, S] -> [1, H, L, S]
        elif not self.batch_first:
            query, key, value = _same(query, key, value, lambda t: F.transpose(t, 0, 1))
        kpm = _float_mask(key_padding_mask, query)
        if is_causal and attn_mask is None:
            raise RuntimeError(
                "Need attn_mask if specifying the is_causal hint. You may use the Transformer "
                "module method `generate_square_subsequent_mask` to create this mask."
            )
        causal = is_causal and kpm is None and not need_weights
        mask = None if causal else _float_mask(attn_mask, query)
        out, weights = self._attend(query, key, value, kpm, mask, need_weights, causal)
        if weights is not None and average_attn_weights:
            weights = F.mean(weights, 1)
        if not batched:
            out = F.squeeze(out, 0)
            weights = None if weights is None else F.squeeze(weights, 0)
        elif not self.batch_first:
            out = F.transpose(out, 0, 1)
        return out, weights

    def _check_shapes(self, query, key, value, kpm, attn_mask) -> None:
        n = query.ndim
        if n not in (2, 3):
            raise ValueError(f"query should be unbatched 2D or batched 3D, got {query.ndim}-D")
        if key.ndim != n or value.ndim != n:
            raise ValueError(f"for a {n}-D query, key and value must be {n}-D too")
        if kpm is not None and kpm.ndim != n - 1:
            raise ValueError(f"for a {n}-D query, key_padding_mask must be {n - 1}-D")
        if attn_mask is not None and attn_mask.ndim not in (2, 3):
            raise ValueError(f"attn_mask must be 2-D or 3-D, got {attn_mask.ndim}-D")
        e = query.shape[-1]
        if e != self.embed_dim:
            raise ValueError(f"was expecting embedding dimension of {self.embed_dim}, got {e}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"key and value must have {self.kdim} and {self.vdim} features, got "
                f"{key.shape[-1]} and {value.shape[-1]}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(f"key {key.shape} and value {value.shape} disagree on (S, N)")

    def _project(self, query, key, value):
        """The in-projections, as ``_in_projection_packed`` / ``_in_projection``."""
        e, b = self.embed_dim, self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else F.chunk(b, 3)
        if not self._qkv_same_embed_dim:
            return (
                F.linear(query, self.q_proj_weight, bq),
                F.linear(key, self.k_proj_weight, bk),
                F.linear(value, self.v_proj_weight, bv),
            )
        w = self.in_proj_weight
        if query is key and key is value:  # one [*, 3E] matmul for self-attention
            return tuple(F.chunk(F.linear(query, w, b), 3, -1))
        wq, wk, wv = F.chunk(w, 3)
        q = F.linear(query, wq, bq)
        if key is value:
            bkv = None if b is None else F.slice(b, 0, e)
            k, v = F.chunk(F.linear(key, F.slice(w, 0, e), bkv), 2, -1)
            return q, k, v
        return q, F.linear(key, wk, bk), F.linear(value, wv, bv)

    def _attend(self, query, key, value, kpm, mask, need_weights: bool, causal: bool):
        n, lq = query.shape[:2]
        h, d, e = self.num_heads, self.head_dim, self.embed_dim
        q, k, v = self._project(query, key, value)  # [N, L, E], [N, S, E], [N, S, E]
        extra = 0
        if self.bias_k is not None:
            k = F.cat([k, F.broadcast_to(self.bias_k, (n, 1, e))], 1)
            v = F.cat([v, F.broadcast_to(self.bias_v, (n, 1, e))], 1)
            extra += 1

        def heads(t):
            return F.permute(F.reshape(t, (n, t.shape[1], h, d)), (0, 2, 1, 3))

        q, k, v = heads(q), heads(k), heads(v)  # [N, H, L or S, D]
        if self.add_zero_attn:
            zeros = F.broadcast_to(q.builder.constant(0.0, q.dtype), (n, h, 1, d))
            k, v = F.cat([k, zeros], 2), F.cat([v, zeros], 2)
            extra += 1
        s = k.shape[2]
        if mask is not None:
            if mask.ndim == 2:
                _expect(mask, (lq, s - extra), "2D attn_mask")
                mask = F.reshape(mask, (1, 1, lq, s - extra))
            elif mask.ndim == 3:
                _expect(mask, (n * h, lq, s - extra), "3D attn_mask")
                mask = F.reshape(mask, (n, h, lq, s - extra))
            else:
                _expect(mask, (1, h, lq, s - extra), "3D attn_mask")
            mask = F.pad(mask, (0, extra))
        if kpm is not None:
            _expect(kpm, (n, s - extra), "key_padding_mask")
            kpm = F.reshape(F.pad(kpm, (0, extra)), (n, 1, 1, s))
            mask = kpm if mask is None else mask + kpm
        dropout = self.dropout if self.training else 0.0
        if need_weights or dropout > 0.0:
            if causal:
                mask = current_trace().constant(np.triu(np.full((lq, s), -np.inf), 1))
            scores = F.matmul(q * (1.0 / math.sqrt(d)), F.transpose(k, -2, -1))
            if mask is not None:
                scores = scores + mask
            weights = F.dropout(F.softmax(scores, -1), dropout, dropout > 0.0)
            out = F.matmul(weights, v)
        else:
            out = F.scaled_dot_product_attention(q, k, v, mask, is_causal=causal)
            weights = None
        out = F.reshape(F.permute(out, (0, 2, 1, 3)), (n, lq, e))
        return self.out_proj(out), weights if need_weights else None


def _same(query, key, value, fn):
    """``fn`` of each of query, key, value, keeping which of them are the same tensor (the
    packed projection of self-attention depends on it, as PyTorch's)."""
    q = fn(query)
    k = q if key is query else fn(key)
    v = k if value is key else q if value is query else fn(value)
    return q, k, v


def _unsqueeze0(mask):
    if mask is None:
        return None
    return mask[None] if isinstance(mask, np.ndarray) else F.unsqueeze(mask, 0)


def _expect(t, shape: tuple[int, ...], what: str) -> None:
    if tuple(t.shape) != shape:
        raise ValueError(f"the shape of the {what} is {tuple(t.shape)}, but should be {shape}")


__all__ = ["MultiheadAttention", "NonDynamicallyQuantizableLinear"]

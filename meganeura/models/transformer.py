"""A small Llama-style causal decoder: token embedding -> N x (RMSNorm -> grouped-query
attention with rotary embeddings (HF half-split) -> residual, RMSNorm -> SwiGLU MLP ->
residual) -> final RMSNorm -> an untied LM head.

Module and parameter names follow Hugging Face's ``LlamaForCausalLM``
(``model.embed_tokens``, ``model.layers.0.self_attn.q_proj.weight`` ..., ``model.norm``,
``lm_head``) so weights map one to one. Shapes: input_ids int [B, S] -> logits f32
[B, S, vocab]. Initialization: the embedding ~ N(0, 0.02^2), linear layers as
``torch.nn.Linear``, norms ones.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import nn
from ..nn import functional as F
from ..nn import init
from . import ModelGraph


@dataclass(frozen=True)
class TransformerConfig:
    """The fields of Hugging Face's ``LlamaConfig`` that shape the decoder (``num_layers`` is
    its ``num_hidden_layers``, ``num_heads`` / ``num_kv_heads`` its ``num_attention_heads`` /
    ``num_key_value_heads``)."""

    vocab_size: int = 64
    hidden_size: int = 32
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    intermediate_size: int = 64
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


class Attention(nn.Module):
    """Causal grouped-query self-attention with rotary embeddings on q and k."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = cfg.num_heads, cfg.num_kv_heads, hd
        self.rope_theta = cfg.rope_theta
        self.q_proj = nn.Linear(d, cfg.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, cfg.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(cfg.num_heads * hd, d, bias=False)

    def forward(self, x):
        bsz, seq, _ = x.shape

        def heads(t, n):
            return F.permute(F.reshape(t, (bsz, seq, n, self.head_dim)), (0, 2, 1, 3))

        q = F.apply_rotary_emb(heads(self.q_proj(x), self.num_heads), self.rope_theta)
        k = F.apply_rotary_emb(heads(self.k_proj(x), self.num_kv_heads), self.rope_theta)
        v = heads(self.v_proj(x), self.num_kv_heads)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o = F.reshape(F.permute(o, (0, 2, 1, 3)), (bsz, seq, self.num_heads * self.head_dim))
        return self.o_proj(o)


class FeedForward(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (HF's ``LlamaMLP``)."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.self_attn = Attention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.mlp = FeedForward(cfg)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


class Decoder(nn.Module):
    """The embedding, the layers and the final norm (HF's ``LlamaModel``): ids -> hidden
    states f32 [B, S, hidden_size]."""

    def __init__(self, cfg: TransformerConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([DecoderLayer(cfg) for _ in range(cfg.num_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.norm(x)


class CausalLM(nn.Module):
    """The decoder and its LM head (HF's ``LlamaForCausalLM``, untied): ``forward(input_ids)``
    -> logits f32 [B, S, vocab_size]."""

    def __init__(self, cfg: TransformerConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = cfg or TransformerConfig()
        self.model = Decoder(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        init.normal_(self.model.embed_tokens.weight, 0.0, 0.02)

    def forward(self, input_ids):
        return self.lm_head(self.model(input_ids))


def lm_loss(model: CausalLM, input_ids, labels):
    """Mean cross-entropy of the next-token logits against ``labels`` int [B, S] (the targets
    at each position, already shifted; a ``Trainer`` loss_fn)."""
    logits = model(input_ids)
    vocab = logits.shape[-1]
    return F.cross_entropy(F.reshape(logits, (-1, vocab)), F.reshape(labels, (-1,)))


def build_transformer(
    batch: int, seq: int, cfg: TransformerConfig | None = None, labels: bool = True
) -> ModelGraph:
    """A fresh :class:`CausalLM` and its traced graph for fixed ``batch`` x ``seq`` token ids,
    for graph-level tests and benchmarks.

    Returns:
        ``ModelGraph(graph, model)``: inputs ``input_ids`` i32[batch, seq] (and ``labels``
        i32[batch, seq]); outputs ``logits`` f32[batch, seq, vocab] (and ``loss``, the mean
        next-token cross-entropy).
    """
    model = CausalLM(cfg)
    ids = np.zeros((batch, seq), np.int32)
    if not labels:
        graph = nn.trace(model, ids, fn=lambda input_ids: {"logits": model(input_ids)})
        return ModelGraph(graph, model)

    def forward(input_ids, labels):
        logits = model(input_ids)
        flat = F.reshape(logits, (batch * seq, model.config.vocab_size))
        return {"logits": logits, "loss": F.cross_entropy(flat, F.reshape(labels, (-1,)))}

    return ModelGraph(nn.trace(model, ids, ids, fn=forward), model)

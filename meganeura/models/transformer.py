"""A Llama-style causal decoder (the SmolLM2 architecture at toy size): token embedding,
pre-norm blocks of RMSNorm -> grouped-query attention with rotary embeddings (HF half-split)
-> residual, RMSNorm -> SwiGLU MLP -> residual, final RMSNorm and an untied LM head.

Parameter names follow Hugging Face's LlamaForCausalLM (``model.layers.0.self_attn.q_proj
.weight`` ...) so weights map one to one.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..dtypes import i32
from ..graph.builder import GraphBuilder, Tensor
from ..graph.ir import Graph
from ..nn.graph_layers import Linear, Module
from ..ops import functional as F
from ..ops.activation import silu
from ..ops.attention import apply_rotary_emb, scaled_dot_product_attention
from ..ops.gather import embedding
from ..ops.norm import rms_norm


@dataclass(frozen=True)
class TransformerConfig:
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


@dataclass(frozen=True)
class TransformerGraph:
    """Inputs ``input_ids`` i32[batch, seq] (and ``labels`` i32[batch, seq]); outputs
    ``logits`` f32[batch, seq, vocab] (and ``loss``, mean next-token cross-entropy)."""

    graph: Graph
    model: Module


class _Decoder(Module):
    def __init__(self, b: GraphBuilder, cfg: TransformerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.b = b
        self.embed = self._param(
            "model.embed_tokens.weight",
            (cfg.vocab_size, cfg.hidden_size),
            lambda rng: rng.normal(0, 0.02, (cfg.vocab_size, cfg.hidden_size)),
        )
        d, hd = cfg.hidden_size, cfg.head_dim
        self.layers = []
        for i in range(cfg.num_layers):
            p = f"model.layers.{i}"
            layer = {
                "ln1": self._ones(f"{p}.input_layernorm.weight", d),
                "q": self._linear(f"{p}.self_attn.q_proj", d, cfg.num_heads * hd),
                "k": self._linear(f"{p}.self_attn.k_proj", d, cfg.num_kv_heads * hd),
                "v": self._linear(f"{p}.self_attn.v_proj", d, cfg.num_kv_heads * hd),
                "o": self._linear(f"{p}.self_attn.o_proj", cfg.num_heads * hd, d),
                "ln2": self._ones(f"{p}.post_attention_layernorm.weight", d),
                "gate": self._linear(f"{p}.mlp.gate_proj", d, cfg.intermediate_size),
                "up": self._linear(f"{p}.mlp.up_proj", d, cfg.intermediate_size),
                "down": self._linear(f"{p}.mlp.down_proj", cfg.intermediate_size, d),
            }
            self.layers.append(layer)
        self.norm = self._ones("model.norm.weight", d)
        self.head = self._linear("lm_head", d, cfg.vocab_size)

    def _param(self, name, shape, init) -> Tensor:
        self.initializers[name] = lambda rng: init(rng).astype(np.float32)
        return self.b.parameter(name, shape)

    def _ones(self, name, n) -> Tensor:
        return self._param(name, (n,), lambda rng: np.ones(n))

    def _linear(self, name, n_in, n_out) -> Linear:
        lin = Linear(self.b, name, n_in, n_out, bias=False)
        self.initializers.update(lin.initializers)
        return lin

    def _attention(self, layer, x: Tensor) -> Tensor:
        cfg = self.cfg
        bsz, seq, _ = x.shape
        hd = cfg.head_dim

        def heads(t: Tensor, n: int) -> Tensor:
            return F.permute(F.reshape(t, (bsz, seq, n, hd)), (0, 2, 1, 3))

        q = apply_rotary_emb(heads(layer["q"](x), cfg.num_heads), cfg.rope_theta)
        k = apply_rotary_emb(heads(layer["k"](x), cfg.num_kv_heads), cfg.rope_theta)
        v = heads(layer["v"](x), cfg.num_kv_heads)
        o = scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        o = F.reshape(F.permute(o, (0, 2, 1, 3)), (bsz, seq, cfg.num_heads * hd))
        return layer["o"](o)

    def __call__(self, ids: Tensor) -> Tensor:
        cfg = self.cfg
        x = embedding(ids, self.embed)
        for layer in self.layers:
            x = x + self._attention(
                layer, rms_norm(x, cfg.hidden_size, layer["ln1"], cfg.rms_norm_eps)
            )
            h = rms_norm(x, cfg.hidden_size, layer["ln2"], cfg.rms_norm_eps)
            x = x + layer["down"](silu(layer["gate"](h)) * layer["up"](h))
        return self.head(rms_norm(x, cfg.hidden_size, self.norm, cfg.rms_norm_eps))


def build_transformer(
    batch: int, seq: int, cfg: TransformerConfig | None = None, labels: bool = True
) -> TransformerGraph:
    """The decoder graph for fixed ``batch`` x ``seq`` token ids."""
    cfg = cfg or TransformerConfig()
    b = GraphBuilder()
    ids = b.input("input_ids", (batch, seq), i32)
    model = _Decoder(b, cfg)
    logits = model(ids)
    b.output("logits", logits)
    if labels:
        y = b.input("labels", (batch, seq), i32)
        flat = F.reshape(logits, (batch * seq, cfg.vocab_size))
        b.output("loss", F.cross_entropy(flat, F.reshape(y, (batch * seq,))))
    return TransformerGraph(b.build(), model)

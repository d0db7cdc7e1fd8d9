"""A small Llama-style causal decoder for the graph-level tests and benchmarks: the Llama model
of :mod:`meganeura.models.llama` with an untied head, sized by a :class:`TransformerConfig`
(short field names, a 64-token vocabulary by default), and ``build_transformer``, which traces
one into a Graph. Shapes: input_ids int [B, S] -> logits f32 [B, S, vocab].
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import nn
from ..nn import functional as F
from . import ModelGraph
from .llama import LlamaConfig, LlamaForCausalLM, lm_loss

__all__ = ["CausalLM", "TransformerConfig", "build_transformer", "lm_loss"]


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


class CausalLM(LlamaForCausalLM):
    """:class:`~meganeura.models.llama.LlamaForCausalLM` built from a
    :class:`TransformerConfig` (an untied head, HF's names): ``forward(input_ids)`` -> logits
    f32 [B, S, vocab_size]."""

    def __init__(self, cfg: TransformerConfig | None = None) -> None:
        cfg = cfg or TransformerConfig()
        super().__init__(
            LlamaConfig(
                vocab_size=cfg.vocab_size,
                hidden_size=cfg.hidden_size,
                intermediate_size=cfg.intermediate_size,
                num_hidden_layers=cfg.num_layers,
                num_attention_heads=cfg.num_heads,
                num_key_value_heads=cfg.num_kv_heads,
                rope_theta=cfg.rope_theta,
                rms_norm_eps=cfg.rms_norm_eps,
                tie_word_embeddings=False,
            )
        )
        object.__setattr__(self, "transformer_config", cfg)


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

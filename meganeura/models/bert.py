"""BERT encoders (Devlin et al., 2019) as ``mn.nn`` modules, with Hugging Face's
``BertModel`` names and arithmetic, so its state dicts (e.g. all-MiniLM-L6-v2) load unchanged.

Embeddings (word + absolute position + token type, LayerNorm, dropout) -> N post-LN encoder
layers (self-attention -> dense -> dropout -> LayerNorm(x + .), then dense -> GELU -> dense ->
dropout -> LayerNorm(x + .)) -> optional pooler (tanh of a dense layer on the first token).
The padding mask is HF's: ``(1 - attention_mask) * finfo(float32).min`` added to the scores.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import nn
from ..nn import functional as F


@dataclass(frozen=True)
class BertConfig:
    """The fields of Hugging Face's ``BertConfig`` that shape the encoder."""

    vocab_size: int = 30522
    hidden_size: int = 768
    num_hidden_layers: int = 12
    num_attention_heads: int = 12
    intermediate_size: int = 3072
    hidden_act: str = "gelu"
    hidden_dropout_prob: float = 0.1
    attention_probs_dropout_prob: float = 0.1
    max_position_embeddings: int = 512
    type_vocab_size: int = 2
    layer_norm_eps: float = 1e-12
    pad_token_id: int = 0

    @classmethod
    def from_dict(cls, d: dict) -> BertConfig:
        """From a ``config.json`` dict (unknown keys ignored)."""
        names = set(cls.__dataclass_fields__)
        return cls(**{k: v for k, v in d.items() if k in names})


def _act(name: str):
    if name == "gelu":
        return F.gelu
    if name in ("gelu_new", "gelu_pytorch_tanh"):
        return lambda x: F.gelu(x, approximate="tanh")
    if name == "relu":
        return F.relu
    if name in ("silu", "swish"):
        return F.silu
    raise ValueError(f"unsupported hidden_act {name!r}")


class BertEmbeddings(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.word_embeddings = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.pad_token_id)
        self.position_embeddings = nn.Embedding(cfg.max_position_embeddings, d)
        self.token_type_embeddings = nn.Embedding(cfg.type_vocab_size, d)
        self.LayerNorm = nn.LayerNorm(d, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, input_ids, token_type_ids=None):
        seq = input_ids.shape[1]
        positions = np.arange(seq, dtype=np.int32)[None]
        x = self.word_embeddings(input_ids) + self.position_embeddings(positions)
        if token_type_ids is None:
            types = np.zeros((1, seq), np.int32)
            x = x + self.token_type_embeddings(types)
        else:
            x = x + self.token_type_embeddings(token_type_ids)
        return self.dropout(self.LayerNorm(x))


class BertSelfAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        d = cfg.hidden_size
        self.num_heads = cfg.num_attention_heads
        self.query = nn.Linear(d, d)
        self.key = nn.Linear(d, d)
        self.value = nn.Linear(d, d)
        self.dropout_p = cfg.attention_probs_dropout_prob

    def forward(self, x, mask=None):
        b, s, d = x.shape
        h = self.num_heads

        def heads(t):
            return F.permute(F.reshape(t, (b, s, h, d // h)), (0, 2, 1, 3))

        o = F.scaled_dot_product_attention(
            heads(self.query(x)),
            heads(self.key(x)),
            heads(self.value(x)),
            attn_mask=mask,
            dropout_p=self.dropout_p if self.training else 0.0,
        )
        return F.reshape(F.permute(o, (0, 2, 1, 3)), (b, s, d))


class BertSelfOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h, x):
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class BertAttention(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.self = BertSelfAttention(cfg)
        self.output = BertSelfOutput(cfg)

    def forward(self, x, mask=None):
        return self.output(self.self(x, mask), x)


class BertIntermediate(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.intermediate_size)
        self.act = _act(cfg.hidden_act)

    def forward(self, x):
        return self.act(self.dense(x))


class BertOutput(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.intermediate_size, cfg.hidden_size)
        self.LayerNorm = nn.LayerNorm(cfg.hidden_size, eps=cfg.layer_norm_eps)
        self.dropout = nn.Dropout(cfg.hidden_dropout_prob)

    def forward(self, h, x):
        return self.LayerNorm(self.dropout(self.dense(h)) + x)


class BertLayer(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.attention = BertAttention(cfg)
        self.intermediate = BertIntermediate(cfg)
        self.output = BertOutput(cfg)

    def forward(self, x, mask=None):
        a = self.attention(x, mask)
        return self.output(self.intermediate(a), a)


class BertEncoder(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.layer = nn.ModuleList([BertLayer(cfg) for _ in range(cfg.num_hidden_layers)])

    def forward(self, x, mask=None):
        for layer in self.layer:
            x = layer(x, mask)
        return x


class BertPooler(nn.Module):
    def __init__(self, cfg: BertConfig) -> None:
        super().__init__()
        self.dense = nn.Linear(cfg.hidden_size, cfg.hidden_size)

    def forward(self, x):
        return F.tanh(self.dense(x[:, 0]))


class BertModel(nn.Module):
    """``transformers.BertModel``: ``forward(input_ids, attention_mask=None,
    token_type_ids=None)`` -> ``{"last_hidden_state": [B, S, H], "pooler_output": [B, H]}``
    (no pooler output with ``add_pooling_layer=False``).

    Shapes: input_ids, attention_mask and token_type_ids int [B, S] (mask 1 = attend).
    """

    def __init__(self, cfg: BertConfig, add_pooling_layer: bool = True) -> None:
        super().__init__()
        self.config = cfg
        self.embeddings = BertEmbeddings(cfg)
        self.encoder = BertEncoder(cfg)
        self.pooler = BertPooler(cfg) if add_pooling_layer else None

    def forward(self, input_ids, attention_mask=None, token_type_ids=None):
        x = self.embeddings(input_ids, token_type_ids)
        mask = None
        if attention_mask is not None:
            b, s = attention_mask.shape
            keep = F.cast(F.reshape(attention_mask, (b, 1, 1, s)), x.dtype)
            mask = (1.0 - keep) * float(np.finfo(np.float32).min)
        h = self.encoder(x, mask)
        out = {"last_hidden_state": h}
        if self.pooler is not None:
            out["pooler_output"] = self.pooler(h)
        return out

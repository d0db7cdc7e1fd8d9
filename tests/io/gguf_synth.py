"""A small synthetic Llama GGUF file for the loader's tests, written with gguf.GGUFWriter.

Two layers, hidden 256 (the K-quants' 256-value blocks need rows of a multiple of 256), 4 query
heads and 2 KV heads of 64, FFN 512, and a byte-level BPE vocabulary: the 256 byte symbols, a
few merges, and special tokens. Each tensor gets one of the types under test. Q and K are
stored as llama.cpp's converter stores them: rows interleaved per head
(convert_hf_to_gguf.py, LlamaModel.permute), written here from that definition.

gguf 0.19 cannot quantize to Q4_K or Q6_K, so those tensors are random valid blocks (small fp16
scales, random nibbles) rather than quantized weights: their reference is a dequantization by
another implementation, not the original weights.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

HIDDEN, HEADS, KV_HEADS, HEAD_DIM, FFN, LAYERS = 256, 4, 2, 64, 512, 2

# Per layer: HF projection -> ggml type name.
LAYER_TYPES = (
    {
        "q_proj": "F16",
        "k_proj": "Q4_0",
        "v_proj": "Q4_1",
        "o_proj": "Q4_K",
        "gate_proj": "Q6_K",
        "up_proj": "Q8_0",
        "down_proj": "Q4_K",
    },
    {
        "q_proj": "Q4_K",
        "k_proj": "Q6_K",
        "v_proj": "Q8_0",
        "o_proj": "F16",
        "gate_proj": "Q4_0",
        "up_proj": "Q4_1",
        "down_proj": "Q6_K",
    },
)
_GGUF_PROJ = {
    "q_proj": "attn_q",
    "k_proj": "attn_k",
    "v_proj": "attn_v",
    "o_proj": "attn_output",
    "gate_proj": "ffn_gate",
    "up_proj": "ffn_up",
    "down_proj": "ffn_down",
}
SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
USER_DEFINED = ("<think>",)
MERGES = ("h e", "l l", "he ll", "Ġ w", "o r", "Ġw or", "l d")
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\n' + m['content'] + '<|im_end|>\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (openai/gpt-2 encoder.py, bytes_to_unicode)."""
    keep = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    keep += range(ord("®"), ord("ÿ") + 1)
    out, extra = {}, 0
    for b in range(256):
        if b in keep:
            out[b] = chr(b)
        else:
            out[b] = chr(256 + extra)
            extra += 1
    return out


def vocabulary() -> list[str]:
    tokens = [*SPECIAL, *bytes_to_unicode().values()]
    tokens += [m.replace(" ", "") for m in MERGES]
    return [*tokens, *USER_DEFINED]


def llama_cpp_permute(w: np.ndarray, n_head: int) -> np.ndarray:
    """HF rows -> GGUF rows: llama.cpp's LlamaModel.permute."""
    rows = w.shape[0]
    return w.reshape(n_head, 2, rows // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def random_blocks(rng: np.random.Generator, ggml_type: str, rows: int, cols: int) -> np.ndarray:
    """Random valid Q4_K/Q6_K blocks, [rows, cols // 256 * type_size] bytes (ggml-common.h)."""
    size = {"Q4_K": 144, "Q6_K": 210}[ggml_type]
    blocks = rng.integers(0, 256, (rows * cols // 256, size), dtype=np.uint8)

    def half(x: float) -> np.ndarray:
        return np.full(len(blocks), x, np.float16).view(np.uint8).reshape(-1, 2)

    if ggml_type == "Q4_K":  # d, dmin, scales[12], qs[128]
        blocks[:, 0:2], blocks[:, 2:4] = half(0.01), half(0.004)
    else:  # ql[128], qh[64], scales[16] (int8), d
        blocks[:, 208:210] = half(0.002)
    return blocks.reshape(rows, -1)


@dataclass
class Synth:
    """What was written: the HF-order float weights (None where random blocks were written)."""

    path: Path
    weights: dict[str, np.ndarray | None] = field(default_factory=dict)
    types: dict[str, str] = field(default_factory=dict)


def write(
    path: Path,
    *,
    arch: str = "llama",
    tied: bool = True,
    metadata: dict[str, object] | None = None,
    drop: tuple[str, ...] = (),
    retype: dict[str, str] | None = None,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> Synth:
    """Write the synthetic model; the keyword arguments spoil it for the refusal tests.

    Args:
        metadata: keys to add or override (``"llama.rope.scaling.type": "linear"``...).
        drop: GGUF tensor names to leave out.
        retype: HF projection name -> a ggml type to use instead, in layer 0.
        extra_tensors: GGUF name -> float32 array to add.
    """
    import gguf
    from gguf import GGMLQuantizationType as T

    rng = np.random.default_rng(1234)
    vocab = vocabulary()
    synth = Synth(path)
    writer = gguf.GGUFWriter(path, arch)
    writer.add_uint32(f"{arch}.block_count", LAYERS)
    writer.add_uint32(f"{arch}.context_length", 1024)
    writer.add_uint32(f"{arch}.embedding_length", HIDDEN)
    writer.add_uint32(f"{arch}.feed_forward_length", FFN)
    writer.add_uint32(f"{arch}.attention.head_count", HEADS)
    writer.add_uint32(f"{arch}.attention.head_count_kv", KV_HEADS)
    writer.add_float32(f"{arch}.rope.freq_base", 50000.0)
    writer.add_float32(f"{arch}.attention.layer_norm_rms_epsilon", 1e-6)
    writer.add_uint32(f"{arch}.rope.dimension_count", HEAD_DIM)
    writer.add_uint32(f"{arch}.vocab_size", len(vocab))
    writer.add_string("tokenizer.ggml.model", "gpt2")
    writer.add_string("tokenizer.ggml.pre", "smollm")
    writer.add_array("tokenizer.ggml.tokens", vocab)
    token_type = [3 if t in SPECIAL else 4 if t in USER_DEFINED else 1 for t in vocab]
    writer.add_array("tokenizer.ggml.token_type", token_type)
    writer.add_array("tokenizer.ggml.merges", list(MERGES))
    writer.add_uint32("tokenizer.ggml.bos_token_id", 1)
    writer.add_uint32("tokenizer.ggml.eos_token_id", 2)
    writer.add_uint32("tokenizer.ggml.padding_token_id", 0)
    writer.add_string("tokenizer.chat_template", CHAT_TEMPLATE)
    for key, value in (metadata or {}).items():
        if isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, float):
            writer.add_float32(key, value)
        else:
            writer.add_uint32(key, int(value))

    def add(gguf_name: str, hf_name: str, w: np.ndarray | None, ggml_type: str, heads=None):
        if gguf_name in drop:
            return
        synth.types[hf_name] = ggml_type
        if w is None:  # random K-quant blocks of an [out, in] matrix
            rows, cols = _shape(hf_name)
            blocks = random_blocks(rng, ggml_type, rows, cols)
            writer.add_tensor(gguf_name, blocks, raw_dtype=T[ggml_type])
            synth.weights[hf_name] = None
            return
        synth.weights[hf_name] = w
        stored = w if heads is None else llama_cpp_permute(w, heads)
        if ggml_type == "F32":
            writer.add_tensor(gguf_name, stored.astype(np.float32))
        elif ggml_type == "F16":
            writer.add_tensor(gguf_name, stored.astype(np.float16))
        else:
            q = gguf.quants.quantize(stored.astype(np.float32), T[ggml_type])
            writer.add_tensor(gguf_name, q, raw_dtype=T[ggml_type])

    def weight(hf_name: str) -> np.ndarray:
        return (0.05 * rng.standard_normal(_shape(hf_name))).astype(np.float32)

    add("token_embd.weight", "model.embed_tokens.weight", weight("embed"), "Q8_0")
    for i in range(LAYERS):
        p = f"model.layers.{i}."
        for proj, ggml_type in LAYER_TYPES[i].items():
            if i == 0 and retype and proj in retype:
                ggml_type = retype[proj]
            hf = p + ("self_attn." if proj[0] in "qkvo" else "mlp.") + proj + ".weight"
            heads = {"q_proj": HEADS, "k_proj": KV_HEADS}.get(proj)
            w = None if ggml_type in ("Q4_K", "Q6_K") else weight(hf)
            add(f"blk.{i}.{_GGUF_PROJ[proj]}.weight", hf, w, ggml_type, heads)
        for gguf_norm, hf_norm in (("attn_norm", "input"), ("ffn_norm", "post_attention")):
            norm = (1 + 0.1 * rng.standard_normal(HIDDEN)).astype(np.float32)
            add(f"blk.{i}.{gguf_norm}.weight", f"{p}{hf_norm}_layernorm.weight", norm, "F32")
    final_norm = np.linspace(0.5, 1.5, HIDDEN, dtype=np.float32)
    add("output_norm.weight", "model.norm.weight", final_norm, "F32")
    if not tied:
        add("output.weight", "lm_head.weight", None, "Q6_K")
    for name, value in (extra_tensors or {}).items():
        writer.add_tensor(name, value.astype(np.float32))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return synth


def _shape(hf_name: str) -> tuple[int, int]:
    vocab = len(vocabulary())
    for key, shape in (
        ("embed", (vocab, HIDDEN)),
        ("lm_head", (vocab, HIDDEN)),
        ("q_proj", (HEADS * HEAD_DIM, HIDDEN)),
        ("k_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
        ("v_proj", (KV_HEADS * HEAD_DIM, HIDDEN)),
        ("o_proj", (HIDDEN, HEADS * HEAD_DIM)),
        ("gate_proj", (FFN, HIDDEN)),
        ("up_proj", (FFN, HIDDEN)),
        ("down_proj", (HIDDEN, FFN)),
    ):
        if key in hf_name:
            return shape
    raise KeyError(hf_name)

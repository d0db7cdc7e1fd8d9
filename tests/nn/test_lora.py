"""meganeura.nn.lora on the Llama-style CausalLM, against a hand-written PyTorch LoRA (Hu et al.
2022: ``W x + (alpha / r) B A x``) wrapped around q_proj and v_proj of Hugging Face's
LlamaForCausalLM holding the same weights, in float64.

The twin reads the adapters by the PEFT names meganeura writes (``base_model.model.<path>
.lora_A.weight``), so the names are checked by every comparison that passes.
"""

from __future__ import annotations

import json
import re

import numpy as np
import pytest
import safetensors
import safetensors.numpy
import torch

import meganeura as mn
from meganeura.models.transformer import CausalLM, TransformerConfig, lm_loss
from meganeura.nn import Linear, StateDictError
from meganeura.nn.lora import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    PEFT_PREFIX,
    LoraConfig,
    LoRALinear,
    apply_lora,
    load_lora,
    lora_state_dict,
    merge_lora,
    save_lora,
)
from meganeura.optim import SGD, AdamW

CFG = TransformerConfig()  # vocab 64, hidden 32, 2 layers, 4 heads (2 kv), head_dim 8
R, ALPHA = 4, 8  # scaling 2: a wrong scaling shows
rng = np.random.default_rng(0)


def _base(seed: int = 0, cfg: TransformerConfig = CFG) -> CausalLM:
    mn.manual_seed(seed)
    return CausalLM(cfg)


def _adapted(seed: int = 0, **kw) -> CausalLM:
    """A CausalLM with adapters on q_proj and v_proj whose lora_B is random (PEFT starts it at
    zero, which would leave lora_A's gradient zero and the comparisons blind to it)."""
    model = apply_lora(_base(seed), r=R, alpha=ALPHA, **kw)
    for _, m in _loras(model):
        m.lora_B.weight.copy_(rng.normal(0.0, 0.2, m.lora_B.weight.shape))
    return model


def _loras(model):
    return [(p, m) for p, m in model.named_modules() if isinstance(m, LoRALinear)]


def _batch(batch: int = 2, seq: int = 8):
    ids = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    labels = rng.integers(0, CFG.vocab_size, (batch, seq)).astype(np.int32)
    return ids, labels


class TorchLoRA(torch.nn.Module):
    """PEFT's LoRA forward written out: ``base(x) + (x @ A.T) @ B.T * scaling``."""

    def __init__(self, base: torch.nn.Linear, a, b, scaling: float) -> None:
        super().__init__()
        self.base = base
        self.lora_A = torch.nn.Parameter(torch.as_tensor(a, dtype=base.weight.dtype))
        self.lora_B = torch.nn.Parameter(torch.as_tensor(b, dtype=base.weight.dtype))
        self.scaling = scaling

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scaling


def _torch_twin(model, adapters=None, dtype=torch.float64):
    """Hugging Face's LlamaForCausalLM with ``model``'s base weights and a TorchLoRA at each
    adapter, read from ``adapters`` (PEFT names; default ``lora_state_dict(model)``); only
    the adapters train. Returns (twin, {meganeura parameter name: torch parameter})."""
    from transformers import LlamaConfig, LlamaForCausalLM

    hf = LlamaConfig(
        vocab_size=CFG.vocab_size,
        hidden_size=CFG.hidden_size,
        intermediate_size=CFG.intermediate_size,
        num_hidden_layers=CFG.num_layers,
        num_attention_heads=CFG.num_heads,
        num_key_value_heads=CFG.num_kv_heads,
        rope_theta=CFG.rope_theta,
        rms_norm_eps=CFG.rms_norm_eps,
        tie_word_embeddings=False,
        attn_implementation="eager",
    )
    twin = LlamaForCausalLM(hf).to(dtype)
    base = {
        k.replace(".base_layer.", "."): torch.as_tensor(v, dtype=dtype)
        for k, v in model.state_dict().items()
        if ".lora_" not in k
    }
    twin.load_state_dict(base, strict=True)
    twin.requires_grad_(False)
    adapters = lora_state_dict(model) if adapters is None else adapters
    params = {}
    for path, m in _loras(model):
        parent, _, name = path.rpartition(".")
        a = adapters[f"{PEFT_PREFIX}{path}.lora_A.weight"]
        b = adapters[f"{PEFT_PREFIX}{path}.lora_B.weight"]
        lora = TorchLoRA(getattr(twin.get_submodule(parent), name), a, b, m.scaling)
        setattr(twin.get_submodule(parent), name, lora)
        params[f"{path}.lora_A.weight"] = lora.lora_A
        params[f"{path}.lora_B.weight"] = lora.lora_B
    return twin, params


def _torch_loss(twin, ids, labels):
    logits = twin(torch.from_numpy(ids).long()).logits
    flat = logits.reshape(-1, CFG.vocab_size)
    return logits, torch.nn.functional.cross_entropy(flat, torch.from_numpy(labels).long().ravel())


def _base_weights(model) -> dict[str, np.ndarray]:
    return {k: v for k, v in model.state_dict().items() if ".lora_" not in k}


# ------------------------------------------------------------------ structure (no GPU)
def test_apply_lora_wraps_the_targets_and_freezes_everything_else():
    model = _base()
    before = dict(model.named_parameters())
    q = model.model.layers[0].self_attn.q_proj
    assert apply_lora(model, r=R, alpha=ALPHA) is model
    paths = [p for p, _ in _loras(model)]
    assert paths == [
        f"model.layers.{i}.self_attn.{n}" for i in (0, 1) for n in ("q_proj", "v_proj")
    ]
    lora = model.model.layers[0].self_attn.q_proj
    assert lora.base_layer is q and lora.base_layer.weight is before[f"{paths[0]}.weight"]
    assert lora.scaling == ALPHA / R
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable == [f"{p}.lora_{x}.weight" for p in paths for x in "AB"]
    assert not any(p.requires_grad for p in before.values())
    # state dict: PEFT's tree (less its adapter name), in module order
    keys = list(model.state_dict())
    i = keys.index("model.layers.0.self_attn.q_proj.base_layer.weight")
    assert keys[i : i + 4] == [
        "model.layers.0.self_attn.q_proj.base_layer.weight",
        "model.layers.0.self_attn.q_proj.lora_A.weight",
        "model.layers.0.self_attn.q_proj.lora_B.weight",
        "model.layers.0.self_attn.k_proj.weight",
    ]
    # PEFT's init: lora_A kaiming-uniform(a=sqrt(5)) = U(-1/sqrt(in), 1/sqrt(in)), lora_B zero
    a, b = lora.lora_A.weight.data, lora.lora_B.weight.data
    assert a.shape == (R, CFG.hidden_size) and b.shape == (CFG.hidden_size, R)
    bound = 1 / np.sqrt(CFG.hidden_size)
    assert np.abs(a).max() <= bound and np.abs(a).max() > 0.8 * bound
    assert not b.any()
    assert list(lora_state_dict(model)) == [
        f"base_model.model.{p}.lora_{x}.weight" for p in paths for x in "AB"
    ]


def test_target_modules_by_regex_and_by_full_path():
    model = apply_lora(_base(), r"model\.layers\.1\.(self_attn\.k_proj|mlp\.down_proj)")
    assert [p for p, _ in _loras(model)] == [
        "model.layers.1.self_attn.k_proj",
        "model.layers.1.mlp.down_proj",
    ]
    model = apply_lora(_base(), ["model.layers.0.mlp.up_proj", "lm_head"], r=2)
    assert [p for p, _ in _loras(model)] == ["model.layers.0.mlp.up_proj", "lm_head"]
    assert model.lm_head.lora_B.weight.shape == (CFG.vocab_size, 2)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"target_modules": ("qkv",)}, "match no module of CausalLM; its Linear layers are named"),
        ({"r": 0}, "rank r must be a positive integer, got 0"),
        ({"r": -2}, "rank r must be a positive integer, got -2"),
        ({"r": 2.5}, "rank r must be a positive integer, got 2.5"),
        ({"alpha": 0}, "lora_alpha must be a positive number, got 0"),
        ({"dropout": 1.0}, "lora_dropout must be in [0, 1), got 1.0"),
        ({"target_modules": ()}, "target_modules must be a non-empty sequence"),
        ({"target_modules": "q_proj("}, "is not a regular expression"),
    ],
    ids=["no_match", "r_zero", "r_negative", "r_float", "alpha_zero", "dropout_one", "empty", "re"],
)
def test_apply_lora_rejects_bad_settings_and_changes_nothing(kwargs, message):
    model = _base()
    before = model.state_dict()
    with pytest.raises(ValueError, match=re.escape(message)) as e:
        apply_lora(model, **kwargs)
    if kwargs.get("target_modules") == ("qkv",):  # the message lists what there is
        assert "'q_proj'" in str(e.value) and "'lm_head'" in str(e.value)
    assert not _loras(model) and model.state_dict().keys() == before.keys()
    assert all(p.requires_grad for p in model.parameters())


def test_other_misuse_is_refused():
    model = _base()
    with pytest.raises(TypeError, match="'model.layers.0.input_layernorm' is a RMSNorm"):
        apply_lora(model, ["input_layernorm"])
    assert all(p.requires_grad for p in model.parameters())
    for fn in (lora_state_dict, merge_lora):
        with pytest.raises(ValueError, match="has no LoRA adapters"):
            fn(model)
    apply_lora(model, r=R, alpha=ALPHA)
    with pytest.raises(ValueError, match="already has LoRA adapters"):
        apply_lora(model)
    with pytest.raises(ValueError, match="config r=8 but the model's adapters have r=4"):
        save_lora(model, "/nonexistent/never-written", LoraConfig(r=8, lora_alpha=ALPHA))
    with pytest.raises(TypeError, match="adapts a Linear"):
        LoRALinear(model.model.norm)


def test_merge_folds_scaling_b_a_into_the_weight_and_restores_the_base_names():
    base = _base()
    keys = list(base.state_dict())
    model = _adapted()
    weights = _base_weights(model)
    lora = model.model.layers[1].self_attn.v_proj
    a = lora.lora_A.weight.data.astype(np.float64)
    b = lora.lora_B.weight.data.astype(np.float64)
    w = lora.base_layer.weight.data.astype(np.float64)
    assert merge_lora(model) is model
    assert list(model.state_dict()) == keys
    assert type(model.model.layers[1].self_attn.v_proj) is Linear
    want = (w + (ALPHA / R) * b @ a).astype(np.float32)
    np.testing.assert_array_equal(model.model.layers[1].self_attn.v_proj.weight.data, want)
    assert not np.array_equal(want, w.astype(np.float32))  # the update is not lost in rounding
    sd = model.state_dict()
    for k, v in weights.items():  # untouched: every weight but q_proj's and v_proj's
        if "q_proj" not in k and "v_proj" not in k:
            np.testing.assert_array_equal(sd[k], v, err_msg=k)


# ------------------------------------------------------------------ files (no GPU)
def test_save_lora_writes_peft_files_and_load_lora_adapts_a_base_model(tmp_path):
    model = _adapted()
    save_lora(model, tmp_path / "adapter", {"base_model_name_or_path": "HuggingFaceTB/tiny"})
    config = json.loads((tmp_path / "adapter" / ADAPTER_CONFIG).read_text())
    assert config["peft_type"] == "LORA" and config["bias"] == "none"
    assert config["r"] == R and config["lora_alpha"] == ALPHA and config["lora_dropout"] == 0.0
    assert config["target_modules"] == ["q_proj", "v_proj"]
    assert config["base_model_name_or_path"] == "HuggingFaceTB/tiny"
    file = tmp_path / "adapter" / ADAPTER_WEIGHTS
    with safetensors.safe_open(str(file), framework="np") as f:
        assert f.metadata() == {"format": "pt"}
    stored = safetensors.numpy.load_file(str(file))
    expected = lora_state_dict(model)
    assert sorted(stored) == sorted(expected)
    for k, v in expected.items():
        assert stored[k].dtype == np.float32
        np.testing.assert_array_equal(stored[k], v, err_msg=k)
    assert [p.name for p in (tmp_path / "adapter").iterdir() if p.name.startswith(".")] == []

    fresh = _base()  # the same base weights; no adapters yet: the config places them
    assert load_lora(fresh, tmp_path / "adapter") is fresh
    assert fresh.state_dict().keys() == model.state_dict().keys()
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(fresh.state_dict()[k], v, err_msg=k)
    assert [n for n, p in fresh.named_parameters() if p.requires_grad] == [
        n for n, p in model.named_parameters() if p.requires_grad
    ]
    other = apply_lora(_base(), r=R, alpha=ALPHA)  # adapters already there: filled in
    load_lora(other, file)
    for k, v in expected.items():
        np.testing.assert_array_equal(lora_state_dict(other)[k], v, err_msg=k)


def test_a_config_names_full_paths_when_leaf_names_would_select_more(tmp_path):
    model = apply_lora(_base(), ["model.layers.1.self_attn.q_proj"], r=2, alpha=4, dropout=0.1)
    save_lora(model, tmp_path)
    config = json.loads((tmp_path / ADAPTER_CONFIG).read_text())
    assert config["target_modules"] == ["model.layers.1.self_attn.q_proj"]
    assert config["lora_dropout"] == 0.1 and config["r"] == 2
    fresh = load_lora(_base(), tmp_path)
    assert [p for p, _ in _loras(fresh)] == ["model.layers.1.self_attn.q_proj"]
    assert fresh.model.layers[1].self_attn.q_proj.lora_dropout.p == 0.1


def test_loading_adapters_of_another_shape_names_the_tensor_and_both_shapes(tmp_path):
    save_lora(_adapted(), tmp_path)  # r = 4
    model = apply_lora(_base(), r=8, alpha=ALPHA)
    before = model.state_dict()
    with pytest.raises(StateDictError) as e:
        load_lora(model, tmp_path)
    msg = str(e.value)
    key = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    assert f"size mismatch for {key}: the file has shape (4, 32), the model (8, 32)" in msg
    assert "lora_B.weight: the file has shape (32, 4), the model (32, 8)" in msg
    for k, v in model.state_dict().items():
        np.testing.assert_array_equal(v, before[k], err_msg=k)

    wide = _base(cfg=TransformerConfig(hidden_size=64))  # a base model of another size
    with pytest.raises(StateDictError, match=r"the file has shape \(4, 32\), the model \(4, 64\)"):
        load_lora(wide, tmp_path)
    assert not _loras(wide) and all(p.requires_grad for p in wide.parameters())

    only_q = apply_lora(_base(), ["q_proj"], r=R, alpha=ALPHA)
    with pytest.raises(StateDictError, match=r"unexpected adapter tensors: \['base_model"):
        load_lora(only_q, tmp_path)
    with pytest.raises(ValueError, match="lora_alpha=8 but the adapter at"):
        load_lora(apply_lora(_base(), r=R, alpha=16), tmp_path)


def test_load_lora_reports_missing_files_and_unsupported_peft_options(tmp_path):
    with pytest.raises(FileNotFoundError, match="no LoRA adapter weights"):
        load_lora(_base(), tmp_path)
    save_lora(_adapted(), tmp_path)
    (tmp_path / ADAPTER_CONFIG).unlink()
    with pytest.raises(FileNotFoundError, match="has no LoRA adapters and there is no"):
        load_lora(_base(), tmp_path)
    peft = {  # as PEFT's LoraConfig.save_pretrained writes it
        "alpha_pattern": {},
        "auto_mapping": None,
        "base_model_name_or_path": "HuggingFaceTB/SmolLM2-135M",
        "bias": "none",
        "fan_in_fan_out": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "layers_pattern": None,
        "layers_to_transform": None,
        "lora_alpha": ALPHA,
        "lora_dropout": 0.05,
        "modules_to_save": None,
        "peft_type": "LORA",
        "r": R,
        "rank_pattern": {},
        "revision": None,
        "target_modules": ["v_proj", "q_proj"],
        "task_type": "CAUSAL_LM",
        "use_dora": False,
        "use_rslora": False,
    }
    (tmp_path / ADAPTER_CONFIG).write_text(json.dumps(peft))
    model = load_lora(_base(), tmp_path)
    assert len(_loras(model)) == 4 and model.model.layers[0].self_attn.v_proj.lora_dropout.p == 0.05
    save_lora(model, tmp_path / "again")
    again = json.loads((tmp_path / "again" / ADAPTER_CONFIG).read_text())
    # the file describes the model's adapters; what only PEFT reads is its default again
    assert again["base_model_name_or_path"] is None and again["lora_dropout"] == 0.05
    assert again["target_modules"] == ["q_proj", "v_proj"]
    for option in ({"use_dora": True}, {"layers_to_transform": [0]}, {"bias": "all"}):
        (tmp_path / ADAPTER_CONFIG).write_text(json.dumps({**peft, **option}))
        model = _base()
        with pytest.raises(ValueError, match=re.escape(str(option)[1:-1])):
            load_lora(model, tmp_path)
        assert not _loras(model)


# ------------------------------------------------------------------ against torch (GPU)
def _cos_and_norm_error(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float]:
    ours, ref = ours.astype(np.float64).ravel(), ref.ravel()
    cos = ours @ ref / (np.linalg.norm(ours) * np.linalg.norm(ref))
    return cos, abs(np.linalg.norm(ours) / np.linalg.norm(ref) - 1)


def test_logits_loss_and_adapter_gradients_match_torch_float64(gpu_device):
    model = _adapted()
    ids, labels = _batch()
    twin, params = _torch_twin(model)
    ref_logits, ref_loss = _torch_loss(twin, ids, labels)
    ref_loss.backward()
    logits = model(ids)
    ref_logits = ref_logits.detach().numpy()
    assert np.abs(logits - ref_logits).max() <= 1e-5 * np.abs(ref_logits).max()
    tr = mn.Trainer(model, SGD(lr=0.0), lm_loss, device=gpu_device)
    loss, grads = tr.step(ids, labels, return_grads=True)
    assert loss == pytest.approx(ref_loss.item(), rel=1e-5)
    assert sorted(grads) == sorted(params)  # the frozen base weights have none
    for name, p in params.items():
        cos, norm_error = _cos_and_norm_error(grads[name], p.grad.numpy())
        assert cos >= 0.999 and norm_error <= 0.01, (name, cos, norm_error)
        assert np.linalg.norm(p.grad.numpy()) > 1e-3, name  # a gradient that could be wrong
        # measured on lavapipe: 1 - cos ~ 1e-13, norm error <= 5e-7
        assert np.abs(grads[name] - p.grad.numpy()).max() <= 1e-4 * np.abs(p.grad.numpy()).max()


def test_adamw_steps_match_torch_and_leave_the_base_weights_bit_identical(gpu_device, tmp_path):
    model = _adapted()
    base = _base_weights(model)
    twin, params = _torch_twin(model)
    opt = AdamW(lr=1e-2, weight_decay=0.1)
    t_opt = torch.optim.AdamW(params.values(), lr=1e-2, weight_decay=0.1)
    tr = mn.Trainer(model, opt, lm_loss, device=gpu_device)
    for _ in range(3):
        ids, labels = _batch()
        loss = tr.step(ids, labels)
        t_opt.zero_grad()
        ref = _torch_loss(twin, ids, labels)[1]
        ref.backward()
        t_opt.step()
        assert loss == pytest.approx(ref.item(), rel=1e-5)
    sd = model.state_dict()
    for name, p in params.items():
        np.testing.assert_allclose(sd[name], p.detach().numpy(), rtol=1e-4, atol=1e-6)
    for k, v in base.items():
        np.testing.assert_array_equal(sd[k], v, err_msg=k)
    state = [k for k in tr.state_dict() if k.startswith("optimizer/")]
    assert sorted(state) == sorted(
        f"optimizer/{n}.{s}" for n in params for s in ("exp_avg", "exp_avg_sq")
    )

    # the trained adapters travel through a file to a fresh base model and to the torch twin
    out = model(ids)
    save_lora(model, tmp_path)
    adapters = safetensors.numpy.load_file(str(tmp_path / ADAPTER_WEIGHTS))
    twin2, _ = _torch_twin(model, adapters=adapters)
    np.testing.assert_allclose(_torch_loss(twin2, ids, labels)[0].detach().numpy(), out, atol=1e-4)
    merged = merge_lora(model)(ids)
    assert np.abs(merged - out).max() <= 1e-5 * np.abs(out).max()


def test_freezing_takes_effect_at_the_next_step_of_a_running_trainer(gpu_device):
    model = _base()
    tr = mn.Trainer(model, AdamW(lr=1e-2), lm_loss, device=gpu_device)
    ids, labels = _batch()
    tr.step(ids, labels)  # full fine-tuning: every weight moves
    apply_lora(model, r=R, alpha=ALPHA)
    base = _base_weights(model)
    for _ in range(2):
        tr.step(ids, labels)
    for k, v in _base_weights(model).items():
        np.testing.assert_array_equal(v, base[k], err_msg=k)
    assert any(m.lora_B.weight.data.any() for _, m in _loras(model))  # the adapters trained
    assert tr.cache_info().misses == 2


def test_lora_dropout_is_active_in_train_mode_only(gpu_device):
    model = _adapted(dropout=0.5)
    plain = _adapted()  # the same weights (same seeds), no dropout
    for (_, a), (_, b) in zip(_loras(model), _loras(plain), strict=True):
        b.lora_B.weight.copy_(a.lora_B.weight)
    ids, _ = _batch()
    want = plain(ids)
    np.testing.assert_array_equal(model.eval()(ids), want)
    assert np.abs(model.train()(ids) - want).max() > 1e-3

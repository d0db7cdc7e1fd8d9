"""The Llama decoder (``meganeura.models.llama``) against transformers' own
``LlamaForCausalLM`` on the same weights: full forward logits, the KV-cache path (prefill and
decode equal to a full recompute at every position, batched left-padded decode equal to one
prompt at a time) and a training step's gradients (float64 torch autograd as the reference).
Small random configs; the real SmolLM2 weights are tested in ``test_llama_real.py``."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers

import meganeura as mn
from meganeura.models.llama import ConfigError, LlamaConfig, LlamaForCausalLM, lm_loss

pytestmark = pytest.mark.gpu

TINY = dict(
    vocab_size=96,
    hidden_size=64,
    intermediate_size=96,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    rope_theta=100000.0,
    rms_norm_eps=1e-5,
    max_position_embeddings=256,
)


def torch_model(cfg: LlamaConfig, state: dict[str, np.ndarray], dtype=torch.float32):
    hf_cfg = transformers.LlamaConfig(**cfg.to_dict(), attn_implementation="eager")
    ref = transformers.LlamaForCausalLM(hf_cfg).to(dtype).eval()
    missing, unexpected = ref.load_state_dict(
        {k: torch.from_numpy(v).to(dtype) for k, v in state.items()}, strict=False
    )
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return ref


def rel_l2(a, b) -> float:
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


@pytest.fixture(params=[True, False], ids=["tied", "untied"])
def tiny(request):
    mn.manual_seed(0)
    cfg = LlamaConfig(**TINY, tie_word_embeddings=request.param)
    return LlamaForCausalLM(cfg)


def test_forward_matches_transformers(tiny, gpu_device):
    ids = np.random.default_rng(0).integers(0, 96, (2, 24))
    ours = tiny(ids)  # int64 ids are accepted
    ref = torch_model(tiny.config, tiny.state_dict(), torch.float64)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    assert ours.shape == (2, 24, 96) and ours.dtype == np.float32
    assert rel_l2(ours, want) <= 1e-5


def test_config_from_dict_reads_hf_and_refuses_what_it_cannot_build():
    cfg = LlamaConfig.from_dict({**TINY, "architectures": ["LlamaForCausalLM"], "foo": 1})
    assert cfg.head_dim == 16 and cfg.tie_word_embeddings
    assert transformers.LlamaConfig(**cfg.to_dict()).head_dim == 16
    bad = [
        ({"architectures": ["MistralForCausalLM"]}, "not a Llama model"),
        ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope_scaling"),
        ({"attention_bias": True}, "attention_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"num_key_value_heads": 3}, "multiple of num_key_value_heads"),
        ({"hidden_size": 0}, "hidden_size must be a positive int"),
    ]
    for extra, msg in bad:
        with pytest.raises(ConfigError, match=msg):
            LlamaConfig.from_dict({**TINY, **extra})


def test_training_step_gradients_match_torch_float64(gpu_device):
    mn.manual_seed(1)
    model = LlamaForCausalLM(LlamaConfig(**TINY, tie_word_embeddings=True))
    state = model.state_dict()
    rng = np.random.default_rng(2)
    tokens = rng.integers(0, 96, (2, 17))
    ids, labels = tokens[:, :-1], tokens[:, 1:].copy()
    labels[1, :3] = -100  # ignored positions, as HF's padding labels
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
    loss, grads = tr.step(ids, labels, return_grads=True)

    ref = torch_model(model.config, state, torch.float64)
    out = ref(torch.from_numpy(ids), labels=None).logits
    want_loss = torch.nn.functional.cross_entropy(
        out.reshape(-1, 96), torch.from_numpy(labels).reshape(-1), ignore_index=-100
    )
    want_loss.backward()
    assert abs(loss - want_loss.item()) <= 1e-5
    named = dict(ref.named_parameters())
    assert set(grads) == {k for k in state if k != "lm_head.weight"}
    for name, g in grads.items():
        w = named[name].grad.numpy()
        cos = float(np.sum(g * w) / (np.linalg.norm(g) * np.linalg.norm(w)))
        assert cos >= 0.999, (name, cos)
        assert abs(np.linalg.norm(g) / np.linalg.norm(w) - 1) <= 0.01, name

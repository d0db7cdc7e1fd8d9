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


def test_cache_prefill_and_decode_equal_a_full_recompute(tiny, gpu_device):
    ids = np.random.default_rng(3).integers(0, 96, (1, 21)).astype(np.int32)
    full = tiny(ids)
    tiny.setup_cache(1, 32)
    got = [tiny(ids[:, :9], cache_position=np.int32(0))]  # prefill 9 tokens
    for t in range(9, 21):  # then one token at a time, the slot a runtime value
        got.append(tiny(ids[:, t : t + 1], cache_position=np.asarray([t], np.int64)))
    got = np.concatenate(got, axis=1)
    np.testing.assert_allclose(got, full, rtol=0, atol=1e-5 * np.abs(full).max())
    # a chunk of 5 after the cache (lower-right causal over 9 + 5 slots)
    tiny.setup_cache(1, 32)
    tiny(ids[:, :9], cache_position=np.int32(0))
    chunk = tiny(ids[:, 9:14], cache_position=np.int32(9))
    np.testing.assert_allclose(chunk, full[:, 9:14], rtol=0, atol=1e-5 * np.abs(full).max())
    from meganeura.nn.compiled import default_compiled

    # full, prefill 9, decode, chunk 5: no compile per position (the cache shape is the same)
    assert default_compiled(tiny).cache_info().misses == 4


def test_batched_left_padded_generation_equals_one_prompt_at_a_time(gpu_device):
    from meganeura.models.generation import Generator

    mn.manual_seed(4)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    rng = np.random.default_rng(5)
    prompts = [rng.integers(3, 96, n).tolist() for n in (5, 11, 2)]
    alone = [
        Generator(model, buckets=(8, 16)).generate(p, 7, stop=[]).sequences[0] for p in prompts
    ]
    together = Generator(model, buckets=(8, 16)).generate(prompts, 7, stop=[])
    assert together.sequences == alone
    unchained = Generator(model, buckets=(8, 16), chain=False).generate(prompts, 7, stop=[])
    assert unchained.sequences == alone  # one decode call per token, ids read back each time
    assert together.finish_reasons == ["length"] * 3
    # and each equals greedy decoding by full recompute in transformers
    ref = torch_model(model.config, model.state_dict())
    for p, seq in zip(prompts, alone):
        with torch.no_grad():
            want = ref.generate(
                torch.tensor([p]), max_new_tokens=7, do_sample=False, eos_token_id=None
            )
        assert seq == want[0, len(p) :].tolist()


def test_generator_continues_a_conversation_from_its_cache(gpu_device):
    from meganeura.models.generation import Generator

    mn.manual_seed(6)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    gen = Generator(model, buckets=(4, 8))
    first = gen.generate([5, 6, 7, 8, 9], 4, stop=[])
    history = [5, 6, 7, 8, 9, *first.sequences[0]]
    assert gen.cached == len(history) - 1  # the last generated token has not run yet
    turn = history + [10, 11, 12]
    second = gen.generate(turn, 5, stop=[])
    fresh = Generator(model, buckets=(4, 8)).generate(turn, 5, stop=[])
    assert second.sequences == fresh.sequences
    # sampling: seeded, reproducible, within top_k
    a = Generator(model).generate([5, 6], 6, temperature=0.8, top_k=5, seed=0, stop=[])
    b = Generator(model).generate([5, 6], 6, temperature=0.8, top_k=5, seed=0, stop=[])
    assert a.sequences == b.sequences
    with pytest.raises(ValueError, match="top_p must be in"):
        gen.generate([5], 2, temperature=1.0, top_p=0.0)
    with pytest.raises(ValueError, match=r"token ids outside \[0, 96\)"):
        gen.generate([5, 96], 2)


def test_smollm2_360m_sized_embedding_runs_past_the_binding_limit(gpu_device):
    """SmolLM2-360M's tied 49152 x 960 f32 embedding (188 MB) is larger than one storage
    binding on lavapipe (128 MiB): split across bindings, the logits still match transformers
    (two of the 32 layers, to keep the test short; the layers' tensors are small)."""
    from dataclasses import replace

    from meganeura.models.llama import SMOLLM2_360M

    mn.manual_seed(7)
    model = LlamaForCausalLM(replace(SMOLLM2_360M, num_hidden_layers=2))
    assert model.model.embed_tokens.weight.numel() * 4 > 2**27
    ids = np.asarray([[1, 504, 3458, 282, 4649, 314]])
    ours = model(ids)
    ref = torch_model(model.config, model.state_dict())
    with torch.no_grad():
        want = ref(torch.from_numpy(ids)).logits.numpy()
    assert rel_l2(ours, want) <= 1e-5


def test_a_cache_shorter_than_the_bucket_still_prefills_exactly(gpu_device):
    from meganeura.models.generation import Generator

    mn.manual_seed(8)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    prompt = np.random.default_rng(9).integers(3, 96, 20).tolist()
    short = Generator(model, max_length=24, buckets=(64,)).generate(prompt, 4, stop=[])
    roomy = Generator(model, buckets=(64,)).generate(prompt, 4, stop=[])
    assert short.sequences == roomy.sequences
    with pytest.raises(ValueError, match="do not fit the cache's max_length 24"):
        Generator(model, max_length=24).generate(prompt, 5, stop=[])


def test_two_generators_on_one_model_do_not_reuse_each_others_cache(gpu_device):
    from meganeura.models.generation import Generator

    mn.manual_seed(10)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    a, b = Generator(model, buckets=(8,)), Generator(model, buckets=(8,))
    first = a.generate([5, 6, 7], 3, stop=[])
    b.generate([40, 41, 42, 43, 44, 45], 6, stop=[])  # overwrites the slots a filled
    turn = [5, 6, 7, *first.sequences[0], 9]
    again = a.generate(turn, 4, stop=[])
    assert again.sequences == Generator(model, buckets=(8,)).generate(turn, 4, stop=[]).sequences


def test_fast_mode_cache_prefill_and_decode_follow_the_strict_model(gpu_device):
    """Fast mode (f16 storage) through the KV cache: the prefill's rotations store v (f16,
    read in place through its permute) into the f32 cache, which once failed to compile
    (no f16 -> f32 conversion); logits at every position within f16 rounding of strict f32."""
    from meganeura.nn.compiled import CompiledModule

    mn.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**TINY))
    ids = np.random.default_rng(5).integers(0, 96, (1, 12)).astype(np.int32)
    full = model(ids)  # strict f32, no cache
    fast = CompiledModule(model, precision="fast")
    model.setup_cache(1, 32)
    got = [fast(ids[:, :8], cache_position=np.int32(0))]
    for t in range(8, 12):
        got.append(fast(ids[:, t : t + 1], cache_position=np.asarray([t], np.int64)))
    got = np.concatenate(got, axis=1)
    assert got.shape == full.shape
    assert rel_l2(got, full) < 3e-3, rel_l2(got, full)

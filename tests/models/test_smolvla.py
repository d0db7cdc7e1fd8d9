"""The SmolVLA action expert (``meganeura.models.smolvla``, workload W2) against a hand-written
torch twin (``smolvla_reference``) on identical weights and inputs, with the gates of
``docs/workloads.md`` (``gates``): forward, loss, per-parameter gradients, one SGD step, the
10-step denoising loop in its three forms (one unrolled program, one program per step chained
on the GPU, the host loop), and fast mode. A CPU-sized config (``SMOLVLA_TINY``); the workload's
own config is checked by its parameter count, without compiling. torch runs in float64 on the
float32 weights and inputs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.models.smolvla import (
    SMOLVLA_TINY,
    ConfigError,
    FlowMatchingSampler,
    SmolVLAActionExpert,
    SmolVLAConfig,
    flow_loss,
    flow_timesteps,
    from_lerobot_state_dict,
    sampling_timesteps,
    timestep_embedding,
    to_lerobot_state_dict,
)
from meganeura.nn import init

from . import gates
from .smolvla_reference import TorchSmolVLAExpert

BATCH, VLM_LEN = 2, 6


def _pair(cfg=SMOLVLA_TINY):
    """(ours, torch float64) with torch's initialization, norm weights drawn away from 1."""
    torch.manual_seed(0)
    ref = TorchSmolVLAExpert(cfg)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if "norm" in name:
                p.copy_(torch.rand(p.shape, generator=g) + 0.5)
    ours = SmolVLAActionExpert(cfg)
    result = ours.load_state_dict({k: v.detach().numpy() for k, v in ref.state_dict().items()})
    assert (result.missing_keys, result.unexpected_keys) == ([], [])
    return ours, ref.double()


def _inputs(cfg=SMOLVLA_TINY, per_layer=False, seed=0):
    rng = np.random.default_rng(seed)
    noisy = rng.standard_normal((BATCH, cfg.chunk_size, cfg.max_action_dim)).astype(np.float32)
    t = np.asarray([0.3, 0.8], np.float32)
    timestep = timestep_embedding(t, 2 * cfg.hidden_size)
    kv_shape = (BATCH, cfg.num_cross_layers, VLM_LEN, cfg.vlm_kv_dim)
    kv = rng.standard_normal(kv_shape if per_layer else (BATCH, VLM_LEN, cfg.vlm_kv_dim))
    target = rng.standard_normal(noisy.shape).astype(np.float32)
    return noisy, timestep, kv.astype(np.float32), target


def t64(*arrays):
    return [torch.from_numpy(np.asarray(a, np.float64)) for a in arrays]


# ---------------------------------------------------------------------------- no GPU
def test_w2_parameter_count_and_names():
    """The workload's config has the parameter count of docs/workloads.md and lerobot's
    names; counted on an uninitialized model (nothing drawn, nothing compiled)."""
    with init.empty_weights():
        model = SmolVLAActionExpert()
    assert sum(p.numel() for p in model.parameters()) == 99_848_592
    names = dict(model.named_parameters())
    layer = "vlm_with_expert.lm_expert.layers"
    assert names[f"{layer}.0.self_attn.k_proj.weight"].shape == (320, 720)  # self: H -> kv
    assert names[f"{layer}.1.self_attn.k_proj.weight"].shape == (320, 320)  # cross: kv -> kv
    assert names[f"{layer}.15.mlp.down_proj.weight"].shape == (720, 2048)
    assert names["action_time_mlp_in.weight"].shape == (720, 1440)
    assert names["action_out_proj.bias"].shape == (32,)
    with init.empty_weights():
        normed = SmolVLAActionExpert(SmolVLAConfig(final_norm=True))
    assert sum(p.numel() for p in normed.parameters()) == 99_848_592 + 720


def test_lerobot_names_round_trip():
    ours, ref = _pair()
    lerobot = to_lerobot_state_dict(ours.state_dict())
    assert "model.vlm_with_expert.lm_expert.layers.1.self_attn.v_proj.weight" in lerobot
    lerobot["model.state_proj.weight"] = np.zeros((960, 32), np.float32)  # not the expert's
    lerobot["model.vlm_with_expert.vlm.model.norm.weight"] = np.zeros(960, np.float32)
    back = from_lerobot_state_dict(lerobot)
    assert list(back) == list(ours.state_dict()) == list(ref.state_dict())


def test_config_errors():
    with pytest.raises(ConfigError, match="num_key_value_heads"):
        SmolVLAConfig(num_attention_heads=15, num_key_value_heads=4)
    with pytest.raises(ConfigError, match="vlm_kv_dim"):
        SmolVLAConfig(vlm_kv_dim=960)
    with pytest.raises(ConfigError, match="hidden_size"):
        SmolVLAConfig(hidden_size=0)


def test_flow_timesteps_are_lerobots():
    """t = 1, 0.9, ..., 0.1 accumulated in float32 (lerobot's ``time += dt``), and the
    sinusoidal embedding of lerobot's ``create_sinusoidal_pos_embedding``."""
    t, dt, want = torch.tensor(1.0), torch.tensor(-0.1), []
    while t >= -dt / 2:
        want.append(t.item())
        t += dt
    np.testing.assert_array_equal(flow_timesteps(10), np.asarray(want, np.float32))
    emb = timestep_embedding(np.asarray([0.25]), 8)
    period = 4e-3 * (4.0 / 4e-3) ** np.linspace(0, 1, 4)
    arg = 0.25 * 2 * np.pi / period
    np.testing.assert_allclose(emb[0], np.concatenate([np.sin(arg), np.cos(arg)]), rtol=1e-6)


# ---------------------------------------------------------------------------- strict f32
@pytest.mark.gpu
@pytest.mark.parametrize("per_layer", [False, True], ids=["shared-kv", "per-layer-kv"])
def test_forward_matches_torch(gpu_device, per_layer):
    ours, ref = _pair()
    noisy, timestep, kv, _ = _inputs(per_layer=per_layer)
    got = ours(noisy, timestep, kv)
    with torch.no_grad():
        want = ref(*t64(noisy, timestep, kv)).numpy()
    assert got.shape == (BATCH, SMOLVLA_TINY.chunk_size, SMOLVLA_TINY.max_action_dim)
    err = gates.check_forward(got, want, gates.STRICT)
    print(f"smolvla forward ({'per-layer' if per_layer else 'shared'} kv): {err:.2e}")


def _torch_step(ref, batch, lr):
    """torch's loss, gradients and SGD step (float64)."""
    noisy, timestep, kv, target = t64(*batch)
    ref.zero_grad()
    loss = torch.nn.functional.mse_loss(ref(noisy, timestep, kv), target)
    loss.backward()
    grads = {k: p.grad.numpy().copy() for k, p in ref.named_parameters()}
    with torch.no_grad():
        for p in ref.parameters():
            p -= lr * p.grad
    return loss.item(), grads, {k: v.numpy().copy() for k, v in ref.state_dict().items()}


@pytest.mark.gpu
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_train_step_matches_torch(gpu_device, precision):
    """Loss, every parameter's gradient and one SGD step (lr 0.1) against torch; the fast
    mode (f16 storage) within the fast gates."""
    tol = gates.STRICT if precision == "strict" else gates.FAST
    ours, ref = _pair()
    batch = _inputs(seed=2)
    before = {k: v.astype(np.float64) for k, v in ours.state_dict().items()}
    lr = 0.1
    tr = mn.Trainer(ours, mn.optim.SGD(lr=lr), flow_loss, precision=precision, device=gpu_device)
    loss, grads = tr.step(*batch, return_grads=True)
    want_loss, want_grads, want_after = _torch_step(ref, batch, lr)
    errs = {
        "loss": gates.check_loss(loss, want_loss, tol),
        **gates.check_grads(grads, want_grads, tol),
        **gates.check_step(before, ours.state_dict(), want_after, tol),
    }
    if precision == "fast":  # the fast forward, through the same parameters after the step
        noisy, timestep, kv, _ = batch
        got = mn.compile(ours, precision="fast")(noisy, timestep, kv)
        with torch.no_grad():
            want = ref(*t64(noisy, timestep, kv)).numpy()
        errs["forward"] = gates.check_forward(got, want, tol)
    print(f"smolvla train step ({precision}): {errs}")


@pytest.mark.gpu
def test_sampling_forms_agree(gpu_device):
    """The 10-step Euler loop as one unrolled program, as one program per step chained on
    the GPU and as the host loop: the same actions, and torch's loop's. Two layers (one self,
    one cross): the unrolled program holds 10 copies of the expert."""
    cfg = dataclasses.replace(SMOLVLA_TINY, num_hidden_layers=2)
    ours, ref = _pair(cfg)
    noise, _, kv, _ = _inputs(cfg, seed=3)
    times = sampling_timesteps(cfg, BATCH)
    assert times.shape == (10, BATCH, 2 * cfg.hidden_size)
    with torch.no_grad():
        want = ref.sample_actions(*t64(noise, times, kv)).numpy()
    got = {}
    for mode in FlowMatchingSampler.MODES:
        sampler = FlowMatchingSampler(ours, mode=mode, device=gpu_device)
        got[mode] = sampler(noise, kv)
        again = sampler(noise, kv)  # the chained form resets its state each call
        np.testing.assert_array_equal(again, got[mode])
        sampler.close()
    for actions in got.values():
        gates.check_forward(actions, want, gates.STRICT)
    # The forms differ only by float32 rounding (the same kernels, differently grouped).
    assert gates.rel_l2(got["chained"], got["unrolled"]) <= 1e-6
    assert gates.rel_l2(got["host"], got["unrolled"]) <= 1e-6
    print({m: f"{gates.rel_l2(a, want):.2e}" for m, a in got.items()})


@pytest.mark.gpu
def test_bad_inputs_name_the_tensor(gpu_device):
    ours, _ = _pair()
    noisy, timestep, kv, _ = _inputs()
    with pytest.raises(ValueError, match=r"timestep must be \[2, 96\], got \[2, 95\]"):
        ours(noisy, timestep[:, :-1], kv)
    with pytest.raises(ValueError, match="vlm_kv"):
        ours(noisy, timestep, kv[..., :-1])

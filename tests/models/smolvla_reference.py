"""A hand-written PyTorch twin of ``meganeura.models.smolvla.SmolVLAActionExpert`` (workload
W2), written from ``docs/workloads.md`` with torch.nn.Linear, torch.nn.RMSNorm and
``F.scaled_dot_product_attention(enable_gqa=True)``: the independent reference of the tests,
of ``bench/smolvla.py`` and of the W2 workload (``bench/workloads_lib/w2_vla.py``). Same
parameter names, so state dicts move between the two as they are.
"""

from __future__ import annotations

import torch.nn.functional as F
from torch import nn


class Attention(nn.Module):
    def __init__(self, hidden, heads, kv_heads, head_dim, kv_in, cross):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim, self.cross = heads, kv_heads, head_dim, cross
        self.q_proj = nn.Linear(hidden, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(kv_in, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, hidden, bias=False)

    def forward(self, x, kv=None):
        b, t, _ = x.shape
        src = kv if self.cross else x
        m = src.shape[1]
        q = self.q_proj(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(src).view(b, m, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(src).view(b, m, self.kv_heads, self.head_dim).transpose(1, 2)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=not self.cross, enable_gqa=True)
        return self.o_proj(o.transpose(1, 2).reshape(b, t, -1))


class MLP(nn.Module):
    def __init__(self, hidden, inter):
        super().__init__()
        self.gate_proj = nn.Linear(hidden, inter, bias=False)
        self.up_proj = nn.Linear(hidden, inter, bias=False)
        self.down_proj = nn.Linear(inter, hidden, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class Layer(nn.Module):
    def __init__(self, cfg, cross):
        super().__init__()
        kv_in = cfg.vlm_kv_dim if cross else cfg.hidden_size
        self.self_attn = Attention(
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim,
            kv_in,
            cross,
        )
        self.mlp = MLP(cfg.hidden_size, cfg.intermediate_size)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, kv=None):
        x = x + self.self_attn(self.input_layernorm(x), kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class TorchSmolVLAExpert(nn.Module):
    """``forward(noisy [B,T,A], timestep [B,2H], vlm_kv [B,M,kv] or [B,C,M,kv]) -> [B,T,A]``."""

    def __init__(self, cfg):
        super().__init__()
        self.cfg = cfg
        h = cfg.hidden_size
        self.vlm_with_expert = nn.Module()
        self.vlm_with_expert.lm_expert = nn.Module()
        self.cross = [i % cfg.self_attn_every_n_layers != 0 for i in range(cfg.num_hidden_layers)]
        self.vlm_with_expert.lm_expert.layers = nn.ModuleList([Layer(cfg, c) for c in self.cross])
        if cfg.final_norm:
            self.vlm_with_expert.lm_expert.norm = nn.RMSNorm(h, eps=cfg.rms_norm_eps)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, h)
        self.action_out_proj = nn.Linear(h, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * h, h)
        self.action_time_mlp_out = nn.Linear(h, h)

    def forward(self, noisy, timestep, vlm_kv):
        t = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(timestep)))
        x = self.action_in_proj(noisy) + t[:, None, :]
        c = 0
        for layer, cross in zip(self.vlm_with_expert.lm_expert.layers, self.cross, strict=True):
            kv = None
            if cross:
                kv = vlm_kv[:, c] if vlm_kv.dim() == 4 else vlm_kv
                c += 1
            x = layer(x, kv)
        if self.cfg.final_norm:
            x = self.vlm_with_expert.lm_expert.norm(x)
        return self.action_out_proj(x)

    def sample_actions(self, noise, timesteps, vlm_kv):
        """lerobot's Euler loop: ``x_t += dt * v_t`` for each embedded time in ``timesteps``
        [S, B, 2H], ``dt = -1/S``."""
        dt = -1.0 / timesteps.shape[0]
        x = noise
        for t in timesteps:
            x = x + dt * self(x, t, vlm_kv)
        return x

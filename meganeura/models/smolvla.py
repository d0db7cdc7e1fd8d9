"""The SmolVLA action expert (workload W2, ``docs/workloads.md``): a flow-matching transformer
that turns a noisy action chunk into the velocity of the flow, conditioned on the flow time
and on the keys/values of a vision-language model (SmolVLM2).

    x = action_in_proj(noisy_actions) + time_mlp(timestep)        [B, T, H]  (T = chunk)
    N x (pre-norm block, RMSNorm):
        even layers: causal self-attention over the T action tokens (GQA)
        odd layers:  cross-attention, queries from the action tokens, keys/values
                     k_proj / v_proj (Linear kv -> kv) of the VLM layer's K/V [B, M, kv]
        then a SwiGLU MLP
    velocity = action_out_proj(x)                                  [B, T, A]

``time_mlp`` is ``action_time_mlp_out(silu(action_time_mlp_in(timestep)))`` on a timestep
vector f32 [B, 2H] (:func:`timestep_embedding`), broadcast over the T tokens: the workload's
formulation. Where it differs from lerobot's ``VLAFlowMatching`` (``lerobot.policies.smolvla.
modeling_smolvla``), on purpose:

  * lerobot feeds ``action_time_mlp_in`` per token with ``cat(action_in_proj(x_t),
    sincos(t)[H])``; the workload feeds it one vector [2H] per sample (sin/cos of H
    frequencies) and adds the MLP's output to ``action_in_proj(x_t)``. Same parameter shapes.
  * lerobot normalizes the expert's output (``lm_expert.norm``) before ``action_out_proj``;
    the workload does not (its parameter count, 99,848,592, has no final norm).
    ``SmolVLAConfig(final_norm=True)`` adds it.
  * the self-attention layers of lerobot also see the VLM prefix (keys/values concatenated);
    the workload's see the action tokens only, causally.

Names: lerobot's without the policy's ``model.`` prefix (``action_in_proj.weight``,
``vlm_with_expert.lm_expert.layers.0.self_attn.q_proj.weight``, ...), so the expert's part of a
lerobot ``smolvla_base`` checkpoint loads with :func:`from_lerobot_state_dict` and ours goes
back with :func:`to_lerobot_state_dict`.

Sampling (:class:`FlowMatchingSampler`): Euler steps ``x <- x + dt * v(x, t)`` from t = 1 to
0, ``dt = -1/num_steps``, as lerobot's ``sample_actions``; either all steps unrolled in one
program or one program per step submitted ``num_steps`` times with the state on the GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .. import nn
from ..nn import functional as F


class ConfigError(ValueError):
    """A configuration this module cannot build (names the field and the value)."""


@dataclass(frozen=True)
class SmolVLAConfig:
    """Sizes of the action expert; the defaults are workload W2's (lerobot ``smolvla_base``:
    SmolVLM2-500M text model of width 960, expert width 0.75 x 960).

    Attributes:
        hidden_size: width of the expert's residual stream (H).
        num_hidden_layers: expert layers; layer i is self-attention when
            ``i % self_attn_every_n_layers == 0``, else cross-attention.
        num_attention_heads, num_key_value_heads, head_dim: grouped-query attention.
        intermediate_size: SwiGLU width.
        rms_norm_eps: epsilon of every RMSNorm.
        self_attn_every_n_layers: see ``num_hidden_layers`` (lerobot's name).
        vlm_kv_dim: width of the VLM's keys/values (its kv heads x head_dim), the input of
            the cross-attention layers' k_proj / v_proj.
        max_action_dim: A, the action vector's width (padded).
        chunk_size: T, action tokens per chunk.
        num_steps: Euler steps of sampling.
        min_period, max_period: the sinusoidal timestep embedding's periods (lerobot's).
        final_norm: apply an RMSNorm (``lm_expert.norm``) before ``action_out_proj``, as
            lerobot does; the workload does not.
    """

    hidden_size: int = 720
    num_hidden_layers: int = 16
    num_attention_heads: int = 15
    num_key_value_heads: int = 5
    head_dim: int = 64
    intermediate_size: int = 2048
    rms_norm_eps: float = 1e-5
    self_attn_every_n_layers: int = 2
    vlm_kv_dim: int = 320
    max_action_dim: int = 32
    chunk_size: int = 50
    num_steps: int = 10
    min_period: float = 4e-3
    max_period: float = 4.0
    final_norm: bool = False

    def __post_init__(self) -> None:
        for name in (
            "hidden_size",
            "num_hidden_layers",
            "num_attention_heads",
            "num_key_value_heads",
            "head_dim",
            "intermediate_size",
            "self_attn_every_n_layers",
            "vlm_kv_dim",
            "max_action_dim",
            "chunk_size",
            "num_steps",
        ):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v <= 0:
                raise ConfigError(f"SmolVLAConfig.{name} must be a positive int, got {v!r}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ConfigError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        if self.vlm_kv_dim != self.num_key_value_heads * self.head_dim:
            raise ConfigError(
                f"vlm_kv_dim ({self.vlm_kv_dim}) must equal num_key_value_heads x head_dim "
                f"({self.num_key_value_heads * self.head_dim}): cross-attention keeps the "
                "VLM's key/value width"
            )

    def is_cross_attention(self, layer: int) -> bool:
        return layer % self.self_attn_every_n_layers != 0

    @property
    def num_cross_layers(self) -> int:
        return sum(self.is_cross_attention(i) for i in range(self.num_hidden_layers))


#: Workload W2 (99,848,592 parameters).
SMOLVLA_BASE = SmolVLAConfig()
#: A CPU-sized expert for tests and smoke runs: 2 self + 2 cross layers.
SMOLVLA_TINY = SmolVLAConfig(
    hidden_size=48,
    num_hidden_layers=4,
    num_attention_heads=3,
    num_key_value_heads=1,
    head_dim=16,
    intermediate_size=96,
    vlm_kv_dim=16,
    max_action_dim=8,
    chunk_size=10,
)


# ---------------------------------------------------------------------------- the modules
class ExpertAttention(nn.Module):
    """Grouped-query attention of one expert layer: causal self-attention over the action
    tokens, or (``cross=True``) cross-attention whose keys and values are ``k_proj`` /
    ``v_proj`` (kv -> kv) of the VLM's keys/values. No biases, no rotary embedding."""

    def __init__(self, cfg: SmolVLAConfig, cross: bool) -> None:
        super().__init__()
        h, hd = cfg.hidden_size, cfg.head_dim
        self.num_heads, self.num_kv_heads, self.head_dim = (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            hd,
        )
        self.cross = cross
        kv_in = cfg.vlm_kv_dim if cross else h
        self.q_proj = nn.Linear(h, self.num_heads * hd, bias=False)
        self.k_proj = nn.Linear(kv_in, self.num_kv_heads * hd, bias=False)
        self.v_proj = nn.Linear(kv_in, self.num_kv_heads * hd, bias=False)
        self.o_proj = nn.Linear(self.num_heads * hd, h, bias=False)

    def forward(self, x, vlm_kv=None):
        """x f32 [B, T, H]; vlm_kv f32 [B, M, kv] (cross-attention only) -> f32 [B, T, H]."""
        bsz, seq, _ = x.shape
        src = vlm_kv if self.cross else x

        def heads(t, n):
            return F.permute(F.reshape(t, (bsz, t.shape[1], n, self.head_dim)), (0, 2, 1, 3))

        q = heads(self.q_proj(x), self.num_heads)
        k = heads(self.k_proj(src), self.num_kv_heads)
        v = heads(self.v_proj(src), self.num_kv_heads)
        o = F.scaled_dot_product_attention(q, k, v, is_causal=not self.cross, enable_gqa=True)
        o = F.reshape(F.permute(o, (0, 2, 1, 3)), (bsz, seq, self.num_heads * self.head_dim))
        return self.o_proj(o)


class ExpertMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))`` (Shazeer 2020)."""

    def __init__(self, cfg: SmolVLAConfig) -> None:
        super().__init__()
        h, f = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, f, bias=False)
        self.up_proj = nn.Linear(h, f, bias=False)
        self.down_proj = nn.Linear(f, h, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class ExpertLayer(nn.Module):
    """``x + self_attn(input_layernorm(x))``, then ``x + mlp(post_attention_layernorm(x))``."""

    def __init__(self, cfg: SmolVLAConfig, cross: bool) -> None:
        super().__init__()
        self.self_attn = ExpertAttention(cfg, cross)  # lerobot's name, cross or not
        self.mlp = ExpertMLP(cfg)
        self.input_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)
        self.post_attention_layernorm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)

    def forward(self, x, vlm_kv=None):
        x = x + self.self_attn(self.input_layernorm(x), vlm_kv)
        return x + self.mlp(self.post_attention_layernorm(x))


class ExpertModel(nn.Module):
    """The expert's layers (lerobot's ``lm_expert``, a Llama decoder without embeddings)."""

    def __init__(self, cfg: SmolVLAConfig) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            [ExpertLayer(cfg, cfg.is_cross_attention(i)) for i in range(cfg.num_hidden_layers)]
        )
        if cfg.final_norm:
            self.norm = nn.RMSNorm(cfg.hidden_size, eps=cfg.rms_norm_eps)


class VLMWithExpert(nn.Module):
    """Holds ``lm_expert`` under lerobot's name (the VLM itself is not part of this model)."""

    def __init__(self, cfg: SmolVLAConfig) -> None:
        super().__init__()
        self.lm_expert = ExpertModel(cfg)


class SmolVLAActionExpert(nn.Module):
    """The W2 action expert: ``forward(noisy_actions, timestep, vlm_kv)`` is the flow's
    velocity v(x_t, t).

    Initialization: ``torch.nn.Linear``'s for every projection, norms ones.

    Attributes:
        config: the :class:`SmolVLAConfig`.
    """

    def __init__(self, config: SmolVLAConfig | None = None) -> None:
        super().__init__()
        self.config = cfg = config or SmolVLAConfig()
        h = cfg.hidden_size
        self.vlm_with_expert = VLMWithExpert(cfg)
        self.action_in_proj = nn.Linear(cfg.max_action_dim, h)
        self.action_out_proj = nn.Linear(h, cfg.max_action_dim)
        self.action_time_mlp_in = nn.Linear(2 * h, h)
        self.action_time_mlp_out = nn.Linear(h, h)

    def forward(self, noisy_actions, timestep, vlm_kv):
        """The velocity of the flow at ``noisy_actions``.

        Args:
            noisy_actions: f32 [B, T, A] (A = ``max_action_dim``).
            timestep: f32 [B, 2H], the embedded flow time (:func:`timestep_embedding`).
            vlm_kv: f32 [B, M, kv]: the VLM keys/values every cross-attention layer reads, or
                f32 [B, C, M, kv]: one per cross-attention layer (C of them, in order).

        Returns:
            f32 [B, T, A].

        Raises:
            ValueError: inputs whose shapes do not fit the config (names the input).
        """
        cfg = self.config
        bsz, _, adim = noisy_actions.shape
        _check(adim == cfg.max_action_dim, "noisy_actions", "[B, T, max_action_dim]", noisy_actions)
        _check(
            tuple(timestep.shape) == (bsz, 2 * cfg.hidden_size),
            "timestep",
            f"[{bsz}, {2 * cfg.hidden_size}]",
            timestep,
        )
        per_layer = len(vlm_kv.shape) == 4
        want = (bsz, cfg.num_cross_layers) if per_layer else (bsz,)
        _check(
            len(vlm_kv.shape) in (3, 4)
            and tuple(vlm_kv.shape[: len(want)]) == want
            and vlm_kv.shape[-1] == cfg.vlm_kv_dim,
            "vlm_kv",
            f"[{bsz}, M, {cfg.vlm_kv_dim}] or [{bsz}, {cfg.num_cross_layers}, M, {cfg.vlm_kv_dim}]",
            vlm_kv,
        )
        t = self.action_time_mlp_out(F.silu(self.action_time_mlp_in(timestep)))
        x = self.action_in_proj(noisy_actions) + F.reshape(t, (bsz, 1, cfg.hidden_size))
        expert = self.vlm_with_expert.lm_expert
        cross = 0
        for layer in expert.layers:
            kv = None
            if layer.self_attn.cross:
                kv = F.select(vlm_kv, 1, cross) if per_layer else vlm_kv
                cross += 1
            x = layer(x, kv)
        if cfg.final_norm:
            x = expert.norm(x)
        return self.action_out_proj(x)

    def sample_actions(self, noise, timesteps, vlm_kv):
        """The Euler loop of flow-matching sampling, every step in one traced call:
        ``x <- x + dt * forward(x, timesteps[i], vlm_kv)`` for i in 0..S-1, ``dt = -1/S``.

        Args:
            noise: f32 [B, T, A], x at t = 1.
            timesteps: f32 [S, B, 2H], the embedded time of each step
                (:func:`flow_timesteps`, :func:`timestep_embedding`).
            vlm_kv: as :meth:`forward`.

        Returns:
            f32 [B, T, A], x at t = 0.
        """
        steps = timesteps.shape[0]
        dt = -1.0 / steps
        x = noise
        for i in range(steps):
            x = x + self(x, F.select(timesteps, 0, i), vlm_kv) * dt
        return x

    def denoise_step(self):
        """One Euler step on GPU state, traced as a program with no inputs: reads the
        buffers ``x_t``, ``step``, ``timesteps`` and ``vlm_kv`` (set by
        :class:`FlowMatchingSampler`), writes ``x_t + dt * v(x_t, timesteps[step])`` to
        ``x_t`` and ``step + 1`` to ``step``; ``dt = -1 / len(timesteps)``. Consecutive steps
        are submitted back to back with no host round trip.

        Returns:
            f32 [B, T, A]: the new ``x_t`` (not read back by the sampler).
        """
        steps, bsz = self.timesteps.shape[:2]
        x, step = self.x_t, self.step
        t = F.reshape(F.index_select(self.timesteps, 0, step), self.timesteps.shape[1:])
        x_next = x + self(x, t, self.vlm_kv) * (-1.0 / steps)
        self.x_t.index_copy_(0, F.arange(bsz), x_next)
        self.step.index_copy_(0, F.arange(1), step + 1)
        return x_next


def _check(ok: bool, name: str, want: str, t) -> None:
    if not ok:
        raise ValueError(f"SmolVLAActionExpert: {name} must be {want}, got {list(t.shape)}")


def flow_loss(model: SmolVLAActionExpert, noisy_actions, timestep, vlm_kv, target):
    """Mean squared error of the predicted velocity against ``target`` f32 [B, T, A]
    (lerobot's loss, ``mse(u_t, v_t)`` averaged): a ``Trainer`` loss_fn."""
    return F.mse_loss(model(noisy_actions, timestep, vlm_kv), target)


# ---------------------------------------------------------------------------- time
def flow_timesteps(num_steps: int) -> np.ndarray:
    """The times of the Euler steps, f32 [num_steps]: 1, 1 + dt, ... accumulated in float32
    as lerobot's ``sample_actions`` does (``time += dt`` on a float32 tensor)."""
    if isinstance(num_steps, bool) or not isinstance(num_steps, int) or num_steps <= 0:
        raise ValueError(f"num_steps must be a positive int, got {num_steps!r}")
    dt = np.float32(-1.0 / num_steps)
    t, out = np.float32(1.0), []
    for _ in range(num_steps):
        out.append(t)
        t = np.float32(t + dt)
    return np.asarray(out, np.float32)


def timestep_embedding(
    time, dim: int, min_period: float = 4e-3, max_period: float = 4.0
) -> np.ndarray:
    """Sine-cosine embedding of flow times (lerobot's ``create_sinusoidal_pos_embedding``):
    ``[sin(2 pi t / p_k), cos(2 pi t / p_k)]`` with ``p_k = min_period (max_period /
    min_period)^(k / (dim/2 - 1))``, computed in float64, returned f32 [*time.shape, dim].

    Raises:
        ValueError: an odd ``dim``.
    """
    if dim % 2:
        raise ValueError(f"timestep_embedding: dim must be even, got {dim}")
    t = np.asarray(time, np.float64)
    fraction = np.linspace(0.0, 1.0, dim // 2, dtype=np.float64)
    period = min_period * (max_period / min_period) ** fraction
    arg = t[..., None] * (2 * np.pi / period)
    return np.concatenate([np.sin(arg), np.cos(arg)], axis=-1).astype(np.float32)


def sampling_timesteps(cfg: SmolVLAConfig, batch: int, num_steps: int | None = None):
    """f32 [S, batch, 2H]: the embedded time of each Euler step (same for every sample)."""
    times = flow_timesteps(num_steps or cfg.num_steps)
    emb = timestep_embedding(times, 2 * cfg.hidden_size, cfg.min_period, cfg.max_period)
    return np.repeat(emb[:, None], batch, axis=1)


# ---------------------------------------------------------------------------- checkpoints
def from_lerobot_state_dict(state: dict) -> dict:
    """The expert's tensors of a lerobot SmolVLA state dict (``model.action_in_proj.weight``,
    ``model.vlm_with_expert.lm_expert.layers.0...``), under our names: the ``model.`` prefix
    dropped; the VLM, ``state_proj`` and normalization buffers left out."""
    ours = ("model.action_", "model.vlm_with_expert.lm_expert.")
    return {k[len("model.") :]: v for k, v in state.items() if k.startswith(ours)}


def to_lerobot_state_dict(state: dict) -> dict:
    """Our state dict under lerobot's names (``model.`` prefixed)."""
    return {f"model.{k}": v for k, v in state.items()}


# ---------------------------------------------------------------------------- sampling
class FlowMatchingSampler:
    """Flow-matching sampling with a :class:`SmolVLAActionExpert`: ``sampler(noise, vlm_kv)``
    runs ``num_steps`` Euler steps from ``noise`` (t = 1) and returns the actions (t = 0).

    Modes (all give the same actions up to float32 rounding):

      * ``"unrolled"``: :meth:`SmolVLAActionExpert.sample_actions`, every step in one
        program: one submission, the inputs uploaded and the result read once.
      * ``"chained"``: :meth:`SmolVLAActionExpert.denoise_step`, one program for one step,
        submitted ``num_steps`` times back to back; ``x_t`` stays on the GPU between steps
        (the noise, the embedded times and the VLM keys/values are written to buffers first,
        the result read once at the end).
      * ``"host"``: the model's forward called once per step, the Euler update on the host
        (a read-back and an upload per step; lerobot's loop).

    Args:
        model: the expert.
        num_steps: Euler steps (default ``model.config.num_steps``).
        mode: see above.
        precision: ``"strict"`` or ``"fast"``.
        device: a runtime Device (default: the default device).

    Raises:
        ValueError: an unknown mode or a bad ``num_steps``.
    """

    MODES = ("unrolled", "chained", "host")

    def __init__(
        self,
        model: SmolVLAActionExpert,
        num_steps: int | None = None,
        mode: str = "unrolled",
        precision: str = "strict",
        device=None,
    ) -> None:
        from ..compile import CompileOptions
        from ..nn.compiled import CompiledModule

        if mode not in self.MODES:
            raise ValueError(f"mode must be one of {self.MODES}, got {mode!r}")
        self.model, self.mode = model, mode
        self.num_steps = model.config.num_steps if num_steps is None else num_steps
        flow_timesteps(self.num_steps)  # validates
        self.options = CompileOptions(precision=precision, shared_parameters=True)
        self.forward = CompiledModule(model, precision=precision, device=device)
        self.device = device
        self._programs: dict = {}
        self._compile_seconds = 0.0

    @property
    def compile_seconds(self) -> float:
        """Trace + compile seconds of the current program ("host": of every forward)."""
        if self.mode == "host":
            return sum(
                e.trace_seconds + e.compile_seconds for e in self.forward.cache_info().entries
            )
        return self._compile_seconds

    def _runner(self, key, fn, args):
        from ..nn.compiled import ProgramRunner, trace_call

        key = (key, self.model.signature_key())
        runner = self._programs.get(key)
        if runner is None:
            traced = trace_call(self.model, fn, args, {})
            runner = ProgramRunner(traced, self.options, self.device)
            self._compile_seconds = traced.seconds + runner.compile_seconds
            for old in self._programs.values():  # one signature at a time
                old.session.close()
            self._programs = {key: runner}
        return runner

    def __call__(self, noise, vlm_kv) -> np.ndarray:
        """Actions f32 [B, T, A] from ``noise`` f32 [B, T, A] and ``vlm_kv`` (as
        :meth:`SmolVLAActionExpert.forward`)."""
        noise = np.ascontiguousarray(noise, np.float32)
        vlm_kv = np.ascontiguousarray(vlm_kv, np.float32)
        times = sampling_timesteps(self.model.config, noise.shape[0], self.num_steps)
        if self.mode == "host":
            x, dt = noise, np.float32(-1.0 / self.num_steps)
            for t in times:
                x = x + dt * self.forward(x, t, vlm_kv)
            return x
        if self.mode == "unrolled":
            args = (noise, times, vlm_kv)
            key = ("unrolled", noise.shape, vlm_kv.shape)
            runner = self._runner(key, self.model.sample_actions, args)
            feeds = dict(zip(runner.traced.inputs, args, strict=True))
            feeds = {k: v for k, v in feeds.items() if k in runner.program.inputs}
            out = runner.run(feeds, tuple(runner.program.outputs))
            return next(iter(out.values()))
        self._set_state(noise, times, vlm_kv)
        runner = self._runner(("chained", noise.shape, vlm_kv.shape), self.model.denoise_step, ())
        for _ in range(self.num_steps):
            runner.run({}, ())
        return self.model.x_t.data.copy()

    def _set_state(self, noise, times, vlm_kv) -> None:
        """The chained program's buffers: new ones when a shape changed (which recompiles
        it), else written in place."""
        m = self.model
        values = {
            "x_t": noise,
            "timesteps": times,
            "vlm_kv": vlm_kv,
            "step": np.zeros(1, np.int32),
        }
        for name, value in values.items():
            buf = m._buffers.get(name)
            if buf is None or tuple(buf.shape) != value.shape:
                setattr(m, name, nn.Buffer(value, persistent=False))
            else:
                buf.copy_(value)

    def close(self) -> None:
        """Free the compiled programs' GPU memory."""
        for runner in self._programs.values():
            runner.session.close()
        self._programs = {}
        self.forward.cache_clear()

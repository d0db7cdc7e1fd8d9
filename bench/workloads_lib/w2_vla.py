"""W2: the SmolVLA action expert (``docs/workloads.md``), meganeura's
``meganeura.models.smolvla`` against :func:`torch_expert`, the tests' plain PyTorch module
of the same structure and state-dict names.

The adapter: :data:`OURS` names the module, classes and methods this file expects. Until that
module is merged, :meth:`SmolVLA.missing` reports it and the harness skips W2.
"""

from __future__ import annotations

import importlib

from .base import Case, Workload
from .weights import sin_input

#: what the harness takes from meganeura's SmolVLA module (fix the names here if they change)
OURS = {
    "module": "meganeura.models.smolvla",
    "config": "SmolVLAConfig",  # fields: hidden_size, num_hidden_layers, num_attention_heads,
    # num_key_value_heads, head_dim, intermediate_size, rms_norm_eps, vlm_kv_dim,
    # max_action_dim, chunk_size; is_cross_attention(i)
    "model": "SmolVLAActionExpert",  # forward(noisy [B,T,A], timestep [B,2H], vlm_kv [B,M,kv])
    "sample": "sample_actions",  # (noise, timesteps [S,B,2H], vlm_kv) -> x at t=0
    "tiny": "SMOLVLA_TINY",  # the CPU-sized config of the tests: --quick's expert
}
STEPS = 10
VLM_CONTEXT = 16


def _module():
    return importlib.import_module(OURS["module"])


def torch_expert(cfg):
    """The PyTorch reference: the tests' hand-written twin
    (``tests/models/smolvla_reference.py``, as ``bench/smolvla.py`` uses it): nn.Linear,
    nn.RMSNorm and scaled_dot_product_attention with ``enable_gqa``; names as meganeura's
    (lerobot's)."""
    from tests.models.smolvla_reference import TorchSmolVLAExpert

    return TorchSmolVLAExpert(cfg)


class SmolVLA(Workload):
    id, name, title = "w2", "smolvla", "SmolVLA action expert"
    paper = {
        "fwd": ("fwd_chunk50", 11.2, 7.5),
        "train": ("train_chunk50", 65.6, 21.9),
        "first_s": 29,
    }

    def missing(self):
        try:
            mod = _module()
        except ImportError as e:
            return f"{OURS['module']} does not import ({e})"
        for key in ("config", "model", "tiny"):
            if not hasattr(mod, OURS[key]):
                return f"{OURS['module']} has no {OURS[key]}"
        return None

    def config(self, quick):
        mod = _module()
        return getattr(mod, OURS["tiny"]) if quick else getattr(mod, OURS["config"])()

    def cases(self, quick):
        chunk = self.config(quick).chunk_size
        return [
            Case(f"fwd_chunk{chunk}", "fwd", {"chunk": chunk}),
            Case(f"denoise{STEPS}", "denoise", {"chunk": chunk, "steps": 3 if quick else STEPS}),
            Case("fwd_chunk1", "fwd", {"chunk": 1}),
            Case(f"train_chunk{chunk}", "train", {"chunk": chunk}),
            Case(f"fwdbwd_chunk{chunk}", "fwdbwd", {"chunk": chunk}),
            Case(f"train_adam_chunk{chunk}", "train", {"chunk": chunk}, ("adam", 1e-5)),
        ]

    def build_ours(self, case, quick):
        import meganeura as mn

        mn.manual_seed(0)
        return getattr(_module(), OURS["model"])(self.config(quick))

    def build_torch(self, case, quick):
        return torch_expert(self.config(quick))

    def batch(self, case, quick):
        cfg = self.config(quick)
        m = 4 if quick else VLM_CONTEXT
        t = case.params["chunk"]
        kv = sin_input((1, m, cfg.vlm_kv_dim), 3.0)
        if case.kind == "denoise":
            noise = sin_input((1, t, cfg.max_action_dim), 1.0)
            times = sin_input((case.params["steps"], 1, 2 * cfg.hidden_size), 2.0)
            return noise, times, kv
        noisy = sin_input((1, t, cfg.max_action_dim), 1.0)
        timestep = sin_input((1, 2 * cfg.hidden_size), 2.0)
        if case.kind == "fwd":
            return noisy, timestep, kv
        return noisy, timestep, kv, sin_input((1, t, cfg.max_action_dim), 4.0)

    def ours_loss(self, model, noisy, timestep, vlm_kv, target):
        import meganeura.nn.functional as F

        return F.mse_loss(model(noisy, timestep, vlm_kv), target)

    def torch_loss(self, m, noisy, timestep, vlm_kv, target):
        import torch

        return torch.nn.functional.mse_loss(m(noisy, timestep, vlm_kv).float(), target)

    # ---------------------------------------------------------------- 10-step denoising
    def custom_ours(self, case, model, batch, precision, quick):
        from .ours import compile_call, timed_feeds

        state = {}

        def first():
            fn = getattr(model, OURS["sample"])
            runner, feeds, _, secs = compile_call(model, fn, batch, precision)
            state.update(runner=runner, feeds=feeds, secs=secs)
            runner.run(feeds, tuple(runner.program.outputs))
            state["timed"] = timed_feeds(runner, feeds)

        def run():
            state["runner"].run(state["timed"], ())

        def result():
            r = state["runner"]
            return next(iter(r.run(state["feeds"], tuple(r.program.outputs)).values()))

        return {
            "first": first,
            "run": run,
            "sync": lambda: state["runner"].session.synchronize(),
            "result": result,
            "sessions": lambda: [state["runner"].session],
            "stages": lambda: state.get("secs", {}),
            "profile": lambda: (state["runner"].session, state["feeds"]),
        }

    def custom_torch(self, case, m, batch, mode, dev):
        import torch

        from .torch_side import compiled

        noise, times, kv = batch
        fwd = compiled(m, mode)
        steps = times.shape[0]
        dt = -1.0 / steps
        out = {}

        def run():
            with torch.no_grad(), torch.autocast(dev, torch.bfloat16, enabled=mode == "eager_bf16"):
                x = noise
                for i in range(steps):
                    if mode == "reduce_overhead":
                        torch.compiler.cudagraph_mark_step_begin()
                    x = x + fwd(x, times[i], kv).float() * dt
                out["x"] = x
            return x

        return {
            "first": run,
            "run": run,
            "result": lambda: out["x"].detach().float().cpu().numpy(),
        }

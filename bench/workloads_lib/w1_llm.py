"""W1: SmolLM2-135M (Llama decoder), ``meganeura.models.llama`` against transformers'
``LlamaForCausalLM`` with the same config (``docs/workloads.md``).

Cases: ``fwd_seq128`` (batch 1 x 128 tokens, full logits, no KV cache); ``fwd_seq1`` (the
"single-token forward" read as the same call on one token, no cache: workloads.md does not say
which; greedy decode below covers the cached step); ``decode32`` (greedy 32 tokens from the
prompt ids with the KV cache: ms per token after the first, and time to first token; ours
``Generator``, torch ``generate``: eager with a dynamic cache, the compile modes with a static
cache and transformers' own ``CompileConfig``); ``train_seq128`` (SGD lr 1e-5, cross-entropy on
labels (i+1) % vocab) and ``fwdbwd_seq128``.
"""

from __future__ import annotations

import time

import numpy as np

from .base import Case, Workload
from .weights import token_ids

PROMPT = [504, 2455, 282, 1029, 314]
NEW_TOKENS = 32


class SmolLM2(Workload):
    id, name, title = "w1", "smollm2", "SmolLM2-135M"
    paper = {"fwd": ("fwd_seq128", 34.8, 10.6), "train": ("train_seq128", 113, 43.2), "first_s": 53}

    def config(self, quick: bool):
        from meganeura.models.llama import LlamaConfig

        if quick:
            return LlamaConfig(
                vocab_size=2048,
                hidden_size=64,
                intermediate_size=128,
                num_hidden_layers=2,
                num_attention_heads=4,
                num_key_value_heads=2,
            )
        return LlamaConfig()

    def cases(self, quick: bool) -> list[Case]:
        seq = 16 if quick else 128
        return [
            Case(f"fwd_seq{seq}", "fwd", {"seq": seq}),
            Case("fwd_seq1", "fwd", {"seq": 1}),
            Case(f"decode{NEW_TOKENS}", "decode", {"new_tokens": 8 if quick else NEW_TOKENS}),
            Case(f"train_seq{seq}", "train", {"seq": seq}),
            Case(f"fwdbwd_seq{seq}", "fwdbwd", {"seq": seq}),
            Case(f"train_adam_seq{seq}", "train", {"seq": seq}, ("adam", 1e-5)),
        ]

    def build_ours(self, case, quick):
        import meganeura as mn
        from meganeura.models.llama import LlamaForCausalLM

        mn.manual_seed(0)
        return LlamaForCausalLM(self.config(quick))

    def build_torch(self, case, quick):
        import transformers

        cfg = self.config(quick).to_dict()
        tcfg = transformers.LlamaConfig(**cfg, attn_implementation="sdpa")
        return transformers.LlamaForCausalLM(tcfg)

    def torch_model(self, case, quick, state=None):
        if state is None:
            _, state = self.ours_model(case, quick)
        state = dict(state)
        if "lm_head.weight" not in state:  # tied: HF's state dict names the head too
            state["lm_head.weight"] = state["model.embed_tokens.weight"]
        return super().torch_model(case, quick, state)

    def batch(self, case, quick):
        vocab = self.config(quick).vocab_size
        if case.kind == "decode":
            return (np.asarray([PROMPT], np.int32) % vocab,)
        seq = case.params["seq"]
        ids = token_ids((1, seq), vocab)
        if case.kind == "fwd":
            return (ids,)
        labels = ((np.arange(seq) + 1) % vocab).astype(np.int32)[None]
        return ids, labels

    def ours_loss(self, model, input_ids, labels):
        from meganeura.models.llama import lm_loss

        return lm_loss(model, input_ids, labels)

    def torch_forward(self, m, ids):
        return m(ids, use_cache=False).logits

    def torch_loss(self, m, ids, labels):
        import torch

        logits = m(ids, use_cache=False).logits
        return torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]).float(), labels.reshape(-1)
        )

    # ---------------------------------------------------------------- greedy decode
    def custom_ours(self, case, model, batch, precision, quick):
        from meganeura.models.generation import Generator

        n = case.params["new_tokens"]
        prompt = [int(t) for t in batch[0][0]]
        gen = Generator(model, buckets=(16, 128), precision=precision)
        state = {}

        def once():
            gen.reset()
            out = gen.generate(prompt, n, stop=[])
            state["tokens"] = list(out.sequences[0])
            return out

        def measure(warmup, repeats):
            ttft, per_token = [], []
            for i in range(warmup + repeats):
                out = once()
                if i >= warmup:
                    ttft.append(out.time_to_first_token * 1e3)
                    per_token.append(out.decode_seconds * 1e3 / max(len(out.sequences[0]) - 1, 1))
            return {"ms_per_token": per_token, "ttft_ms": ttft}

        def sessions():
            runners = [e.runner for e in gen.forward.cache_info().entries if e.runner]
            return [r.session for r in runners] + [c.session for c in gen._chains.values()]

        return {
            "first": once,
            "measure": measure,
            "result": lambda: np.asarray(state["tokens"][:n], np.int64),
            "sessions": sessions,
            "metrics": ("ms_per_token", "ttft_ms"),
            # the chained greedy step (one token), profiled against ms_per_token
            "profile": lambda: (next(iter(gen._chains.values())).session, {}),
        }

    def custom_torch(self, case, m, batch, mode, dev):
        import torch
        import transformers

        n = case.params["new_tokens"]
        ids = batch[0]
        kw: dict = {"disable_compile": True}
        if mode in ("compile", "reduce_overhead"):
            # transformers compiles the forward itself with a static cache (CompileConfig)
            kw = {
                "cache_implementation": "static",
                "compile_config": transformers.CompileConfig(
                    mode="reduce-overhead" if mode == "reduce_overhead" else "default"
                ),
            }
        autocast = mode == "eager_bf16"

        def run(k):
            with torch.no_grad(), torch.autocast(dev, torch.bfloat16, enabled=autocast):
                return m.generate(ids, max_new_tokens=k, min_new_tokens=k, do_sample=False, **kw)

        def sync():
            if dev == "cuda":
                torch.cuda.synchronize()

        state = {}

        def first():
            state["tokens"] = run(n)[0, ids.shape[1] :].tolist()

        def measure(warmup, repeats):
            one, full = [], []
            for i in range(warmup + repeats):
                for k, acc in ((1, one), (n, full)):
                    sync()
                    t = time.perf_counter()
                    run(k)
                    sync()
                    if i >= warmup:
                        acc.append((time.perf_counter() - t) * 1e3)
            per_token = [(f - o) / max(n - 1, 1) for f, o in zip(full, one, strict=True)]
            return {"ms_per_token": per_token, "ttft_ms": one}

        return {
            "first": first,
            "measure": measure,
            "result": lambda: np.asarray(state["tokens"], np.int64),
            "metrics": ("ms_per_token", "ttft_ms"),
        }

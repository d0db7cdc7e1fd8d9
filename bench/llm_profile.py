"""Where the time of SmolLM2-135M's prefill and training step goes (H200 profiling aid).

Compiles the prefill program (128 tokens, cache filled, last token out) and the training step
(seq 128, AdamW) of a randomly initialized SmolLM2-135M, then prints for each: the dispatch
count, the host-timed ``Session.run`` (median of 10 after 3 warm-ups, inputs fed), and the GPU
time per kernel from timestamp queries grouped by op and the 25 longest dispatches.

``--split-sums dispatch`` gives split-K products their own summing dispatch again (the
programs before ``codegen.wgsl.matmul.deferred``), for an A/B on one commit; ``--split-members
join`` lets products whose plan splits K join tiled matmul groups, run unsplit there
(``codegen.wgsl.matmul.tiled_group``; the default, ``apart``, keeps them split: the H200 timed
the prefill at 5.48-5.73 ms joined against 4.26-4.33 apart); ``--weight-grads apart`` leaves
the weight gradients sharing a right operand in their own dispatches
(``codegen.wgsl.matmul.tiled_rgroup``; default ``grouped``: q/k/v and gate/up one each);
``--sum-groups off`` gives split-K products summed by one kernel (the MLP's input gradient)
their own partials dispatches again (``codegen.wgsl.matmul.split_group.set_sum_groups``);
``--residual off`` keeps the residual add apart from the norm's input gradient
(``passes.fuse_norm.RESIDUAL``); ``--norm-prologue off`` keeps the summing dispatch of a split-K
matmul group whose output a layer_norm / rms_norm reads (o_proj + residual, down_proj +
residual), instead of the norm computing that output from the partials
(``codegen.wgsl.norm.prologue.set_enabled``); ``--sum-runs off`` keeps the summing
dispatches of split-K products that run back to back (q, k and v's) apart instead of one
dispatch (``codegen.wgsl.matmul.summing.set_enabled``).

Usage: python bench/llm_profile.py [--parts prefill,train] [--quick] [--out FILE]
                                   [--split-sums deferred|dispatch]
                                   [--split-members join|apart]
                                   [--weight-grads grouped|apart] [--sum-groups on|off]
                                   [--residual on|off] [--norm-prologue on|off]
                                   [--sum-runs on|off]
"""

from __future__ import annotations

import argparse
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import timeit  # noqa: E402


def report(name: str, session, feeds: dict, fetch: tuple, out) -> None:
    t = timeit(lambda: session.run(feeds, fetch), lambda: None, 3, 10)
    prof = session.profile(feeds, repeats=3)
    out.write(
        f"== {name}: {len(session.program.dispatches)} dispatches, Session.run median "
        f"{t['median']:.3f} ms (min {t['min']:.3f}); GPU sum {prof.step_ns() / 1e6:.3f} ms, "
        f"span {prof.span_ns() / 1e6:.3f} ms\n"
    )
    out.write(prof.table(by="op") + "\n")
    rows = prof.stats("dispatch")[:25]
    for k in rows:
        out.write(f"  {k.name[:90]:90s} {k.total_ns / prof.repeats / 1e3:9.1f} us\n")
    out.flush()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="prefill,train")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out")
    ap.add_argument("--split-sums", choices=("deferred", "dispatch"), default="deferred")
    ap.add_argument("--split-members", choices=("join", "apart"), default="apart")
    ap.add_argument("--weight-grads", choices=("grouped", "apart"), default="grouped")
    ap.add_argument("--sum-groups", choices=("on", "off"), default="on")
    ap.add_argument("--residual", choices=("on", "off"), default="on")
    ap.add_argument("--norm-prologue", choices=("on", "off"), default="on")
    ap.add_argument("--sum-runs", choices=("on", "off"), default="on")
    args = ap.parse_args()
    import meganeura as mn
    from bench.lever_ab import apply_flags

    apply_flags(args)
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import CompiledModule

    mn.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, vocab_size=4096) if args.quick else LlamaConfig()
    model = LlamaForCausalLM(cfg)
    seq = 16 if args.quick else 128
    out = open(args.out, "w") if args.out else sys.stdout
    out.write(
        f"split-K sums: {args.split_sums}, split members: {args.split_members}, "
        f"weight gradients: {args.weight_grads}, sum groups: {args.sum_groups}, "
        f"residual adds: {args.residual}, norm prologues: {args.norm_prologue}, "
        f"sum runs: {args.sum_runs}\n"
    )
    parts = args.parts.split(",")
    if "prefill" in parts:
        ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq), np.int32)
        model.setup_cache(1, 512)
        fwd = CompiledModule(model)
        pos = np.asarray(0, np.int32)
        fwd(ids, cache_position=pos, logits_to_keep=1, greedy=True)
        t = timeit(
            lambda: fwd(ids, cache_position=pos, logits_to_keep=1, greedy=True),
            lambda: None,
            3,
            10,
        )
        out.write(f"prefill module call median {t['median']:.3f} ms\n")
        runner = fwd.cache_info().entries[0].runner
        feeds = {n: runner.session.read(n) for n in runner.program.inputs}
        report("prefill", runner.session, feeds, tuple(runner.program.outputs), out)
    if "train" in parts:
        ids = (np.arange(seq, dtype=np.int32) % cfg.vocab_size)[None]
        labels = ((np.arange(seq) + 1) % cfg.vocab_size).astype(np.int32)[None]
        tr = mn.Trainer(model, mn.optim.AdamW(lr=1e-5), lm_loss)
        tr.step(ids, labels)
        t = timeit(lambda: tr.step(ids, labels), lambda: None, 3, 10)
        out.write(f"train Trainer.step median {t['median']:.3f} ms\n")
        prog = next(iter(tr._cache.values()))
        runner = prog.entry.runner
        feeds = {n: runner.session.read(n) for n in runner.program.inputs}
        report("train", runner.session, feeds, tuple(runner.program.outputs), out)


if __name__ == "__main__":
    main()

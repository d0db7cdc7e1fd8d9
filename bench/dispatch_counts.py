"""Dispatch counts of the big programs as the H200 compiles them, without a GPU and without
timing: SmolLM2-135M prefill (128 tokens into a 512-slot cache, last token's argmax, as
``bench/llm_profile.py``), its training step (seq 128, AdamW, as ``Trainer``), ResNet-50's
training step at batch 4 (SGD, cross-entropy), and on request W1's ``fwd_seq128``
(``--parts w1fwd``: the same model's 128-token forward without a cache, full logits),
whisper-tiny's training step (``--parts whisper``: 30 s of features, 32 tokens, SGD), the
SmolVLA action expert's (``--parts smolvla``: W2's ``train_chunk50``; ``smolvla_fwd``: its
forward, ``fwd_chunk50``) and the W5 U-Net's (``--parts unet``: ``train_small_b2``). Random
weights; each program is traced and compiled with ``meganeura.codegen.kernel.H200_LIMITS``
(``Limits.cpu`` False, so the GPU's matmul plans and split-K apply), and its dispatch list is
counted by kernel kind.

``--split-sums dispatch`` compiles split-K products with their own summing dispatch (the
program before ``codegen.wgsl.matmul.deferred``), for before/after figures from one commit;
``--conv-phases apart`` lowers each stride phase of a strided conv input gradient as its own
dispatch (``codegen.wgsl.conv.lowering.MERGE_PHASES`` False: the program before
``conv/phases.py``); ``--split-members join`` lets products whose plan splits K join tiled
matmul groups, run unsplit there (``codegen.wgsl.matmul.tiled_group.set_split_members``; the
default ``apart`` keeps them split, as the H200 timed faster); ``--weight-grads apart`` leaves
weight gradients sharing a right operand (``dQ.mT @ x``, ``dK.mT @ x``, ...) in their own
dispatches (``codegen.wgsl.matmul.tiled_rgroup.set_enabled``; default ``grouped``);
``--sum-groups off`` gives split-K products summed by one kernel (``dG @ Wg + dU @ Wu``) their
own partials dispatches again (``codegen.wgsl.matmul.split_group.set_sum_groups``);
``--residual off`` keeps the residual add apart from the norm's input gradient
(``passes.fuse_norm.RESIDUAL``); ``--norm-prologue off`` keeps the summing dispatch of a split-K
matmul group whose output a layer_norm / rms_norm reads (o_proj + residual, down_proj +
residual), instead of the norm computing that output from the partials
(``codegen.wgsl.norm.prologue.set_enabled``); ``--conv-epilogue off`` runs elementwise groups
reading a conv2d (the folded eval BatchNorm, ReLU, residual add) in their own dispatch after the
conv instead of in its store (``passes.fuse_conv.set_enabled``); ``--sum-runs off`` keeps the
summing dispatches of split-K products that run back to back (q, k and v's) apart instead of one
dispatch (``codegen.wgsl.matmul.summing.set_enabled``); ``--conv-norm off`` keeps the summing
dispatch of a split-K conv2d whose output a train-mode batch_norm or a group_norm reads first,
instead of the norm summing the partials (``codegen.wgsl.norm.conv_prologue.set_enabled``);
``--broadcast-views off`` copies a broadcast or slice that ``cat`` or a reduction reads (the
U-Net's nearest-2x upsample, its gradient's sums) in its own dispatch instead of the reader
reading it in place
(``passes.broadcast_views.set_enabled``); ``--attention-sums off`` keeps the summing dispatch of
q, k and v read only by the attention forward, instead of that kernel summing their partials
(``codegen.wgsl.attention.summed.set_enabled``); ``--pack off`` leaves independent
neighbouring dispatches apart instead of packing them into one (``schedule.pack.set_enabled``).
``--parts`` also takes ``resnet_eval`` and ``resnet_eval_b1`` (W3's ``fwd_b4`` / ``fwd_b1``:
ResNet-50 eval forward) and ``unet_fwd`` (W5's ``fwd_small_b2``).

Usage: python bench/dispatch_counts.py
           [--parts prefill,train,resnet[,w1fwd,whisper,smolvla,smolvla_fwd,unet]]
           [--quick] [--json FILE]
           [--split-sums deferred|dispatch] [--split-members join|apart]
           [--conv-phases merged|apart] [--weight-grads grouped|apart] [--sum-groups on|off]
           [--residual on|off] [--norm-prologue on|off] [--conv-epilogue on|off]
           [--sum-runs on|off] [--conv-norm on|off] [--broadcast-views on|off]
           [--attention-sums on|off] [--pack on|off]
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from meganeura.codegen.kernel import H200_LIMITS  # noqa: E402


def kind(name: str) -> str:
    """The kernel kind of a dispatch name: ``%12+13 matmul sum_splits`` -> ``matmul sum_splits``."""
    words = name.split()
    return " ".join(w for w in words if not w.startswith("%"))


def count(program) -> dict:
    kinds = collections.Counter(kind(d.name) for d in program.dispatches)
    return {"dispatches": len(program.dispatches), "by_kind": dict(kinds.most_common())}


def _train_options(optimizer):
    from meganeura.compile import CompileOptions

    return CompileOptions(
        loss="loss", optimizer=optimizer, shared_parameters=True, nonfinite_guard="raise"
    )


def _trainable(traced) -> tuple[str, ...]:
    from meganeura.nn import Parameter

    objects = traced.trace.objects
    return tuple(n for n, o in objects.items() if isinstance(o, Parameter) and o.requires_grad)


def prefill(quick: bool):
    import meganeura as mn
    from meganeura.compile import CompileOptions, compile
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, vocab_size=4096) if quick else LlamaConfig()
    model = LlamaForCausalLM(cfg)
    seq = 16 if quick else 128
    model.setup_cache(1, 512)
    ids = np.random.default_rng(0).integers(0, cfg.vocab_size, (1, seq), np.int32)
    kwargs = {"cache_position": np.asarray(0, np.int32), "logits_to_keep": 1, "greedy": True}
    traced = trace_call(model, model.forward, (ids,), kwargs)
    return compile(traced.graph, CompileOptions(shared_parameters=True), H200_LIMITS)


def train(quick: bool):
    import dataclasses

    import meganeura as mn
    from meganeura.compile import compile
    from meganeura.models.llama import LlamaConfig, LlamaForCausalLM, lm_loss
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    cfg = LlamaConfig(num_hidden_layers=2, vocab_size=4096) if quick else LlamaConfig()
    model = LlamaForCausalLM(cfg)
    seq = 16 if quick else 128
    ids = (np.arange(seq, dtype=np.int32) % cfg.vocab_size)[None]
    labels = ((np.arange(seq) + 1) % cfg.vocab_size).astype(np.int32)[None]
    traced = trace_call(model, lambda i, y: lm_loss(model, i, y), (ids, labels), {}, "loss")
    options = dataclasses.replace(
        _train_options(mn.optim.AdamW(lr=1e-5)), trainable=_trainable(traced)
    )
    return compile(traced.graph, options, H200_LIMITS)


def resnet(quick: bool):
    import dataclasses

    import meganeura as mn
    import meganeura.nn.functional as F
    from meganeura.compile import compile
    from meganeura.models.resnet import ResNet, ResNetConfig
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    layers, classes = ((1, 1, 1, 1), 10) if quick else ((3, 4, 6, 3), 1000)
    model = ResNet(ResNetConfig("bottleneck", layers, classes)).train()
    side, n = (32, 4) if quick else (224, 4)
    x = np.sin(np.arange(n * 3 * side * side, dtype=np.float32)).reshape(n, 3, side, side)
    labels = (np.arange(n) % classes).astype(np.int32)
    traced = trace_call(model, lambda x, y: F.cross_entropy(model(x), y), (x, labels), {}, "loss")
    options = dataclasses.replace(
        _train_options(mn.optim.SGD(lr=1e-5)), trainable=_trainable(traced)
    )
    return compile(traced.graph, options, H200_LIMITS)


def whisper(quick: bool):
    """whisper-tiny's training step (layer_norm with biases throughout): 30 s of features
    (3000 frames) and 32 decoder tokens at batch 1, SGD; ``--quick``: one layer per stack,
    vocab 4096, 2 s."""
    import dataclasses

    import meganeura as mn
    from meganeura.compile import compile
    from meganeura.models.whisper import (
        WhisperConfig,
        WhisperForConditionalGeneration,
        whisper_loss,
    )
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    cfg = WhisperConfig()
    if quick:
        special = dict(pad_token_id=4095, eos_token_id=4095, bos_token_id=4094)
        cfg = dataclasses.replace(
            cfg, encoder_layers=1, decoder_layers=1, vocab_size=4096, max_source_positions=100,
            decoder_start_token_id=4094, **special
        )  # fmt: skip
    model = WhisperForConditionalGeneration(cfg)
    frames, tokens = 2 * cfg.max_source_positions, 32
    feats = np.sin(np.arange(cfg.num_mel_bins * frames, dtype=np.float32))
    feats = feats.reshape(1, cfg.num_mel_bins, frames)
    ids = (np.arange(tokens + 1) % cfg.vocab_size).astype(np.int32)[None]
    args = (feats, ids[:, :-1], ids[:, 1:].copy())
    traced = trace_call(model, lambda f, i, y: whisper_loss(model, f, i, y), args, {}, "loss")
    options = dataclasses.replace(
        _train_options(mn.optim.SGD(lr=1e-5)), trainable=_trainable(traced)
    )
    return compile(traced.graph, options, H200_LIMITS)


def _workload_train(wid: str, case_name: str, quick: bool):
    """The training step of ``bench/workloads.py``'s case ``case_name`` of workload ``wid``
    (its model, batch, loss and optimizer), compiled for the H200's limits."""
    import dataclasses

    import meganeura as mn
    from bench.workloads_lib.cell import _optimizer
    from bench.workloads_lib.registry import WORKLOADS
    from meganeura.compile import compile
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    wl = WORKLOADS[wid]
    case = wl.case(case_name, quick)
    model, _ = wl.ours_model(case, quick)
    args = wl.batch(case, quick)
    traced = trace_call(model, lambda *a: wl.ours_loss(model, *a), args, {}, "loss")
    options = dataclasses.replace(
        _train_options(_optimizer(case.optimizer)), trainable=_trainable(traced)
    )
    return compile(traced.graph, options, H200_LIMITS)


def smolvla(quick: bool):
    """The SmolVLA action expert's training step as ``bench/workloads.py`` runs it (W2
    ``train_chunk50``: chunk 50, its optimizer; ``--quick``: the CPU-sized case)."""
    return _workload_train("w2", "train_chunk10" if quick else "train_chunk50", quick)


def smolvla_fwd(quick: bool):
    """The SmolVLA action expert's forward as ``bench/workloads.py`` compiles it (W2
    ``fwd_chunk50``, strict, shared parameters; ``--quick``: the CPU-sized case)."""
    import meganeura as mn
    from bench.workloads_lib.registry import WORKLOADS
    from meganeura.compile import CompileOptions, compile
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    wl = WORKLOADS["w2"]
    case = wl.case("fwd_chunk10" if quick else "fwd_chunk50", quick)
    model = wl.build_ours(case, quick)
    traced = trace_call(model, model.forward, wl.batch(case, quick), {})
    return compile(traced.graph, CompileOptions(shared_parameters=True), H200_LIMITS)


def unet(quick: bool):
    """W5's ``train_small_b2`` (the conv U-Net, batch 2 of 4x32x32, MSE, Adam) as
    ``bench/workloads.py`` builds it (``--quick``: its CPU-sized model, 16x16)."""
    return _workload_train("w5", "train_small_b2", quick)


def _workload_forward(wid: str, case_name: str, quick: bool):
    """The forward of ``bench/workloads.py``'s case ``case_name`` of workload ``wid`` as it
    compiles it (strict, shared parameters, eval mode where the case says so)."""
    import meganeura as mn
    from bench.workloads_lib.registry import WORKLOADS
    from meganeura.compile import CompileOptions, compile
    from meganeura.nn.compiled import trace_call

    mn.manual_seed(0)
    wl = WORKLOADS[wid]
    case = wl.case(case_name, quick)
    model = wl.build_ours(case, quick)
    traced = trace_call(model, model.forward, wl.batch(case, quick), {})
    return compile(traced.graph, CompileOptions(shared_parameters=True), H200_LIMITS)


def resnet_eval(quick: bool):
    """W3's ``fwd_b4``: ResNet-50's eval forward at batch 4 (BatchNorm folded,
    ``passes.fold_batch_norm``)."""
    return _workload_forward("w3", "fwd_b4", quick)


def resnet_eval_b1(quick: bool):
    """W3's ``fwd_b1``: ResNet-50's eval forward at batch 1."""
    return _workload_forward("w3", "fwd_b1", quick)


def unet_fwd(quick: bool):
    """W5's ``fwd_small_b2``: the conv U-Net's forward at batch 2."""
    return _workload_forward("w5", "fwd_small_b2", quick)


def w1fwd(quick: bool):
    """W1's ``fwd_seq128`` as ``bench/workloads.py`` compiles it (strict, shared parameters;
    ``--quick``: the CPU-sized case, ``fwd_seq16``)."""
    return _workload_forward("w1", "fwd_seq16" if quick else "fwd_seq128", quick)


PARTS = {
    "prefill": prefill,
    "train": train,
    "resnet": resnet,
    "whisper": whisper,
    "smolvla": smolvla,
    "smolvla_fwd": smolvla_fwd,
    "w1fwd": w1fwd,
    "unet": unet,
    "resnet_eval": resnet_eval,
    "resnet_eval_b1": resnet_eval_b1,
    "unet_fwd": unet_fwd,
}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="prefill,train,resnet")
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", help="also write the counts to this file")
    ap.add_argument("--split-sums", choices=("deferred", "dispatch"), default="deferred")
    ap.add_argument("--split-members", choices=("join", "apart"), default="apart")
    ap.add_argument("--conv-phases", choices=("merged", "apart"), default="merged")
    ap.add_argument("--weight-grads", choices=("grouped", "apart"), default="grouped")
    ap.add_argument("--sum-groups", choices=("on", "off"), default="on")
    ap.add_argument("--residual", choices=("on", "off"), default="on")
    ap.add_argument("--norm-prologue", choices=("on", "off"), default="on")
    ap.add_argument("--conv-epilogue", choices=("on", "off"), default="on")
    ap.add_argument("--sum-runs", choices=("on", "off"), default="on")
    ap.add_argument("--conv-norm", choices=("on", "off"), default="on")
    ap.add_argument("--broadcast-views", choices=("on", "off"), default="on")
    ap.add_argument("--attention-sums", choices=("on", "off"), default="on")
    ap.add_argument("--attention-rereads", choices=("bounded", "unbounded"), default="bounded")
    ap.add_argument("--delta-in-dq", choices=("on", "off"), default="on")
    ap.add_argument("--pack", choices=("on", "off"), default="on")
    args = ap.parse_args()
    from bench.lever_ab import apply_flags

    apply_flags(args)
    result = {
        "split_sums": args.split_sums,
        "split_members": args.split_members,
        "conv_phases": args.conv_phases,
        "weight_grads": args.weight_grads,
        "sum_groups": args.sum_groups,
        "residual": args.residual,
        "norm_prologue": args.norm_prologue,
        "conv_epilogue": args.conv_epilogue,
        "sum_runs": args.sum_runs,
        "conv_norm": args.conv_norm,
        "broadcast_views": args.broadcast_views,
        "attention_sums": args.attention_sums,
        "pack": args.pack,
    }
    for part in args.parts.split(","):
        c = result[part] = count(PARTS[part](args.quick))
        print(f"== {part}: {c['dispatches']} dispatches")
        for k, v in c["by_kind"].items():
            print(f"  {v:5d}  {k}")
    if args.json:
        tmp = args.json + ".tmp"
        with open(tmp, "w") as f:
            json.dump(result, f, indent=1)
        os.replace(tmp, args.json)


if __name__ == "__main__":
    main()

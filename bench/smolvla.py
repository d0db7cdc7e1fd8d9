"""Benchmark: the SmolVLA action expert (workload W2) against a hand-written torch twin in the
same process.

Cases (batch 1, VLM keys/values [1, 16, 320] shared by the cross-attention layers, the
protocol of ``docs/workloads.md``):
  * ``forward_chunk50`` / ``forward_chunk1``: one expert forward (the flow's velocity).
  * ``denoise10_*``: the 10-step Euler loop. Ours in three forms: ``unrolled`` (one program
    holding the 10 steps, one submission), ``chained`` (one single-step program submitted 10
    times back to back, x_t kept on the GPU), ``host`` (the forward called 10 times, the
    Euler update on the host); torch: its forward called 10 times in a Python loop.
  * ``train_chunk50``: one training step, MSE of the velocity to a target, SGD lr 1e-5
    (``--optimizer adamw`` for AdamW), the loss read back each step on both sides.

Our calls take NumPy inputs and return NumPy outputs (upload and read-back included); torch's
inputs and weights stay on its device and each call is followed by a device sync. Median and
min of ``--repeats`` (>= 10) timed runs after ``--warmup`` (>= 3). ``--compile`` adds
``torch.compile`` (default mode and "reduce-overhead" on CUDA), each with its first call's
time (the compile, from this process's cache state). ``--precision fast``: our f16 storage
against torch with TF32. Each row carries ``rel_err`` of our output against torch's.
Writes ``bench/results/<out-name>.json`` (``bench/results/quick/`` with ``--small``).

Usage: python bench/smolvla.py [--small] [--compile] [--precision strict|fast]
       [--parts forward,denoise,train] [--repeats 10] [--warmup 3] [--out-name smolvla_h200]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import ms_result, rel_err, timeit, torch_setup, write  # noqa: E402

VLM_LEN = 16


def inputs(cfg, chunk: int) -> dict[str, np.ndarray]:
    """Deterministic inputs (sin patterns, as the reference implementation's benchmark)."""
    n = chunk * cfg.max_action_dim
    noisy = (np.sin(np.arange(n) * 0.01) * 0.1).reshape(1, chunk, cfg.max_action_dim)
    kv = np.sin(np.arange(VLM_LEN * cfg.vlm_kv_dim) * 0.002) * 0.05
    target = np.cos(np.arange(n) * 0.013).reshape(noisy.shape)
    from meganeura.models.smolvla import timestep_embedding

    return {
        "noisy": noisy.astype(np.float32),
        "timestep": timestep_embedding(np.asarray([0.7]), 2 * cfg.hidden_size),
        "vlm_kv": kv.reshape(1, VLM_LEN, cfg.vlm_kv_dim).astype(np.float32),
        "target": target.astype(np.float32),
    }


def torch_variants(ref, torch, dev, args):
    """(name, callable module) pairs: eager, and with --compile torch.compile's modes."""
    out = [("eager", ref)]
    if args.compile:
        out.append(("compile", torch.compile(ref)))
        if dev == "cuda":
            out.append(("compile_reduce_overhead", torch.compile(ref, mode="reduce-overhead")))
    return out


def first_call(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def bench_forward(model, ref, torch, dev, sync, args, add):
    import meganeura as mn

    fwd = mn.compile(model, precision=args.precision)
    for chunk in (model.config.chunk_size, 1):
        x = inputs(model.config, chunk)
        ours_args = (x["noisy"], x["timestep"], x["vlm_kv"])
        ours_first = first_call(lambda a=ours_args: fwd(*a))
        mine = timeit(lambda a=ours_args: fwd(*a), lambda: None, args.warmup, args.repeats)
        got = fwd(*ours_args)
        t_args = [torch.from_numpy(a).to(dev) for a in ours_args]
        for mode, m in torch_variants(ref, torch, dev, args):
            try:
                with torch.no_grad():
                    t_first = first_call(lambda m=m, a=t_args: (m(*a), sync()))
                    theirs = timeit(lambda m=m, a=t_args: m(*a), sync, args.warmup, args.repeats)
                    want = m(*t_args).float().cpu().numpy()
            except Exception as e:  # noqa: BLE001 - one failing torch mode must not stop the rest
                print(f"torch {mode} forward failed: {type(e).__name__}: {str(e)[:300]}")
                continue
            add(
                ms_result(
                    f"w2_smolvla_forward_chunk{chunk}_vs_{mode}",
                    mine,
                    theirs,
                    rel_err=rel_err(got, want),
                    ours_first_call_s=ours_first,
                    torch_first_call_s=t_first,
                )
            )


def bench_denoise(model, ref, torch, dev, sync, args, add):
    from meganeura.models.smolvla import FlowMatchingSampler, sampling_timesteps

    cfg = model.config
    x = inputs(cfg, cfg.chunk_size)
    noise, kv = x["noisy"], x["vlm_kv"]
    times = sampling_timesteps(cfg, 1)
    t_noise, t_kv = (torch.from_numpy(a).to(dev) for a in (noise, kv))
    t_times = torch.from_numpy(times).to(dev)
    theirs = {}
    for mode, m in torch_variants(ref, torch, dev, args):

        def loop(m=m):
            x = t_noise
            for t in t_times:
                x = x + (-1.0 / len(t_times)) * m(x, t, t_kv)
            return x

        try:
            with torch.no_grad():
                first = first_call(lambda loop=loop: (loop(), sync()))
                timing = timeit(loop, sync, args.warmup, args.repeats)
                theirs[mode] = (timing, first, loop().float().cpu().numpy())
        except Exception as e:  # noqa: BLE001
            print(f"torch {mode} denoise failed: {type(e).__name__}: {str(e)[:300]}")
    for form in FlowMatchingSampler.MODES:
        sampler = FlowMatchingSampler(model, mode=form, precision=args.precision)
        ours_first = first_call(lambda s=sampler: s(noise, kv))
        mine = timeit(lambda s=sampler: s(noise, kv), lambda: None, args.warmup, args.repeats)
        got = sampler(noise, kv)
        programs = list(sampler._programs.values())
        dispatches = len(programs[0].program.dispatches) if programs else None
        for mode, (timing, first, want) in theirs.items():
            add(
                ms_result(
                    f"w2_smolvla_denoise10_{form}_vs_{mode}",
                    mine,
                    timing,
                    rel_err=rel_err(got, want),
                    ours_first_call_s=ours_first,
                    ours_compile_s=sampler.compile_seconds,
                    dispatches=dispatches,
                    torch_first_call_s=first,
                )
            )
        sampler.close()


def bench_train(model, ref, torch, dev, sync, args, add):
    import meganeura as mn
    from meganeura.models.smolvla import flow_loss

    x = inputs(model.config, model.config.chunk_size)
    batch = (x["noisy"], x["timestep"], x["vlm_kv"], x["target"])
    lr = 1e-5
    opt = mn.optim.AdamW(lr=lr) if args.optimizer == "adamw" else mn.optim.SGD(lr=lr)
    tr = mn.Trainer(model, opt, flow_loss, precision=args.precision)
    initial = {k: torch.from_numpy(v.copy()) for k, v in model.state_dict().items()}
    t0 = time.perf_counter()
    ours_loss = tr.step(*batch)  # the first step: compiles; its loss is compared below
    ours_first = time.perf_counter() - t0
    mine = timeit(lambda: tr.step(*batch), lambda: None, args.warmup, args.repeats)
    t_batch = [torch.from_numpy(a).to(dev) for a in batch]
    ref.train()
    for mode, m in torch_variants(ref, torch, dev, args):
        ref.load_state_dict(initial)  # every mode's first step from the same weights as ours
        params = list(ref.parameters())
        t_opt = (
            torch.optim.AdamW(params, lr=lr)
            if args.optimizer == "adamw"
            else torch.optim.SGD(params, lr=lr)
        )

        def step(m=m, t_opt=t_opt):
            t_opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(m(*t_batch[:3]), t_batch[3])
            loss.backward()
            t_opt.step()
            return loss.item()

        try:
            t0 = time.perf_counter()
            t_loss = step()
            first = time.perf_counter() - t0
            theirs = timeit(step, sync, args.warmup, args.repeats)
        except Exception as e:  # noqa: BLE001
            print(f"torch {mode} train failed: {type(e).__name__}: {str(e)[:300]}")
            continue
        add(
            ms_result(
                f"w2_smolvla_train_chunk{model.config.chunk_size}_{args.optimizer}_vs_{mode}",
                mine,
                theirs,
                loss_rel_err=abs(ours_loss - t_loss) / abs(t_loss),
                ours_first_call_s=ours_first,
                torch_first_call_s=first,
            )
        )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default="forward,denoise,train")
    ap.add_argument("--small", action="store_true", help="the CPU-sized config (smoke test)")
    ap.add_argument("--compile", action="store_true", help="also torch.compile")
    ap.add_argument("--precision", choices=["strict", "fast"], default="strict")
    ap.add_argument("--optimizer", choices=["sgd", "adamw"], default="sgd")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument(
        "--out-name",
        default=None,
        help="default smolvla_h200[_fast] (smolvla_small[_fast] with --small)",
    )
    args = ap.parse_args()
    if args.out_name is None:
        suffix = "_fast" if args.precision == "fast" else ""
        args.out_name = ("smolvla_small" if args.small else "smolvla_h200") + suffix

    import meganeura as mn
    from meganeura.models.smolvla import SMOLVLA_BASE, SMOLVLA_TINY, SmolVLAActionExpert
    from meganeura.runtime import get_device
    from tests.models.smolvla_reference import TorchSmolVLAExpert

    torch, dev = torch_setup()
    if args.precision == "fast":  # the protocol's fast point for PyTorch: TF32
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
        torch.set_float32_matmul_precision("high")

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    cfg = SMOLVLA_TINY if args.small else SMOLVLA_BASE
    mn.manual_seed(0)
    model = SmolVLAActionExpert(cfg)
    ref = TorchSmolVLAExpert(cfg)
    ref.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    ref = ref.to(dev).eval()
    device = get_device()
    rows: list[dict] = []
    t0 = time.perf_counter()

    def meta(complete: bool) -> dict:
        return {
            "config": dataclasses.asdict(cfg),
            "precision": args.precision,
            "repeats": args.repeats,
            "warmup": args.warmup,
            "torch_device": dev,
            "complete": complete,
            "wall_seconds": round(time.perf_counter() - t0, 2),
        }

    def add(row):
        rows.append(row)
        print(
            f"{row['case']:<52} ours {row['ours']:9.3f} ms  torch {row['torch']:9.3f} ms  "
            f"speedup {row['speedup']:6.3f}x",
            flush=True,
        )
        write(args.out_name, device, rows, meta(complete=False), quick=args.small)

    parts = args.parts.split(",")
    for name, fn in (
        ("forward", bench_forward),
        ("denoise", bench_denoise),
        ("train", bench_train),
    ):
        if name in parts:
            fn(model, ref, torch, dev, sync, args, add)
    print(write(args.out_name, device, rows, meta(complete=True), quick=args.small))


if __name__ == "__main__":
    main()

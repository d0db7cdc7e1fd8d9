"""Data-parallel training steps under ``mpiexec`` (issue 17 item 5, issue 18): SmolLM2-135M
(seq 128, AdamW lr 1e-5, strict f32) and ResNet-50 (AdamW lr 1e-5, train-mode BatchNorm), one
rank per GPU (``meganeura.distributed.init``: local rank -> adapter; fewer GPUs than ranks:
they share), against PyTorch DDP on the same per-rank batches.

Usage (every rank runs this script; rank 0 writes the result file):

    mpiexec -n 2 python bench/data_parallel.py --machine h200 [--workloads smollm2,resnet50]
    mpiexec -n 2 python bench/data_parallel.py --quick     # lavapipe smoke test
    mpiexec -n 2 python bench/data_parallel.py --quick --reduce mpi   # MPI, not shared memory

For each workload, weak scaling (the per-rank batch is fixed, the global batch is ranks x it):

  * ``1rank``: rank 0 alone (the others wait at a barrier), a plain ``Trainer`` step: the
    single-GPU baseline; and ``DistributedTrainer`` on ``COMM_SELF`` with and without overlap:
    what the split into two programs, the segments and the readback cost with no network;
  * ``Nranks``: every rank, ``DistributedTrainer`` with overlap (buckets of
    ``--bucket-cap-mb``) and without: step time, samples/s, the reduce's parts (GPU wait,
    readback, all-reduce, what overlap left exposed), efficiency = T(1 rank) / T(N ranks)
    (1.0: perfect weak scaling);
  * torch: the same model and weights (``bench/workloads_lib``), one rank alone and
    ``DistributedDataParallel`` on every rank (NCCL when every rank has a CUDA device of its
    own, else gloo: NCCL refuses two ranks on one GPU), AdamW, ``loss.item()`` each step.

Every step reads the loss back (both sides). Times: median of ``--repeats`` steps after
``--warmup``, rank 0's clock, a barrier before each step; our variants of one phase (plain /
no overlap / overlap) run interleaved step by step, so a drifting load weighs on each alike.
Results: ``bench/results/data_parallel_<machine>.json`` (``--quick``:
``bench/results/quick/``), rows in ``bench/common.py``'s schema (``speedup > 1``: ours
faster).
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import result as _result  # noqa: E402
from bench.common import write  # noqa: E402

LR = 1e-5


def workload(name: str, quick: bool, batch: int):
    """(our model, torch model factory, our loss_fn, torch loss, batch arrays, samples)."""
    from bench.workloads_lib.registry import WORKLOADS

    w = {x.name: x for x in WORKLOADS.values()}[name]
    case = w.case("train_seq16" if quick else "train_seq128", quick) if name == "smollm2" else None
    if name == "smollm2":
        from bench.workloads_lib.weights import token_ids

        seq = 16 if quick else 128
        vocab = w.config(quick).vocab_size
        ids = token_ids((batch, seq), vocab)
        labels = np.broadcast_to((np.arange(seq) + 1) % vocab, (batch, seq)).astype(np.int32)
        arrays = (ids, np.ascontiguousarray(labels))
    else:
        from bench.workloads_lib.weights import sin_input

        case = w.case("train_b4", quick)
        side = 32 if quick else 224
        x = sin_input((batch, 3, side, side), 1.0)
        arrays = (x, (np.arange(batch) % w._classes(quick)).astype(np.int32))
    model, state = w.ours_model(case, quick)
    return w, case, model, state, arrays


def result(case: str, metric: str, ours: float, theirs: float | None, **extra) -> dict:
    """``bench.common.result``; ``torch`` and ``speedup`` None where torch did not run."""
    if theirs is None:
        return {
            "case": case,
            "metric": metric,
            "ours": ours,
            "torch": None,
            "speedup": None,
            **extra,
        }
    return _result(case, metric, ours, theirs, **extra)


def timed(step, comm, warmup: int, repeats: int) -> list[float]:
    """Milliseconds of ``step()`` (which reads the loss back), a barrier before each."""
    for _ in range(warmup):
        step()
    out = []
    for _ in range(repeats):
        comm.Barrier()
        t = time.perf_counter()
        step()
        out.append((time.perf_counter() - t) * 1e3)
    return out


def interleaved(steps: dict, comm, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Milliseconds of each ``steps[k]()`` (a step reading the loss back), the steps run in
    turn, a barrier before each: a load that drifts (other jobs on the sandbox's two cores)
    then weighs on every variant alike."""
    out = {k: [] for k in steps}
    for i in range(warmup + repeats):
        for k, fn in steps.items():
            comm.Barrier()
            t = time.perf_counter()
            fn()
            if i >= warmup:
                out[k].append((time.perf_counter() - t) * 1e3)
    return out


def idle(comm) -> None:
    """A barrier that does not spin on the ranks waiting for rank 0's single-rank phase
    (MPICH's blocking calls busy-poll: on lavapipe that takes a core from rank 0's "GPU")."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.005)


def med(xs) -> float:
    return float(statistics.median(xs))


def ours(name, args, ctx, MPI, rows, info):
    import meganeura as mn
    from meganeura import distributed as dist

    comm, n = ctx.comm, ctx.world_size
    w, case, _, _, arrays = workload(name, args.quick, args.batch[name])
    loss_fn = w.ours_loss
    bs = arrays[0].shape[0]

    def fresh():
        # a model of its own per trainer: trainers taking turns on one model would move its
        # parameters between their programs' layouts (runtime.shared) and reopen every
        # Session each step
        return w.ours_model(case, args.quick)[0]

    def trainer(**kw):
        return dist.DistributedTrainer(
            fresh(),
            mn.optim.AdamW(lr=LR),
            loss_fn,
            bucket_cap_mb=args.bucket_cap_mb,
            reduce=args.reduce,
            **kw,
        )

    one = {}
    if ctx.rank == 0:  # the single-GPU figures: rank 0 alone, the three steps interleaved
        self_ = dict(comm=MPI.COMM_SELF, device=ctx.device)
        with (
            mn.Trainer(fresh(), mn.optim.AdamW(lr=LR), loss_fn, device=ctx.device) as plain,
            trainer(overlap=False, **self_) as no,
            trainer(overlap=True, **self_) as ov,
        ):
            steps = {
                "plain": lambda: plain.step(*arrays),
                "self_no_overlap": lambda: no.step(*arrays),
                "self_overlap": lambda: ov.step(*arrays),
            }
            one = interleaved(steps, MPI.COMM_SELF, args.warmup, args.repeats)
            one["self_overlap_buckets"] = ov.buckets
    idle(comm)
    parts = {
        o: {"gpu_wait": [], "readback": [], "allreduce": [], "exposed": [], "apply": []}
        for o in (0, 1)
    }

    def step(t, p):
        t.step(*arrays)
        p["gpu_wait"].append(t.gpu_wait_seconds * 1e3)
        p["readback"].append(t.readback_seconds * 1e3)
        p["allreduce"].append(t.allreduce_seconds * 1e3)
        p["exposed"].append(t.reduce_seconds * 1e3)
        p["apply"].append(t.apply_seconds * 1e3)

    with trainer(overlap=False) as no, trainer(overlap=True) as ov:
        times = interleaved(
            {0: lambda: step(no, parts[0]), 1: lambda: step(ov, parts[1])},
            comm,
            args.warmup,
            args.repeats,
        )
        figures = {
            bool(o): {
                "ms": times[o],
                **{k: med(v[args.warmup :]) for k, v in parts[o].items()},
                "buckets": t.buckets,
                "reduce_bytes": t.reduce_bytes,
                "reduce_via": t.reduce_via,
            }
            for o, t in ((0, no), (1, ov))
        }
    if ctx.rank != 0:
        return
    t1 = med(one["plain"])
    info[name] = {"per_rank_batch": bs, "ranks": n, "ours_1rank_ms": t1}
    for overlap, f in figures.items():
        tag = f"{n}ranks" + ("" if overlap else "_no_overlap")
        tn = med(f["ms"])
        info[name][f"ours_{tag}"] = {k: v for k, v in f.items() if k != "ms"} | {"median_ms": tn}
    no, ov = figures[False], figures[True]
    hidden = no["readback"] + no["allreduce"]
    info[name]["overlap_achieved"] = (1 - ov["exposed"] / hidden) if hidden > 0 else None
    info[name]["ours_split_cost_ms"] = {
        "plain_trainer": t1,
        "distributed_1rank_no_overlap": med(one["self_no_overlap"]),
        "distributed_1rank_overlap": med(one["self_overlap"]),
        "buckets_1rank": one["self_overlap_buckets"],
    }


def torch_side(name, args, ctx, MPI, info):
    """PyTorch: rank 0 alone, then DDP on every rank. Returns silently where torch is
    missing (noted in ``info``)."""
    try:
        import torch
        import torch.distributed as tdist
    except ImportError:
        info.setdefault("torch", "not installed")
        return
    comm, n = ctx.comm, ctx.world_size
    cuda = torch.cuda.is_available()
    dev = f"cuda:{ctx.local_rank % torch.cuda.device_count()}" if cuda else "cpu"
    hosts = comm.allreduce(1 if ctx.local_rank == 0 else 0)
    own_gpu = cuda and torch.cuda.device_count() * hosts >= n
    backend = "nccl" if own_gpu else "gloo"
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    w, case, _, state, arrays = workload(name, args.quick, args.batch[name])
    m = w.torch_model(case, args.quick, state).to(dev).train()
    batch = [torch.from_numpy(np.asarray(a)).to(dev) for a in arrays]
    batch = [b.long() if not b.is_floating_point() else b for b in batch]

    def sync():
        if cuda:
            torch.cuda.synchronize(dev)

    def make_step(module):
        opt = torch.optim.AdamW(module.parameters(), lr=LR)

        def step():
            loss = w.torch_loss(module, *batch)
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            loss.item()

        return step

    one = None
    if ctx.rank == 0:
        one = timed(make_step(m), MPI.COMM_SELF, args.warmup, args.repeats)
    idle(comm)
    if not tdist.is_initialized():
        host = comm.bcast(socket.gethostname() if ctx.rank == 0 else None, root=0)
        port = comm.bcast(29500 + os.getpid() % 1000 if ctx.rank == 0 else None, root=0)
        os.environ.setdefault("MASTER_ADDR", host if hosts > 1 else "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(port))
        tdist.init_process_group(backend, rank=ctx.rank, world_size=n)
    m = w.torch_model(case, args.quick, state).to(dev).train()
    ddp = torch.nn.parallel.DistributedDataParallel(
        m,
        device_ids=[torch.device(dev).index] if backend == "nccl" else None,
        bucket_cap_mb=args.bucket_cap_mb,
    )
    many = timed(make_step(ddp), comm, args.warmup, args.repeats)
    sync()
    if ctx.rank == 0:
        info[name]["torch"] = {
            "device": dev,
            "backend": backend,
            "1rank_ms": med(one),
            f"{n}ranks_ms": med(many),
        }


def add_rows(name, info, rows):
    d = info[name]
    n, bs = d["ranks"], d["per_rank_batch"]
    t = d.get("torch", {})
    ov, no = d[f"ours_{n}ranks"], d[f"ours_{n}ranks_no_overlap"]
    t1, tn = d["ours_1rank_ms"], ov["median_ms"]
    th1, thn = t.get("1rank_ms"), t.get(f"{n}ranks_ms")
    extra = {k: ov[k] for k in ("gpu_wait", "readback", "allreduce", "exposed", "apply", "buckets")}
    extra["reduce_via"] = ov["reduce_via"]
    rows.append(result(f"{name}_train_step_1rank", "ms", t1, th1, per_rank_batch=bs))
    rows.append(
        result(
            f"{name}_train_step_{n}ranks",
            "ms",
            tn,
            thn,
            per_rank_batch=bs,
            reduce_bytes=ov["reduce_bytes"],
            overlap_achieved=d["overlap_achieved"],
            **{f"{k}_ms" if k not in ("buckets", "reduce_via") else k: v for k, v in extra.items()},
            torch_backend=t.get("backend"),
        )
    )
    rows.append(
        result(
            f"{name}_train_step_{n}ranks_no_overlap",
            "ms",
            no["median_ms"],
            thn,
            gpu_wait_ms=no["gpu_wait"],
            readback_ms=no["readback"],
            allreduce_ms=no["allreduce"],
            apply_ms=no["apply"],
        )
    )
    rows.append(
        result(
            f"{name}_samples_per_s_{n}ranks",
            "samples/s",
            n * bs * 1e3 / tn,
            n * bs * 1e3 / thn if thn else None,
        )
    )
    rows.append(
        result(
            f"{name}_weak_scaling_efficiency_{n}ranks",
            "ratio",
            t1 / tn,
            th1 / thn if th1 and thn else None,
        )
    )
    split = d["ours_split_cost_ms"]
    rows.append(
        result(
            f"{name}_distributed_1rank_overlap_vs_plain_trainer",
            "ms",
            split["distributed_1rank_overlap"],
            None,
            plain_trainer_ms=split["plain_trainer"],
            no_overlap_ms=split["distributed_1rank_no_overlap"],
            buckets=split["buckets_1rank"],
        )
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="tiny models (lavapipe smoke test)")
    ap.add_argument("--workloads", default="smollm2,resnet50")
    ap.add_argument(
        "--batch",
        default=None,
        help="per-rank batch, e.g. smollm2=8,resnet50=32 (default: quick 2,4; else 8,32)",
    )
    ap.add_argument(
        "--bucket-cap-mb",
        type=float,
        default=None,
        help="PyTorch DDP's name; default 25 (quick 0.25: the tiny models then have buckets)",
    )
    ap.add_argument(
        "--reduce",
        default="auto",
        choices=("auto", "mpi", "shm"),
        help="DistributedTrainer's reduce: auto (shared memory on one host), mpi, shm",
    )
    ap.add_argument("--warmup", type=int, default=None, help="default 3 (quick 1)")
    ap.add_argument("--repeats", type=int, default=None, help="default 10 (quick 3)")
    ap.add_argument("--no-torch", action="store_true", help="skip the PyTorch DDP side")
    ap.add_argument("--machine", default="lavapipe", help="result file suffix")
    ap.add_argument("--adapter", default=os.environ.get("MEGANEURA_ADAPTER"))
    args = ap.parse_args()
    args.warmup = args.warmup if args.warmup is not None else (1 if args.quick else 3)
    if args.bucket_cap_mb is None:
        args.bucket_cap_mb = 0.25 if args.quick else 25.0
    args.repeats = args.repeats if args.repeats is not None else (3 if args.quick else 10)
    batch = {"smollm2": 2, "resnet50": 4} if args.quick else {"smollm2": 8, "resnet50": 32}
    for item in (args.batch or "").split(","):
        if item:
            k, v = item.split("=")
            batch[k] = int(v)
    args.batch = batch

    from mpi4py import MPI

    from meganeura import distributed as dist

    ctx = dist.init(args.adapter)
    rows: list[dict] = []
    info: dict = {}
    t_start = time.perf_counter()
    for name in args.workloads.split(","):
        ours(name, args, ctx, MPI, rows, info)
        if not args.no_torch:
            torch_side(name, args, ctx, MPI, info)
        if ctx.rank == 0:
            add_rows(name, info, rows)
            for r in rows[-6:]:
                more = {
                    k: round(v, 3) if isinstance(v, float) else v
                    for k, v in r.items()
                    if k.endswith("_ms")
                    or k in ("buckets", "reduce_bytes", "overlap_achieved", "reduce_via")
                }
                print(f"{r['case']}: ours {r['ours']:.3f} torch {r['torch']} {more}", flush=True)
    if ctx.rank == 0:
        devices = ctx.comm.gather(ctx.device.name, root=0)
        extra = {
            "ranks": ctx.world_size,
            "rank_devices": devices,
            "details": info,
            "wall_seconds": time.perf_counter() - t_start,
            "complete": True,
            "command": "mpiexec -n " + str(ctx.world_size) + " python " + " ".join(sys.argv),
        }
        print(write(f"data_parallel_{args.machine}", ctx.device, rows, extra, quick=args.quick))
    else:
        ctx.comm.gather(ctx.device.name, root=0)


if __name__ == "__main__":
    main()

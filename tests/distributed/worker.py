"""The MPI side of tests/distributed: ``mpiexec -n N python -m tests.distributed.worker MODE OUT``.

``parity``: every configuration of ``workloads.CONFIGS`` trained ``STEPS`` steps with
``DistributedTrainer`` on each rank's shard, with the overlapped bucketed reduce (several
buckets) and without (``reduce="auto"``: the shared-memory reduce on this one host),
"adamw" again with ``reduce="mpi"`` (``adamw_mpi0/``, ``adamw_mpi1/``: without and with
overlap) and with ``reduce_dtype=float64`` (``adamw_f64/``), and the shared-memory
reduce alone, on this host and on a host split that pretends to be 2 hosts (``shm_exact``,
``hierarchical_exact``); rank 0 writes
``OUT/parity.npz`` (losses and parameters of the
overlapped runs per configuration), whether every rank ended with rank 0's exact bytes,
whether the runs without overlap gave the same bits, whether a run resumed from a checkpoint
after step 1 ends bit-identical to the "adamw" run, and, for a loss with dropout fed the same
batch on every rank, each rank's local loss (different masks: different losses) and whether
two such runs repeat bit for bit. And a model with BatchNorm (``make_bn_model``, AdamW): its
state after step 1 (``bn1/``) and after ``STEPS`` (``bn/``), and whether a NaN in one rank's
shard raises ``NonFiniteError`` on every rank with nothing changed, training going on after.

``failure``: AdamW with a checkpoint after every step; at step 2 rank 1's batch holds a class
index out of range, which its program rejects before running. Every rank must raise
``DistributedError``; each writes its message to ``OUT/caught-<rank>.txt`` and exits 3.

``abort``: rank 1 raises outside a step; the job must end (MPI_Abort) with the checkpoint of
step 1 intact.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np

import meganeura as mn
from meganeura import distributed as dist
from tests.distributed.workloads import (
    BUCKET_CAP_MB,
    CONFIGS,
    batches,
    dropout_loss_fn,
    loss_fn,
    make_bn_model,
    make_model,
)


def parity(out: Path) -> None:
    ctx = dist.init()
    results, identical, same_bits, buckets = {}, True, True, 0
    for name, (make_opt, clip, k) in CONFIGS.items():
        runs = {}
        for overlap in (False, True):
            kwargs = dict(max_grad_norm=clip, accumulation_steps=k, overlap=overlap)
            kwargs["bucket_cap_mb"] = BUCKET_CAP_MB
            with dist.DistributedTrainer(make_model(), make_opt(), loss_fn, **kwargs) as t:
                assert t.reduce_via == "shm", "reduce='auto' on one host: shared memory"
                losses = [t.step(dist.shard(x), dist.shard(y)) for x, y in batches()]
                runs[overlap] = (losses, t.state_dict())
                buckets = max(buckets, t.buckets)
        losses, sd = runs[True]
        same_bits &= losses == runs[False][0]
        same_bits &= all(np.array_equal(v, runs[False][1][k]) for k, v in sd.items())
        everyone = ctx.comm.allgather({k: v.tobytes() for k, v in sd.items()})
        identical &= all(e == everyone[0] for e in everyone)
        results[f"{name}/losses"] = np.asarray(losses, np.float64)
        for k, v in sd.items():
            results[f"{name}/{k}"] = v
    # reduce="mpi" (MPI's Iallreduce/Allreduce), against the shared-memory reduce that
    # "auto" chose above on this one host: within rounding of each other
    make_opt, clip, k = CONFIGS["adamw"]
    via_mpi = {}
    for overlap in (False, True):
        kwargs = dict(max_grad_norm=clip, accumulation_steps=k, overlap=overlap)
        kwargs.update(bucket_cap_mb=BUCKET_CAP_MB, reduce="mpi")
        with dist.DistributedTrainer(make_model(), make_opt(), loss_fn, **kwargs) as t:
            assert t.reduce_via == "mpi"
            losses = [t.step(dist.shard(x), dist.shard(y)) for x, y in batches()]
            via_mpi[overlap] = (losses, t.state_dict())
            everyone = ctx.comm.allgather({k: v.tobytes() for k, v in t.state_dict().items()})
            identical &= all(e == everyone[0] for e in everyone)
    for overlap, (losses, sd) in via_mpi.items():
        results[f"adamw_mpi{int(overlap)}/losses"] = np.asarray(losses, np.float64)
        for key, v in sd.items():
            results[f"adamw_mpi{int(overlap)}/{key}"] = v
    # reduce_dtype float64: every bucket summed exactly, so the bucketed and the one-vector
    # reduce give the same bits at any number of ranks
    make_opt, clip, k = CONFIGS["adamw"]
    wide = {}
    for overlap in (False, True):
        kwargs = dict(max_grad_norm=clip, accumulation_steps=k, overlap=overlap)
        kwargs.update(bucket_cap_mb=BUCKET_CAP_MB, reduce_dtype=np.float64)
        with dist.DistributedTrainer(make_model(), make_opt(), loss_fn, **kwargs) as t:
            losses = [t.step(dist.shard(x), dist.shard(y)) for x, y in batches()]
            wide[overlap] = (losses, t.state_dict())
    f64_same_bits = wide[True][0] == wide[False][0] and all(
        np.array_equal(v, wide[False][1][k]) for k, v in wide[True][1].items()
    )
    results["adamw_f64/losses"] = np.asarray(wide[True][0], np.float64)
    for key, v in wide[True][1].items():
        results[f"adamw_f64/{key}"] = v
    # resuming: 1 step, a checkpoint, a fresh trainer (other initial weights) loading it on
    # every rank, 2 more steps: bit-identical to the uninterrupted "adamw" run
    make_opt = CONFIGS["adamw"][0]
    data = batches()
    with dist.DistributedTrainer(make_model(), make_opt(), loss_fn) as t:
        t.step(dist.shard(data[0][0]), dist.shard(data[0][1]))
        t.save(out / "resume.safetensors")
    model = make_model()
    for p in model.parameters():
        p.copy_(np.zeros(p.shape, np.float32))
    with dist.DistributedTrainer(model, make_opt(), loss_fn) as t:
        t.load(out / "resume.safetensors")
        for x, y in data[1:]:
            t.step(dist.shard(x), dist.shard(y))
        sd = t.state_dict()
    resumed = all(np.array_equal(v, results[f"adamw/{k}"]) for k, v in sd.items())
    # dropout: the same (unsharded) batch on every rank; each rank's local loss before the
    # reduce (the loss accumulator) differs only through its dropout mask
    local, repeat = [], []
    for _ in range(2):
        with dist.DistributedTrainer(make_model(), make_opt(), dropout_loss_fn) as t:
            mn.manual_seed(5)
            t.step(*data[0])
            local.append(float(t._loss_accumulator.data))
            repeat.append(t.state_dict())
    if dist.is_main():
        results["dropout_local_losses"] = np.asarray(ctx.comm.gather(local[0], root=0))
        results["dropout_repeats"] = np.asarray(
            all(np.array_equal(v, repeat[1][k]) for k, v in repeat[0].items())
        )
        results["overlap_same_bits"] = np.asarray(same_bits)
        results["f64_overlap_same_bits"] = np.asarray(f64_same_bits)
        results["buckets"] = np.asarray(buckets)
    else:
        ctx.comm.gather(local[0], root=0)
    # BatchNorm: local-batch statistics, rank 0's running statistics (PyTorch DDP's default)
    with dist.DistributedTrainer(make_bn_model(), make_opt(), loss_fn) as t:
        for step, (x, y) in enumerate(data):
            t.step(dist.shard(x), dist.shard(y))
            sd = t.state_dict()
            everyone = ctx.comm.allgather({k: v.tobytes() for k, v in sd.items()})
            identical &= all(e == everyone[0] for e in everyone)
            if step == 0:
                results.update({f"bn1/{k}": v for k, v in sd.items()})
        results.update({f"bn/{k}": v for k, v in sd.items()})
    # a NaN in rank 1's shard at step 2: every rank raises NonFiniteError, nothing changes
    # (parameters, moments, running statistics), and training goes on
    from meganeura.training.guard import NonFiniteError

    with dist.DistributedTrainer(make_bn_model(), make_opt(), loss_fn) as t:
        t.step(dist.shard(data[0][0]), dist.shard(data[0][1]))
        before = t.state_dict()
        x = dist.shard(data[1][0]).copy()
        if ctx.rank == 1:
            x[0, 0] = np.nan
        try:
            t.step(x, dist.shard(data[1][1]))
            raised = False
        except NonFiniteError:
            raised = True
        after = t.state_dict()
        unchanged = all(np.array_equal(v, after[k]) for k, v in before.items())
        t.step(dist.shard(data[2][0]), dist.shard(data[2][1]))
        goes_on = t.step_count == 2 and all(np.isfinite(v).all() for v in t.state_dict().values())
    nan_ok = all(ctx.comm.allgather(raised and unchanged and goes_on))
    one_host_ok, hosts_ok = _shm_exact(ctx.comm, 1), _shm_exact(ctx.comm, 2)
    if dist.is_main():
        results["shm_exact"] = np.asarray(one_host_ok)
        results["hierarchical_exact"] = np.asarray(hosts_ok)
        results["nan_step_skipped_everywhere"] = np.asarray(nan_ok)
        results["resume_identical"] = np.asarray(resumed)
        results["identical"] = np.asarray(identical)
        results["world_size"] = np.asarray(ctx.world_size)
        np.savez(out / "parity.npz", **results)


def _shm_exact(comm, hosts: int) -> bool:
    """``SharedMemoryReducer`` on this one host (``hosts=1``), or with a host communicator
    that pretends rank ``r`` lives on host ``r % 2`` (``hosts=2``; at 3 ranks ranks 0 and 2
    share one): every rank must get ``(host sums in rank order, added by the leaders'
    Allreduce) / divisor``, the same bits everywhere, through windows of 2 slots reused over
    5 vectors of different lengths (the window grown once), ``out`` past ``n`` untouched."""
    from meganeura.distributed.shm import SharedMemoryReducer

    rank, size = comm.Get_rank(), comm.Get_size()
    node = comm.Split(rank % 2, key=rank) if hosts == 2 else None
    red = SharedMemoryReducer(comm, np.float32, node)
    ok = red.hosts == min(size, hosts)
    try:
        for i, n in enumerate([1000, 37, 4096, 999, 3]):
            red.reserve(n)
            every = [
                np.random.default_rng([i, r]).standard_normal(n).astype(np.float32)
                for r in range(size)
            ]
            red.slot()[:n] = every[rank]
            out = np.full(n + 1, 7, np.float32)
            red.allreduce(n, out, float(size))
            sums = []
            for h in range(red.hosts):
                mine = [every[r] for r in range(size) if r % red.hosts == h]
                total = mine[0].copy()
                for x in mine[1:]:
                    total += x
                sums.append(total)
            want = (sums[0] + sums[1] if len(sums) > 1 else sums[0]) / np.float32(size)
            ok &= np.array_equal(out[:n], want) and out[n] == 7
    finally:
        red.close()
    return all(comm.allgather(bool(ok)))


def failure(out: Path) -> None:
    from meganeura.optim import AdamW

    ctx = dist.init()
    trainer = dist.DistributedTrainer(make_model(), AdamW(lr=1e-2), loss_fn)
    try:
        for step, (x, y) in enumerate(batches()):
            y = dist.shard(y).copy()
            if step == 2 and ctx.rank == 1:
                y[0] = 99  # out of range: the program's label check rejects the batch
            trainer.step(dist.shard(x), y)
            trainer.save(out / "ckpt.safetensors", {"at": step})
    except dist.DistributedError as e:
        (out / f"caught-{ctx.rank}.txt").write_text(str(e))
        sys.exit(3)


def abort(out: Path) -> None:
    """Rank 1 raises outside a step, after the checkpoint of step 1: ``init``'s excepthook
    aborts the job while rank 0 waits in its next step's collective."""
    from meganeura.optim import AdamW

    ctx = dist.init()
    trainer = dist.DistributedTrainer(make_model(), AdamW(lr=1e-2), loss_fn)
    for step, (x, y) in enumerate(batches()):
        if step == 2 and ctx.rank == 1:
            raise RuntimeError("rank 1 lost its data loader")
        trainer.step(dist.shard(x), dist.shard(y))
        trainer.save(out / "ckpt.safetensors", {"at": step})
    (out / f"finished-{ctx.rank}.txt").write_text("rank 0 must not get here")


def shm_full(out: Path) -> None:
    """``/dev/shm`` reported full on rank 1 only: ``reduce="auto"`` must fall back to MPI on
    every rank alike (the same losses as ``reduce="mpi"``), ``reduce="shm"`` must raise
    ``MemoryError`` on every rank. Rank 0 writes ``OUT/shm_full.npz``."""
    import os
    import warnings

    from meganeura.distributed import shm as shm_module
    from meganeura.optim import AdamW

    ctx = dist.init()
    real = os.statvfs

    class Full:
        f_bavail, f_frsize = 0, 4096

    shm_module.os.statvfs = lambda p: Full() if ctx.rank == 1 else real(p)
    results = {}
    for reduce in ("auto", "mpi"):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kwargs = dict(reduce=reduce, bucket_cap_mb=BUCKET_CAP_MB)
            with dist.DistributedTrainer(make_model(), AdamW(lr=1e-2), loss_fn, **kwargs) as t:
                results[f"{reduce}/losses"] = np.asarray(
                    [t.step(dist.shard(x), dist.shard(y)) for x, y in batches()]
                )
                results[f"{reduce}/via"] = np.asarray(t.reduce_via)
        results[f"{reduce}/warned"] = np.asarray(any("/dev/shm" in str(w.message) for w in caught))
    raised = False
    try:
        with dist.DistributedTrainer(make_model(), AdamW(lr=1e-2), loss_fn, reduce="shm") as t:
            t.step(dist.shard(batches()[0][0]), dist.shard(batches()[0][1]))
    except MemoryError:
        raised = True
    everyone = ctx.comm.gather(raised, root=0)
    if dist.is_main():
        results["shm_raised_everywhere"] = np.asarray(all(everyone))
        np.savez(out / "shm_full.npz", **results)


if __name__ == "__main__":
    modes = {"parity": parity, "failure": failure, "abort": abort, "shm_full": shm_full}
    modes[sys.argv[1]](Path(sys.argv[2]))

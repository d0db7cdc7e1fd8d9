"""The gradient all-reduce alone, between the ranks of one host: MPI ``Allreduce`` against the
shared-memory reduce of ``meganeura.distributed.shm`` (and a variant not kept, to
compare).

    mpiexec -n 2 python bench/shm_reduce.py --mb 538 --chunk-mb 25 --repeats 5

A float32 vector of ``--mb`` MB per rank, summed over ranks and divided by the world size (what
``DistributedTrainer`` does per step), through:

  * ``mpi``: ``Allreduce(IN_PLACE)`` of the whole vector, then ``/=``;
  * ``shm`` (``SharedMemoryReducer.allreduce``): in chunks of ``--chunk-mb`` MiB (the bucket
    size; the one-vector path's chunks): copy the chunk into this rank's slot (the overlapped
    path's GPU map writes there itself: ``copy_in`` gives that part apart), a barrier, every
    rank sums its 1/N slice over all slots in rank order and divides, into its slot, a second
    barrier, every rank copies every slice out;
  * ``sum_all``: the same, but after the first barrier every rank sums the whole chunk over
    all slots into its own result (one barrier, N x the reads).

Prints the median ms of ``--repeats`` runs on rank 0 (a barrier before each) and checks that
the three agree (shm and sum-all bit for bit).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def sum_all(red, n: int, out: np.ndarray, divisor: float) -> None:
    """The variant not kept: one barrier, then every rank sums the whole vector over all
    slots in rank order into its own result (N x the reads of the reduce-scatter)."""
    slots = [s[:n] for s in red._slots[red._turn % 2]]
    red._turn += 1
    red._sync()
    block = red._block.size
    for a in range(0, n, block):
        b = min(a + block, n)
        o = out[a:b]
        np.add(slots[0][a:b], slots[1][a:b], out=o)
        for s in slots[2:]:
            np.add(o, s[a:b], out=o)
        np.divide(o, divisor, out=o)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=float, default=538.0, help="MB (1e6 bytes) of float32 per rank")
    ap.add_argument("--chunk-mb", type=float, default=25.0, help="MiB per shared-memory chunk")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()

    from mpi4py import MPI

    from meganeura.distributed.shm import SharedMemoryReducer

    comm = MPI.COMM_WORLD
    rank, size = comm.Get_rank(), comm.Get_size()
    n = int(args.mb * 1e6) // 4
    chunk = min(n, int(args.chunk_mb * 1024 * 1024) // 4)
    rng = np.random.default_rng(rank)
    data = rng.standard_normal(n, dtype=np.float32)
    work = np.empty_like(data)
    red = SharedMemoryReducer(comm)
    red.reserve(chunk)
    times: dict[str, list[float]] = {"mpi": [], "shm": [], "copy_in": [], "sum_all": []}
    results = {}

    def run_mpi():
        np.copyto(work, data)
        comm.Barrier()
        t = time.perf_counter()
        comm.Allreduce(MPI.IN_PLACE, work, op=MPI.SUM)
        np.divide(work, size, out=work)
        times["mpi"].append(time.perf_counter() - t)
        results["mpi"] = work.copy() if rank == 0 else None

    def run_shm(kind):
        comm.Barrier()
        t, copy = time.perf_counter(), 0.0
        for a in range(0, n, chunk):
            b = min(a + chunk, n)
            t1 = time.perf_counter()
            red.slot()[: b - a] = data[a:b]
            copy += time.perf_counter() - t1
            if kind == "shm":
                red.allreduce(b - a, work[a:b], size)
            else:
                sum_all(red, b - a, work[a:b], size)
        times[kind].append(time.perf_counter() - t)
        if kind == "shm":
            times["copy_in"].append(copy)
        results[kind] = work.copy() if rank == 0 else None

    for _ in range(args.repeats):
        run_mpi()
        run_shm("shm")
        run_shm("sum_all")
    same = comm.allreduce(
        int(not np.array_equal(work, comm.bcast(work if rank == 0 else None, root=0)))
    )
    red.close()
    if rank == 0:
        med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
        diff = np.max(np.abs(results["shm"] - results["mpi"]))
        rel = float(diff / np.max(np.abs(results["mpi"])))
        print(
            f"{size} ranks, {n * 4 / 1e6:.1f} MB float32 per rank, chunks of "
            f"{chunk * 4 / 2**20:.1f} MiB, median of {args.repeats}: "
            f"MPI Allreduce {med['mpi']:.1f} ms, shm "
            f"{med['shm']:.1f} ms (copy-in {med['copy_in']:.1f}), "
            f"sum-all {med['sum_all']:.1f} ms; "
            f"shm == sum-all: {np.array_equal(results['shm'], results['sum_all'])}, "
            f"shm vs MPI max rel diff {rel:.1e}, ranks identical: {same == 0}"
        )


if __name__ == "__main__":
    main()

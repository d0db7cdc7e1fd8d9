"""The overlapped reduce of :class:`meganeura.distributed.DistributedTrainer` (issue 17 item 2).

The last micro-batch's accumulate program runs in segments (``runtime.segments``): its
accumulate dispatches are moved to just after the gradients they read are computed, and the
step is cut where a bucket of about ``bucket_cap_mb`` megabytes of gradients (PyTorch DDP's
name and default, 25) is final. Backward produces the last layers' gradients first, so bucket 0
holds the last layers. Every segment is submitted at once, each with a copy of its bucket
into a mappable staging buffer. For bucket k in order, the host waits for segment k, copies
the mapped bucket straight into a host vector kept for it (one copy; float32, the gradients'
own dtype, as PyTorch DDP reduces; with ``reduce_dtype=float64`` widened into a second vector)
and starts a non-blocking ``Iallreduce`` (``MPI.SUM``) of it in place, then waits for segment
k+1 while that reduce proceeds: the GPU computes the rest of the backward pass while the host
reads back and the network reduces.

With the shared-memory reduce (``reduce="shm"``, ``distributed.shm``; the default on one host)
the float32 bucket is mapped straight into this rank's slot of the host's shared window and
reduced there, blocking, at once: the later segments are already submitted, so the GPU keeps
computing while the host sums. Every element is summed in rank order whatever the bucket, so
with and without overlap the results are the same bits at any number of ranks.

MPICH moves a non-blocking collective forward only inside MPI calls (no progress thread by
default), so while a reduce is in flight the wait for the next segment polls the GPU without
blocking and calls ``Testall`` in between (20 us sleeps); once every reduce has completed it
blocks on the GPU.

Results: the kernels read the same bytes as in program order. In float64 each bucket is
summed exactly (a sum of float32 values over a few ranks fits float64's mantissa), in any
order, so a step with overlap gives the same bits as one without (tested at 2 and 3 ranks).
In float32 two ranks' sum ``a + b`` is also one rounding in any order; with three or more the
MPI library's reduction order (chosen by message size, not timing: the same run repeats bit for
bit) may differ between the bucketed and the one-vector reduce by a rounding.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from ..optim.accumulate import LOSS_ACCUMULATOR, grad_accumulator
from ..runtime.segments import SegmentedRun, plan_segments

DEFAULT_BUCKET_CAP_MB = 25.0


@dataclass
class ReduceTimes:
    """Seconds of one overlapped reduce (``DistributedTrainer`` copies them).

    Attributes:
        gpu_wait: waiting for segments to finish (the backward pass as the host sees it).
        readback: copying mapped buckets out (and widening them with ``reduce_dtype``
            float64).
        exposed: from the last segment's end until every bucket is reduced: the part of
            readback + all-reduce the backward pass did not hide.
        buckets: number of buckets.
    """

    gpu_wait: float = 0.0
    readback: float = 0.0
    exposed: float = 0.0
    buckets: int = 0


class BucketReducer:
    """Segmented runs of one trainer's accumulate programs, one per Session (a Session is
    reopened when the shared store moves its buffers; its plan is then rebuilt).

    Args:
        bucket_cap_mb: MiB of float32 gradients per bucket (``bucket_cap_mb * 1024 * 1024``
            bytes, as ``torch.nn.parallel.DistributedDataParallel`` counts it); a bucket
            closes at the first gradient that reaches it.
    """

    def __init__(self, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB, reduce_dtype=np.float32):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self.reduce_dtype = check_reduce_dtype(reduce_dtype)
        self._runs: dict[int, tuple[object, SegmentedRun]] = {}
        self._wide: dict[tuple[int, int], np.ndarray] = {}  # result buckets, reused

    def segmented(self, runner, names: list[str]) -> SegmentedRun:
        """The SegmentedRun of ``runner``'s current Session over the accumulators of
        ``names`` (parameter names) and the loss accumulator."""
        session = runner.fresh_session()
        held = self._runs.get(id(runner))
        if held is not None and held[0] is session:
            return held[1]
        if held is not None:
            held[1].close()
            self._wide = {k: v for k, v in self._wide.items() if k[0] != id(held[1])}
        program = session.program
        slots = [grad_accumulator(n) for n in names] + [LOSS_ACCUMULATOR]
        sizes = {s: program.state[s].nbytes for s in slots}
        run = SegmentedRun(session, plan_segments(program, slots, self.cap_bytes, sizes))
        self._runs[id(runner)] = (session, run)
        return run

    def reduce(self, runner, feeds, names: list[str], comm, divisor: float, shm=None):
        """Run ``runner``'s program on ``feeds`` in segments, all-reducing each bucket as it
        is read back; returns ({parameter name: mean gradient in ``reduce_dtype``}, mean loss
        float, :class:`ReduceTimes`). Every rank must call it with the same ``names`` and
        program (the plan, hence the buckets and their order, follows from the program alone).

        ``shm``: a :class:`~meganeura.distributed.shm.SharedMemoryReducer` of ``comm``: each
        bucket is mapped straight into this rank's shared-memory slot (float32) and reduced
        there, blocking, while the GPU computes the later segments; None: ``Iallreduce``.
        """
        from . import _mpi

        MPI = _mpi()
        run = self.segmented(runner, names)
        times = ReduceTimes(buckets=len(run.plan.groups))
        if shm is not None:  # collective, the same sizes on every rank
            shm.reserve(run.max_staging_bytes // 4)
        run.start(feeds)
        pending, held = [], []

        def progress() -> bool:
            if pending and MPI.Request.Testall(pending):
                pending.clear()
            return bool(pending)

        t0 = time.perf_counter()
        for k in range(len(run.plan.groups)):
            t_wait, g_wait = time.perf_counter(), run.gpu_wait_seconds
            direct = shm is not None and self.reduce_dtype == np.float32
            # the map copied straight into the bucket's host vector (or the shared slot)
            run.wait(k, progress, into=shm.slot() if direct else None)
            t0 = time.perf_counter()
            times.readback += (t0 - t_wait) - (run.gpu_wait_seconds - g_wait)  # the copy
            flat, layout = run.bucket(k)
            if shm is not None:
                if not direct:
                    np.copyto(shm.slot()[: flat.size], flat)  # widened to float64
                out = self._result(run, k, flat.size)
                times.readback += time.perf_counter() - t0
                shm.allreduce(flat.size, out, divisor)  # blocking; the GPU computes on
                held.append((layout, out))
                continue
            if self.reduce_dtype == np.float64:
                wide = self._result(run, k, flat.size)
                np.copyto(wide, flat)
                flat = wide
            times.readback += time.perf_counter() - t0
            pending.append(comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM))
            held.append((layout, flat))
        times.gpu_wait = run.gpu_wait_seconds
        MPI.Request.Waitall(pending)
        times.exposed = time.perf_counter() - t0  # from the last segment's end
        grads, loss = {}, 0.0
        by_slot = {grad_accumulator(n): n for n in names}
        for layout, flat in held:
            if shm is None:
                flat /= divisor
            for s, first, size in layout:
                shape = run.session.program.state[s].shape
                value = flat[first : first + size].reshape(shape)
                if s == LOSS_ACCUMULATOR:
                    loss = float(value)
                else:
                    grads[by_slot[s]] = value
        return grads, loss, times

    def _result(self, run, k: int, size: int) -> np.ndarray:
        """Bucket ``k``'s kept host vector in ``reduce_dtype`` (the float64 widening, or the
        shared-memory reduce's result), allocated once per run."""
        out = self._wide.get((id(run), k))
        if out is None or out.size != size:
            out = self._wide[(id(run), k)] = np.empty(size, self.reduce_dtype)
        return out

    def close(self) -> None:
        for _, run in self._runs.values():
            run.close()
        self._runs, self._wide = {}, {}


def check_reduce_dtype(dtype):
    """``np.float32`` or ``np.float64`` (what ``reduce_dtype`` accepts), as a numpy dtype.

    Raises:
        ValueError: any other dtype.
    """
    dt = np.dtype(dtype)
    if dt not in (np.float32, np.float64):
        raise ValueError(f"reduce_dtype must be float32 or float64, got {dt}")
    return dt

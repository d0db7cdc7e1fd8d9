"""The overlapped reduce of :class:`meganeura.distributed.DistributedTrainer` (issue 17 item 2).

The last micro-batch's accumulate program runs in segments (``runtime.segments``): its
accumulate dispatches are moved to just after the gradients they read are computed, and the
step is cut where a bucket of about ``bucket_cap_mb`` megabytes of gradients (PyTorch DDP's
name and default, 25) is final. Backward produces the last layers' gradients first, so bucket 0
holds the last layers. Every segment is submitted at once, each with a copy of its bucket
into a mappable staging buffer. For bucket k in order, the host waits for segment k, copies
the bucket out as float64 and starts a non-blocking ``Iallreduce`` (``MPI.SUM``) of it, then
waits for segment k+1 while that reduce proceeds: the GPU computes the rest of the backward
pass while the host reads back and the network reduces.

MPICH moves a non-blocking collective forward only inside MPI calls (no progress thread by
default), so while a reduce is in flight the wait for the next segment polls the GPU without
blocking and calls ``Testall`` in between (20 us sleeps); once every reduce has completed it
blocks on the GPU.

Results: the kernels read the same bytes as in program order and each bucket is summed in
float64 as the one-vector ``Allreduce`` sums it, so a step with overlap gives the same bits as
one without (tested at 2 and 3 ranks).
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
        readback: copying mapped buckets out and widening them to float64.
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

    def __init__(self, bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB):
        if not bucket_cap_mb > 0:
            raise ValueError(f"bucket_cap_mb must be positive, got {bucket_cap_mb!r}")
        self.cap_bytes = int(bucket_cap_mb * 1024 * 1024)
        self._runs: dict[int, tuple[object, SegmentedRun]] = {}

    def segmented(self, runner, names: list[str]) -> SegmentedRun:
        """The SegmentedRun of ``runner``'s current Session over the accumulators of
        ``names`` (parameter names) and the loss accumulator."""
        session = runner.fresh_session()
        held = self._runs.get(id(runner))
        if held is not None and held[0] is session:
            return held[1]
        if held is not None:
            held[1].close()
        program = session.program
        slots = [grad_accumulator(n) for n in names] + [LOSS_ACCUMULATOR]
        sizes = {s: program.state[s].nbytes for s in slots}
        run = SegmentedRun(session, plan_segments(program, slots, self.cap_bytes, sizes))
        self._runs[id(runner)] = (session, run)
        return run

    def reduce(self, runner, feeds, names: list[str], comm, divisor: float):
        """Run ``runner``'s program on ``feeds`` in segments, all-reducing each bucket as it
        is read back; returns ({parameter name: mean gradient float64}, mean loss float64,
        :class:`ReduceTimes`). Every rank must call it with the same ``names`` and program
        (the plan, hence the buckets and their order, follows from the program alone).
        """
        from . import _mpi

        MPI = _mpi()
        run = self.segmented(runner, names)
        times = ReduceTimes(buckets=len(run.plan.groups))
        run.start(feeds)
        pending, held = [], []

        def progress() -> bool:
            if pending and MPI.Request.Testall(pending):
                pending.clear()
            return bool(pending)

        t0 = time.perf_counter()
        for k, group in enumerate(run.plan.groups):
            arrays = run.wait(k, progress)
            t0 = time.perf_counter()
            flat = np.concatenate([arrays[s].astype(np.float64).ravel() for s in group])
            times.readback += time.perf_counter() - t0
            pending.append(comm.Iallreduce(MPI.IN_PLACE, flat, op=MPI.SUM))
            held.append((group, flat))
        times.gpu_wait = run.gpu_wait_seconds
        MPI.Request.Waitall(pending)
        times.exposed = time.perf_counter() - t0  # from the last segment's end
        grads, loss = {}, 0.0
        by_slot = {grad_accumulator(n): n for n in names}
        for group, flat in held:
            flat /= divisor
            offset = 0
            for s in group:
                shape = run.session.program.state[s].shape
                size = int(np.prod(shape, dtype=np.int64))
                value = flat[offset : offset + size].reshape(shape)
                offset += size
                if s == LOSS_ACCUMULATOR:
                    loss = float(value)
                else:
                    grads[by_slot[s]] = value
        return grads, loss, times

    def close(self) -> None:
        for _, run in self._runs.values():
            run.close()
        self._runs = {}

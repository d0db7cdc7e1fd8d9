"""The data-parallel trainer of :mod:`meganeura.distributed` (the package docstring describes
its step, determinism, dropout and BatchNorm handling, and checkpoints)."""

from __future__ import annotations

import sys
import time
import traceback
import warnings

import numpy as np

from .. import random as mn_random
from ..nn.module import Module
from ..optim import HYPER_INPUT
from ..optim.accumulate import ACCUM_FIRST_INPUT
from ..optim.guard import GUARD_OUTPUT, GUARD_RESET_INPUT
from ..training.batches import split_batch
from ..training.guard import StepRun, check_finite_feeds
from ..training.trainer import Trainer
from . import (
    GRAD_ACCUM_SUFFIX,
    DistributedError,
    _check_agree,
    _context,
    _describe,
    _mpi,
    broadcast_parameters,
    rank_seed,
)
from .overlap import DEFAULT_BUCKET_CAP_MB, BucketReducer


def _read_many(buffers: list) -> list[np.ndarray]:
    """Values of trainer-held Buffers, read in one GPU round trip where they are resident in
    one shared store (``SharedStore.read_many``), else one ``.data`` each."""
    stores = {id(b._store) for b in buffers}
    store = buffers[0]._store if buffers and len(stores) == 1 else None
    if store is None or not all(store.resident(b) for b in buffers):
        return [np.asarray(b.data) for b in buffers]
    return store.read_many(buffers)


def _finite(loss: float, grads: dict, max_grad_norm: float | None) -> bool:
    """Whether the update guard (``optim.guard``) lets a step with these all-reduced loss and
    gradients through: finite loss and gradients and, with clipping, a float32-finite sum of
    squares (summed here in float64: a sum within rounding of float32's largest value may be
    judged apart from the GPU's)."""
    if not np.isfinite(loss) or not all(np.isfinite(g).all() for g in grads.values()):
        return False
    if max_grad_norm is None:
        return True
    total = sum(float(np.dot(g.ravel().astype(np.float64), g.ravel())) for g in grads.values())
    return total <= float(np.finfo(np.float32).max)


def _apply_fn(model: Module, mean_loss, grads):
    """The update program's surrogate loss ``mean_loss + sum_p sum(grads[p] * p)``: its
    gradient with respect to parameter ``p`` is ``grads[p]`` exactly (module docstring)."""
    params = dict(model.named_parameters())
    total = mean_loss
    for name, g in grads.items():
        total = total + (g * params[name]).sum()
    return total


class DistributedTrainer(Trainer):
    """A Trainer whose step averages the gradients of every rank's local batch (module
    docstring). Takes ``Trainer``'s arguments (``accumulation_steps``: micro-batches summed on
    each rank before the one reduce of the step, what DDP's ``no_sync`` is used for), and:

    Args:
        comm: the communicator (default: :func:`init`'s ``COMM_WORLD``).
        device: default the device :func:`init` chose.
        overlap: read back and all-reduce the gradients in buckets while the backward pass
            runs (``distributed.overlap``); False: read all of them back after the backward
            pass and reduce them in one ``Allreduce``. The results are the same bits.
        bucket_cap_mb: MiB of float32 gradients per bucket with ``overlap`` (PyTorch DDP's
            name and default, 25).
        reduce_dtype: ``np.float32`` (default: the gradients' dtype, as DDP reduces; half
            the bytes) or ``np.float64`` (every bucket summed exactly, so the result does not
            depend on the MPI library's reduction order: bucketed and one-vector reduces give
            the same bits at any number of ranks).
        reduce: how the sums cross ranks: ``"shm"``, through an MPI shared-memory window
            among the ranks of each host (``distributed.shm``: summed in rank order, so
            bucketed and one-vector reduces give the same bits at any number of ranks; on
            several hosts the hosts' sums are then ``Allreduce``-d among one leader per host);
            ``"mpi"``, MPI's ``Iallreduce``/``Allreduce``; ``"auto"`` (default): ``"shm"``
            when every rank of ``comm`` is on one host and there are at least 2, else
            ``"mpi"``; and ``"mpi"`` from the step on which a host's ``/dev/shm`` lacks room
            for the window (a warning says so; ``"shm"`` raises ``MemoryError`` there
            instead). ``reduce_via`` holds the choice.

    Construction broadcasts rank 0's parameters and buffers (:func:`broadcast_parameters`),
    as ``torch.nn.parallel.DistributedDataParallel`` does. Dropout draws a different mask on
    every rank: rank ``r`` feeds ``rank_seed(seed, r)`` for each seed a Trainer would feed
    (:func:`rank_seed`; rank 0 the Trainer's own).

    Attributes:
        reduce_seconds: wall seconds of the last step's gradient reduce that the backward
            pass did not hide: without overlap ``readback_seconds`` + ``allreduce_seconds``,
            after the backward pass; with overlap the time from the last segment's end until
            every bucket was reduced.
        gpu_wait_seconds: the host waiting for the last micro-batch's forward + backward
            (with overlap: for its segments).
        readback_seconds: host seconds reading the gradients back once computed (with
            overlap: copying the mapped buckets out).
        allreduce_seconds: the ``Allreduce`` (without overlap; with overlap 0: it is spread
            over the buckets, inside ``reduce_seconds`` where not hidden).
        apply_seconds: the update program with the reduced gradients: their upload, and the
            update itself where the step reads a guard output (``return_loss`` with the
            non-finite guard); else only what is not left queued on the GPU.
        buckets: buckets of the last step (1 without overlap).
        reduce_bytes: bytes all-reduced per step (the gradients and the loss, in
            ``reduce_dtype``).
        reduce_via: ``"shm"`` or ``"mpi"``: what ``reduce`` resolved to.

    Raises:
        ValueError: ``reduce`` not one of "auto", "mpi", "shm"; a ``reduce_dtype`` other than
            float32 or float64; ``bucket_cap_mb`` not positive.
    """

    def __init__(
        self,
        model,
        optimizer,
        loss_fn,
        *,
        comm=None,
        device=None,
        overlap: bool = True,
        bucket_cap_mb: float = DEFAULT_BUCKET_CAP_MB,
        reduce_dtype=np.float32,
        reduce: str = "auto",
        **kwargs,
    ) -> None:
        if reduce not in ("auto", "mpi", "shm"):
            raise ValueError(f"reduce must be 'auto', 'mpi' or 'shm', got {reduce!r}")
        if kwargs.get("loss_scale", 1.0) != 1.0:
            # the update program's surrogate loss would scale the reduced (already scaled)
            # gradients a second time
            raise ValueError("DistributedTrainer does not take a loss_scale yet (only 1.0)")
        ctx = _context() if comm is None or device is None else None
        super().__init__(model, optimizer, loss_fn, device=device or ctx.device, **kwargs)
        self.comm = comm or ctx.comm
        self.rank, self.world_size = self.comm.Get_rank(), self.comm.Get_size()
        self.overlap = bool(overlap)
        self._reducer = BucketReducer(bucket_cap_mb, reduce_dtype)
        self.reduce_dtype = self._reducer.reduce_dtype
        self.reduce_seconds = self.readback_seconds = self.allreduce_seconds = 0.0
        self.gpu_wait_seconds = self.apply_seconds = 0.0
        self.reduce_bytes = self.buckets = 0
        self._shm = None
        self._reduce = reduce
        if reduce != "mpi":
            from .shm import SharedMemoryReducer, host_comm

            node = host_comm(self.comm)
            if reduce == "shm" or (node.Get_size() == self.world_size > 1):
                self._shm = SharedMemoryReducer(self.comm, self.reduce_dtype, node)
            else:
                node.Free()
        self.reduce_via = "mpi" if self._shm is None else "shm"
        broadcast_parameters(model, self.comm)

    def _prepare(self, kind, batch, kwargs, return_grads=False, fn=None):
        prog, feeds = super()._prepare(kind, batch, kwargs, return_grads, fn)
        if self.rank:
            for name in prog.entry.runner.traced.trace.seeds:
                if name in feeds:
                    feeds[name] = np.asarray(rank_seed(int(feeds[name]), self.rank), np.uint32)
        return prog, feeds

    def step(self, *batch, return_loss: bool = True, **kwargs):
        """One optimizer step on this rank's local batch (given as to ``Trainer.step``) and
        every other rank's; returns the mean loss over ranks (the same float on every rank),
        or None with ``return_loss=False``.

        Raises:
            DistributedError: on every rank, when any rank failed before the reduce (tracing,
                a batch the program rejects, a non-finite batch with ``check_finite``, a
                model whose forward updates buffers); nothing is updated on any rank.
            NonFiniteError: as ``Trainer.step``, on every rank alike.
            MemoryError: with ``reduce="shm"``, on every rank alike, when a host's
                ``/dev/shm`` lacks room for the shared-memory window; nothing is updated.
        """
        comm, k = self.comm, self.accumulation_steps
        rng_state = mn_random.get_rng_state()
        error = exc = signature = None
        try:
            micro = split_batch(self._fn, batch, kwargs, k) if k > 1 else [(batch, kwargs)]
            runs = []
            for i, (mb, mkw) in enumerate(micro):
                prog, feeds = self._prepare("accumulate", mb, mkw)
                if ACCUM_FIRST_INPUT in prog.entry.runner.program.inputs:
                    feeds[ACCUM_FIRST_INPUT] = np.asarray(float(i == 0), np.float32)
                if self.check_finite:
                    check_finite_feeds(feeds, self.step_count, "DistributedTrainer")
                runs.append((prog, feeds))
            for prog, feeds in runs:
                prog.entry.runner.session.check(feeds)
            params = dict(self.model.named_parameters())
            state = runs[-1][0].entry.runner.program.state
            names = [n for n in params if n + GRAD_ACCUM_SUFFIX in state]
            signature = [(n, params[n].shape) for n in names]
            # compiled now, so that a compile error stops every rank before the reduce
            zeros = {n: np.zeros(params[n].shape, params[n].dtype.numpy) for n in names}
            self._prepare("apply", (np.float32(0), zeros), {}, fn=self._apply)
            host = self._host_counters()
            # with overlap the last micro-batch runs inside the reduce, after the check below
            for prog, feeds in runs[:-1] if self.overlap else runs:
                self._run(prog, feeds, ())
            if self.overlap:
                self._reducer.segmented(runs[-1][0].entry.runner, names)  # built before
            else:
                t0 = time.perf_counter()
                runs[-1][0].entry.runner.session.synchronize()  # the backward pass, timed apart
                gpu_wait = time.perf_counter() - t0
                t0 = time.perf_counter()
                held = [self._accumulators[params[n]] for n in names] + [self._loss_accumulator]
                flat = np.concatenate([a.ravel() for a in _read_many(held)])
                flat = flat.astype(self.reduce_dtype, copy=False)
                read_seconds = time.perf_counter() - t0
        except Exception as e:
            error, exc = _describe(e), e
        # one collective: every rank's error (None: success) and gradient layout
        gathered = comm.allgather((error, signature))
        try:
            _check_agree([e for e, _ in gathered], f"step {self.step_count}", "nothing was updated")
            if any(sig != gathered[0][1] for _, sig in gathered):
                raise DistributedError(
                    f"step {self.step_count}: the ranks' gradients differ in parameters or "
                    f"shapes (rank 0: {gathered[0][1]}); the same model and loss_fn must run on "
                    "every rank; nothing was updated",
                    {},
                )
        except DistributedError as e:
            mn_random.set_rng_state(rng_state)
            raise e from exc
        divisor = float(self.world_size * k)
        if self._shm is not None:  # the window, before anything can be updated: a /dev/shm
            try:  # shortfall raises on every rank alike (reserve's allreduce), or falls back
                self._shm_reserved(
                    self._shm_elements(runs[-1], names, None if self.overlap else flat)
                )
            except MemoryError:
                mn_random.set_rng_state(rng_state)
                raise
        try:
            if self.overlap:
                grads, loss = self._overlapped(runs[-1], names, divisor)
            else:
                grads, loss = self._reduced(flat, names, divisor, read_seconds)
                self.gpu_wait_seconds = gpu_wait
            t_apply = time.perf_counter()
            prog, feeds = self._prepare("apply", (np.float32(loss), grads), {}, fn=self._apply)
            inputs = prog.entry.runner.program.inputs
            if HYPER_INPUT in inputs:
                feeds[HYPER_INPUT] = self.optimizer.hyper(self.step_count, self.lr())
            if GUARD_RESET_INPUT in inputs:
                feeds[GUARD_RESET_INPUT] = self._guard.reset_feed()
            guarded = GUARD_OUTPUT in prog.entry.runner.program.outputs
            out = self._run(prog, feeds, (GUARD_OUTPUT,) if return_loss and guarded else ())
            self.apply_seconds = time.perf_counter() - t_apply
            if self._pending_stats:
                self._commit_running_stats(_finite(loss, grads, self._options.max_grad_norm))
        except Exception:
            # The other ranks may have updated: the replicas would diverge. Stop the job.
            traceback.print_exc()
            sys.stderr.write(f"rank {self.rank}: the step failed after the error check; aborting\n")
            sys.stderr.flush()
            comm.Abort(1)
            raise
        if guarded:
            located = tuple(
                StepRun(x.program, f, x.session, x.traced.graph, x.options)
                for x, f in [(p.entry.runner, f) for p, f in [*runs, (prog, feeds)]]
            )
            self._guard.ran(self.step_count, rng_state, located, host)
        self.step_count += 1
        if GUARD_OUTPUT in out:
            self._settle(out, loss)
        return loss if return_loss else None

    def _commit_running_stats(self, finite: bool) -> None:
        """Rank 0's staged running statistics (BatchNorm's, updated by its local batch's
        forwards) into every rank's running statistics, unless the step is skipped: PyTorch
        DDP's ``broadcast_buffers=True``, which broadcasts rank 0's buffers before each
        forward. One ``Bcast`` of the statistics as one float32 vector."""
        staged = [(b, self._pending_stats.get(b)) for _, b in self.model.named_buffers()]
        staged = [(b, p) for b, p in staged if p is not None and b.dtype.numpy == np.float32]
        sizes = [int(np.prod(b.shape, dtype=np.int64)) for b, _ in staged]
        if self.rank == 0:
            flat = np.concatenate([a.ravel() for a in _read_many([p for _, p in staged])])
        else:
            flat = np.empty(sum(sizes), np.float32)
        self.comm.Bcast(flat, root=0)
        if finite:
            offset = 0
            for (b, _), size in zip(staged, sizes, strict=True):
                b.copy_(flat[offset : offset + size].reshape(b.shape))
                offset += size

    def _reduced(self, flat: np.ndarray, names: list[str], divisor: float, read_seconds: float):
        """The one-vector reduce (no overlap): ({name: mean gradient}, mean loss)."""
        MPI = _mpi()
        t0 = time.perf_counter()
        if self._shm is not None:  # reserved by step(); in chunks of the slots' size
            shm = self._shm
            for a in range(0, flat.size, shm.capacity):
                b = min(a + shm.capacity, flat.size)
                shm.slot()[: b - a] = flat[a:b]
                shm.allreduce(b - a, flat[a:b], divisor)
        else:
            self.comm.Allreduce(MPI.IN_PLACE, flat, op=MPI.SUM)
            flat /= divisor
        self.allreduce_seconds = time.perf_counter() - t0
        self.readback_seconds = read_seconds
        self.reduce_seconds = read_seconds + self.allreduce_seconds
        self.reduce_bytes, self.buckets = flat.nbytes, 1
        params = dict(self.model.named_parameters())
        grads, offset = {}, 0
        for n in names:
            p = params[n]
            size = int(np.prod(p.shape, dtype=np.int64))
            grads[n] = (
                flat[offset : offset + size].reshape(p.shape).astype(p.dtype.numpy, copy=False)
            )
            offset += size
        return grads, float(np.float32(flat[-1]))

    def _shm_elements(self, run: tuple, names: list[str], flat: np.ndarray | None) -> int:
        """Values per slot the step's shared-memory reduce needs: the largest bucket's with
        overlap (``flat`` None), else the one vector's, in chunks of at most a bucket."""
        if flat is not None:
            return min(flat.size, self._reducer.cap_bytes // 4)
        return self._reducer.segmented(run[0].entry.runner, names).max_staging_bytes // 4

    def _shm_reserved(self, elements: int) -> bool:
        """Whether the shared-memory reduce serves this step, its slots now holding at least
        ``elements`` values (collective). With ``reduce="auto"`` a ``/dev/shm`` too small on
        some host (every rank learns it from one ``allreduce`` inside ``reserve``) switches
        this trainer to MPI for good, on every rank alike, with a warning."""
        if self._shm is None:
            return False
        try:
            self._shm.reserve(elements)
            return True
        except MemoryError as e:
            if self._reduce != "auto":
                raise
            self._shm.close()
            self._shm, self.reduce_via = None, "mpi"
            if self.rank == 0:
                warnings.warn(f"{e}; reducing through MPI from now on", stacklevel=3)
            return False

    def _overlapped(self, run: tuple, names: list[str], divisor: float):
        """The last micro-batch run in segments with the bucketed reduce (``overlap``)."""
        prog, feeds = run
        runner = prog.entry.runner
        means, loss, times = self._reducer.reduce(
            runner, feeds, names, self.comm, divisor, self._shm
        )
        prog.entry.calls += 1
        for effect in runner.traced.trace.host_effects:  # as Trainer._run
            effect()
        params = dict(self.model.named_parameters())
        grads = {n: means[n].astype(params[n].dtype.numpy, copy=False) for n in names}
        self.readback_seconds, self.gpu_wait_seconds = times.readback, times.gpu_wait
        self.allreduce_seconds, self.reduce_seconds = 0.0, times.exposed
        self.buckets = times.buckets
        self.reduce_bytes = self.reduce_dtype.itemsize * (1 + sum(g.size for g in grads.values()))
        return grads, float(np.float32(loss))

    def close(self) -> None:
        if not self._closed:
            self._reducer.close()
            if self._shm is not None:  # collective: every rank closes its trainers in turn
                self._shm.close()
                self._shm = None
        super().close()

    def _apply(self, mean_loss, grads):
        return _apply_fn(self.model, mean_loss, grads)

    def save(self, path, metadata=None) -> None:
        """Rank 0 writes the checkpoint (``Trainer.save``: atomic); every rank returns once it
        is written, or raises :class:`DistributedError` if rank 0 failed (the previous file,
        if any, is intact: the write is atomic)."""
        self.check_nonfinite()  # on every rank: the guard's count is the same everywhere
        error = exc = None
        if self.rank == 0:
            try:
                super().save(path, metadata)
            except Exception as e:
                error, exc = _describe(e), e
        try:
            _check_agree(self.comm.allgather(error), f"saving {path}", "no file was changed")
        except DistributedError as e:
            raise e from exc

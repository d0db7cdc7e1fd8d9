"""Data-parallel training on MPI (issue 17): one process per GPU, launched by ``mpiexec -n N``.

MPI (``mpi4py`` on the ``mpich`` wheel: ``pip install meganeura[distributed]``) is the engine:
it starts the processes, on one host or many, and moves the bytes. This module adds what a
meganeura Trainer needs on top:

  * :func:`init`: rank, world size and local rank (``COMM_TYPE_SHARED`` split of
    ``COMM_WORLD``) and the process's device: the adapter selection given (the CLI passes
    ``MEGANEURA_ADAPTER``), else the host's ``local_rank``-th GPU (``runtime.get_local_device``);
  * :func:`broadcast_parameters`: rank 0's parameters and buffers to every rank;
  * :class:`DistributedTrainer`: a ``Trainer`` whose step all-reduces the gradients.

A step of :class:`DistributedTrainer` on each rank's local batch:

  1. every micro-batch is traced, compiled and its feeds checked, and the update program
     compiled; micro-batches ``0 .. k-2`` run forward + backward into the gradient
     accumulators (the accumulate program of ``optim.accumulate``; the first overwrites them);
  2. every rank reports success or its error (``allgather`` of a short message); if any rank
     failed, every rank raises :class:`DistributedError` naming the failed ranks, before
     anything is updated (parameters and optimizer state untouched on every rank);
  3. the last micro-batch runs (without overlap it ran in step 1) and the gradients are
     summed across ranks in ``reduce_dtype`` (float32, the gradients' dtype, as DDP; or
     float64) and divided by ``world_size * accumulation_steps``
     (DDP's and Hugging Face's mean of the per-rank, per-micro-batch means): with
     ``overlap`` (default) in buckets of ``bucket_cap_mb`` read back and reduced while the
     rest of the backward pass runs (``distributed.overlap``), else read back after it into
     one vector and reduced; the reduce goes through a shared-memory window among the ranks
     of one host (``distributed.shm``, ``reduce="auto"`` on one host) or MPI's
     ``Iallreduce``/``Allreduce`` (``reduce="mpi"``);
  4. the update program applies clipping, the non-finite guard and the optimizer to that mean
     gradient, given as an input. It is the compiled step of the surrogate loss
     ``L + sum_p sum(g_p * p)`` (``g_p`` and the mean loss ``L`` inputs), whose gradient with
     respect to ``p`` is ``1 * g_p = g_p`` exactly, so the update, clipping (it sees the
     all-reduced gradient) and the guard are the ordinary Trainer's code. A failure after
     step 2 (a lost device) calls ``MPI_Abort``: the replicas could otherwise diverge;
  5. BatchNorm (PyTorch DDP without ``SyncBatchNorm``, its default): each rank normalizes
     with its local batch's statistics; rank 0's updated running statistics are broadcast to
     every rank after the update (DDP's ``broadcast_buffers=True``), unless the step is
     skipped as non-finite.

Determinism: every rank feeds the same bytes to the same update program, so the parameters
stay identical on every rank. What this relies on: the MPI library's
``Allreduce``/``Iallreduce`` for a fixed communicator, message size and op choosing a fixed
algorithm and combination order (MPICH and Open MPI never combine in arrival order) that gives
every rank the same result, as the MPI standard advises (MPI 4.1, section 6.9.1, "Advice to
implementors"): a run repeats bit for bit. With ``reduce_dtype=np.float64`` the float32 values
are summed exactly (for 2 ranks always; for more unless the summands' exponents span more than
~29 binades), so the order does not matter at all and overlap (bucketed reduces) gives the same
bits as one vector; in float32 that holds for 2 ranks (``a + b`` is one rounding either way),
and with more ranks the two may differ by a rounding through MPI. The shared-memory reduce
sums every element in rank order on one host (``distributed.shm``), so there bucketed and
one-vector reduces give the same bits at any number of ranks in float32 too.

Dropout: rank ``r`` feeds :func:`rank_seed` ``(seed, r)`` where a Trainer feeds ``seed``, so
every rank draws its own mask, deterministically (rank 0 the Trainer's own).

Rank 0 alone writes checkpoints (:meth:`DistributedTrainer.save`, atomic as
``io.checkpoint``); every rank then continues or raises together. docs/distributed.md gives
the measured costs and what is left.
"""

from __future__ import annotations

import sys
import time
import traceback
from dataclasses import dataclass

import numpy as np

from ..nn.module import Module

GRAD_ACCUM_SUFFIX = ".grad_accum"


class DistributedError(RuntimeError):
    """A rank failed during a distributed step; raised on every rank.

    Attributes:
        failed: {rank: "ExceptionType: message"} of the ranks that failed.
    """

    def __init__(self, message: str, failed: dict[int, str]) -> None:
        super().__init__(message)
        self.failed = failed


@dataclass(frozen=True)
class Context:
    """The MPI process's place in the job (:func:`init`).

    Attributes:
        comm: the communicator (``MPI.COMM_WORLD``).
        rank: this process's rank in ``comm``, 0 .. world_size - 1.
        world_size: number of processes.
        local_rank: rank among the processes of this host.
        device: the runtime Device this process trains on.
    """

    comm: object
    rank: int
    world_size: int
    local_rank: int
    device: object


_CONTEXT: Context | None = None


def _mpi():
    try:
        from mpi4py import MPI
    except ImportError as e:
        raise ImportError(
            "meganeura.distributed needs mpi4py and an MPI library: "
            "pip install 'meganeura[distributed]' (mpi4py and the mpich wheel)"
        ) from e
    return MPI


def init(adapter: str | None = None, *, abort_on_exception: bool = True) -> Context:
    """Initialize this process from the MPI environment (idempotent).

    Args:
        adapter: an adapter selection string (``runtime.Device.open``; the CLI passes
            ``MEGANEURA_ADAPTER``); None picks the host's ``local_rank``-th GPU, or the default
            adapter where there is no GPU (lavapipe).
        abort_on_exception: replace ``sys.excepthook`` so that an exception no rank catches
            prints its traceback and then calls ``MPI.COMM_WORLD.Abort(1)``: the other ranks
            would otherwise wait forever in their next collective (``python -m mpi4py`` does
            the same).

    Returns:
        The :class:`Context` (also kept for :func:`rank`, :func:`world_size`, :func:`is_main`).

    Raises:
        ImportError: mpi4py is not installed.
    """
    global _CONTEXT
    if _CONTEXT is not None:
        return _CONTEXT
    MPI = _mpi()
    from ..runtime.device import get_device, get_local_device

    comm = MPI.COMM_WORLD
    local = comm.Split_type(MPI.COMM_TYPE_SHARED)
    local_rank = local.Get_rank()
    local.Free()
    device = get_device(adapter) if adapter else get_local_device(local_rank)
    _CONTEXT = Context(comm, comm.Get_rank(), comm.Get_size(), local_rank, device)
    if abort_on_exception and _CONTEXT.world_size > 1:
        previous = sys.excepthook

        def hook(kind, value, tb):
            previous(kind, value, tb)
            sys.stderr.flush()
            # mpiexec tears the whole job down at Abort, possibly before its proxies have
            # forwarded this rank's traceback (seen once in CI under load): give them a moment
            time.sleep(0.5)
            comm.Abort(1)

        sys.excepthook = hook
    return _CONTEXT


def _context() -> Context:
    if _CONTEXT is None:
        raise RuntimeError("call meganeura.distributed.init() first")
    return _CONTEXT


def rank() -> int:
    """This process's rank (0 before :func:`init` and outside MPI)."""
    return 0 if _CONTEXT is None else _CONTEXT.rank


def world_size() -> int:
    """Number of processes (1 before :func:`init`)."""
    return 1 if _CONTEXT is None else _CONTEXT.world_size


def is_main() -> bool:
    """Whether this is rank 0, the one that logs and writes checkpoints."""
    return rank() == 0


def shard(array: np.ndarray, rank_: int | None = None, size: int | None = None) -> np.ndarray:
    """This rank's rows of a global batch array: the ``rank``-th of ``size`` equal parts
    along dim 0.

    Raises:
        ValueError: a length that ``size`` does not divide (the mean of per-rank means
            equals the global batch's mean only for equal parts).
    """
    r = rank() if rank_ is None else rank_
    n = world_size() if size is None else size
    a = np.asarray(array)
    if a.ndim == 0 or a.shape[0] % n:
        raise ValueError(
            f"a global batch of {a.shape[0] if a.ndim else 'a scalar'} rows cannot be split into "
            f"{n} equal parts (one per rank); use a batch size divisible by the world size"
        )
    q = a.shape[0] // n
    return a[r * q : (r + 1) * q]


def rank_seed(seed: int, rank_: int) -> int:
    """The dropout seed rank ``rank_`` feeds where a one-process Trainer would feed ``seed``:
    ``seed`` itself on rank 0 (a 1-rank job equals a Trainer, dropout included), else the
    first uint32 word of ``numpy.random.SeedSequence([seed, rank_])``: a different,
    deterministic stream per rank (PyTorch DDP leaves per-rank seeding to the user; the
    usual recipe is ``torch.manual_seed(seed + rank)``).

    Returns:
        An int in [0, 2**32).
    """
    if rank_ == 0:
        return int(seed)
    return int(np.random.SeedSequence([int(seed), int(rank_)]).generate_state(1, np.uint32)[0])


def _check_agree(errors: list[str | None], what: str, after: str) -> None:
    """Raise if any rank failed (``errors``: every rank's error or None, in rank order, from
    an ``allgather``: the same list on every rank, so every rank raises), the message ending
    with ``after`` (what state the failure left)."""
    failed = {r: e for r, e in enumerate(errors) if e is not None}
    if failed:
        listed = "; ".join(f"rank {r}: {e}" for r, e in failed.items())
        raise DistributedError(
            f"{what} failed on {len(failed)} of {len(errors)} ranks ({listed}); {after} on any "
            "rank",
            failed,
        )


def _describe(e: BaseException) -> str:
    return "".join(traceback.format_exception_only(type(e), e)).strip()


def broadcast_parameters(model: Module, comm=None) -> None:
    """Give every rank rank 0's parameters and buffers (``model.state_dict()``).

    Raises:
        DistributedError: the ranks' models differ in names, shapes or dtypes (raised on every
            rank; nothing is loaded).
    """
    comm = comm or _context().comm
    sd = model.state_dict()
    spec = [(k, tuple(v.shape), str(v.dtype)) for k, v in sd.items()]
    specs = comm.allgather(spec)
    bad = [r for r, s in enumerate(specs) if s != specs[0]]
    if bad:
        theirs = {k: v for k, *v in specs[bad[0]]}
        diff = [f"{k}: {v} vs {theirs.get(k)}" for k, *v in specs[0] if theirs.get(k) != v][:3]
        raise DistributedError(
            f"broadcast_parameters: the model of rank {bad[0]} differs from rank 0's ({diff})",
            {r: "model differs" for r in bad},
        )
    out = {}
    for k, v in sd.items():
        a = np.array(v, order="C")  # not ascontiguousarray: it makes a 0-d array 1-d
        comm.Bcast(a, root=0)
        out[k] = a
    if comm.Get_rank() != 0:
        model.load_state_dict(out, strict=True)


# the trainer needs the helpers above: imported last
from .trainer import DistributedTrainer as DistributedTrainer  # noqa: E402

"""The intra-host shared-memory all-reduce of :class:`meganeura.distributed.DistributedTrainer`
(``reduce="shm"``, the default on one host through ``reduce="auto"``).

MPI's ``Allreduce`` between ranks of one host moves every byte through its shared-memory
transport (one or two copies per step of its algorithm, Open MPI's ``vader`` without a
single-copy mechanism copies twice). Here the ranks of one host (``COMM_TYPE_SHARED``) share an
MPI-3 shared-memory window (``MPI.Win.Allocate_shared``) and sum each other's vectors directly:

  * every rank has a segment of two slots (double buffering), each sized for the largest
    vector reduced so far (a bucket; the one-vector path reduces in slot-sized chunks), in
    ``reduce_dtype``. A rank writes its vector into its slot (the overlapped path maps the GPU
    bucket straight into it: no host copy of its own);
  * ``Win.Sync``, barrier, ``Win.Sync`` (the MPI-3 unified memory model's synchronization of a
    passive-target epoch held open by ``Lock_all``: MPI 4.1, 12.7);
  * reduce-scatter: rank ``r`` sums the ``r``-th of N contiguous slices over every rank's slot
    in rank order ``0 .. N-1``, block by block through a cache-sized buffer, divides by the
    divisor and writes the slice into its own slot (no other rank reads that slice of it);
  * a second barrier, then every rank copies every slice out of its owner's slot into its own
    private result (the all-gather).

Every element is ``(((x0 + x1) + x2) + ...) / divisor``, computed once by one rank, the same
float operations whatever the vector's length and slicing: every rank gets the same bits, and
the bucketed (overlapped) and one-vector reduces give the same bits at any number of ranks.

A rank writes slot ``s`` again two vectors later, after the first barrier of the vector in
between, which every rank enters only after it finished reading slot ``s``: two barriers per
vector. The alternative, every rank summing the whole vector over all slots into its own result
(one barrier, N x the reads), measured no faster at 2 ranks and 10-30% slower at 3 on the
2-core sandbox (docs/distributed.md; ``bench/shm_reduce.py``), and its memory traffic grows
with N x N: at 8 ranks a host reads 64 vectors per vector reduced instead of 16.

Several hosts (the host communicator smaller than the world): the host's leader (its rank 0)
gathers the host's sum (reduce-scattered as above, not divided), ``Allreduce``-s it with the
other hosts' leaders (a ``Split`` communicator of the leaders), divides, and writes the result
into its own slot; after a third barrier the other ranks of the host copy it out. The order:
rank order within a host, then the MPI library's order among hosts, fixed for a fixed job
(``distributed.__init__``'s docstring).
"""

from __future__ import annotations

import os
import time

import numpy as np

_BLOCK = 1 << 15  # elements summed per block: 128 KiB of float32 per operand, in L2 cache
_ALIGN = 4096


def _mpi():
    from . import _mpi as load

    return load()


def host_comm(comm):
    """The ranks of ``comm`` on this rank's host (``Split_type(COMM_TYPE_SHARED)``, keyed by
    rank, so host ranks follow ``comm``'s order)."""
    MPI = _mpi()
    return comm.Split_type(MPI.COMM_TYPE_SHARED, key=comm.Get_rank())


class SharedMemoryReducer:
    """Sums vectors across the ranks of ``comm`` through shared memory (module docstring).

    Args:
        comm: the communicator reduced over (every rank must build one, collectively).
        dtype: ``np.float32`` or ``np.float64``: the slots' dtype, the sums'.
        node: the host communicator (default :func:`host_comm`; a test may pass a split
            that pretends to be several hosts); owned: :meth:`close` frees it.

    Every method that touches the window is collective over ``comm``: every rank calls them in
    the same order with the same sizes (they follow from the program alone).
    """

    def __init__(self, comm, dtype=np.float32, node=None):
        MPI = _mpi()
        self.comm, self.dtype = comm, np.dtype(dtype)
        if self.dtype not in (np.float32, np.float64):
            raise ValueError(f"SharedMemoryReducer: dtype must be float32 or float64, got {dtype}")
        self.node = node if node is not None else host_comm(comm)
        self.node_rank, self.node_size = self.node.Get_rank(), self.node.Get_size()
        self.hosts = comm.allreduce(1 if self.node_rank == 0 else 0)
        self.leaders = None  # the hosts' leaders' communicator (COMM_NULL on the others)
        if self.hosts > 1:
            color = 0 if self.node_rank == 0 else MPI.UNDEFINED
            self.leaders = comm.Split(color, key=comm.Get_rank())
        self.win, self.capacity, self._turn = None, 0, 0
        self._slots: list[list[np.ndarray]] = []  # [slot][node rank] -> dtype[capacity]
        self._block = np.empty(_BLOCK, self.dtype)

    def reserve(self, elements: int) -> None:
        """Make each slot hold at least ``elements`` values (collective: a larger window
        replaces the old one; its contents are lost).

        Raises:
            MemoryError: on every rank, when ``/dev/shm`` (where MPI libraries map shared
                windows on Linux) has less free space than the host's window needs on any
                host (containers often give it 64 MiB): use ``reduce="mpi"`` or a smaller
                ``bucket_cap_mb``, or enlarge it (``docker run --shm-size``).
        """
        if elements <= self.capacity:
            return
        MPI = _mpi()
        self._free()
        item = self.dtype.itemsize
        slot = -(-elements * item // _ALIGN) * _ALIGN
        need = 2 * slot * self.node_size
        free = need
        if os.path.isdir("/dev/shm"):
            st = os.statvfs("/dev/shm")
            free = st.f_bavail * st.f_frsize
        if self.comm.allreduce(int(free >= need), op=MPI.MIN) == 0:
            raise MemoryError(
                f"the shared-memory all-reduce needs {need} bytes of /dev/shm on a host (2 "
                f"slots of {slot} bytes per rank), {free} free here: use reduce='mpi', a "
                "smaller bucket_cap_mb, or a larger /dev/shm"
            )
        info = MPI.Info.Create()
        info.Set("alloc_shared_noncontig", "true")
        try:
            self.win = MPI.Win.Allocate_shared(2 * slot, item, info=info, comm=self.node)
        finally:
            info.Free()
        self.win.Lock_all(MPI.MODE_NOCHECK)
        self.capacity = slot // item
        segments = []
        for r in range(self.node_size):
            buf, _ = self.win.Shared_query(r)
            segments.append(np.frombuffer(buf, self.dtype, 2 * self.capacity))
        self._slots = [
            [seg[s * self.capacity : (s + 1) * self.capacity] for seg in segments] for s in (0, 1)
        ]

    def slot(self) -> np.ndarray:
        """This rank's slot for the next :meth:`allreduce` (``dtype[capacity]``): write the
        vector into its first elements."""
        if self.win is None:
            raise ValueError("SharedMemoryReducer.slot: call reserve() first")
        return self._slots[self._turn % 2][self.node_rank]

    def allreduce(self, n: int, out: np.ndarray, divisor: float = 1.0) -> None:
        """Every rank's first ``n`` elements of its :meth:`slot`, summed in rank order and
        divided by ``divisor`` (``sum / divisor`` in ``dtype``), into ``out[:n]`` (``dtype``,
        a private array: not a slot). The same bits on every rank. Collective over ``comm``.

        Raises:
            ValueError: ``n`` over the capacity, or ``out`` of another dtype or too short.
        """
        if n > self.capacity:
            raise ValueError(f"allreduce of {n} elements: the slots hold {self.capacity}")
        if out.dtype != self.dtype or out.size < n:
            raise ValueError(
                f"allreduce: out must be {self.dtype}[>= {n}], got {out.dtype}[{out.size}]"
            )
        slots = [s[:n] for s in self._slots[self._turn % 2]]
        self._turn += 1
        size, r = self.node_size, self.node_rank
        bounds = [n * i // size // 16 * 16 for i in range(size)] + [n]
        lo, hi = bounds[r], bounds[r + 1]
        one_host = self.hosts == 1
        self._sync()
        self._sum(slots, lo, hi, divisor if one_host else 1.0)
        self._sync()
        if one_host:
            for j in range(size):
                out[bounds[j] : bounds[j + 1]] = slots[j][bounds[j] : bounds[j + 1]]
            return
        if r == 0:  # the host's sum, then the hosts' sum, into the leader's slot
            MPI = _mpi()
            for j in range(size):
                out[bounds[j] : bounds[j + 1]] = slots[j][bounds[j] : bounds[j + 1]]
            self.leaders.Allreduce(MPI.IN_PLACE, out[:n], op=MPI.SUM)
            np.divide(out[:n], divisor, out=out[:n])
            slots[0][:] = out[:n]
        self._sync()
        if r != 0:
            out[:n] = slots[0]

    def _sum(self, slots: list[np.ndarray], lo: int, hi: int, divisor: float) -> None:
        """Elements ``lo:hi`` of every slot summed in rank order (divided by ``divisor``)
        into this rank's slot, block by block through a cache-sized buffer."""
        tmp = self._block
        mine = slots[self.node_rank]
        for a in range(lo, hi, tmp.size):
            b = min(a + tmp.size, hi)
            t = tmp[: b - a]
            if len(slots) == 1:
                t[:] = slots[0][a:b]
            else:
                np.add(slots[0][a:b], slots[1][a:b], out=t)
            for s in slots[2:]:
                np.add(t, s[a:b], out=t)
            np.divide(t, divisor, out=mine[a:b])

    def _sync(self) -> None:
        """``Win.Sync``, a barrier of the host, ``Win.Sync``: every rank's writes to its
        slot before the barrier are visible to every rank after it (MPI 4.1, 12.7,
        "shared memory synchronization"). The barrier is polled, sleeping 20 us between tests
        after the first 200 us: a spinning rank would take a core from lavapipe's kernels."""
        self.win.Sync()
        req = self.node.Ibarrier()
        t0 = time.perf_counter()
        while not req.Test():
            if time.perf_counter() - t0 > 2e-4:
                time.sleep(2e-5)
        self.win.Sync()

    def _free(self) -> None:
        if self.win is not None:
            self._slots = []
            self.win.Unlock_all()
            self.win.Free()
            self.win, self.capacity = None, 0

    def close(self) -> None:
        """Free the window (collective) and the communicators made here."""
        self._free()
        MPI = _mpi()
        for c in (self.leaders, self.node):
            if c is not None and c != MPI.COMM_NULL:
                c.Free()
        self.leaders = self.node = None

"""The GPU lock and the quiet sections of overlapped children (``workloads.py --jobs N``).

With ``--jobs N`` the parent keeps up to N children alive at once, so that the CPU-only start
of one (Python and torch imports, the deterministic weights, the models built on the CPU) runs
while another finishes. Two rules keep every figure as a lone child would measure it:

* everything that touches the GPU (device and context creation, the first call, the timed
  calls, the profile, the gates) runs after :func:`gpu_phase`, which holds an exclusive
  ``flock`` on the file the parent names in ``MN_BENCH_GPU_LOCK`` until the child exits, so
  no two children ever use the GPU at once;
* every measured section (the first call with its compilation, the clock warm-up, the warm-up
  and timed calls) runs inside :func:`quiet`, which stops every other child of the parent
  (``SIGSTOP``, their pids from the file the parent keeps in ``MN_BENCH_CHILD_PIDS``) and
  continues them after (``SIGCONT``). The first H200 run with ``--jobs 3`` and no quiet
  sections (2026-12-03) measured host-bound PyTorch modes up to 1.8x slower than alone
  (W2 forward under torch.compile 7.85 ms against 4.40), while CUDA graphs did not move.

With ``workloads.py --gpu-overlap`` the parent names no lock file, so :func:`gpu_phase` is a
no-op and only the quiet sections keep children apart: the others' device set-up, profiles,
gates and exit then overlap too. A child stopped by a quiet section may still have GPU work in
flight (PyTorch queues kernels asynchronously); it drains during the measured child's clock
warm-up (``--warm-seconds``, 2 s), before the timed calls, but can fall into the first call's
compile time. Untimed on the H200 so far.

With ``workloads.py --overlap-compile`` torch.compile's first call (its compilation) runs
outside the quiet section too: the matrix's compiles then overlap each other instead of
taking turns (~30 of the ~85 s a cell took in the quiet sections of 2026-12-04's run), and
their times are not compile figures (the headline cells give those).

A child starting during a quiet section waits before its imports (:func:`started`). The
others' start then overlaps only the unmeasured parts: the gates, the profile, process start
and exit. The parent continues every child whenever one exits (a child that dies inside
its quiet section leaves none stopped). Without the variables (``--jobs 1``,
``--in-process``) both are no-ops.
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

ENV = "MN_BENCH_GPU_LOCK"
PIDS_ENV = "MN_BENCH_CHILD_PIDS"
_held: list = []  # the open lock file, kept until the process exits


def gpu_phase() -> float:
    """Block until this process holds the GPU lock (held until exit); returns the seconds
    waited (0.0 without ``MN_BENCH_GPU_LOCK`` or when already held)."""
    path = os.environ.get(ENV)
    if not path or _held:
        return 0.0
    import fcntl

    t = time.perf_counter()
    f = open(path, "a+")  # noqa: SIM115 - held open until the process exits
    fcntl.flock(f.fileno(), fcntl.LOCK_EX)
    _held.append(f)
    return time.perf_counter() - t


def read_pids(path: str) -> list[int]:
    """The pids in the parent's file (one per line); [] when it is missing or unreadable."""
    try:
        with open(path) as f:
            return [int(x) for x in f.read().split()]
    except (OSError, ValueError):
        return []


def write_pids(path: str, pids) -> None:
    """Replace the pid file atomically (a temporary name, then a rename)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        f.write("".join(f"{p}\n" for p in sorted(pids)))
    os.replace(tmp, path)


def signal_all(pids, sig) -> None:
    """Send ``sig`` to each pid's process group where the pid leads one (the parent starts
    each child in a session of its own, so the workers it spawns, such as torch.compile's
    compile pool, stop and continue with it), else to the pid alone; pids that have exited
    are ignored."""
    for p in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            if os.getpgid(p) == p:
                os.killpg(p, sig)
            else:
                os.kill(p, sig)


def _flock(path: str, mode: int):
    import fcntl

    f = open(path, "a+")  # noqa: SIM115 - closed by the caller (or at exit)
    fcntl.flock(f.fileno(), mode)
    return f


def started() -> None:
    """A child's first step, before its imports: wait until the parent has listed this
    process in the pid file and no quiet section runs (a shared lock on the quiet file, which
    :func:`quiet` holds exclusively), so a quiet section that begins later stops this process
    too, and one that runs now is not disturbed by its start. A no-op without
    ``MN_BENCH_CHILD_PIDS``."""
    path = os.environ.get(PIDS_ENV)
    if not path:
        return
    import fcntl

    deadline = time.monotonic() + 60.0
    while True:
        f = _flock(path + ".quiet", fcntl.LOCK_SH)
        listed = os.getpid() in read_pids(path)
        f.close()
        if listed or time.monotonic() > deadline:
            return
        time.sleep(0.01)


@contextlib.contextmanager
def quiet():
    """Stop the parent's other children for the duration (see the module docstring)."""
    path = os.environ.get(PIDS_ENV)
    if not path:
        yield 0
        return
    import fcntl

    f = _flock(path + ".quiet", fcntl.LOCK_EX)  # children starting now wait in ``started``
    others = [p for p in read_pids(path) if p != os.getpid()]
    signal_all(others, signal.SIGSTOP)
    try:
        yield len(others)
    finally:
        signal_all(others, signal.SIGCONT)
        f.close()

"""The GPU phase lock of overlapped children (``workloads.py --jobs N``).

With ``--jobs N`` the parent keeps up to N children alive at once, so that the CPU-only start
of one (Python and torch imports, the deterministic weights, the models built on the CPU) runs
while another is measured. Everything that touches the GPU (device and context creation, the
first call with its compilation, the warm-up and timed calls, the profile, the gates) runs
inside :func:`gpu_phase`, which holds an exclusive ``flock`` on the file the parent names in
``MN_BENCH_GPU_LOCK`` until the child exits: measured phases never overlap, and a first call
(ours: compile + shader compile; torch.compile: Inductor and Triton) never shares the machine
with another child's GPU work. Without the variable (``--jobs 1``, ``--in-process``) it is a
no-op.
"""

from __future__ import annotations

import os
import time

ENV = "MN_BENCH_GPU_LOCK"
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

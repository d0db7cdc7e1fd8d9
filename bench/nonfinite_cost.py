"""Benchmark: GPU time of the kernels that NaN-propagating semantics made heavier (issue 11,
item 2): amax/argmax reductions (vec4 rows and the scalar strided path), max_pool2d, and the
elementwise maximum/relu/comparison chain. Run it on two checkouts to compare before/after:

    python bench/nonfinite_cost.py                  # this checkout
    PYTHONPATH=<other checkout> python bench/nonfinite_cost.py
    python bench/nonfinite_cost.py --small          # shapes / 64, for lavapipe

Prints one line per case: name, median and min GPU ms per step (``Session.profile``).
"""

from __future__ import annotations

import sys

import numpy as np

import meganeura
from meganeura.compile import CompileOptions, compile
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import functional as F
from meganeura.runtime import Session, get_device
from meganeura.training import device_limits

CASES = {
    # name: (input shape, function of the input)
    "amax-rows-vec4 [8192, 4096] dim1": ((8192, 4096), lambda x: x.amax(1)),
    "amax-cols-scalar [4096, 8192] dim0": ((4096, 8192), lambda x: x.amax(0)),
    "amax-all [2^25]": ((1 << 25,), lambda x: x.amax()),
    "argmax-rows [8192, 4096] dim1": ((8192, 4096), lambda x: x.argmax(1)),
    "max_pool2d [32, 64, 112, 112] k3 s2 p1": (
        (32, 64, 112, 112),
        lambda x: F.max_pool2d(x, 3, stride=2, padding=1),
    ),
    "maximum+gt chain [2^25]": ((1 << 25,), lambda x: F.where(x > 0.5, F.maximum(x, x * 0.0), x)),
    "relu [2^25]": ((1 << 25,), F.relu),
}


def _small(shape: tuple[int, ...]) -> tuple[int, ...]:
    return (max(shape[0] // 64, 1), *shape[1:]) if len(shape) > 1 else (shape[0] // 64,)


def main() -> None:
    small = "--small" in sys.argv
    dev = get_device()
    print(f"# meganeura from {meganeura.__file__}", file=sys.stderr)
    rng = np.random.default_rng(0)
    for name, (shape, f) in CASES.items():
        shape = _small(shape) if small else shape
        b = GraphBuilder()
        x = b.input("x", shape)
        b.output("y", f(x))
        program = compile(b.build(), CompileOptions(), device_limits(dev))
        feed = {"x": rng.normal(size=shape).astype(np.float32)}
        with Session(program, dev) as s:
            prof = s.profile(feed, repeats=20, warmup=5)
        steps: dict[int, float] = {}
        for t in prof.timings:
            steps[t.repeat] = steps.get(t.repeat, 0.0) + t.duration_ns / 1e6
        ms = sorted(steps.values())
        dims = "x".join(map(str, shape))
        print(f"{name:40s} {dims:>14s} median {ms[len(ms) // 2]:.4f} ms  min {ms[0]:.4f} ms")


if __name__ == "__main__":
    main()

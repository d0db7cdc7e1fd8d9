"""The fuzzer's hypothesis tests: one per suite of op families, each drawing random programs
(``programs.py``) and checking them on the GPU fused and unfused, strict and fast, and on the
NumPy interpreter, against torch float64, forward and gradients (``check.py``).

CI runs a fixed, small number of examples per suite, derandomized (the same programs every
run) and without hypothesis's example database. ``--fuzz-examples=N`` runs N per suite with
a fresh seed each run (``--fuzz-seed=S`` fixes it) and keeps failures in ``.hypothesis/`` so
the next run replays them first; docs/testing.md says how to run it and replay a failure.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from hypothesis import HealthCheck, given, seed, settings

from .check import check_program
from .programs import programs

pytestmark = pytest.mark.gpu


@dataclass(frozen=True)
class Suite:
    families: tuple[str, ...]
    examples: int  # in CI
    max_steps: int = 5
    attention: bool = False


SUITES = {
    # chains of unary and broadcasting binary ops: what the fusion pass joins into one kernel
    "elementwise": Suite(("unary", "binary"), 14, max_steps=6),
    "reduce": Suite(("reduce", "softmax", "unary", "binary"), 14),
    "views": Suite(("view", "unary", "binary", "reduce"), 14),
    "matmul": Suite(("matmul", "view", "unary", "binary"), 12),
    "norm": Suite(("norm", "unary", "binary", "view"), 12),
    "attention": Suite(("unary", "binary", "reduce", "view"), 10, max_steps=2, attention=True),
    "mixed": Suite(("unary", "binary", "reduce", "softmax", "view", "norm", "matmul"), 14, 6),
}


def _settings(config, ci_examples: int) -> settings:
    n = config.getoption("--fuzz-examples")
    common = dict(
        deadline=None,
        # programs are drawn with assume() (finite values, sizes that fit) and run on a GPU
        suppress_health_check=[HealthCheck.filter_too_much, HealthCheck.too_slow],
        print_blob=True,
    )
    if n is None:
        return settings(max_examples=ci_examples, derandomize=True, database=None, **common)
    return settings(max_examples=n, **common)


@pytest.mark.parametrize("suite", sorted(SUITES))
def test_fuzz(suite, gpu_device, request):
    s = SUITES[suite]
    strategy = programs(families=s.families, max_steps=s.max_steps, attention=s.attention)

    @_settings(request.config, s.examples)
    @given(program=strategy)
    def fuzz(program):
        check_program(program, gpu_device)

    fixed = request.config.getoption("--fuzz-seed")
    (fuzz if fixed is None else seed(fixed)(fuzz))()

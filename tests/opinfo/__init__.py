"""The op database: one OpInfo per op (or per functional entry point), as data.

Each entry names the meganeura function, an independent PyTorch reference (run in float64 on
the CPU), sample inputs (awkward shapes included), tolerances and expected failures. The
generic tests in ``tests/test_opinfo.py`` run every sample through the real GPU path
(lavapipe on CI): forward against the reference, gradients against torch.autograd, and the
op mid-graph (its inputs produced by and its output consumed by other kernels).

Family files (``elementwise.py``, ``reduce.py`` ...) each export ``ENTRIES``; ``DATABASE``
is assembled here explicitly.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np


@dataclass(frozen=True)
class Sample:
    """One call of an op.

    Attributes:
        args: positional operands: NumPy arrays (floating arrays become f32 graph inputs and
            float64 torch tensors; integer arrays i32 inputs and torch int64; bool arrays
            bool inputs) or plain Python values passed through unchanged.
        kwargs: keyword arguments passed to both the meganeura function and the reference.
        name: short label used in test ids and in ``OpInfo.xfail``.
        grad: positions of the args to differentiate; None means every floating array.
        rtol: forward bound for this sample, overriding ``OpInfo.rtol`` (e.g. 1e-4 for a
            reduction over more than 1e4 elements).
    """

    args: tuple
    kwargs: dict = field(default_factory=dict)
    name: str = ""
    grad: tuple[int, ...] | None = None
    rtol: float | None = None


@dataclass(frozen=True)
class OpInfo:
    """Everything the generic tests need to check one op.

    Attributes:
        name: entry name (test ids).
        fn: meganeura function ``fn(*tensors_or_values, **kwargs) -> Tensor``.
        ref: PyTorch reference ``ref(*torch_tensors_or_values, **kwargs) -> torch.Tensor``.
        samples: ``samples(rng) -> list[Sample]``.
        ops: the IR op names this entry exercises (the completeness test uses them).
        differentiable: False skips the gradient test (comparisons, argmax ...).
        rtol: forward relative error bound, ``max|ours - ref| / max(|ref|)``.
        grad_cos: minimum cosine similarity of each gradient with torch's.
        grad_rel: maximum relative error of each gradient's norm.
        xfail: sample name -> reason, for samples expected to fail in every test; a key
            ``"<sample>:<test>"`` (test one of ``forward``, ``gradients``, ``mid_graph``)
            marks one test only. Expected failures are strict: a pass is reported.
        mid_graph: run the mid-graph test too.
    """

    name: str
    fn: Callable
    ref: Callable
    samples: Callable[[np.random.Generator], list[Sample]]
    ops: tuple[str, ...]
    differentiable: bool = True
    rtol: float = 1e-5
    grad_cos: float = 0.9999
    grad_rel: float = 1e-4
    xfail: dict = field(default_factory=dict)
    mid_graph: bool = True


# Family modules, in database order. tests/test_opinfo.py checks that every module of this
# package other than the runner is listed here, so an entry file cannot be left out silently.
FAMILIES = (
    "elementwise",
    "elementwise_extra",
    "creation",
    "reduce",
    "reduce_extra",
    "shape",
    "linalg",
    "conv",
    "norm",
    "distance",
    "attention",
    "loss",
    "quantized",
)


def _families():
    import importlib

    out = []
    for n in FAMILIES:
        try:
            mod = importlib.import_module(f"tests.opinfo.{n}")
        except ModuleNotFoundError as e:
            if e.name == f"tests.opinfo.{n}":
                continue
            raise
        out.extend(mod.ENTRIES)
    return out


DATABASE: list[OpInfo] = _families()

"""Runs one fuzz Program through meganeura and torch float64 and compares them.

The meganeura side is one graph: the program's value ``out``, ``loss = sum(out * R)`` for a
fixed random ``R`` (``runner.upstream``), and the gradients of ``loss`` w.r.t. every input that
is not a constant (``meganeura.autodiff.differentiate``), all as outputs. That graph is

  * interpreted by the NumPy interpreter (``graph.interpret``) in float64: the ops' NumPy
    references and the autodiff rules, checked against torch float64 and torch.autograd to
    ``INTERPRETER`` (float64 round-off, not f32's);
  * compiled and run on the GPU (lavapipe on CI) once per ``Variant``: strict precision fused
    and unfused (``CompileOptions.fuse``), and fast precision (f16 storage) fused, each
    checked against torch float64 with the variant's tolerance.

Metrics: the op database's forward error (``tests/opinfo/runner.py``), ``max|ours - ref| /
max|ref|``, for the value, and the same with a floor on the scale for each gradient
(``Tolerance``).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from meganeura.autodiff import differentiate
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.ops import functional as MF
from meganeura.runtime import Session
from meganeura.training import device_limits

from ..opinfo.runner import _output_grads, forward_error, upstream
from .programs import Program


@dataclass(frozen=True)
class Tolerance:
    """Bounds on ``max|ours - ref| / max(max|ref|, floor)`` for the value and each gradient.

    The floor keeps a result that is nearly zero by cancellation (``v - sdpa(q, k, v)`` over
    one key is exactly 0; the gradient of rms_norm over one element is ``eps / (x^2 +
    eps)^1.5``) from being judged by its own round-off: inputs and upstream ``R`` are O(1),
    so results are compared at that scale. f16 storage rounds O(1) values by up to 2^-11,
    so fast mode's floor is larger.
    """

    rtol: float
    grad_rtol: float
    floor: float = 1e-3
    grad_floor: float = 1e-2


@dataclass(frozen=True)
class Variant:
    name: str
    fuse: bool
    precision: str
    tol: Tolerance


# Strict: f32 round-off through a chain of up to ~6 ops (and reductions) on O(1) values.
STRICT = Tolerance(rtol=1e-4, grad_rtol=3e-4)
# Fast: test_opinfo_fast's contract for one op (1e-2), loosened for a chain of several f16
# stores: each rounds to 2^-11 relative, and cancellation (sub, var, norms) amplifies that.
FAST = Tolerance(rtol=3e-2, grad_rtol=6e-2, floor=1e-1, grad_floor=1e-1)
INTERPRETER = Tolerance(rtol=1e-8, grad_rtol=1e-8, floor=1e-6, grad_floor=1e-6)

VARIANTS = (
    Variant("strict-fused", True, "strict", STRICT),
    Variant("strict-unfused", False, "strict", STRICT),
    Variant("fast-fused", True, "fast", FAST),
)
# Fast mode stores values as f16; its range (65504) and its narrowing rules belong to
# another part of issue 11: programs whose values exceed this are checked strict only.
FAST_MAX_ABS = 1e3


@dataclass
class Reference:
    out: np.ndarray
    grads: dict[int, np.ndarray]  # input index -> gradient
    max_abs: float  # largest |value| of any intermediate


def feeds_of(program: Program) -> dict[str, np.ndarray]:
    return {f"x{k}": inp.value() for k, inp in enumerate(program.inputs)}


def differentiated(program: Program) -> tuple[int, ...]:
    return tuple(k for k in range(len(program.inputs)) if k not in program.constant_inputs)


def reference(program: Program, feeds: dict[str, np.ndarray], r: np.ndarray | None) -> Reference:
    """torch float64 forward and torch.autograd gradients of ``sum(out * R)``."""
    wrt = differentiated(program)
    leaves = []
    for k in range(len(program.inputs)):
        t = torch.from_numpy(feeds[f"x{k}"].astype(np.float64))
        leaves.append(t.requires_grad_(k in wrt))
    vals = program.run("torch", leaves)
    out = vals[-1]
    max_abs = max(float(v.detach().abs().max()) for v in vals if v.numel())
    grads = {}
    if r is not None and out.requires_grad:
        loss = (out * torch.from_numpy(r.astype(np.float64))).sum()
        gs = torch.autograd.grad(loss, [leaves[k] for k in wrt], allow_unused=True)
        for k, g in zip(wrt, gs):
            grads[k] = np.zeros(leaves[k].shape) if g is None else g.numpy()
    return Reference(out.detach().numpy(), grads, max_abs)


def build(program: Program, r: np.ndarray | None):
    """(graph with outputs ``out``, ``loss``, ``grad<k>``; constant gradients by name)."""
    b = GraphBuilder()
    leaves = [b.input(f"x{k}", inp.shape, DType.f32) for k, inp in enumerate(program.inputs)]
    out = program.run("mn", leaves)[-1]
    b.output("out", out)
    # build_unverified: verified too, but an input no step uses (the draw skipped the step
    # it was drawn for) is allowed
    if r is None:
        return b.build_unverified(), {}
    loss = b.output("loss", MF.sum(out * b.input("upstream", out.shape)))
    wrt = differentiated(program)
    graph, grads = differentiate(b.build_unverified(), loss.id, [leaves[k].id for k in wrt])
    b2 = GraphBuilder(graph)
    consts = _output_grads(b2, grads, {k: leaves[k].id for k in wrt})
    return b2.build_unverified(), consts


def _grads(ref: Reference, got: dict) -> dict[int, np.ndarray]:
    out = {}
    for k, g in ref.grads.items():
        ours = got.get(f"grad{k}")
        out[k] = np.zeros_like(g) if ours is None else np.asarray(ours, np.float64)
    return out


def check_program(program: Program, device, variants=VARIANTS) -> None:
    """Assert that every variant (and the interpreter) agrees with torch float64."""
    feeds = feeds_of(program)
    out_shape = tuple(
        program.run("torch", [torch.zeros(i.shape) for i in program.inputs])[-1].shape
    )
    r = upstream(out_shape) if differentiated(program) else None
    ref = reference(program, feeds, r)
    if not ref.grads:
        r = None
    graph, consts = build(program, r)
    if r is not None:
        feeds["upstream"] = r
    names = [n for n, _ in graph.outputs]

    vals, _, _ = interpret(graph, feeds, float64=True)
    by_name = {n: vals[i] for n, i in graph.outputs} | consts
    _compare("interpreter", INTERPRETER, by_name, ref)

    for v in variants:
        if v.precision == "fast" and ref.max_abs > FAST_MAX_ABS:
            continue
        program_ = compile(graph, CompileOptions(fuse=v.fuse, precision=v.precision),
                           device_limits(device))  # fmt: skip
        with Session(program_, device) as session:
            got = session.run({k: feeds[k] for k in feeds}, names)
        _compare(v.name, v.tol, got | consts, ref)


def _compare(what: str, tol: Tolerance, got: dict, ref: Reference) -> None:
    _close(f"{what}: out", np.asarray(got["out"], np.float64), ref.out, tol.rtol, tol.floor)
    for k, ours in _grads(ref, got).items():
        _close(f"{what}: grad of x{k}", ours, ref.grads[k], tol.grad_rtol, tol.grad_floor)


def _close(what: str, ours: np.ndarray, ref: np.ndarray, rtol: float, floor: float) -> None:
    assert ours.shape == ref.shape, f"{what}: shape {ours.shape} != {ref.shape}"
    if forward_error(ours, ref) <= rtol:  # the op database's metric (non-finite values too)
        return
    assert np.isfinite(ours).all(), f"{what}: not finite: {ours.ravel()[:8]}"
    err = float(np.abs(ours - ref).max(initial=0.0))
    err /= max(float(np.abs(ref).max(initial=0.0)), floor)
    assert err <= rtol, (
        f"{what}: relative error {err:.3g} > {rtol:g}\n ours[:8]={ours.ravel()[:8]}\n"
        f" ref[:8]={ref.ravel()[:8]}"
    )

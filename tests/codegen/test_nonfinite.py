"""Non-finite semantics of every op on the GPU path (issue 11, item 2; docs/ops.md).

Each op runs on inputs holding NaN, +inf, -inf, -0.0 and ordinary numbers, and is compared
with torch float32 (CPU): NaN positions and inf signs exactly, finite values to 1e-5. Modes:

  * ``fused-vec4``: 4x8 input, ``f(x * 1.0)`` fused into one kernel, vec4 loads;
  * ``unfused-scalar``: 5x7 input (no vec4 path), one kernel per node;
  * ``fast-unfused``: 4x8, fast precision, one kernel per node, so ``x * 1.0`` is stored as
    f16 (every input value is exact in f16) and the op reads it back.

``x * 1.0`` is exact for every value (NaN, inf, -0.0 included). The NaN checks are host-side
(``np.isnan``); the kernels themselves test NaN by bit pattern (``core.mathlib``).
Where we follow torch's CUDA formula rather than its CPU kernel: ``gelu(+inf) = inf``.
"""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.nn import functional as F
from meganeura.runtime import Session
from meganeura.training import device_limits

TF = torch.nn.functional
VALUES = np.array([np.nan, 1.0, -np.inf, np.inf, -1.0, -0.0, 0.0, 2.5], np.float32)


def _input(shape: tuple[int, int]) -> np.ndarray:
    """Rows that are rotations of VALUES, so every row and column holds non-finite values."""
    rows, cols = shape
    flat = np.concatenate([np.roll(VALUES, 3 * r) for r in range(rows * cols // 8 + 2)])
    return flat[: rows * cols].reshape(shape).astype(np.float32)


MODES = {
    "fused-vec4": ((4, 8), CompileOptions(fuse=True)),
    "unfused-scalar": ((5, 7), CompileOptions(fuse=False)),
    "fast-unfused": ((4, 8), CompileOptions(fuse=False, precision="fast")),
}

# id -> (meganeura function of x, torch function of x)
CASES = {
    "relu": (F.relu, torch.relu),
    "maximum": (lambda x: F.maximum(x, x * 0.0), lambda t: torch.maximum(t, t * 0.0)),
    "minimum": (lambda x: F.minimum(x, x * 0.0), lambda t: torch.minimum(t, t * 0.0)),
    "mul-zero": (lambda x: x * 0.0, lambda t: t * 0.0),
    "div-zero": (lambda x: x / 0.0, lambda t: t / 0.0),
    "div-neg-zero": (lambda x: x / -0.0, lambda t: t / -0.0),
    "reciprocal": (lambda x: 1.0 / x, lambda t: 1.0 / t),
    # inf - inf = NaN: Mesa folded the same value minus itself (x - x, x + -x) to 0
    "sub-self": (lambda x: x - x, lambda t: t - t),
    "add-neg-self": (lambda x: x + (-x), lambda t: t + (-t)),
    "ne-self": (lambda x: x != x, lambda t: t != t),
    "eq-self": (lambda x: x == x, lambda t: t == t),
    "ge-self": (lambda x: x >= x, lambda t: t >= t),
    "lt": (lambda x: x < 1.0, lambda t: t < 1.0),
    "to-bool": (lambda x: F.cast(x, DType.bool), lambda t: t.bool()),
    "logical_and": (
        lambda x: F.logical_and(x, x * 0.0 + 1.0),
        lambda t: torch.logical_and(t, t * 0 + 1),
    ),
    "logical_or": (lambda x: F.logical_or(x, x * 0.0), lambda t: torch.logical_or(t, t * 0)),
    "logical_not": (F.logical_not, torch.logical_not),
    "erf": (F.erf, torch.erf),
    "exp": (F.exp, torch.exp),
    "log": (F.log, torch.log),
    "sqrt": (F.sqrt, torch.sqrt),
    "rsqrt": (F.rsqrt, torch.rsqrt),
    "tanh": (F.tanh, torch.tanh),
    "sigmoid": (F.sigmoid, torch.sigmoid),
    "softplus": (F.softplus, TF.softplus),
    "silu": (F.silu, TF.silu),
    "gelu-tanh": (
        lambda x: F.gelu(x, approximate="tanh"),
        lambda t: TF.gelu(t, approximate="tanh"),
    ),
    "log1p": (F.log1p, torch.log1p),
    "expm1": (F.expm1, torch.expm1),
    "pow-1.5": (lambda x: x**1.5, lambda t: t**1.5),
    "pow-xx": (lambda x: F.pow(x, x), lambda t: torch.pow(t, t)),
    "exp2-base": (lambda x: F.pow(x * 0.0 + 2.0, x), lambda t: torch.pow(t * 0.0 + 2.0, t)),
    "clamp": (lambda x: F.clamp(x, -0.5, 0.5), lambda t: torch.clamp(t, -0.5, 0.5)),
    "where": (lambda x: F.where(x > 0.0, x, x * 2.0), lambda t: torch.where(t > 0, t, t * 2)),
    "sign": (F.sign, torch.sign),
    "abs": (F.abs, torch.abs),
    "amax-dim1": (lambda x: x.amax(1), lambda t: t.amax(1)),
    "amax-dim0": (lambda x: x.amax(0), lambda t: t.amax(0)),
    "amin-dim1": (lambda x: x.amin(1), lambda t: t.amin(1)),
    "max-dim1": (lambda x: F.max(x, 1)[0], lambda t: torch.max(t, 1)[0]),
    "min-dim0": (lambda x: F.min(x, 0)[0], lambda t: torch.min(t, 0)[0]),
    "argmax-dim1": (lambda x: x.argmax(1), lambda t: t.argmax(1)),
    "argmax-dim0": (lambda x: x.argmax(0), lambda t: t.argmax(0)),
    "argmin-dim1": (lambda x: x.argmin(1), lambda t: t.argmin(1)),
    "sum": (lambda x: x.sum(1), lambda t: t.sum(1)),
    "mean": (lambda x: x.mean(0), lambda t: t.mean(0)),
    "cumsum": (lambda x: F.cumsum(x, 1), lambda t: torch.cumsum(t, 1)),
    "var": (lambda x: F.var(x, 1), lambda t: torch.var(t, 1)),
    "logsumexp": (lambda x: F.logsumexp(x, 1), lambda t: torch.logsumexp(t, 1)),
    "softmax": (lambda x: F.softmax(x, 1), lambda t: torch.softmax(t, 1)),
    "log_softmax": (lambda x: F.log_softmax(x, 1), lambda t: torch.log_softmax(t, 1)),
}


def assert_same(got: np.ndarray, ref: np.ndarray, what: str, tol: float = 1e-5) -> None:
    """NaN positions and inf signs exactly, finite values to ``tol``."""
    got, ref = np.asarray(got).astype(np.float64), np.asarray(ref).astype(np.float64)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    for test in (np.isnan, np.isposinf, np.isneginf):
        bad = test(got) != test(ref)
        assert not bad.any(), f"{what}: {test.__name__} differs at {np.argwhere(bad).tolist()}"
    fin = np.isfinite(ref)
    np.testing.assert_allclose(got[fin], ref[fin], rtol=tol, atol=tol, err_msg=what)


def run(build, feeds: dict, options: CompileOptions, device, names=("y",)) -> dict:
    b = GraphBuilder()
    ins = {k: b.input(k, v.shape) for k, v in feeds.items()}
    outs = build(b, **ins)
    for name, t in zip(names, outs if isinstance(outs, tuple) else (outs,), strict=True):
        b.output(name, t)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a fast program that fell back to strict is no test
        program = compile(b.build(), options, device_limits(device))
    with Session(program, device) as s:
        return s.run(feeds, list(names))


@pytest.mark.gpu
@pytest.mark.parametrize("mode", list(MODES))
@pytest.mark.parametrize("case", list(CASES))
def test_op_on_nonfinite_inputs(case, mode, gpu_device):
    shape, options = MODES[mode]
    if options.precision == "fast" and "shader-f16" not in gpu_device.features:
        pytest.skip("fast mode needs shader-f16")
    f, tf = CASES[case]
    x = _input(shape)
    out = run(lambda b, x: f(x * 1.0), {"x": x}, options, gpu_device)
    with np.errstate(all="ignore"):
        ref = tf(torch.from_numpy(x.copy())).numpy()
    assert_same(out["y"], ref, f"{case} ({mode})")


@pytest.mark.gpu
@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu_of_inf_follows_the_formula(approximate, gpu_device):
    """gelu(+inf) = inf (torch's CUDA formula x * 0.5 * (1 + erf(x / sqrt 2)); its CPU kernel
    gives NaN), gelu(-inf) = NaN (-inf * 0), gelu(NaN) = NaN."""
    x = VALUES.reshape(1, 8)
    out = run(
        lambda b, x: F.gelu(x, approximate=approximate),
        {"x": x},
        MODES["fused-vec4"][1],
        gpu_device,
    )
    ref = TF.gelu(torch.from_numpy(x.astype(np.float64)), approximate=approximate).numpy()
    ref[np.isposinf(x)] = np.inf
    ref[np.isneginf(x)] = np.nan
    assert_same(out["y"], ref, f"gelu {approximate}")


@pytest.mark.gpu
@pytest.mark.parametrize("n", [4096, 4099], ids=["vec4-chunked", "scalar-chunked"])
def test_long_reductions_propagate_nan(n, gpu_device):
    """Rows long enough to be split over chunks (two dispatches): the NaN must survive the
    per-thread fold, the workgroup tree and the combining pass; argmax returns the first NaN."""
    x = np.random.default_rng(0).normal(size=(2, n)).astype(np.float32)
    x[0, [1000, 3000]] = np.nan
    x[1, 5] = np.inf

    def build(b, x):
        return x.amax(1), x.amin(1), x.argmax(1), x.argmin(1)

    names = ("amax", "amin", "argmax", "argmin")
    out = run(build, {"x": x}, CompileOptions(), gpu_device, names)
    t = torch.from_numpy(x)
    for k, ref in zip(names, (t.amax(1), t.amin(1), t.argmax(1), t.argmin(1)), strict=True):
        assert_same(out[k], ref.numpy(), k)


@pytest.mark.gpu
def test_max_pool2d_propagates_nan(gpu_device):
    x = _input((4, 8)).reshape(1, 1, 4, 8)
    out = run(lambda b, x: F.max_pool2d(x, 2), {"x": x}, CompileOptions(), gpu_device)
    assert_same(out["y"], TF.max_pool2d(torch.from_numpy(x), 2).numpy(), "max_pool2d")


GRAD_CASES = {
    "relu": (F.relu, torch.relu),
    "maximum": (lambda x: F.maximum(x, x * 0.0 + 1.0), lambda t: torch.maximum(t, t * 0.0 + 1)),
    "amax": (lambda x: x.amax(1), lambda t: t.amax(1)),
    "max-dim": (lambda x: F.max(x, 1)[0], lambda t: torch.max(t, 1)[0]),
    "max_pool2d": (
        lambda x: F.max_pool2d(F.reshape(x, (1, 1, 4, 8)), 2),
        lambda t: TF.max_pool2d(t.reshape(1, 1, 4, 8), 2),
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(GRAD_CASES))
def test_gradient_with_nan_inputs_matches_torch(case, gpu_device):
    """The max-style ops' gradients where an input is NaN: torch's (a NaN maximum routes g
    to the first NaN for max over a dim and max_pool2d, gives NaN for amax's shared
    gradient, g to both operands of maximum; relu passes g at NaN)."""
    f, tf = GRAD_CASES[case]
    x = _input((4, 8))
    x[2] = np.arange(8, dtype=np.float32)  # one row without non-finite values
    y_ref = tf(torch.from_numpy(x.copy()))
    r = np.random.default_rng(1).normal(size=tuple(y_ref.shape)).astype(np.float32)

    b = GraphBuilder()
    xi, ri = b.input("x", x.shape), b.input("r", r.shape)
    loss = b.output("loss", F.sum(f(xi) * ri))
    g, grads = differentiate(b.build(), loss.id, [xi.id])
    gb = GraphBuilder(g)
    gb.output("dx", gb.tensor(grads[xi.id]))
    program = compile(gb.build_unverified(), CompileOptions(), device_limits(gpu_device))
    with Session(program, gpu_device) as s:
        dx = s.run({"x": x, "r": r}, ["dx"])["dx"]
    tx = torch.from_numpy(x.astype(np.float64)).requires_grad_(True)
    (tf(tx) * torch.from_numpy(r.astype(np.float64))).sum().backward()
    assert_same(dx, tx.grad.numpy(), f"d{case}/dx")


ROW_CASES = {
    "softmax": (lambda x: F.softmax(x, 1), lambda t: torch.softmax(t, 1)),
    "log_softmax": (lambda x: F.log_softmax(x, 1), lambda t: torch.log_softmax(t, 1)),
    "logsumexp": (lambda x: F.logsumexp(x, 1), lambda t: torch.logsumexp(t, 1)),
    "layer_norm": (lambda x: F.layer_norm(x, x.shape[1:]), lambda t: TF.layer_norm(t, t.shape[1:])),
    "rms_norm": (lambda x: F.rms_norm(x, x.shape[1:]), lambda t: TF.rms_norm(t, t.shape[1:])),
    "var": (lambda x: F.var(x, 1), lambda t: torch.var(t, 1)),
    "normalize": (lambda x: F.normalize(x, dim=1), lambda t: TF.normalize(t, dim=1)),
    "normalize-inf": (
        lambda x: F.normalize(x, p=float("inf"), dim=1),
        lambda t: TF.normalize(t, p=float("inf"), dim=1),
    ),
}


@pytest.mark.gpu
@pytest.mark.parametrize("n", [8, 300], ids=["row8", "row300"])
@pytest.mark.parametrize("case", list(ROW_CASES))
def test_row_ops_on_rows_with_inf_and_nan(case, n, gpu_device):
    """Row kernels (plain and team) on rows that are all -inf, hold one +inf, one -inf, both,
    a NaN, or two +inf, against torch: NaN rows where torch has them, exact -inf/0 elsewhere."""
    x = np.random.default_rng(0).normal(size=(6, n)).astype(np.float32)
    x[0] = -np.inf
    x[1, 3] = np.inf
    x[2, 5] = -np.inf
    x[3, [2, 4]] = np.inf, -np.inf
    x[4, 1] = np.nan
    x[5, :2] = np.inf
    f, tf = ROW_CASES[case]
    out = run(lambda b, x: f(x), {"x": x}, CompileOptions(), gpu_device)
    with np.errstate(all="ignore"):
        ref = tf(torch.from_numpy(x.copy())).numpy()
    assert_same(out["y"], ref, f"{case} n={n}", tol=1e-4)


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["unfused-scalar", "fast-unfused"])
def test_dropout_keeps_nan_and_inf_where_it_drops(mode, gpu_device):
    """torch's dropout is ``x * mask * scale``: a dropped NaN or inf is NaN (``0 * inf``), not
    0, so a NaN in a batch still reaches the loss and the training guard. The GPU kernel, the
    NumPy reference and ``x * keep_mask * scale`` (torch's formula, float64) agree."""
    from meganeura.ops.dropout import _dropout_np as dropout_reference
    from meganeura.ops.dropout import keep_mask

    shape, options = MODES[mode]
    if options.precision == "fast" and "shader-f16" not in gpu_device.features:
        pytest.skip("fast mode needs shader-f16")
    x = _input(shape)
    seed = np.asarray(7, np.uint32)
    keep = keep_mask(int(seed), shape, 0.5)
    assert keep.any() and not keep.all()

    def build(b, x):
        return F.dropout(x * 1.0, 0.5, seed=b.input("seed", (), DType.u32))

    b = GraphBuilder()
    xi = b.input("x", shape)
    b.output("y", build(b, xi))
    program = compile(b.build(), options, device_limits(gpu_device))
    with Session(program, gpu_device) as s:
        got = s.run({"x": x, "seed": seed}, ["y"])["y"]
    with np.errstate(all="ignore"):
        ref = x.astype(np.float64) * keep * 2.0
        host = dropout_reference([x, seed], {"p": 0.5})
    assert np.isnan(ref[~keep & ~np.isfinite(x)]).all()
    assert_same(got, ref, f"dropout ({mode})")
    assert_same(host, ref, "dropout (NumPy reference)")


# Across the ops of a fused chain Mesa rewrote exp(log x) -> x, sqrt(x) * sqrt(x) -> |x| and
# (x + x) - x -> x, wrong for negative, inf and NaN x. Strict modes only: fast mode stores the
# intermediate as f16, which no 1e-5 tolerance holds.
CHAIN_CASES = {
    "exp-log": (lambda x: F.exp(F.log(x)), lambda t: torch.exp(torch.log(t))),
    "sqrt-times-sqrt": (lambda x: F.sqrt(x) * F.sqrt(x), lambda t: torch.sqrt(t) * torch.sqrt(t)),
    "add-then-sub": (lambda x: (x + x) - x, lambda t: (t + t) - t),
}


@pytest.mark.gpu
@pytest.mark.parametrize("mode", ["fused-vec4", "unfused-scalar"])
@pytest.mark.parametrize("case", list(CHAIN_CASES))
def test_fused_chains_are_not_rewritten_across_ops(case, mode, gpu_device):
    shape, options = MODES[mode]
    f, tf = CHAIN_CASES[case]
    x = _input(shape)
    out = run(lambda b, x: f(x * 1.0), {"x": x}, options, gpu_device)
    with np.errstate(all="ignore"):
        ref = tf(torch.from_numpy(x.copy())).numpy()
    assert_same(out["y"], ref, f"{case} ({mode})")

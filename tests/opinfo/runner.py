"""Runs one OpInfo sample through the real pipeline and through PyTorch, and measures errors.

Our side: a graph is built with one ``input`` leaf per array operand (floating arrays f32,
integer arrays i32, bool arrays bool; other Python values are passed through), the op is
called, the graph is compiled with ``meganeura.compile.compile`` for the device's limits and
executed by a ``meganeura.runtime.Session``. Reference side: the same values as float64 (int64
for integers) CPU tensors through ``info.ref``. Floating operands are rounded to float32
*before* either side sees them, so both compute on identical inputs and the measured error is
the op's own.

Three runs per sample:
  * forward: the op's value is a graph output;
  * gradients: ``loss = sum(out * R)`` for a fixed random ``R`` (an input, so nothing folds),
    differentiated by ``meganeura.autodiff.differentiate`` and compared with torch.autograd;
    ``out`` is then an intermediate, not an output;
  * mid-graph: every operand is produced by a kernel (floats as ``h * 2.0`` with ``h = x/2``
    fed, exact in binary floating point; integers ``i + 0``; bools ``b != false``) and the
    result is consumed by kernels (``out * s`` as the checked output, ``sum(tanh(out * s) * R)``
    as the loss), so the op reads and writes planner-shared intermediate buffers. ``s`` is a
    power of two with ``|out * s| <= 1`` (exact scaling; keeps tanh well conditioned).

Metrics: forward ``max|ours - ref| / max(max|ref|, 1e-30)`` (non-finite values must sit in the
same places with the same values); gradients: cosine similarity and relative error of the
norm, per operand, skipped when both norms are below 1e-12.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass

import numpy as np
import torch

from meganeura.autodiff import differentiate
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, Tensor
from meganeura.graph.ir import VIEW_OPS, Graph
from meganeura.ops import functional as F
from meganeura.runtime import Session
from meganeura.training import device_limits

from . import OpInfo, Sample

TINY_NORM = 1e-12
UPSTREAM_SEED = 20240611


# ---- operands ---------------------------------------------------------------------------------
def _kind(a) -> str:
    if isinstance(a, (np.ndarray, np.generic)):
        if a.dtype == np.bool_:
            return "bool"
        if np.issubdtype(a.dtype, np.integer):
            return "int"
        if np.issubdtype(a.dtype, np.floating):
            return "float"
        raise TypeError(f"unsupported sample array dtype {a.dtype}")
    return "value"


def host_args(sample: Sample) -> list:
    """The operands as the GPU sees them: floats rounded to f32, integers i32."""
    out = []
    for a in sample.args:
        k = _kind(a)
        a = np.asarray(a) if k != "value" else a
        if k == "float":
            out.append(np.ascontiguousarray(a, np.float32))
        elif k == "int":
            if a.size and (a.min() < -(2**31) or a.max() >= 2**31):
                raise ValueError("integer sample values must fit i32")
            out.append(np.ascontiguousarray(a, np.int32))
        elif k == "bool":
            out.append(np.ascontiguousarray(a, np.bool_))
        else:
            out.append(a)
    return out


def entry_samples(info: OpInfo) -> list[Sample]:
    """The entry's samples, from a generator seeded by the entry's name (stable across runs
    and processes, so test ids and data never change between collection and execution)."""
    return info.samples(np.random.default_rng(zlib.crc32(info.name.encode())))


def grad_positions(sample: Sample) -> tuple[int, ...]:
    """Positions of the operands to differentiate (``sample.grad`` or every float array)."""
    if sample.grad is not None:
        return tuple(sample.grad)
    return tuple(i for i, a in enumerate(sample.args) if _kind(a) == "float")


def upstream(shape: tuple[int, ...], seed: int = UPSTREAM_SEED) -> np.ndarray:
    """The fixed random ``R`` of ``loss = sum(out * R)`` (f32 values, exact in float64)."""
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def graph_operands(
    b: GraphBuilder, args: list, mid: bool
) -> tuple[list, dict[str, np.ndarray], dict]:
    """Graph operands, feeds, and {position: leaf id} of the array operands."""
    ops, feeds, leaf = [], {}, {}
    for i, a in enumerate(args):
        k = _kind(a)
        if k == "value":
            ops.append(a)
            continue
        name = f"arg{i}"
        dtype = {"float": DType.f32, "int": DType.i32, "bool": DType.bool}[k]
        t = b.input(name, a.shape, dtype)
        leaf[i] = t.id
        feeds[name] = a
        if mid:
            if k == "float":
                feeds[name] = (a.astype(np.float64) / 2).astype(np.float32)
                t = t * 2.0
            elif k == "int":
                t = t + 0
            else:
                t = F.ne(t, b.constant(False, DType.bool))
        ops.append(t)
    return ops, feeds, leaf


def torch_args(args: list, positions: tuple[int, ...] = (), mid: bool = False):
    """(operands for ``info.ref``, {position: leaf tensor with requires_grad})."""
    ops, leaves = [], {}
    for i, a in enumerate(args):
        k = _kind(a)
        if k == "value":
            ops.append(a)
            continue
        if k == "float":
            host = a.astype(np.float64) / 2 if mid else a.astype(np.float64)
            t = torch.from_numpy(host.copy())
            if i in positions:
                t.requires_grad_(True)
                leaves[i] = t
            ops.append(t * 2.0 if mid else t)
        else:
            t = torch.from_numpy(a.astype(np.int64) if k == "int" else a.copy())
            ops.append(t)
    return ops, leaves


# ---- execution --------------------------------------------------------------------------------
def execute(
    graph: Graph, feeds: dict[str, np.ndarray], fetch: list[str], device, precision="strict"
) -> dict:
    """Compile ``graph`` for ``device`` (with ``CompileOptions.precision``), run it once and
    free its buffers.

    Sessions are not cached: every sample builds a different graph, and compiled pipelines
    are already cached per device by WGSL text, so a new Session costs only its buffers.
    """
    program = compile(graph, CompileOptions(precision=precision), device_limits(device))
    with Session(program, device) as session:
        return session.run(feeds, fetch)


def _output_grads(b: GraphBuilder, grads: dict[int, int], leaf: dict[int, int]) -> dict:
    """Name each gradient as an output; gradients that are constants are returned as values
    (a constant has no storage to fetch)."""
    consts = {}
    for pos, lid in leaf.items():
        if lid not in grads:
            continue
        gid = root = grads[lid]
        while b.nodes[root].op in VIEW_OPS:
            root = b.nodes[root].inputs[0]
        root = b.nodes[root]
        shape = b.nodes[gid].type.shape
        if root.op == "constant":
            consts[f"grad{pos}"] = np.full(shape, root.attr("value"), np.float32)
        else:
            b.output(f"grad{pos}", b.tensor(gid))
    return consts


def _run_with_grads(
    b: GraphBuilder, loss: Tensor, feeds: dict, leaf: dict, positions, device, precision="strict"
) -> dict:
    b.output("loss", loss)
    graph = b.build_unverified()
    wrt = [leaf[p] for p in positions]
    g2, grads = differentiate(graph, "loss", wrt)
    b2 = GraphBuilder(g2)
    wanted = {p: leaf[p] for p in positions}
    consts = _output_grads(b2, grads, wanted)
    g2 = b2.build_unverified()
    fetch = [n for n, _ in g2.outputs]
    got = execute(g2, feeds, fetch, device, precision)
    got.update(consts)
    return got


def symbolic_graph(info: OpInfo, sample: Sample) -> Graph:
    """The sample's graph without running it: forward, plus the backward of
    ``sum(out * R)`` when the entry is differentiable and the sample has grad positions."""
    b = GraphBuilder()
    ops, _, leaf = graph_operands(b, host_args(sample), mid=False)
    out = info.fn(*ops, **sample.kwargs)
    b.output("out", out)
    positions = grad_positions(sample) if info.differentiable else ()
    if not (positions and out.dtype.is_floating and out.type.numel):
        return b.build_unverified()
    loss = b.output("loss", F.sum(out * b.input("upstream", out.shape)))
    graph, _ = differentiate(b.build_unverified(), loss.id, [leaf[p] for p in positions])
    return graph


def _to_numpy(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy()


def reference(info: OpInfo, sample: Sample) -> np.ndarray:
    """The reference forward value (float64, int64 or bool)."""
    args = host_args(sample)
    ops, _ = torch_args(args)
    with torch.no_grad():
        return _to_numpy(info.ref(*ops, **sample.kwargs))


def run_forward(
    info: OpInfo, sample: Sample, device, precision="strict"
) -> tuple[np.ndarray, np.ndarray]:
    """(our value, the reference value) of one sample."""
    args = host_args(sample)
    b = GraphBuilder()
    ops, feeds, _ = graph_operands(b, args, mid=False)
    out = info.fn(*ops, **sample.kwargs)
    b.output("out", out)
    got = execute(b.build(), feeds, ["out"], device, precision)["out"]
    return got, reference(info, sample)


@dataclass(frozen=True)
class GradPair:
    """Our gradient and torch's for the operand at ``position``."""

    position: int
    ours: np.ndarray
    ref: np.ndarray


def run_gradients(
    info: OpInfo, sample: Sample, device, upstream_values: np.ndarray | None = None
) -> list[GradPair]:
    """Gradients of ``sum(op(...) * R)`` w.r.t. the sample's grad positions, ours and torch's.

    Args:
        upstream_values: ``R``; default ``upstream(out.shape)``.

    Returns:
        One pair per grad position; an empty list when the op's value has no elements (a sum
        over zero elements is rejected at build, and there is no gradient to compare).
    """
    args = host_args(sample)
    positions = grad_positions(sample)
    b = GraphBuilder()
    ops, feeds, leaf = graph_operands(b, args, mid=False)
    out = info.fn(*ops, **sample.kwargs)
    if out.type.numel == 0:
        return []
    r = upstream(out.shape) if upstream_values is None else upstream_values.astype(np.float32)
    feeds["upstream"] = r
    loss = F.sum(out * b.input("upstream", out.shape))
    got = _run_with_grads(b, loss, feeds, leaf, positions, device)

    tops, tleaves = torch_args(args, positions)
    tloss = (info.ref(*tops, **sample.kwargs) * torch.from_numpy(r.astype(np.float64))).sum()
    tgrads = torch.autograd.grad(tloss, [tleaves[p] for p in positions], allow_unused=True)
    return [
        GradPair(p, got[f"grad{p}"], _ref_grad(tg, tleaves[p])) for p, tg in zip(positions, tgrads)
    ]


def _ref_grad(g: torch.Tensor | None, leaf: torch.Tensor) -> np.ndarray:
    return np.zeros(tuple(leaf.shape)) if g is None else _to_numpy(g)


def pow2_scale(ref: np.ndarray) -> float:
    """The power of two ``s`` with ``max|ref * s|`` in (1/2, 1] (1 for an all-zero ref)."""
    finite = np.abs(ref[np.isfinite(ref)]) if ref.size else np.zeros(0)
    m = float(finite.max()) if finite.size else 0.0
    if m == 0.0:
        return 1.0
    # Never below 2^-126: a subnormal scale is flushed to zero by GPUs (the H200 does).
    return 2.0 ** max(-math.ceil(math.log2(m)), -126)


@dataclass(frozen=True)
class MidGraphResult:
    ours: np.ndarray
    ref: np.ndarray
    grads: list[GradPair]


def run_mid_graph(
    info: OpInfo,
    sample: Sample,
    device,
    differentiable: bool | None = None,
    precision: str = "strict",
) -> MidGraphResult:
    """The op between kernels: forward ``out * s`` and gradients of ``sum(tanh(out*s) * R)``.

    Floating outputs only get the gradient part when the entry is differentiable and the
    sample has grad positions; other outputs are compared through ``cast(out, f32)``.
    """
    args = host_args(sample)
    ref = reference(info, sample)
    b = GraphBuilder()
    ops, feeds, leaf = graph_operands(b, args, mid=True)
    out = info.fn(*ops, **sample.kwargs)
    if not out.dtype.is_floating:
        b.output("scaled", F.cast(out, DType.f32))
        got = execute(b.build(), feeds, ["scaled"], device, precision)
        return MidGraphResult(got["scaled"], ref.astype(np.float64), [])

    s = pow2_scale(ref)
    scaled = b.output("scaled", out * s)
    differentiable = info.differentiable if differentiable is None else differentiable
    positions = grad_positions(sample) if differentiable and out.type.numel else ()
    if not positions:
        got = execute(b.build(), feeds, ["scaled"], device, precision)
        return MidGraphResult(got["scaled"], ref * s, [])
    r = upstream(out.shape)
    feeds["upstream"] = r
    loss = F.sum(F.tanh(scaled) * b.input("upstream", out.shape))
    got = _run_with_grads(b, loss, feeds, leaf, positions, device, precision)

    tops, tleaves = torch_args(args, positions, mid=True)
    tout = info.ref(*tops, **sample.kwargs) * s
    tloss = (torch.tanh(tout) * torch.from_numpy(r.astype(np.float64))).sum()
    tgrads = torch.autograd.grad(tloss, [tleaves[p] for p in positions], allow_unused=True)
    grads = [
        GradPair(p, got[f"grad{p}"], _ref_grad(tg, tleaves[p])) for p, tg in zip(positions, tgrads)
    ]
    return MidGraphResult(got["scaled"], _to_numpy(tout), grads)


# ---- metrics ----------------------------------------------------------------------------------
def forward_error(ours: np.ndarray, ref: np.ndarray) -> float:
    """``max|ours - ref| / max(max|ref|, 1e-30)`` over finite reference entries; ``inf`` when
    shapes differ or non-finite values (inf, NaN) are not identical on both sides."""
    ours = np.asarray(ours)
    ref = np.asarray(ref)
    if ours.shape != ref.shape:
        return math.inf
    if (ref.dtype == np.bool_) != (ours.dtype == np.bool_):
        return math.inf
    a = ours.astype(np.float64)
    r = ref.astype(np.float64)
    fa, fr = np.isfinite(a), np.isfinite(r)
    if not np.array_equal(fa, fr):
        return math.inf
    bad = ~fr
    if bad.any() and not np.array_equal(a[bad], r[bad], equal_nan=True):
        return math.inf
    if not fr.any():
        return 0.0
    scale = max(float(np.abs(r[fr]).max()), 1e-30)
    return float(np.abs(a[fr] - r[fr]).max()) / scale


def grad_errors(ours: np.ndarray, ref: np.ndarray) -> tuple[float, float] | None:
    """(cosine similarity, relative norm error), or None when both norms are below 1e-12."""
    a = np.asarray(ours, np.float64).reshape(-1)
    r = np.asarray(ref, np.float64).reshape(-1)
    if a.shape != r.shape:
        return (-math.inf, math.inf)
    if not (np.isfinite(a).all() and np.isfinite(r).all()):
        return (-math.inf, math.inf)
    na, nr = float(np.linalg.norm(a)), float(np.linalg.norm(r))
    if na < TINY_NORM and nr < TINY_NORM:
        return None
    if na == 0.0 or nr == 0.0:
        return (0.0, math.inf)
    return float(a @ r) / (na * nr), abs(na - nr) / nr


def check_forward(ours: np.ndarray, ref: np.ndarray, rtol: float, what: str = "") -> float:
    """Assert the forward error is within ``rtol``; returns it."""
    assert np.shape(ours) == np.shape(ref), f"{what}: shape {np.shape(ours)} != {np.shape(ref)}"
    err = forward_error(ours, ref)
    assert err <= rtol, (
        f"{what}: relative error {err:.3g} > {rtol:g}\n ours[:8]={np.ravel(ours)[:8]}\n"
        f" ref[:8]={np.ravel(ref)[:8]}"
    )
    return err


def check_gradients(pairs: list[GradPair], grad_cos: float, grad_rel: float, what: str = ""):
    """Assert every gradient pair meets the bounds; returns the worst (cos, rel) seen."""
    worst_cos, worst_rel = 1.0, 0.0
    for p in pairs:
        assert p.ours.shape == p.ref.shape, (
            f"{what}: grad of arg {p.position} has shape {p.ours.shape}, torch {p.ref.shape}"
        )
        e = grad_errors(p.ours, p.ref)
        if e is None:
            continue
        cos, rel = e
        worst_cos, worst_rel = min(worst_cos, cos), max(worst_rel, rel)
        assert cos >= grad_cos and rel <= grad_rel, (
            f"{what}: grad of arg {p.position}: cosine {cos:.8f} (>= {grad_cos}), norm rel "
            f"error {rel:.3g} (<= {grad_rel})\n ours[:6]={p.ours.ravel()[:6]}\n"
            f" ref[:6]={p.ref.ravel()[:6]}"
        )
    return worst_cos, worst_rel

"""Runs a meganeura module and its torch.nn twin on the same weights and inputs.

``build(name, args, kwargs)`` makes ``torch.nn.<name>(*args, **kwargs)`` and
``meganeura.nn.<name>(*args, **kwargs)``, checks that their state dicts have the same keys
(in the same order) and shapes, and loads torch's values into ours, so every later
comparison is of the computation alone. Inputs are rounded to float32 before either side sees
them. The torch side then runs in float64 (``module.double()``).

Forward: ours through compile-on-call (``ours(*arrays)``, GPU). Gradients: ours traced to a
graph (``trace_call``), ``loss = sum(out * R)`` appended for a fixed random R, differentiated
by ``meganeura.autodiff.differentiate`` and evaluated by the NumPy interpreter in float64 (no
GPU); torch's by autograd on the same loss.
"""

from __future__ import annotations

import math

import numpy as np
import torch

import meganeura.nn as mnn
from meganeura.autodiff import differentiate
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.nn.compiled import _unflatten, flatten_arguments, trace_call
from meganeura.nn.parameter import Buffer, Parameter
from meganeura.ops import functional as OF

GPU_RTOL = 1e-5  # f32 kernels against float64 torch
TINY = 1e-12  # gradients below this on both sides are zero up to float64 rounding


def build(name: str, args=(), kwargs=None):
    """(torch module, our module) with torch's state dict loaded into ours."""
    kwargs = kwargs or {}
    theirs = getattr(torch.nn, name)(*args, **kwargs)
    ours = getattr(mnn, name)(*args, **kwargs)
    check_state_dict_layout(theirs, ours)
    ours.load_state_dict({k: v.detach().numpy() for k, v in theirs.state_dict().items()})
    return theirs, ours


def check_state_dict_layout(theirs, ours) -> None:
    want = [(k, tuple(v.shape)) for k, v in theirs.state_dict().items()]
    got = [(k, tuple(v.shape)) for k, v in ours.state_dict().items()]
    assert got == want


def f32(a):
    a = np.asarray(a)
    return a.astype(np.float32) if a.dtype.kind == "f" else a


def to_torch(a, requires_grad: bool = False):
    a = np.asarray(a)
    if a.dtype.kind == "f":
        t = torch.from_numpy(a.astype(np.float64))
        return t.requires_grad_(requires_grad)
    if a.dtype.kind in "iu":
        return torch.from_numpy(a.astype(np.int64))
    return torch.from_numpy(a.copy())


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, (got.shape, want.shape)
    scale = float(np.max(np.abs(want), initial=0.0))
    diff = float(np.max(np.abs(got - want), initial=0.0))
    return diff / scale if scale > 0 else diff


def torch_kwargs(kwargs):
    return {k: to_torch(v) if isinstance(v, np.ndarray) else v for k, v in (kwargs or {}).items()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def torch_forward(theirs, arrays, kwargs=None):
    theirs.double()
    with torch.no_grad():
        out = theirs(*[to_torch(a) for a in arrays], **torch_kwargs(kwargs))
    return _numpy_tree(out)


def _numpy_tree(out):
    if isinstance(out, tuple):
        return tuple(_numpy_tree(o) for o in out)
    return None if out is None else out.detach().numpy()


def assert_close(got, want, rtol: float) -> None:
    if isinstance(want, tuple):
        assert isinstance(got, tuple) and len(got) == len(want)
        for g, w in zip(got, want, strict=True):
            assert_close(g, w, rtol)
        return
    if want is None:
        assert got is None
        return
    assert rel_err(got, want) <= rtol, rel_err(got, want)


# ---------------------------------------------------------------------------- gradients
def _interpret_feeds(ours, traced, arrays, kwargs):
    _, _, flat = flatten_arguments(ours.forward, [f32(a) for a in arrays], kwargs or {})
    feeds = {n: a for n, a in flat}
    for name in traced.trace.seeds:
        feeds[name] = np.uint32(1234)
    state = {n: o.data for n, o in traced.trace.objects.items() if isinstance(o, Buffer)}
    state.update(traced.trace.constants)
    params = {n: p.data.astype(np.float64) for n, p in traced.trace.objects.items()
              if isinstance(p, Parameter)}  # fmt: skip
    feeds = {k: (v.astype(np.float64) if v.dtype.kind == "f" else v) for k, v in feeds.items()}
    return feeds, params, state


def interpret_forward(ours, arrays, kwargs=None):
    """Our module's outputs (NumPy, float64) by the interpreter, in ``forward``'s structure."""
    kwargs = {k: f32(v) if isinstance(v, np.ndarray) else v for k, v in (kwargs or {}).items()}
    traced = trace_call(ours, ours.forward, [f32(a) for a in arrays], kwargs)
    feeds, params, state = _interpret_feeds(ours, traced, arrays, kwargs)
    vals, _, state_after = interpret(traced.graph, feeds, params, state, float64=True)
    outs = {name: vals[i] for name, i in traced.graph.outputs}
    return _unflatten(traced.output_spec, outs), state_after


def graph_gradients(ours, arrays, kwargs=None, seed: int = 7):
    """(loss, {name: gradient}, R) of ``sum(out * R)`` for our module, float64 interpreter;
    ``out`` is the (first) output. Gradients are taken with respect to every parameter the
    forward reads (by dotted name) and every floating positional input (by argument name).
    """
    kwargs = {k: f32(v) if isinstance(v, np.ndarray) else v for k, v in (kwargs or {}).items()}
    traced = trace_call(ours, ours.forward, [f32(a) for a in arrays], kwargs)
    b = GraphBuilder(traced.graph)
    outputs = dict(traced.graph.outputs)
    out = b.tensor(outputs["output.0"] if "output.0" in outputs else outputs["output"])
    r = np.random.default_rng(seed).standard_normal(out.shape)
    loss = OF.sum(out * b.input("_R", out.shape))
    b.output("_loss", loss)
    graph = b.build_unverified()
    feeds, params, state = _interpret_feeds(ours, traced, arrays, kwargs)
    feeds["_R"] = r
    float_inputs = [
        n for n, a in zip(traced.inputs, arrays, strict=False) if np.asarray(a).dtype.kind == "f"
    ]
    g2, grads = differentiate(graph, "_loss", list(params) + float_inputs)
    vals, _, _ = interpret(g2, feeds, params, state, float64=True)
    by_name = {g2.nodes[w].name: vals[gid] for w, gid in grads.items()}
    return float(vals[loss.id]), by_name, r


def torch_gradients(theirs, arrays, r, arg_names, kwargs=None):
    theirs.double()
    inputs = [to_torch(a, requires_grad=np.asarray(a).dtype.kind == "f") for a in arrays]
    out = _first(theirs(*inputs, **torch_kwargs(kwargs)))
    loss = (out * torch.from_numpy(r)).sum()
    loss.backward()
    grads = {}
    for name, p in theirs.named_parameters():
        grads[name] = np.zeros(p.shape) if p.grad is None else p.grad.numpy()
    for name, t in zip(arg_names, inputs, strict=True):
        if t.requires_grad:
            grads[name] = t.grad.numpy()
    return float(loss.detach()), grads


def check_gradients(theirs, ours, arrays, kwargs=None, rtol: float = 1e-9) -> None:
    import inspect

    arg_names = list(inspect.signature(ours.forward).parameters)[: len(arrays)]
    loss, got, r = graph_gradients(ours, arrays, kwargs)
    want_loss, want = torch_gradients(theirs, arrays, r, arg_names, kwargs)
    assert abs(loss - want_loss) <= rtol * max(1.0, abs(want_loss)), (loss, want_loss)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for k in want:
        if max(np.abs(got[k]).max(initial=0), np.abs(want[k]).max(initial=0)) < TINY:
            continue  # both zero up to rounding (a bias feeding a BatchNorm in train mode)
        assert rel_err(got[k], want[k]) <= rtol, (k, rel_err(got[k], want[k]))


def check_uniform(w, bound):
    """Values of U(-bound, bound): all within and not all zero; for a large tensor also spread
    to the edges with std bound / sqrt(3)."""
    w = np.asarray(w, np.float64)
    assert np.max(np.abs(w)) <= bound * (1 + 1e-6)
    assert np.count_nonzero(w) == w.size
    if w.size >= 200:
        assert np.max(np.abs(w)) > 0.95 * bound
        assert abs(w.std() / (bound / math.sqrt(3)) - 1) < 0.1

"""Bit-identity A/B of an attention lever through a training step: the graph (``loss =
sum(sdpa(q, k, v) * r)`` with q, k, v parameters, optionally the attention output too), the
program compiled with the lever's switch on and off, both run, every fetched value identical,
and the switch-on values against float64 torch autograd. Shared by the lever tests
(``test_attention_prefetch``, ``test_dq_delta``)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import meganeura.nn.functional as F
from meganeura.compile import CompileOptions
from meganeura.graph.builder import GraphBuilder
from meganeura.optim import HYPER_INPUT, SGD

from .harness import compile_both, run_identical


def graph(qs, ks, dv, causal, masked, out=False):
    """The training graph of a case (q shape, k shape, v head dim, is_causal, masked): a
    float ``mask`` input [Lq, Lk] when masked, ``r`` the output's weights; with ``out`` the
    attention output is an output too."""
    b = GraphBuilder()
    q, k = b.parameter("q", qs), b.parameter("k", ks)
    v = b.parameter("v", (*ks[:-1], dv))
    m = b.input("mask", (qs[2], ks[2])) if masked else None
    o = F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=causal, enable_gqa=qs[1] != ks[1]
    )
    if out:
        b.output("out", o)
    b.output("loss", F.sum(o * b.input("r", o.shape)))
    return b.build()


def run_both(gpu_device, switch, case, precision, check_programs, out=False, seed=5):
    """Compile ``case``'s step with ``switch`` on and off (``harness.compile_both``), call
    ``check_programs(on, off)``, run both: q, k, v gradients, the loss (and ``out``)
    bit-identical, and within tolerance of float64 torch autograd (1e-4 of each value's
    largest magnitude in strict precision, 3e-2 in fast). Skips fast precision on an adapter
    without shader-f16."""
    from meganeura.training import device_limits

    qs, ks, dv, causal, masked = case
    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    rng = np.random.default_rng(seed)
    params = {n: rng.standard_normal(s).astype(np.float32)
              for n, s in (("q", qs), ("k", ks), ("v", (*ks[:-1], dv)))}  # fmt: skip
    r = rng.standard_normal((*qs[:-1], dv)).astype(np.float32)
    feeds = {"r": r}
    if masked:
        feeds["mask"] = (rng.standard_normal((qs[2], ks[2])) * 0.5).astype(np.float32)
    opt = SGD(lr=0.0)
    feeds[HYPER_INPUT] = opt.hyper(0, opt.lr)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True, precision=precision)
    on, off = compile_both(switch, graph(qs, ks, dv, causal, masked, out), options, limits)
    check_programs(on, off)
    names = [*(["out"] if out else []), "q.grad", "k.grad", "v.grad", "loss"]
    got = run_identical(gpu_device, (on, off), feeds, names, params)
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()}
    mask = torch.tensor(feeds["mask"], dtype=torch.float64) if masked else None
    o = TF.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask,
                                        is_causal=causal, enable_gqa=qs[1] != ks[1])  # fmt: skip
    (o * torch.tensor(r, dtype=torch.float64)).sum().backward()
    tol = 1e-4 if precision == "strict" else 3e-2
    want = {f"{n}.grad": p.grad.numpy() for n, p in t.items()}
    if out:
        want["out"] = o.detach().numpy()
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(got[name], w, rtol=0, atol=tol * scale, err_msg=name)

"""Query-row attention loops that load the next key tile into registers while computing the
current one (``attention.lane_stream._prefetched``): the forward, its log-sum-exp and the
query gradient bit-identical to the plain loop (causal and not, GQA, a float mask, head dims
not a multiple of 4, a runtime key count including an empty row) and against float64 torch
autograd; where the prefetch applies (the WGSL) and where it does not (one tile, a short
query block, too many registers)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import meganeura.nn.functional as F
from meganeura.codegen.kernel import H200_LIMITS
from meganeura.codegen.wgsl.attention import lane_stream
from meganeura.compile import CompileOptions, compile
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.ops.attention import scaled_dot_product_attention
from meganeura.optim import HYPER_INPUT, SGD

from .harness import compile_both

# name: (q shape, k shape, v head dim, is_causal, mask); streams longer than one tile
CASES = {
    "mha": ((2, 2, 70, 16), (2, 2, 70, 16), 16, False, False),
    "gqa_causal": ((1, 4, 90, 8), (1, 2, 90, 8), 8, True, False),
    "mask_d6_dv12": ((1, 2, 37, 6), (1, 2, 81, 6), 12, False, True),
}


@pytest.fixture(autouse=True)
def restore():
    yield
    lane_stream.set_prefetch(True)


def _graph(qs, ks, dv, causal, masked):
    b = GraphBuilder()
    q, k = b.parameter("q", qs), b.parameter("k", ks)
    v = b.parameter("v", (*ks[:-1], dv))
    m = b.input("mask", (qs[2], ks[2])) if masked else None
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=m, is_causal=causal, enable_gqa=qs[1] != ks[1]
    )
    b.output("out", out)
    b.output("loss", F.sum(out * b.input("r", out.shape)))
    return b.build()


def _prefetching(program) -> list[str]:
    """Names of the dispatches whose WGSL declares prefetch registers."""
    return [d.name for d in program.dispatches if "var ke0v: vec4<f32>;" in d.wgsl]


@pytest.mark.gpu
@pytest.mark.parametrize("case", CASES.values(), ids=CASES.keys())
@pytest.mark.parametrize("precision", ["strict", "fast"])
def test_forward_and_gradients_bit_identical_and_match_torch(gpu_device, case, precision):
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    qs, ks, dv, causal, masked = case
    limits = device_limits(gpu_device)
    if precision == "fast" and not limits.shader_f16:
        pytest.skip("the adapter has no shader-f16")
    rng = np.random.default_rng(5)
    params = {n: rng.standard_normal(s).astype(np.float32)
              for n, s in (("q", qs), ("k", ks), ("v", (*ks[:-1], dv)))}  # fmt: skip
    r = rng.standard_normal((*qs[:-1], dv)).astype(np.float32)
    feeds = {"r": r}
    if masked:
        feeds["mask"] = (rng.standard_normal((qs[2], ks[2])) * 0.5).astype(np.float32)
    opt = SGD(lr=0.0)
    feeds[HYPER_INPUT] = opt.hyper(0, opt.lr)
    options = CompileOptions(loss="loss", optimizer=opt, output_grads=True, precision=precision)
    graph = _graph(qs, ks, dv, causal, masked)
    on, off = compile_both(lane_stream.set_prefetch, graph, options, limits)
    # the forward and the query gradient prefetch; the key-row gradients stream queries
    kinds = sorted(n.split()[-1] for n in _prefetching(on))
    assert kinds and set(kinds) <= {"fwd", "fwd+lse", "dq", "dq+delta"}, kinds
    assert any(k.startswith("fwd") for k in kinds) and any(k.startswith("dq") for k in kinds)
    assert not _prefetching(off)
    names = ["out", "q.grad", "k.grad", "v.grad", "loss"]
    got = []
    for program in (on, off):
        with Session(program, gpu_device) as s:
            s.load_state_dict(params)
            got.append(s.run(feeds, names))
    for name in names:
        np.testing.assert_array_equal(got[0][name], got[1][name], err_msg=name)
    t = {n: torch.tensor(a, dtype=torch.float64, requires_grad=True) for n, a in params.items()}
    mask = torch.tensor(feeds["mask"], dtype=torch.float64) if masked else None
    out = TF.scaled_dot_product_attention(t["q"], t["k"], t["v"], attn_mask=mask,
                                          is_causal=causal, enable_gqa=qs[1] != ks[1])  # fmt: skip
    (out * torch.tensor(r, dtype=torch.float64)).sum().backward()
    tol = 1e-4 if precision == "strict" else 3e-2
    want = {"out": out.detach().numpy(), **{f"{n}.grad": p.grad.numpy() for n, p in t.items()}}
    for name, w in want.items():
        scale = float(np.max(np.abs(w)))
        np.testing.assert_allclose(got[0][name], w, rtol=0, atol=tol * scale, err_msg=name)


def _kv_length_graph(lq, lk, causal):
    b = GraphBuilder()
    q = b.input("q", (2, 4, lq, 8))
    k, v = b.input("k", (2, 2, lk, 8)), b.input("v", (2, 2, lk, 8))
    kvl = b.input("kvl", (2,), DType.i32)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, kv_length=kvl)
    b.output("out", out)
    return b.build()


@pytest.mark.gpu
@pytest.mark.parametrize("causal", [False, True], ids=["full", "causal"])
def test_runtime_key_count_bit_identical(gpu_device, causal):
    """A forward whose key loop stops at a runtime count: 0 keys (the prefetch before the
    loop must not read), a count inside the first tile, one past several tiles."""
    from meganeura.runtime import Session
    from meganeura.training import device_limits

    lq, lk = 12, 100
    on, off = compile_both(lane_stream.set_prefetch, _kv_length_graph(lq, lk, causal),
                           CompileOptions(), device_limits(gpu_device))  # fmt: skip
    assert _prefetching(on) and not _prefetching(off)
    rng = np.random.default_rng(8)
    feeds = {"q": rng.standard_normal((2, 4, lq, 8)).astype(np.float32),
             "k": rng.standard_normal((2, 2, lk, 8)).astype(np.float32),
             "v": rng.standard_normal((2, 2, lk, 8)).astype(np.float32)}  # fmt: skip
    for lengths in ([0, 5], [lk, 77]):
        feeds["kvl"] = np.asarray(lengths, np.int32)
        got = []
        for program in (on, off):
            with Session(program, gpu_device) as s:
                got.append(s.run(feeds, ["out"])["out"])
        np.testing.assert_array_equal(got[0], got[1], err_msg=str(lengths))
        assert np.isfinite(got[0]).all()
        if lengths[0] == 0:
            assert not got[0][0].any()  # a row with no key writes zeros


def test_where_it_applies():
    """Whisper's encoder self-attention (1500 keys, 16-entry tiles: 8 vec4 registers a
    thread) prefetches on the H200's limits; SmolLM2's 128-token forward (32-entry tiles: 16
    registers) and a one-tile stream do not; the switch turns it off."""

    def fwd(lq, lk, d):
        b = GraphBuilder()
        q, k, v = (b.input(n, (1, 6, n_, d)) for n, n_ in (("q", lq), ("k", lk), ("v", lk)))
        b.output("o", F.scaled_dot_product_attention(q, k, v))
        return compile(b.build(), CompileOptions(), H200_LIMITS)

    assert _prefetching(fwd(1500, 1500, 64))
    assert not _prefetching(fwd(128, 128, 64))
    assert not _prefetching(fwd(64, 16, 64))
    lane_stream.set_prefetch(False)
    assert not _prefetching(fwd(1500, 1500, 64))

"""MultiheadAttention against torch.nn.MultiheadAttention: state-dict layout, outputs and
attention weights (NumPy interpreter in float64, and a few on the GPU), gradients, errors."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn as mnn
from meganeura.nn.compiled import trace_call

from .harness import (
    GPU_RTOL,
    assert_close,
    build,
    check_gradients,
    check_uniform,
    f32,
    interpret_forward,
    torch_forward,
)

rng = np.random.default_rng(9)

E, H, N, L, S = 8, 2, 2, 3, 4
PAD = np.array([[False, False, True, False], [False, True, True, False]])
CAUSAL = np.triu(np.ones((L, L), bool), 1)


def _r(*shape):
    return f32(rng.standard_normal(shape))


def _self_bf():
    x = _r(N, L, E)
    return [x, x, x]


def _self_seq():
    x = _r(L, N, E)
    return [x, x, x]


# (id, constructor kwargs, inputs, forward kwargs): forward kwargs are made per test, so the
# random masks come from the test's own generator.
CASES = [
    ("self-batch_first", {"batch_first": True}, _self_bf, lambda: {}),
    ("self-seq_first-no_weights", {}, _self_seq, lambda: {"need_weights": False}),
    ("cross-bool_padding_mask", {"batch_first": True},
     lambda: [_r(N, L, E), _r(N, S, E), _r(N, S, E)], lambda: {"key_padding_mask": PAD}),
    ("cross-padding_mask-no_weights", {"batch_first": True},
     lambda: [_r(N, L, E), _r(N, S, E), _r(N, S, E)],
     lambda: {"key_padding_mask": PAD, "need_weights": False}),
    ("cross-float_mask-no_weights", {"batch_first": True},
     lambda: [_r(N, L, E), _r(N, S, E), _r(N, S, E)],
     lambda: {"attn_mask": _r(L, S), "need_weights": False}),
    ("kdim_vdim-per_head_weights", {"batch_first": True, "kdim": 5, "vdim": 3},
     lambda: [_r(N, L, E), _r(N, S, 5), _r(N, S, 3)], lambda: {"average_attn_weights": False}),
    ("bias_kv-zero_attn-masks", {"add_bias_kv": True, "add_zero_attn": True},
     lambda: [_r(L, N, E), _r(S, N, E), _r(S, N, E)],
     lambda: {"attn_mask": np.triu(np.ones((L, S), bool), 1), "key_padding_mask": PAD}),
    ("unbatched-3d_mask", {}, lambda: [_r(L, E), _r(S, E), _r(S, E)],
     lambda: {"attn_mask": _r(H, L, S)}),
    ("causal_hint-no_weights", {"batch_first": True}, _self_bf,
     lambda: {"attn_mask": CAUSAL, "is_causal": True, "need_weights": False}),
    ("no_bias-batch_heads_mask", {"bias": False},
     lambda: [_r(L, N, E), _r(S, N, E), _r(S, N, E)], lambda: {"attn_mask": _r(N * H, L, S)}),
]  # fmt: skip
PARAMS = [pytest.param(kw, inputs, fkw, id=cid) for cid, kw, inputs, fkw in CASES]


@pytest.mark.parametrize("kwargs, inputs, forward_kwargs", PARAMS)
def test_forward_matches_torch(kwargs, inputs, forward_kwargs):
    theirs, ours = build("MultiheadAttention", (E, H), kwargs)
    xs, fkw = inputs(), forward_kwargs()
    got, _ = interpret_forward(ours, xs, fkw)
    want = torch_forward(theirs, xs, fkw)
    assert (got[1] is None) == (want[1] is None)
    assert_close(got, want, 1e-10)


@pytest.mark.parametrize("kwargs, inputs, forward_kwargs", PARAMS)
def test_gradients_match_torch(kwargs, inputs, forward_kwargs):
    theirs, ours = build("MultiheadAttention", (E, H), kwargs)
    check_gradients(theirs, ours, inputs(), forward_kwargs())


GPU_CASES = ("self-batch_first", "cross-padding_mask-no_weights", "bias_kv-zero_attn-masks")


@pytest.mark.parametrize("kwargs, inputs, forward_kwargs", [p for p in PARAMS if p.id in GPU_CASES])
def test_forward_on_gpu_matches_torch(gpu_device, kwargs, inputs, forward_kwargs):
    theirs, ours = build("MultiheadAttention", (E, H), kwargs)
    xs, fkw = inputs(), forward_kwargs()
    assert_close(ours(*xs, **fkw), torch_forward(theirs, xs, fkw), GPU_RTOL)


def test_self_attention_inside_a_model():
    """Inside a trace query is key is value: one packed [*, 3E] in-projection matmul, as
    PyTorch's; a NumPy mask written in forward becomes a constant of the graph."""
    theirs, ours = build("MultiheadAttention", (E, H), {"batch_first": True})

    class Self(mnn.Module):
        def __init__(self):
            super().__init__()
            self.attn = ours

        def forward(self, x):
            return self.attn(x, x, x, attn_mask=CAUSAL, need_weights=False)[0]

    model = Self()
    x = _r(N, L, E)
    traced = trace_call(model, model.forward, [x], {})
    assert sum(n.op == "matmul" for n in traced.graph.nodes) == 2  # in_proj and out_proj
    got, _ = interpret_forward(model, [x])
    want = torch_forward(theirs, [x, x, x], {"attn_mask": CAUSAL, "need_weights": False})[0]
    assert_close(got, want, 1e-10)


def test_state_dict_names_with_separate_projections():
    ours = mnn.MultiheadAttention(E, H, kdim=5, vdim=3, add_bias_kv=True)
    theirs = torch.nn.MultiheadAttention(E, H, kdim=5, vdim=3, add_bias_kv=True)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert "in_proj_weight" not in ours.state_dict()
    assert repr(ours) == repr(theirs)


def test_multihead_attention_init():
    mn.manual_seed(3)
    e = 32
    m = mnn.MultiheadAttention(e, 4, add_bias_kv=True)
    check_uniform(m.in_proj_weight.data, math.sqrt(6 / (e + 3 * e)))  # xavier_uniform_ of [3E, E]
    np.testing.assert_array_equal(m.in_proj_bias.data, 0)
    np.testing.assert_array_equal(m.out_proj.bias.data, 0)
    check_uniform(m.out_proj.weight.data, 1 / math.sqrt(e))  # Linear's own init
    bias_k = np.concatenate([m.bias_k.data.ravel(), m.bias_v.data.ravel()])
    assert abs(bias_k.std() * math.sqrt(e) - 1) < 0.3  # xavier_normal_ of [1, 1, E]
    sep = mnn.MultiheadAttention(e, 4, kdim=16, vdim=8)
    check_uniform(sep.k_proj_weight.data, math.sqrt(6 / (e + 16)))


def test_errors():
    ours = mnn.MultiheadAttention(E, H)
    with pytest.raises(ValueError, match="divisible by num_heads"):
        mnn.MultiheadAttention(E, 3)
    x = _r(L, N, E)
    with pytest.raises(RuntimeError, match="Need attn_mask"):
        trace_call(ours, ours.forward, [x, x, x], {"is_causal": True})
    with pytest.raises(ValueError, match="embedding dimension"):
        y = _r(L, N, E + 1)
        trace_call(ours, ours.forward, [y, y, y], {})
    with pytest.raises(ValueError, match="2D attn_mask"):
        trace_call(ours, ours.forward, [x, x, x], {"attn_mask": _r(L, L + 1)})


def test_dropout_in_train_mode_drops_attention_weights():
    """Train mode with dropout: each returned weight is 0 or the eval weight / (1 - p), and
    the output is those weights applied to the values (PyTorch returns the dropped weights)."""
    mn.manual_seed(4)
    ours = mnn.MultiheadAttention(E, H, dropout=0.5, batch_first=True)
    xs = [_r(N, L, E), _r(N, S, E), _r(N, S, E)]
    kw = {"average_attn_weights": False}
    (_, dropped), _ = interpret_forward(ours, xs, kw)
    ours.eval()
    (_, full), _ = interpret_forward(ours, xs, kw)
    kept = dropped != 0
    assert 0 < kept.mean() < 1
    np.testing.assert_allclose(dropped[kept], full[kept] / 0.5, rtol=1e-12)

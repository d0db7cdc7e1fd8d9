"""``passes.ranges``: which values the fast mode keeps in f32 because they may leave f16's
range, and a pin that the common models' training steps still narrow every activation the
other rules allow (so a later range rule cannot silently turn the fast mode off). No GPU."""

from __future__ import annotations

import math

import numpy as np
import pytest

from meganeura import nn
from meganeura.compile import CompileOptions, _training_graph
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.models.convnet import build_convnet
from meganeura.models.mlp import build_mlp
from meganeura.models.transformer import TransformerConfig, build_transformer
from meganeura.models.unet import TINY, UNet
from meganeura.ops import elementwise as E
from meganeura.ops import functional as F
from meganeura.optim import AdamW
from meganeura.passes import cse, dce, fold_permutes
from meganeura.passes.precision import narrow_storage
from meganeura.passes.ranges import degrees


def _dtypes(build):
    """{output name: storage dtype of the value named, after narrowing} for a graph whose
    outputs are ``tanh(v) * 1`` wrappers, so each named value is an intermediate."""
    b = GraphBuilder()
    x = b.input("x", (4, 8))
    w = b.parameter("w", (8, 8))
    named = build(x @ w)
    for name, t in named.items():
        b.output(name, F.tanh(t) * 1.0)  # consumers, so the value itself is not an output
    g = b.build()
    plan, _ = narrow_storage(g, parameters=True)
    return {name: plan[t.node.id].type.dtype for name, t in named.items()}, degrees(g), named


def test_squares_exponentials_and_pow_stay_f32_bounded_values_narrow():
    def build(h):
        m = F.amax(h, 1, keepdim=True)
        e = F.exp(h - m)  # stable softmax by hand: exp of a value <= 0
        var = F.mean((h - F.mean(h, 1, keepdim=True)) ** 2, 1, keepdim=True)
        return {
            "h": h,
            "square": h * h,
            "pow3": E.pow(h, 3.0),
            "exp": F.exp(h),
            "exp_sum": F.sum(F.exp(h), 1) + 1.0,
            "stable_exp": e,
            "softmax_by_hand": e / F.sum(e, 1, keepdim=True),
            "tanh_of_square": F.tanh(h * h),
            "normalized": (h - F.mean(h, 1, keepdim=True)) * E.rsqrt(var + 1e-5),
            "rms_by_hand": h / F.sqrt(F.mean(h * h, 1, keepdim=True)),
            "scaled_up": h * 1e5,
            "scaled_down": h * 1e-3,
            "log_of_square": F.log(h * h + 1.0),
            "consumer_of_square": h * h + h,
        }

    dt, deg, named = _dtypes(build)
    wide = {k for k, v in dt.items() if v is DType.f32}
    assert wide == {"square", "pow3", "exp", "exp_sum", "scaled_up", "consumer_of_square"}
    assert deg[named["square"].node.id] == 2 and deg[named["pow3"].node.id] == 3
    assert math.isinf(deg[named["exp"].node.id])
    assert deg[named["softmax_by_hand"].node.id] == 0  # exp(x - amax) in (0, 1], / its sum


@pytest.mark.parametrize("n, wide", [(256, False), (4096, True)])
def test_a_sum_counts_its_terms(n, wide):
    b = GraphBuilder()
    x = b.input("x", (2, n))
    s = F.sum(x * 1.0, 1, keepdim=True)  # kept f32 as a sum; its consumer is the question
    t = s * 2.0
    b.output("y", F.tanh(t) * 1.0)
    plan, _ = narrow_storage(b.build())
    assert (plan[t.node.id].type.dtype is DType.f32) == wide


def _passes(g, master):
    for rewrite in (fold_permutes, dce, cse, dce):
        g, id_map = rewrite(g)
        master = frozenset(id_map[i] for i in master if i in id_map)
    return g, master


def _unet_graph():
    model = UNet(TINY)
    x = np.zeros((1, 4, 16, 16), np.float32)
    return nn.trace(model, x, x, fn=lambda x, y: {"loss": F.mse_loss(model(x), y)})


# (graph, how many values the range rule keeps f32 that the other rules would narrow)
MODELS = {
    "mlp": (lambda: build_mlp(64).graph, 0),
    "transformer": (lambda: build_transformer(2, 32, TransformerConfig()).graph, 0),
    "convnet": (lambda: build_convnet(16).graph, 0),
    "unet": (_unet_graph, 1),  # mse_loss's squared residual, (out - y) ** 2
}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_common_training_steps_narrow_what_they_narrowed(name):
    """The range rule keeps almost nothing of these models' AdamW steps in f32 that the
    other rules narrow: every activation and activation gradient is still stored f16, and
    the only exception is a square of a difference of activations (a loss's)."""
    build, n_wide = MODELS[name]
    g, master = _training_graph(build(), CompileOptions(loss="loss", optimizer=AdamW(lr=1e-3)))
    g, master = _passes(g, master)
    _, half = narrow_storage(g, master)
    _, unchecked = narrow_storage(g, master, ranges=False)
    assert half <= unchecked
    kept = unchecked - half
    assert len(kept) == n_wide
    assert all(g[i].op == "mul" and g[i].inputs[0] == g[i].inputs[1] for i in kept)
    ops = {g[i].op for i in half}
    assert {"matmul"} <= ops or {"conv2d"} <= ops  # the activations themselves
    floats = [n for n in g.nodes if n.type.dtype.is_floating and n.op not in ("reshape",)]
    assert len(half) >= len(floats) // 4, (len(half), len(floats))


def test_embedding_rows_are_activations():
    """A hand-written RMSNorm of token embeddings (Llama ports write it): the square of an
    embedding row stays f32, the normalized row is f16 again."""
    from meganeura.ops.gather import embedding

    b = GraphBuilder()
    ids = b.input("ids", (2, 4), DType.i32)
    e = embedding(ids, b.parameter("emb", (16, 8)))
    sq = e * e
    normed = e * E.rsqrt(F.mean(sq, -1, keepdim=True) + 1e-6)
    b.output("y", F.tanh(normed) * 1.0)
    plan, _ = narrow_storage(b.build())
    assert plan[sq.node.id].type.dtype is DType.f32
    assert plan[e.node.id].type.dtype is DType.f16
    assert plan[normed.node.id].type.dtype is DType.f16

"""GPU-free checks of the lowering table and the emitted WGSL text."""

from __future__ import annotations

import re

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits, ValueRef
from meganeura.codegen.wgsl import LOWERINGS, lower, reads
from meganeura.codegen.wgsl.core.layout import fold_grid
from meganeura.codegen.wgsl.core.literals import f32_literal, int_literal
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.ir import PLACED_OPS, SUBRANGE_OPS, VIEW_OPS
from meganeura.ops import OPS
from meganeura.ops import functional as F
from meganeura.ops.inplace import index_copy_


def every_op_graph():
    """A graph using every lowered op at least once, with awkward constants."""
    b = GraphBuilder()
    x = b.input("x", (6, 70))
    w = b.parameter("w", (5, 70))
    t = b.input("t", (6,), DType.i32)
    hyper = b.input("hyper", (3,))
    hyper2 = F.reshape(b.input("hyper2", (1, 2)), (2,))  # a view operand
    y = x @ w.mT
    z = F.tanh(y) * 3.4028234663852886e38 + F.sigmoid(y) * -3.4028234663852886e38
    z = F.where(z > 1e-45, F.exp(z) - F.log(F.sqrt(F.relu(z) + 1.0)), -z)
    z = F.maximum(F.minimum(z, 1e30), -1e30) / 7.0
    c = F.cast(F.cast(F.less_equal(z, 0.0), DType.i32), DType.f32)
    c = c + F.cast(F.ne(z, 0.0), DType.f32) + F.cast(F.eq(z, z), DType.f32)
    c = c + F.cast(F.greater_equal(z, 0.0), DType.f32) + F.cast(F.less(z, 0.0), DType.f32)
    s = F.sum(c, 1) + F.mean(z, 1) + F.amax(z, 1)
    sm = F.softmax(F.permute(y, (1, 0)), 0) + F.log_softmax(F.broadcast_to(s, (5, 6)), 1)
    loss = F.cross_entropy(F.permute(sm, (1, 0)), t, -100)
    b.output("loss", loss)
    lg = b.add("cross_entropy_backward", [y, t, b.constant(1.0)],
               {"ignore_index": None, "reduction": "sum"})  # fmt: skip
    gw = lg.mT @ x
    clip = b.constant(1.0)
    sgd = dict(momentum=0.0, dampening=0.0, weight_decay=0.0, nesterov=False, maximize=False)
    b.add("sgd_update", [w, gw, hyper2, clip], sgd)
    w2 = b.parameter("w2", (5, 70))
    b.add("sgd_momentum_update", [w2, gw, hyper2, clip, b.state("m", (5, 70))],
          {**sgd, "momentum": 0.9})  # fmt: skip
    w3 = b.parameter("w3", (5, 70))
    adam = dict(beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.0, decoupled=False,
                maximize=False)  # fmt: skip
    b.add("adam_update", [w3, gw, hyper, clip, b.state("m3", (5, 70)), b.state("v3", (5, 70))],
          adam)  # fmt: skip
    b.add("accumulate", [b.state("w.grad_accum", (5, 70)), gw, F.reshape(hyper2, (2,))[0]])
    # the non-finite guard: found_inf over the gradients, the clip it gates, the skip count
    skipped, reset = b.state("guard.skipped", ()), F.reshape(hyper2, (2,))[1]
    found = b.add("found_inf", [gw, x])
    gated = b.add("guard_clip", [clip, skipped, reset, loss, found], {"sticky": True})
    b.add("guard_count", [skipped, gated, reset])
    b.output("neg", -F.sub(x, x))
    # an in-place write of a state that a later kernel reads (the KV cache)
    written = index_copy_(b.state("cache", (3, 70)), 0, b.input("pos", (2,), DType.i32), x[:2])
    b.output("cache_sum", F.sum(written, 1))
    return b.build_unverified()


def test_every_op_has_a_lowering():
    # row_block / row_concat (passes.split_bindings) are bindings at offsets: no kernel
    lowered = set(LOWERINGS) | VIEW_OPS | SUBRANGE_OPS | PLACED_OPS
    assert lowered == set(OPS), sorted(lowered ^ set(OPS))


def test_every_op_is_exercised_by_the_text_graph():
    # Ops added with the op database are lowered by its samples (tests/test_opinfo.py), and
    # their backward ops by its gradient tests.
    from tests.opinfo import DATABASE

    graph = every_op_graph()
    covered = {n.op for n in graph.nodes} | {op for info in DATABASE for op in info.ops}
    internal = {
        op
        for op in LOWERINGS
        if "_backward" in op or op.endswith(("_update_stats", "_stats_into", "norm_stats"))
    }
    # no longer emitted by attention's gradient rule (the forward saves its log-sum-exp); its
    # lowering has a direct test: test_attention_lse.py::test_one_pass_stats_op_matches_torch
    internal.add("scaled_dot_product_attention_stats")
    missing = set(LOWERINGS) - covered - internal
    assert not missing, sorted(missing)


def test_emitted_wgsl_never_spells_inf_or_nan_and_declares_access_right():
    graph = every_op_graph()
    for n in graph.nodes:
        for k in lower(graph, n.id, Limits()):
            assert not re.search(r"\b(inf|nan|infinity)\b", k.wgsl, re.IGNORECASE), k.name
            decl = re.findall(r"@binding\((\d+)\) var<storage, (read_write|read)>", k.wgsl)
            assert [int(i) for i, _ in decl] == list(range(len(k.bindings)))
            for (_, access), ref in zip(decl, k.bindings, strict=True):
                assert (access == "read_write") == ref.write, (k.name, ref)
            assert k.name.startswith(f"%{n.id} {n.op}")
            assert all(1 <= g <= 65535 for g in k.grid)


@pytest.mark.parametrize("v", [1.0, 1e-6, -0.5, 0.1, 3.4028234663852886e38, -1e-45, 0.0, 7])
def test_f32_literals_are_exact(v):
    lit = f32_literal(v)
    assert ("." in lit or "e" in lit) and not lit.startswith("-")
    assert np.float32(float(lit.strip("()"))) == np.float32(v)


def test_non_finite_literals_are_refused():
    for v in (float("inf"), float("-inf"), float("nan"), 1e39):
        with pytest.raises(ValueError, match="finite"):
            f32_literal(v)


def test_int_literals():
    assert int_literal(5, DType.i32) == "5i" and int_literal(-5, DType.i32) == "(-5i)"
    assert int_literal(-(2**31), DType.i32) == "(-2147483647i - 1i)"
    assert int_literal(7, DType.u32) == "7u" and int_literal(True, DType.bool) == "1u"


def test_reads():
    b = GraphBuilder()
    x = b.input("x", (4, 3))
    w = b.parameter("w", (5, 3))
    r = F.reshape(x, (3, 4))
    sg = F.stop_gradient(r)
    y = sg * 2.0  # the constant is inlined; the view resolves to the buffer's owner
    z = sg + F.reshape(x, (3, 4))  # two views of one buffer: read once
    mm = x @ w.mT
    graph = b.build_unverified()
    assert reads(graph, x.id) == () and reads(graph, r.id) == (x.id,)
    assert reads(graph, sg.id) == (r.id,)
    assert reads(graph, y.id) == (x.id,)
    assert reads(graph, z.id) == (x.id,)
    assert reads(graph, mm.id) == (x.id, w.id)
    assert lower(graph, r.id, Limits()) == [] and lower(graph, x.id, Limits()) == []


def test_reads_of_an_in_place_write_bind_the_state():
    b = GraphBuilder()
    cache = b.state("cache", (4, 3))
    pos, src = b.input("pos", (1,), DType.i32), b.input("src", (1, 3))
    w = index_copy_(cache, 0, pos, src)
    y = F.reshape(w, (3, 4)) * 2.0
    graph = b.build_unverified()
    assert reads(graph, w.id) == (cache.id, pos.id, src.id)
    assert reads(graph, y.id) == (cache.id,)  # the written value is the state's buffer
    (ks,) = lower(graph, w.id, Limits())
    assert [(r.node, r.write) for r in ks.bindings] == [
        (cache.id, True),
        (pos.id, False),
        (src.id, False),
    ]


def test_too_many_elements_is_a_value_error_naming_the_node():
    b = GraphBuilder()
    x = b.input("x", (2**16, 2**15))
    y = F.exp(x)
    graph = b.build_unverified()
    with pytest.raises(ValueError, match=r"%0 .*2\^31"):
        lower(graph, y.id, Limits())
    b = GraphBuilder()
    y = F.exp(b.input("x", (2**26,)))  # 256 MiB: over the 128 MiB default binding limit
    graph = b.build_unverified()
    with pytest.raises(ValueError, match="storage binding limit"):
        lower(graph, y.id, Limits())


def test_fold_grid():
    lim = Limits(max_workgroups_per_dimension=65535)
    assert fold_grid(65535, lim) == (65535, 1, 1)
    assert fold_grid(65536, lim) == (65535, 2, 1)
    assert fold_grid(50, Limits(max_workgroups_per_dimension=4)) == (4, 4, 4)
    with pytest.raises(ValueError):
        fold_grid(65, Limits(max_workgroups_per_dimension=4))


def test_effect_ops_write_in_place_and_bind_no_token():
    graph = every_op_graph()
    for n in graph.nodes:
        if n.op.endswith("_update"):
            (k,) = lower(graph, n.id, Limits())
            refs = [r for r in k.bindings if isinstance(r, ValueRef)]
            assert n.id not in {r.node for r in refs}
            assert refs[0] == ValueRef(n.inputs[0], write=True)

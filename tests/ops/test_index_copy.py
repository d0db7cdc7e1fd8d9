"""``index_copy_`` without a GPU: its type rule, the version rules ``verify`` keeps, the NumPy
interpreter, and what the passes, the scheduler and the planner do with an in-place write whose
value later ops read (never removed, merged, reordered or given a buffer of its own)."""

from __future__ import annotations

import re

import numpy as np
import pytest

from meganeura.codegen.kernel import Limits, ValueRef
from meganeura.codegen.wgsl.elementwise.maps import FUSIBLE
from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.graph.interpret import interpret
from meganeura.graph.verify import GraphError, verify
from meganeura.ops import functional as F
from meganeura.ops.attention import scaled_dot_product_attention
from meganeura.ops.inplace import index_copy_
from meganeura.passes.fuse import plan_fusion
from meganeura.passes.simplify import cse, dce
from meganeura.schedule.schedule import schedule

rng = np.random.default_rng(5)
CACHE = (2, 3, 8, 4)  # [B, H, max_len, D]
LIMITS = Limits(max_workgroup_storage_size=32768, max_invocations_per_workgroup=256,
                max_storage_buffer_binding_size=2**27)  # fmt: skip


def _cache_graph(t: int = 3):
    b = GraphBuilder()
    cache = b.state("cache", CACHE)
    pos = b.input("pos", (t,), i32)
    src = b.input("src", (*CACHE[:2], t, CACHE[3]))
    return b, cache, pos, src


def test_index_copy_is_typed_like_its_input():
    b, cache, pos, src = _cache_graph()
    out = index_copy_(cache, -2, pos, src)
    assert out.type == cache.type
    node = b.nodes[out.id]
    assert node.op == "index_copy_" and node.attr("dim") == 2


@pytest.mark.parametrize(
    ("case", "needle"),
    [
        pytest.param("source_shape", "source must be f32[2,3,2,4]", id="source_shape"),
        pytest.param("index_2d", "index must be 1-D", id="index_2d"),
        pytest.param("float_index", "index must be an integer tensor", id="float_index"),
        pytest.param("source_dtype", "source must be f32", id="source_dtype"),
        pytest.param("dim", "dim 4 out of range", id="dim"),
    ],
)
def test_index_copy_rejects_bad_operands(case, needle):
    b, cache, pos, src = _cache_graph(2)
    dim = 2
    if case == "source_shape":
        src = b.input("s2", (2, 3, 3, 4))
    elif case == "index_2d":
        pos = b.input("p2", (2, 1), i32)
    elif case == "float_index":
        pos = b.input("p2", (2,))
    elif case == "source_dtype":
        src = b.input("s2", (2, 3, 2, 4), i32)
    else:
        dim = 4
    with pytest.raises(GraphTypeError, match=re.escape(needle)):
        index_copy_(cache, dim, pos, src)


def test_interpreter_writes_the_state_and_returns_the_new_value():
    b, cache, pos, src = _cache_graph()
    first = index_copy_(cache, 2, pos, src)
    one = b.input("one", (1,), i32)
    row = b.input("row", (*CACHE[:2], 1, CACHE[3]))
    second = index_copy_(first, 2, one, row)
    b.output("y", second * 2.0)
    g = b.build()
    start = rng.standard_normal(CACHE).astype(np.float32)
    feeds = {
        "pos": np.array([4, 0, 6], np.int32),
        "src": rng.standard_normal((2, 3, 3, 4)).astype(np.float32),
        "one": np.array([0], np.int32),
        "row": rng.standard_normal((2, 3, 1, 4)).astype(np.float32),
    }
    vals, _, state = interpret(g, feeds, state={"cache": start})
    want = start.copy()
    want[:, :, [4, 0, 6]] = feeds["src"]
    np.testing.assert_array_equal(vals[first.id], want)
    want[:, :, [0]] = feeds["row"]  # the second write replaces row 0 again
    np.testing.assert_array_equal(vals[second.id], want)
    np.testing.assert_array_equal(state["cache"], want)
    np.testing.assert_array_equal(vals[g.output_dict["y"]], want * 2)


def test_reference_rejects_an_index_out_of_range():
    b, cache, pos, src = _cache_graph(1)
    b.output("y", index_copy_(cache, 2, pos, src))
    feeds = {"pos": np.array([8], np.int32), "src": np.zeros((2, 3, 1, 4), np.float32)}
    with pytest.raises(IndexError, match="index 8 out of range for dim 2 of size 8"):
        interpret(b.build(), feeds)


def test_verify_rejects_reading_the_old_version_after_the_write():
    b, cache, pos, src = _cache_graph()
    new = index_copy_(cache, 2, pos, src)
    b.output("new", new + 1.0)
    b.output("stale", cache + 1.0)  # reads the state after it was overwritten
    with pytest.raises(GraphError, match="older version of cache than %.*index_copy_"):
        b.build()


def test_verify_rejects_an_old_version_as_output_and_a_second_write_of_it():
    b, cache, pos, src = _cache_graph()
    index_copy_(cache, 2, pos, src)
    b.output("stale", cache)
    with pytest.raises(GraphError, match="output 'stale' reads"):
        b.build()
    b, cache, pos, src = _cache_graph()
    index_copy_(cache, 2, pos, src)
    index_copy_(cache, 2, pos, src)  # forks the state: the first write is lost
    with pytest.raises(GraphError, match="older version of cache"):
        b.build()


def test_verify_accepts_reads_before_the_write_and_chained_writes():
    b, cache, pos, src = _cache_graph()
    before = F.sum(cache)  # reads the old values, earlier in program order: fine
    new = index_copy_(index_copy_(cache, 2, pos, src), 2, pos, src * 2.0)
    b.output("y", F.reshape(new, (-1,)) + before)
    verify(b.build())


def test_verify_rejects_writing_a_value_that_is_not_state():
    b = GraphBuilder()
    x = b.input("x", CACHE)
    pos = b.input("pos", (1,), i32)
    src = b.input("src", (2, 3, 1, 4))
    b.output("y", index_copy_(x + 0.0, 2, pos, src))
    with pytest.raises(GraphError, match="only a state leaf"):
        b.build()


def test_dce_and_cse_keep_every_write():
    b, cache, pos, src = _cache_graph()
    index_copy_(cache, 2, pos, src)  # nothing reads it: kept for its effect
    g = b.build()
    g2, _ = dce(g)
    assert [n.op for n in g2.nodes].count("index_copy_") == 1
    b, cache, pos, src = _cache_graph()
    w = index_copy_(cache, 2, pos, src)
    w2 = index_copy_(w, 2, pos, src)  # the same op and operands but a different version
    b.output("y", w2)
    g3, _ = cse(b.build())
    assert [n.op for n in g3.nodes].count("index_copy_") == 2


def _attention_after_write(fuse: bool):
    b = GraphBuilder()
    cache = b.state("cache", CACHE)
    pos = b.input("pos", (1,), i32)
    src = b.input("src", (2, 3, 1, 4))
    q = b.input("q", (2, 3, 1, 4))
    kvl = b.input("kvl", (2,), i32)
    old_sum = cache * 2.0 + 1.0  # an elementwise chain over the old values
    k = index_copy_(cache, 2, pos, src)
    att = scaled_dot_product_attention(q, k * 1.0, k, kv_length=kvl)
    b.output("att", att)
    b.output("old", old_sum * 3.0)
    g = b.build()
    return g, schedule(g, LIMITS, fuse=fuse), k.id


@pytest.mark.parametrize("fuse", [False, True], ids=["unfused", "fused"])
def test_schedule_binds_the_state_and_orders_readers_after_the_write(fuse):
    g, sched, w = _attention_after_write(fuse)
    leaf = g.find("cache").id
    assert sched.root[w] == leaf and leaf in sched.pinned
    assert all(iv.key != w for iv in sched.intervals)  # no buffer of its own: no copy
    order = [nid for nid, _ in sched.dispatches]
    at = order.index(w)
    (write,) = [ks for nid, ks in sched.dispatches if nid == w]
    assert ValueRef(leaf, write=True) in write.bindings
    readers = [
        (nid, pos)
        for pos, (nid, ks) in enumerate(sched.dispatches)
        if nid != w and any(isinstance(r, ValueRef) and r.node == leaf for r in ks.bindings)
    ]
    assert any(nid > w for nid, _ in readers)  # the attention reads the written cache
    assert any(nid < w for nid, _ in readers)  # the chain over the old values reads it too
    for nid, pos in readers:  # and neither moves across the write
        assert (pos > at) == (nid > w), sched.dispatches[pos][1].name


def test_fusion_never_spans_the_write():
    g, _, w = _attention_after_write(True)
    for grp in plan_fusion(g, FUSIBLE):
        assert not grp.members[0] < w < grp.members[-1], grp


def test_fast_mode_storage_keeps_the_written_state_f32():
    from meganeura.passes.precision import narrow_storage

    g, _, w = _attention_after_write(False)
    plan, half = narrow_storage(g, parameters=True)
    assert w not in half and plan[w].type == g[w].type
    assert g.find("cache").id not in half

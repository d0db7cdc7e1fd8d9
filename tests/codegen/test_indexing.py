"""Shape and indexing ops beyond the op database: type-rule errors (no GPU), out-of-range
indices on the GPU, the deterministic scatter-add kernels at sizes the database does not
reach (more indices than a workgroup scans, vocabulary-sized embeddings, several column
blocks), grid folding, integer/bool dtypes and the kernel counts of the view-only helpers."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder, GraphTypeError
from meganeura.ops import functional as F
from meganeura.ops import gather as G
from meganeura.ops import indexing as I  # noqa: E741 - the family module, as F is functional
from meganeura.ops.gather import _index_select_backward_np

from ..ids import shape_id
from .harness import check, run

rng = np.random.default_rng(11)


# ---- type rules and argument errors (no GPU) ----------------------------------------------------
def _b():
    b = GraphBuilder()
    return b, b.input("x", (3, 7, 5)), b.input("i", (4,), DType.i32)


def test_index_tensor_must_be_integer():
    b, x, _ = _b()
    fidx = b.input("f", (3, 7, 5))
    with pytest.raises(GraphTypeError, match=r"index must be an integer tensor.*got f32\[3,7,5\]"):
        G.gather(x, 1, fidx)
    with pytest.raises(GraphTypeError, match="index must be an integer tensor"):
        G.index_select(x, 0, b.input("f1", (2,)))
    with pytest.raises(GraphTypeError, match=r"^embedding\(.* integer token ids .*got f32\[2\]"):
        G.embedding(b.input("f2", (2,)), b.parameter("w", (10, 4)))


@pytest.mark.parametrize(
    "call",
    [
        pytest.param(lambda x, i: I.slice(x, 3, 0, 1), id="slice-dim3"),
        pytest.param(lambda x, i: I.cat([x, x], -4), id="cat-dim-4"),
        pytest.param(lambda x, i: G.gather(x, 5, F.reshape(i, (1, 1, 4))), id="gather-dim5"),
        pytest.param(lambda x, i: G.index_select(x, -4, i), id="index_select-dim-4"),
        pytest.param(lambda x, i: I.split(x, 2, 3), id="split-dim3"),
        pytest.param(lambda x, i: I.unsqueeze(x, 4), id="unsqueeze-dim4"),
    ],
)
def test_dim_out_of_range_names_the_valid_range(call):
    _, x, i = _b()
    with pytest.raises(TypeError, match=r"out of range: expected -?\d <= dim < [34]"):
        call(x, i)


def test_dim_out_of_range_in_the_type_rule():
    b, x, i = _b()
    with pytest.raises(GraphTypeError, match=r"dim 3 out of range: expected 0 <= dim < 3"):
        b.add("index_select", [x, i], {"dim": 3})


def test_cat_mismatch_names_expected_and_actual():
    b, x, _ = _b()
    y = b.input("y", (3, 2, 6))
    with pytest.raises(
        TypeError, match=r"operand 1 has shape \[3, 2, 6\] where \[3, \*, 5\] is expected"
    ):
        I.cat([x, y], 1)
    with pytest.raises(TypeError, match="operand 1 has dtype i32, operand 0 f32"):
        I.cat([x, b.input("z", (3, 7, 5), DType.i32)], 0)
    with pytest.raises(GraphTypeError, match=r"operand 1 has shape \[3, 2, 6\]"):
        b.add("cat", [x, y], {"dim": 1})


def test_empty_slices_are_rejected_when_built():
    _, x, _ = _b()
    with pytest.raises(GraphTypeError, match=r"slice \[5:3:1\] of size 7 is empty"):
        I.slice(x, 1, 5, 3)
    with pytest.raises(GraphTypeError, match="is empty"):
        I.index(x, (slice(None), slice(7, None)))
    with pytest.raises(TypeError, match=r"sections \[7, 0\] must be positive"):
        I.split(x, [7, 0], 1)


def test_argument_errors():
    b, x, i = _b()
    with pytest.raises(ValueError, match="step must be positive"):
        I.index(x, slice(None, None, -1))
    with pytest.raises(IndexError, match="too many indices"):
        I.index(x, (0, 0, 0, 0))
    with pytest.raises(IndexError, match="out of bounds"):
        I.index(x, (slice(None), -8))
    with pytest.raises(NotImplementedError, match="only one integer Tensor"):
        I.index(x, (i, i))
    with pytest.raises(TypeError, match=r"sections \[3, 3\] must be positive and sum to 7"):
        I.split(x, [3, 3], 1)
    with pytest.raises(GraphTypeError, match="does not fit i32"):  # a float pad may be inf
        b.add("pad", [i], {"pad": ((1, 1),), "value": float("inf")})
    with pytest.raises(GraphTypeError, match=r"crops \[3, 7, 5\] below zero"):
        I.pad(x, (-3, -3))
    with pytest.raises(NotImplementedError, match="only 'constant'"):
        I.pad(x, (1, 1), mode="reflect")
    with pytest.raises(GraphTypeError, match=r"index size 4 exceeds the input's 3 at dim 0"):
        G.gather(x, 1, b.input("big", (4, 1, 1), DType.i32))


def test_index_builds_one_slice_node_and_free_views():
    b, x, _ = _b()
    y = I.index(x, (1, None, slice(None, None, 2), -1))
    assert y.shape == (1, 4)
    assert [n.op for n in b.nodes[2:]] == ["slice", "reshape"]
    assert I.index(x, ...) is x and I.squeeze(I.unsqueeze(x, -1)).shape == x.shape
    assert [n.op for n in b.nodes[4:]] == ["reshape", "reshape"]  # views: no kernels


# ---- out-of-range indices on the GPU --------------------------------------------------------


@pytest.mark.gpu
def test_out_of_range_indices_read_zero_and_add_no_gradient():
    b = GraphBuilder()
    x = b.input("x", (5, 3))
    i = b.input("i", (4,), DType.i32)
    gi = b.input("gi", (2, 3), DType.i32)
    sel = b.output("sel", G.index_select(x, 0, i))
    gat = b.output("gat", G.gather(x, 0, gi))
    loss = F.sum(sel) + F.sum(gat)
    graph, grads = differentiate(b.build_unverified(), loss.id, [x.id])
    b2 = GraphBuilder(graph)
    b2.output("dx", b2.tensor(grads[x.id]))
    xs = rng.standard_normal((5, 3)).astype(np.float32)
    idx = np.array([4, -1, 5, 1 << 30], np.int32)
    gidx = np.array([[0, 7, -3], [2, 2, 5]], np.int32)
    res = run(b2.build_unverified(), {"x": xs, "i": idx, "gi": gidx})
    np.testing.assert_array_equal(
        res.values[sel.id], np.stack([xs[4], 0 * xs[0], 0 * xs[0], 0 * xs[0]])
    )
    want = np.array([[xs[0, 0], 0, 0], [xs[2, 0], xs[2, 1], 0]], np.float32)
    np.testing.assert_array_equal(res.values[gat.id], want)
    dx = np.zeros((5, 3), np.float32)
    dx[4] += 1
    dx[0, 0] += 1
    dx[2, 0] += 1
    dx[2, 1] += 1
    np.testing.assert_array_equal(res.values[grads[x.id]], dx)


# ---- the scatter-add kernels at larger sizes -----------------------------------------------------
def _select_backward_graph(g_shape, k, dim, size, dtype=DType.i32):
    b = GraphBuilder()
    g = b.input("g", g_shape)
    i = b.input("i", (k,), dtype)
    out = b.output("out", b.add("index_select_backward", [g, i], {"dim": dim, "size": size}))
    return b.build(), out.id


SELECT_BACKWARD_CASES = [
    ((600, 3), 0, 7),  # K = 600 > one scan of 256, narrow rows
    ((5, 300, 2), 1, 40),  # B > 1, K > 256
    ((2, 9, 700), 1, 3),  # two column blocks of 4 x 256 columns, K <= 64
    ((70, 1), 0, 1000),  # more targets than indices: one workgroup per first occurrence
    ((2, 300, 600), 1, 1000),  # ... with K > 256, B > 1 and two column blocks
]


@pytest.mark.gpu
@pytest.mark.parametrize(
    "g_shape,dim,size",
    SELECT_BACKWARD_CASES,
    ids=[f"{shape_id(g)}-dim{d}-size{n}" for g, d, n in SELECT_BACKWARD_CASES],
)
def test_index_select_backward_accumulates_deterministically(g_shape, dim, size):
    k = g_shape[dim]
    graph, out = _select_backward_graph(g_shape, k, dim, size)
    idx = rng.integers(0, size, k).astype(np.int32)
    idx[: k // 3] = size // 2  # a heavily repeated index
    g = rng.standard_normal(g_shape).astype(np.float32)
    first = check(graph, {"g": g, "i": idx}).values[out]
    again = run(graph, {"g": g, "i": idx}).values[out]
    assert first.tobytes() == again.tobytes()
    want = _index_select_backward_np([g.astype(np.float64), idx], {"dim": dim, "size": size})
    np.testing.assert_allclose(first, want, rtol=1e-5, atol=1e-5 * np.abs(want).max())


@pytest.mark.gpu
def test_vocabulary_sized_embedding_gradient():
    """W1's shape class: 49152 rows, 128 tokens (E reduced to keep lavapipe quick)."""
    b = GraphBuilder()
    ids = b.input("ids", (1, 128), DType.u32)
    w = b.parameter("w", (49152, 24))
    emb = G.embedding(ids, w)
    loss = F.sum(emb * b.input("r", (1, 128, 24)))
    graph, grads = differentiate(b.build_unverified(), loss.id, [w.id])
    b2 = GraphBuilder(graph)
    b2.output("dw", b2.tensor(grads[w.id]))
    b2.output("emb", b2.tensor(emb.id))
    tokens = rng.integers(0, 49152, (1, 128)).astype(np.uint32)
    tokens[0, ::5] = 504
    wv = rng.standard_normal((49152, 24)).astype(np.float32)
    r = rng.standard_normal((1, 128, 24)).astype(np.float32)
    res = run(b2.build_unverified(), {"ids": tokens, "r": r}, {"w": wv})
    np.testing.assert_array_equal(res.values[emb.id], wv[tokens])
    dw = np.zeros((49152, 24))
    np.add.at(dw, tokens[0].astype(np.int64), r[0].astype(np.float64))
    np.testing.assert_allclose(res.values[grads[w.id]], dw, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
def test_small_grid_limit_folds_every_kernel():
    """Every kernel of the family with a grid limit of 7 workgroups per dimension."""
    b = GraphBuilder()
    x = b.input("x", (40, 70))
    i = b.input("i", (50,), DType.i32)
    gi = b.input("gi", (30, 70), DType.i32)
    pieces = [
        I.slice(x, 1, 1, None, 3),
        I.pad(x, (2, -1, 1, 1), value=0.5),
        I.cat([x, x, x], 0),
        G.gather(x, 0, gi),
        G.index_select(x, 0, i),
    ]
    loss = sum(F.sum(p * p) for p in pieces[1:]) + F.sum(pieces[0])
    graph, grads = differentiate(b.build_unverified(), loss.id, [x.id])
    b2 = GraphBuilder(graph)
    b2.output("dx", b2.tensor(grads[x.id]))
    feeds = {
        "x": rng.standard_normal((40, 70)).astype(np.float32),
        "i": rng.integers(0, 40, 50).astype(np.int32),
        "gi": rng.integers(0, 40, (30, 70)).astype(np.int32),
    }
    small = Limits(max_workgroups_per_dimension=7)
    res = check(b2.build_unverified(), feeds, limits=small)
    assert any(k.grid[1] > 1 for k in res.kernels if "index_select_backward" in k.name)


# ---- dtypes, kernel counts -----------------------------------------------------------------------
@pytest.mark.gpu
def test_integer_and_bool_values():
    b = GraphBuilder()
    x = b.input("x", (7, 3), DType.i32)
    m = b.input("m", (7, 3), DType.bool)
    b.output("s", I.index(x, (slice(1, None, 2), -1)))
    b.output("p", I.pad(x, (1, 1), value=-4))
    b.output("c", I.cat([x, x], 1))
    b.output("pm", I.pad(m, (0, 2), value=1))
    b.output("gm", G.index_select(m, 0, b.input("i", (2,), DType.u32)))
    feeds = {
        "x": rng.integers(-9, 9, (7, 3)).astype(np.int32),
        "m": rng.integers(0, 2, (7, 3)).astype(bool),
        "i": np.array([6, 0], np.uint32),
    }
    check(b.build(), feeds)


def test_cat_of_nine_needs_two_kernels_and_views_need_none():
    b = GraphBuilder()
    xs = [b.input(f"x{k}", (2, k + 1)) for k in range(9)]
    y = I.cat(xs, 1)
    z = I.squeeze(I.unsqueeze(y, 0))
    b.output("z", z)
    graph = b.build()
    assert len(lower(graph, y.id, Limits())) == 2
    assert lower(graph, z.id, Limits()) == []
    text = "".join(k.wgsl for n in graph.nodes for k in lower(graph, n.id, Limits()))
    assert "atomic<f32>" not in text


# ---- gradient rules of the backward ops, generated text (no GPU) ---------------------------------
def _family_graph():
    """Every op of the family once (the lead's every-op text graph can reuse this list)."""
    b = GraphBuilder()
    x = b.input("x", (6, 70))
    idx = b.input("idx", (4,), DType.i32)
    gidx = b.input("gidx", (6, 3), DType.i32)
    s = I.slice(x, 1, 1, None, 3)
    p = I.pad(s, (2, -1), value=-2.5)
    c = I.cat([x, s, p], 1)
    sel = G.index_select(c, 1, idx)
    gat = G.gather(c, 1, gidx)
    outs = [
        b.add("slice_backward", [s], {"shape": x.shape, "start": (0, 1), "step": (1, 3)}),
        b.add("index_select_backward", [sel, idx], {"dim": 1, "size": c.shape[1]}),
        b.add("gather_backward", [gat, gidx], {"dim": 1, "shape": c.shape}),
    ]
    for k, o in enumerate(outs):
        b.output(f"o{k}", o)
    return b.build()


def test_family_wgsl_text_is_bound_as_declared_and_spells_no_inf():
    import re

    graph = _family_graph()
    ops = {n.op for n in graph.nodes}
    assert ops >= {"slice", "slice_backward", "pad", "cat", "gather", "gather_backward"}
    for n in graph.nodes:
        for k in lower(graph, n.id, Limits()):
            assert not re.search(r"\b(inf|nan|infinity)\b", k.wgsl, re.IGNORECASE), k.name
            decl = re.findall(r"@binding\((\d+)\) var<storage, (read_write|read)>", k.wgsl)
            assert [a == "read_write" for _, a in decl] == [r.write for r in k.bindings]


@pytest.mark.parametrize("op", ["slice_backward", "gather_backward", "index_select_backward"])
def test_backward_ops_gradient_is_their_adjoint(op):
    """Each backward op B is linear in g; its rule must give B^T: <B(g), r> == <g, B^T(r)>."""
    from meganeura.graph.interpret import interpret

    b = GraphBuilder()
    g = b.input("g", (3, 4))
    idx = b.input("i", (3, 4), DType.i32)
    idx1 = b.input("i1", (4,), DType.i32)
    args = {
        "slice_backward": ([g], {"shape": (7, 9), "start": (1, 0), "step": (2, 2)}),
        "gather_backward": ([g, idx], {"dim": 1, "shape": (5, 6)}),
        "index_select_backward": ([g, idx1], {"dim": 1, "size": 6}),
    }[op]
    out = b.add(op, *args)
    r = b.input("r", out.shape)
    loss = b.output("loss", F.sum(out * r))
    graph, grads = differentiate(b.build_unverified(), loss.id, [g.id])
    feeds = {
        "g": rng.standard_normal((3, 4)),
        "i": rng.integers(0, 5, (3, 4)).astype(np.int32),
        "i1": np.array([5, 0, 5, 2], np.int32),
        "r": rng.standard_normal(out.shape),
    }
    vals, _, _ = interpret(graph, feeds, float64=True)
    bt_r = vals[grads[g.id]]
    np.testing.assert_allclose(np.sum(feeds["g"] * bt_r), vals[loss.id], rtol=1e-12)


@pytest.mark.gpu
@pytest.mark.parametrize("dim", [0, 1, 2], ids=lambda d: f"dim{d}")
def test_index_copy_along_each_dim_writes_the_state(dim):
    """``index_copy_`` of a state along each dim (collapsed [B, C, A] with B or A of 1), then a
    read of the written value, against the NumPy interpreter; repeated rows excluded (their
    winner is unspecified)."""
    from meganeura.ops.inplace import index_copy_

    shape = (5, 6, 7)
    index = np.array([4, 0, 2], np.int32)
    b = GraphBuilder()
    cache = b.state("cache", shape)
    pos = b.input("pos", (3,), DType.i32)
    src_shape = shape[:dim] + (3,) + shape[dim + 1 :]
    src = b.input("src", src_shape)
    b.output("y", index_copy_(cache, dim, pos, src) * 2.0)
    start = rng.standard_normal(shape).astype(np.float32)
    feeds = {"pos": index, "src": rng.standard_normal(src_shape).astype(np.float32)}
    got = check(b.build(), feeds, state={"cache": start})
    want = start.copy()
    np.moveaxis(want, dim, 0)[index] = np.moveaxis(feeds["src"], dim, 0)
    np.testing.assert_array_equal(got.state["cache"], want)

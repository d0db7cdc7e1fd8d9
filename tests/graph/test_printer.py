"""Golden test of the printed form of a small MLP graph: the format is part of the interface
(error messages quote it), so a refactor must not change it (no GPU)."""

from __future__ import annotations

from meganeura.dtypes import i32
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.ir import Graph
from meganeura.graph.printer import format_graph, format_node
from meganeura.ops import functional as F

GOLDEN = """\
%0: f32[2,4] = input name='x'
%1: i32[2] = input name='y'
%2: f32[3,4] = parameter name='fc1.weight'
%3: f32[3] = parameter name='fc1.bias'
%4: f32[5,3] = parameter name='fc2.weight'
%5: f32[4,3] = permute %2, dims=(1, 0)
%6: f32[2,3] = matmul %0, %5
%7: f32[2,3] = add %6, %3
%8: f32[2,3] = relu %7
%9: f32[3,5] = permute %4, dims=(1, 0)
%10: f32[2,5] = matmul %8, %9
%11: f32[] = constant value=0.5
%12: f32[2,5] = mul %10, %11
%13: f32[2,5] = softmax %12, dim=1
%14: f32[2,1] = mean %8, dims=(1,), keepdim=True
%15: f32[2] = reshape %14, shape=(2,)
%16: f32[] = cross_entropy %10, %1, ignore_index=None, reduction='sum'
%17: f32[] = sum %15, dims=(0,), keepdim=False
%18: f32[] = constant value=0.001
%19: f32[] = mul %17, %18
%20: f32[] = add %16, %19
return logits=%10, probs=%13, loss=%20"""


def _mlp() -> Graph:
    b = GraphBuilder()
    x = b.input("x", (2, 4))
    y = b.input("y", (2,), i32)
    w1 = b.parameter("fc1.weight", (3, 4))
    b1 = b.parameter("fc1.bias", (3,))
    w2 = b.parameter("fc2.weight", (5, 3))
    h = F.relu(F.linear(x, w1, b1))
    logits = F.linear(h, w2)
    b.output("logits", logits)
    b.output("probs", F.softmax(logits * 0.5, dim=1))
    r = F.reshape(F.mean(h, 1, keepdim=True), (2,))
    ce = F.cross_entropy(logits, y, ignore_index=None, reduction="sum")
    b.output("loss", ce + F.sum(r) * 1e-3)
    return b.build()


def test_mlp_golden():
    g = _mlp()
    assert format_graph(g) == GOLDEN
    assert str(g) == GOLDEN


def test_printing_is_stable_across_rebuilds():
    assert format_graph(_mlp()) == format_graph(_mlp())


def test_node_without_operands_or_attrs_and_graph_without_outputs():
    b = GraphBuilder()
    s = b.state("m", (7,))
    n = -s
    g = Graph(tuple(b.nodes))
    assert format_node(g.nodes[n.id]) == "%1: f32[7] = neg %0"
    assert format_graph(g) == "%0: f32[7] = state name='m'\n%1: f32[7] = neg %0"

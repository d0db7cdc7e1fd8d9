"""Eval-mode BatchNorm folded away after a convolution, for inference programs.

An eval-mode ``batch_norm(y, mean, var, gamma, beta, eps)`` is a per-channel affine map of
``y`` with fixed statistics (torch.nn.BatchNorm2d docs)::

    bn(y) = y * s + t,   s = gamma / sqrt(var + eps),   t = beta - mean * s

and when ``y = conv2d(x, w, b)`` that map is the convolution's own: ``conv2d(x, w * s[oc],
t + b * s)`` (the fold of Jacob et al. 2018, sec. 3.2, and of torch.fx's
``fuse_conv_bn_eval``). The parameters and running statistics of a compiled program are
runtime buffers (the shared parameter copy a training step writes), not host constants, so
the fold is graph arithmetic the program recomputes on every call. Two forms:

  * ``into="output"`` (the default of ``compile``): ``(conv2d(x, w, b) - mean) *
    (rsqrt(var + eps) * gamma) + beta`` with the four ``[C]`` vectors read as ``[C, 1, 1]``
    views. Every op is elementwise, so ``passes.fuse`` computes the map in the kernel of the
    ReLU or residual add that follows (in a ResNet, always): the BatchNorm's kernel and its
    pass over the activation disappear and no kernel is added. ResNet-50's eval program at
    batch 4 goes from 192 dispatches to 143.
  * ``into="weight"``: the textbook form, ``conv2d(x, w * s[:, None, None, None], t)``: the
    bias rides in the convolution's epilogue, but every call also reads and writes the whole
    weight to scale it, and computes ``s`` and ``t`` in kernels of their own: two kernels
    for the one removed, and often more bytes than the BatchNorm read (ResNet-50's last stage
    at batch 1: a 3x3 weight of 2.4M elements for an output of 25k). docs/vision.md has the
    measurements.

Invariants: only ``batch_norm`` nodes in eval mode (``training`` False, five operands) whose
input is a ``conv2d`` read by nothing else (not an output either) and whose statistics,
weight and bias are leaves (parameters, states or constants) that no effect op of the graph
writes are folded; every other node is copied unchanged, in order. The result computes the
same values up to float32 rounding (the output form: the BatchNorm kernel's own expression).
"""

from __future__ import annotations

import dataclasses
from typing import Literal

from ..graph.builder import GraphBuilder, Tensor
from ..graph.ir import Graph
from ..ops import OPS
from ..ops import functional as OF
from ..ops.elementwise import rsqrt
from .simplify import dce

LEAVES = ("parameter", "state", "constant")


def foldable_batch_norms(graph: Graph) -> list[int]:
    """Ids of the ``batch_norm`` nodes ``fold_batch_norm`` folds (see the module docstring)."""
    users = graph.users()
    outputs = {v for _, v in graph.outputs}
    written = {n.inputs[p] for n in graph.nodes if n.op in OPS for p in OPS[n.op].writes}
    found = []
    for n in graph.nodes:
        if n.op != "batch_norm" or n.attr("training") or len(n.inputs) != 5:
            continue
        conv = graph[n.inputs[0]]
        if conv.op != "conv2d" or users[conv.id] != [n.id] or conv.id in outputs:
            continue
        operands = [graph[i] for i in n.inputs[1:]]
        if any(o.op not in LEAVES or o.id in written for o in operands):
            continue
        found.append(n.id)
    return found


def fold_batch_norm(
    graph: Graph, into: Literal["output", "weight"] = "output"
) -> tuple[Graph, dict[int, int]]:
    """Fold every eval-mode ``batch_norm`` that follows a ``conv2d`` (module docstring).

    Args:
        graph: a verified inference graph (``compile`` runs this only on programs without a
            backward pass: the backward of a training graph reads the BatchNorm's input).
        into: ``"output"``: the affine map as elementwise ops on the conv's output;
            ``"weight"``: ``conv2d(x, w * s, t)``.

    Returns:
        (the rewritten graph, old id -> new id of every node kept; a folded BatchNorm maps to
        the node computing its value).

    Raises:
        ValueError: an unknown ``into``.
    """
    if into not in ("output", "weight"):
        raise ValueError(f"into must be 'output' or 'weight', got {into!r}")
    folds = set(foldable_batch_norms(graph))
    if not folds:
        return graph, {n.id: n.id for n in graph.nodes}
    moved = {graph[i].inputs[0] for i in folds} if into == "weight" else set()
    b = GraphBuilder()
    new: dict[int, int] = {}
    for n in graph.nodes:
        if n.id in moved:  # the convolution is rebuilt at its BatchNorm's position
            continue
        if n.id not in folds:
            node = dataclasses.replace(n, id=len(b.nodes), inputs=tuple(new[i] for i in n.inputs))
            b.nodes.append(node)
            if node.name is not None:
                b._names[node.name] = node.id
            new[n.id] = node.id
            continue
        out = _fold(b, graph, n.id, new, into)
        b.nodes[out.id] = dataclasses.replace(b.nodes[out.id], loc=n.loc)
        new[n.id] = out.id
    b.outputs = {k: new[v] for k, v in graph.outputs}
    folded = b.build_unverified()
    folded, ids = dce(folded)  # nothing dies; renumbers densely, as every pass returns
    return folded, {old: ids[v] for old, v in new.items() if v in ids}


def _fold(b: GraphBuilder, graph: Graph, bn_id: int, new: dict[int, int], into: str) -> Tensor:
    """Append the folded form of BatchNorm ``bn_id`` (and, ``into="weight"``, its conv)."""
    bn = graph[bn_id]
    conv = graph[bn.inputs[0]]
    mean, var, gamma, beta = (b.tensor(new[i]) for i in bn.inputs[1:])
    eps = bn.attr("eps")
    oc = conv.type.shape[1]
    if into == "output":
        # Per channel, as views [C, 1, 1]: every op below is elementwise over the conv's
        # output, so the following kernel computes them; the statistics are read, not stored.
        shape = (oc,) + (1,) * (conv.type.ndim - 2)

        def channel(t: Tensor) -> Tensor:
            return t if t.ndim == 0 else OF.reshape(t, shape)

        y = b.tensor(new[conv.id])
        scale = rsqrt(channel(var) + eps) * channel(gamma)
        return (y - channel(mean)) * scale + channel(beta)
    s = gamma * rsqrt(var + eps)  # [C]: var is [C], gamma [C] or the scalar 1.0
    t = beta - mean * s
    x, w = b.tensor(new[conv.inputs[0]]), b.tensor(new[conv.inputs[1]])
    if len(conv.inputs) == 3:  # the conv's own bias passes through the affine map too
        t = t + b.tensor(new[conv.inputs[2]]) * s
    w = w * OF.reshape(s, (oc, 1, 1, 1))
    return b.add("conv2d", [x, w, t], conv.attr_dict)

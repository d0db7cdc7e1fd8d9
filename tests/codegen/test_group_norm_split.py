"""group_norm with each group split across workgroups (``codegen/wgsl/norm/split.py``):
forward and gradients (input, weight, bias) against float64 torch autograd with the split
forced (the CPU adapter never chooses it), vec4 and scalar chunks, chunks in register and in
chunked team mode, through both team reductions; and the plan on H200-like limits."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from meganeura.autodiff import differentiate
from meganeura.codegen.kernel import Limits
from meganeura.codegen.wgsl import lower
from meganeura.codegen.wgsl.norm import split
from meganeura.codegen.wgsl.rowwise import team as rowwise
from meganeura.graph.builder import GraphBuilder
from meganeura.ops import functional as F
from meganeura.ops.norm import group_norm

from ..ids import shape_id
from .harness import device_limits, has_subgroups, run

RNG = np.random.default_rng(11)
TF = torch.nn.functional

# (shape, groups, chunks): the U-Net's [2, 64, 32, 32] with 8 and 32 groups, an odd spatial
# size (scalar units, chunks of 961 elements, a ragged team), a group of 7 x 13 channels x
# spatial split 7 ways (13 elements per chunk, fewer than a team).
CASES = [
    ((2, 64, 32, 32), 8, 8),
    ((2, 64, 32, 32), 32, 4),
    ((1, 16, 31, 31), 2, 8),
    ((2, 14, 13), 2, 7),
]


def _limits(subgroups: bool) -> Limits:
    if subgroups and not has_subgroups():
        pytest.skip("device has no subgroup feature")
    return dataclasses.replace(device_limits(), subgroups=subgroups)


def _graph(shape, groups):
    b = GraphBuilder()
    c = shape[1]
    x = b.input("x", shape)
    w, bias, up = b.input("w", (c,)), b.input("b", (c,)), b.input("up", shape)
    y = group_norm(x, groups, w, bias, eps=1e-5)
    b.output("y", y)
    loss = b.output("loss", F.sum(y * up))
    g, grads = differentiate(b.build(), loss.id, [x.id, w.id, bias.id])
    return g, y.id, grads


@pytest.mark.parametrize("subgroups", [True, False], ids=["subgroup", "tree"])
@pytest.mark.parametrize(
    "shape,groups,chunks", CASES, ids=[f"{shape_id(s)}-g{g}-p{p}" for s, g, p in CASES]
)
def test_group_norm_split(subgroups, shape, groups, chunks, monkeypatch):
    monkeypatch.setattr(split, "FORCE_CHUNKS", chunks)
    if shape[0] * shape[1] * np.prod(shape[2:]) // (groups * chunks) > 1024:
        # Chunks longer than a 32-thread team's registers: the team walks them in chunks.
        monkeypatch.setattr(rowwise, "MAX_UNITS", 2)
        monkeypatch.setattr(rowwise, "MAX_TEAM", 32)
    lim = _limits(subgroups)
    g, y_id, grads = _graph(shape, groups)
    for nd in g.nodes:
        if nd.op in ("group_norm", "group_norm_backward"):
            names = [k.name for k in lower(g, nd.id, lim)]
            assert len(names) == 2 and names[0].endswith("partial"), names
    c = shape[1]
    xs = (RNG.standard_normal(shape) * 2 + 20.0).astype(np.float32)
    ws = (1 + 0.2 * RNG.standard_normal(c)).astype(np.float32)
    bs = RNG.standard_normal(c).astype(np.float32)
    ups = RNG.standard_normal(shape).astype(np.float32)
    got = run(g, {"x": xs, "w": ws, "b": bs, "up": ups}, limits=lim)
    t = [torch.from_numpy(a).double().requires_grad_(True) for a in (xs, ws, bs)]
    ty = TF.group_norm(t[0], groups, t[1], t[2], 1e-5)
    (ty * torch.from_numpy(ups).double()).sum().backward()
    want = [ty.detach().numpy()] + [a.grad.numpy() for a in t]
    ours = [got.values[y_id]] + [got.values[grads[i]] for i in sorted(grads)]
    for name, o, w in zip(("y", "dx", "dw", "db"), ours, want, strict=True):
        np.testing.assert_allclose(o, w, rtol=1e-4, atol=2e-5 * np.abs(w).max(), err_msg=name)


H200 = Limits(max_invocations_per_workgroup=1024, subgroups=True, max_workgroup_storage_size=49152)


@pytest.mark.parametrize(
    "shape,groups,want",
    [
        ((4, 128, 64, 64), 32, 8),  # bench/bandwidth's U-Net row: 128 groups of 16384
        ((2, 256, 64, 64), 8, 64),  # 16 groups of 131072: MAX_CHUNKS chunks of 2048
        ((32, 256, 14, 14), 32, 1),  # 1024 groups already fill the GPU
        ((2, 64, 32, 32), 16, 1),  # the W5 U-Net's: too small for a second dispatch
    ],
    ids=["unet", "chunked", "resnet", "w5"],
)
def test_split_plan(shape, groups, want, monkeypatch):
    attrs = {"num_groups": groups, "eps": 1e-5}
    assert split.split_chunks(shape, attrs, H200) == 1  # off by default (slower on the H200)
    monkeypatch.setattr(split, "SPLIT", True)
    attrs = {"num_groups": groups, "eps": 1e-5}
    assert split.split_chunks(shape, attrs, H200) == want
    assert split.split_chunks(shape, attrs, dataclasses.replace(H200, cpu=True)) == 1

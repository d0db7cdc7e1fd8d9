"""scaled_dot_product_attention with a bool ``attn_mask`` (True = attend, PyTorch's
convention): it becomes ``where(mask, 0, -inf)`` in the graph, so the fused kernel and the
dropout path see the additive mask they already take. Values and gradients against torch in
float64 (NumPy interpreter), the fused kernel on the GPU, and a query row with no key to
attend, which gives zeros (PyTorch's CPU kernels too; its math path gives NaN).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.autodiff import differentiate
from meganeura.dtypes import DType
from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.ops.attention import SDPA

SHAPES = {
    "full_mask": ((2, 2, 5, 4), (2, 2, 6, 4), (2, 2, 5, 6)),
    "broadcast_mask": ((2, 2, 5, 4), (2, 2, 6, 4), (5, 6)),
    "per_batch_mask": ((2, 3, 4, 8), (2, 3, 7, 8), (2, 1, 4, 7)),
    "unbatched": ((2, 5, 4), (2, 6, 4), (5, 6)),
}


def _arrays(q_shape, k_shape, m_shape, seed=5):
    rng = np.random.default_rng(seed)
    q, k, v = (rng.standard_normal(s) for s in (q_shape, k_shape, k_shape))
    mask = rng.random(m_shape) < 0.6
    mask[..., 0] = True  # every row attends somewhere (torch gives NaN otherwise)
    return q, k, v, mask


def _graph(q, k, v, mask, **kw):
    b = GraphBuilder()
    t = [b.input(n, a.shape) for n, a in zip("qkv", (q, k, v))]
    m = b.input("mask", mask.shape, DType.bool)
    out = F.scaled_dot_product_attention(*t, attn_mask=m, **kw)
    b.output("out", out)
    b.output("loss", F.sum(out * b.input("r", out.shape)))
    return b.build_unverified(), out


@pytest.mark.parametrize("shapes", SHAPES.values(), ids=SHAPES.keys())
def test_value_and_gradients_match_torch(shapes):
    q, k, v, mask = _arrays(*shapes)
    graph, out = _graph(q, k, v, mask)
    assert SDPA in {n.op for n in graph.nodes}  # the fused op, with the additive mask
    r = np.random.default_rng(1).standard_normal(out.shape)
    g2, grads = differentiate(graph, "loss", ["q", "k", "v"])
    vals, _, _ = interpret(g2, {"q": q, "k": k, "v": v, "mask": mask, "r": r}, float64=True)

    tq, tk, tv = (torch.from_numpy(a).requires_grad_(True) for a in (q, k, v))
    want = TF.scaled_dot_product_attention(tq, tk, tv, attn_mask=torch.from_numpy(mask))
    (want * torch.from_numpy(r)).sum().backward()
    np.testing.assert_allclose(vals[graph.output_dict["out"]], want.detach().numpy(), atol=1e-12)
    by_name = {g2.nodes[w].name: vals[gid] for w, gid in grads.items()}
    for name, t in zip("qkv", (tq, tk, tv)):
        np.testing.assert_allclose(by_name[name], t.grad.numpy(), atol=1e-11, err_msg=name)


def test_a_row_with_nothing_to_attend_gives_zeros():
    q, k, v, mask = _arrays(*SHAPES["full_mask"])
    mask[1, 0, 2] = False
    graph, _ = _graph(q, k, v, mask)
    vals, _, _ = interpret(graph, {"q": q, "k": k, "v": v, "mask": mask, "r": q}, float64=True)
    out = vals[graph.output_dict["out"]]
    assert (out[1, 0, 2] == 0).all() and np.isfinite(out).all()


def test_dropout_path_takes_the_bool_mask():
    q, k, v, mask = _arrays(*SHAPES["full_mask"])
    b = GraphBuilder()
    t = [b.input(n, a.shape) for n, a in zip("qkv", (q, k, v))]
    m = b.input("mask", mask.shape, DType.bool)
    b.output("out", F.scaled_dot_product_attention(*t, attn_mask=m, dropout_p=1.0))
    vals, _, _ = interpret(b.build(), {"q": q, "k": k, "v": v, "mask": mask}, float64=True)
    assert (vals[b.build().output_dict["out"]] == 0).all()  # p = 1 drops everything


class _Attend(mn.nn.Module):
    def forward(self, q, k, v, mask):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.gpu
def test_fused_kernel_on_the_gpu(gpu_device):
    q, k, v, mask = _arrays(*SHAPES["per_batch_mask"])
    mask[0, 0, 1] = False  # a fully masked row: zeros
    got = _Attend()(*(a.astype(np.float32) for a in (q, k, v)), mask)
    tmask = torch.from_numpy(mask)
    want = TF.scaled_dot_product_attention(*(torch.from_numpy(a) for a in (q, k, v)), tmask)
    want = torch.nan_to_num(want, nan=0.0).numpy()
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
    assert (got[0, :, 1] == 0).all()

"""interpolate beyond the op database (no GPU, on the NumPy interpreter, which runs the same
f32 arithmetic as the kernels): a sweep of sizes, factors and modes against PyTorch's
float32 CPU results (nearest exactly, linear modes to f32 rounding), the cases where
PyTorch's float64 positions differ from its float32 ones, the graphs chosen for whole
factors, and the argument errors torch raises."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as TF

from meganeura.graph.builder import GraphBuilder
from meganeura.graph.interpret import interpret
from meganeura.ops.resample import interpolate, upsample_bilinear2d, upsample_nearest2d


def _run(fn, x: np.ndarray, **kw):
    b = GraphBuilder()
    y = fn(b.input("x", x.shape), **kw)
    b.output("y", y)
    graph = b.build()
    vals, _, _ = interpret(graph, {"x": x})
    return vals[y.id], {n.op for n in graph.nodes}


RESIZES = {
    "size": lambda sp: dict(size=tuple(s + 2 for s in sp)),
    "same_size": lambda sp: dict(size=sp),
    "shrink": lambda sp: dict(size=tuple(max(1, s // 2) for s in sp)),
    "sf2.5": lambda sp: dict(scale_factor=2.5),
    "sf1.3": lambda sp: dict(scale_factor=1.3),
    "sf2.2": lambda sp: dict(scale_factor=2.2),
    "sf0.6": lambda sp: dict(scale_factor=0.6),
    "sf3": lambda sp: dict(scale_factor=3),
    "sf1.3_recompute": lambda sp: dict(scale_factor=1.3, recompute_scale_factor=True),
}
MODES = {
    "nearest_1d": ("nearest", None, (7,)),
    "nearest_2d": ("nearest", None, (3, 5)),
    "nearest_3d": ("nearest", None, (3, 2, 4)),
    "linear": ("linear", False, (7,)),
    "linear_align": ("linear", True, (5,)),
    "bilinear": ("bilinear", False, (3, 5)),
    "bilinear_align": ("bilinear", True, (4, 3)),
    "trilinear": ("trilinear", False, (3, 2, 4)),
    "area": ("area", None, (6, 5)),
}


@pytest.mark.parametrize("resize", RESIZES.values(), ids=RESIZES.keys())
@pytest.mark.parametrize("mode", MODES.values(), ids=MODES.keys())
def test_matches_torch_float32(mode, resize):
    mode, align, spatial = mode
    kw = dict(resize(spatial), mode=mode, align_corners=align)
    x = np.random.default_rng(5).standard_normal((2, 3, *spatial)).astype(np.float32)
    ref = TF.interpolate(torch.from_numpy(x), **kw).numpy()
    got, _ = _run(interpolate, x, **kw)
    assert got.shape == ref.shape
    if mode == "nearest":
        np.testing.assert_array_equal(got, ref)
    else:
        np.testing.assert_allclose(got, ref, rtol=0, atol=2e-6)


@pytest.mark.parametrize("n_in,n_out", [(2, 82), (6, 74), (14, 46), (26, 22)])
def test_nearest_1d_follows_torch_float32_where_float64_differs(n_in, n_out):
    x = np.arange(n_in, dtype=np.float32).reshape(1, 1, n_in)
    ref32 = TF.interpolate(torch.from_numpy(x), size=n_out).numpy()
    ref64 = TF.interpolate(torch.from_numpy(x.astype(np.float64)), size=n_out).numpy()
    got, _ = _run(interpolate, x, size=n_out)
    np.testing.assert_array_equal(got, ref32)
    assert not np.array_equal(ref32, ref64)


def test_whole_factors_broadcast_and_fractions_gather():
    x = np.zeros((1, 2, 3, 4), np.float32)
    _, ops = _run(interpolate, x, scale_factor=(2, 3))
    assert "broadcast_to" in ops and "index_select" not in ops
    _, ops = _run(interpolate, x, scale_factor=2.2)  # 4-d: 3 -> 6 is ATen's dst // 2
    assert "broadcast_to" in ops and "index_select" not in ops
    _, ops = _run(interpolate, x, size=(5, 4))
    assert "index_select" in ops and "arange" in ops


def test_upsample_functions_accept_unbatched_input():
    x = np.random.default_rng(1).standard_normal((2, 3, 4)).astype(np.float32)
    got, _ = _run(upsample_bilinear2d, x, size=(5, 7), align_corners=True)
    ref = TF.interpolate(torch.from_numpy(x[None]), (5, 7), mode="bilinear", align_corners=True)
    np.testing.assert_allclose(got, ref[0].numpy(), atol=2e-6)
    got, _ = _run(upsample_nearest2d, x, scale_factor=1.5)
    np.testing.assert_array_equal(got, TF.interpolate(torch.from_numpy(x[None]), None, 1.5)[0])


ERRORS = {
    "both": (4, dict(size=3, scale_factor=2.0), ValueError, "exactly one"),
    "neither": (4, dict(), ValueError, "exactly one"),
    "align_nearest": (4, dict(size=3, align_corners=False), ValueError, "align_corners"),
    "bilinear_3d": (3, dict(size=3, mode="bilinear"), NotImplementedError, "needs 4D"),
    "bicubic": (4, dict(size=3, mode="bicubic"), NotImplementedError, "not supported"),
    "antialias": (4, dict(size=3, mode="bilinear", antialias=True), NotImplementedError, "anti"),
    "recompute_size": (4, dict(size=3, recompute_scale_factor=True), ValueError, "meaningful"),
    "empty": (4, dict(scale_factor=0.1), ValueError, "empty"),
    "wrong_length": (4, dict(size=(3, 4, 5)), ValueError, "2 entries"),
}


@pytest.mark.parametrize("case", ERRORS.values(), ids=ERRORS.keys())
def test_invalid_arguments_raise(case):
    ndim, kw, exc, text = case
    b = GraphBuilder()
    with pytest.raises(exc, match=text):
        interpolate(b.input("x", (1, 2, 3, 4, 5)[:ndim]), **kw)

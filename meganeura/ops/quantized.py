"""Linear layers on GGUF-quantized weights (Q8_0, Q4_1) kept packed in GPU memory.

``quantized_linear(x [..., in], qweight, scales) -> [..., out]`` is ``x @ W^T`` for the weight
``W [out, in]`` that the packed u32 arrays hold (layout: ``meganeura.ops.quant_formats``); the
kernels dequantize inside the product, so W is never materialized in f32. The weights are
frozen: they get no gradient (they are integers anyway). The gradient with respect to x,
``g @ W``, is the op ``quantized_linear_backward(g [..., out], qweight, scales) -> [..., in]``,
which dequantizes the same way; that is what LoRA fine-tuning on a quantized base needs.

Attributes of both ops: ``qtype`` ("q8_0" | "q4_1"), ``in_features``, ``out_features``.
"""

from __future__ import annotations

import numpy as np

from ..dtypes import DType
from ..graph.builder import Tensor, op_error
from ..graph.ir import TensorType
from .quant_formats import QK, dequantize_packed, qformat
from .registry import OpDef, ShapeError

QLINEAR = "quantized_linear"
QLINEAR_BWD = "quantized_linear_backward"


def _check_weights(types, attrs) -> tuple[int, int]:
    """(out_features, in_features) after checking qweight and scales against the attrs."""
    fmt = qformat(attrs["qtype"])
    out, n = attrs["out_features"], attrs["in_features"]
    if out <= 0 or n <= 0 or n % QK:
        raise ShapeError(
            f"out_features must be positive and in_features a positive multiple of {QK}, got "
            f"out_features={out}, in_features={n}"
        )
    for t, what, want in (
        (types[1], "qweight", fmt.qweight_shape(out, n)),
        (types[2], "scales", fmt.scales_shape(out, n)),
    ):
        if t.dtype not in (DType.u32, DType.i32) or t.shape != want:
            raise ShapeError(
                f"{what} of a {fmt.name} [{out}, {n}] weight must be u32{list(want)}, got {t}"
            )
    return out, n


def _qlinear_type(types, attrs):
    out, n = _check_weights(types, attrs)
    x = types[0]
    if not x.dtype.is_floating or x.ndim < 1 or x.shape[-1] != n:
        raise ShapeError(f"input must be floating [..., {n}] (in_features), got {x}")
    return TensorType(x.shape[:-1] + (out,), x.dtype)


def _qlinear_bwd_type(types, attrs):
    out, n = _check_weights(types, attrs)
    g = types[0]
    if not g.dtype.is_floating or g.ndim < 1 or g.shape[-1] != out:
        raise ShapeError(f"grad_output must be floating [..., {out}] (out_features), got {g}")
    return TensorType(g.shape[:-1] + (n,), g.dtype)


def _weight(x, a) -> np.ndarray:
    return dequantize_packed(x[1].view(np.uint32), x[2].view(np.uint32), a["qtype"])


def _qlinear_ref(x, a):
    w = _weight(x, a).astype(np.float64)
    return (x[0].astype(np.float64) @ w.T).astype(x[0].dtype)


def _qlinear_bwd_ref(x, a):
    w = _weight(x, a).astype(np.float64)
    return (x[0].astype(np.float64) @ w).astype(x[0].dtype)


def _qlinear_grad(node, i, o, g):
    attrs = {k: node.attr(k) for k in ("qtype", "in_features", "out_features")}
    return (g.builder.add(QLINEAR_BWD, [g, i[1], i[2]], attrs), None, None)


DEFS = [
    OpDef(QLINEAR, _qlinear_type, _qlinear_ref, _qlinear_grad, arity=3),
    OpDef(QLINEAR_BWD, _qlinear_bwd_type, _qlinear_bwd_ref, differentiable=False, arity=3),
]


def quantized_linear(
    x: Tensor, qweight: Tensor, scales: Tensor, qtype: str, bias: Tensor | None = None
) -> Tensor:
    """``x @ W^T (+ bias)`` for a Q8_0 or Q4_1 weight ``W [out, in]`` held packed.

    Args:
        x: floating [..., in_features].
        qweight: u32 (or i32, same bits) packed quants, [out, in/4] (q8_0) or [out, in/8]
            (q4_1) (``meganeura.ops.quant_formats.pack_blocks``).
        scales: u32 packed f16 scales, [out, ceil(in/64)] (q8_0) or [out, in/32] (q4_1).
        qtype: "q8_0" or "q4_1".
        bias: optional [out_features] of x's dtype.

    Returns:
        [..., out_features], x's dtype. Differentiable with respect to x (and bias) only.

    Raises:
        ValueError: for an unknown qtype.
        GraphTypeError: for shapes or dtypes that do not fit (naming the operand).
    """
    fmt = qformat(qtype)
    operands = [x, qweight, scales]
    if not all(isinstance(t, Tensor) for t in operands):
        raise op_error(QLINEAR, operands, None, "x, qweight and scales must be Tensors")
    if qweight.ndim != 2:
        raise op_error(QLINEAR, operands, None, f"qweight must be 2-D, got {qweight.type}")
    out, n = qweight.shape[0], qweight.shape[1] * 32 // fmt.q_words
    attrs = {"qtype": fmt.name, "in_features": n, "out_features": out}
    y = x.builder.add(QLINEAR, operands, attrs)
    return y if bias is None else y + bias

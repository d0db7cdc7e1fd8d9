"""Transposed convolution (torch.nn.functional.conv_transpose2d), as the adjoint of conv2d.

``conv_transpose2d(x, w)`` with PyTorch's weight layout ``w [C_in, C_out / groups, KH, KW]``
is by definition the gradient, with respect to its input, of a ``conv2d`` whose weight is
``w`` (that conv2d maps C_out channels to C_in): the existing ``conv2d_backward_input`` op,
with ``input_size`` the transposed convolution's output size

    OH = (H - 1) sh - 2 ph + dh (KH - 1) + oph + 1        (torch.nn.ConvTranspose2d docs)

so no zeros are inserted and no flipped kernel is materialized. ``output_padding`` extends
the bottom and right of the output and must be smaller than the stride or the dilation (as
in PyTorch). Where it is not smaller than the stride (allowed by a larger dilation), a
conv2d over the output size has more output rows than ``x``: ``x`` is first padded with
``output_padding // stride`` zero rows (columns) at the bottom (right), which add nothing.

Gradients come from ``conv2d_backward_input``'s rule: ``conv2d(g, w)`` for ``x`` and
``conv2d_backward_weight(g, x)`` for ``w``; the bias gradient is a sum.
"""

from __future__ import annotations

from collections.abc import Sequence

from ..graph.builder import GraphTypeError, Tensor
from . import functional as F
from .conv import out_size
from .indexing import pad
from .pool import pair, unbatched


def conv_transpose2d(
    input: Tensor,  # noqa: A002 - PyTorch's name
    weight: Tensor,
    bias: Tensor | None = None,
    stride: int | Sequence[int] = 1,
    padding: int | Sequence[int] = 0,
    output_padding: int | Sequence[int] = 0,
    groups: int = 1,
    dilation: int | Sequence[int] = 1,
) -> Tensor:
    """2-D transposed convolution ("deconvolution"), as torch.nn.functional.conv_transpose2d.

    Cost: one kernel, conv2d's input-gradient kernel (an implicit GEMM, as conv2d's):
    ``2 N C_in (C_out / groups) KH KW H W`` flops, the same as the conv2d whose output has
    ``x``'s shape; the backward is one such conv2d (for ``x``) and one conv2d weight
    gradient (for ``weight``), and a sum for ``bias``. A bias adds one elementwise pass
    (fused with what follows where possible). With ``output_padding >= stride``, one
    zero-pad copy of ``x`` precedes it.

    Args:
        input: floating [N, C_in, H, W] (or unbatched [C_in, H, W]).
        weight: [C_in, C_out / groups, KH, KW], input's dtype.
        bias: optional [C_out].
        stride, padding, output_padding, dilation: int or (h, w); stride, dilation >= 1,
            padding >= 0 (cropped from both sides of the full output), 0 <= output_padding
            < max(stride, dilation) per dim.
        groups: C_in and C_out both divide into this many groups.

    Returns:
        [N, C_out, OH, OW] with ``OH = (H - 1) sh - 2 ph + dh (KH - 1) + oph + 1``.

    Raises:
        ValueError: output_padding not below the stride or the dilation, an empty output, or
            inputs that are not 4-d (3-d unbatched).
        GraphTypeError: channels or groups that do not match the weight, a bias of the wrong
            shape, or mismatched dtypes.
    """
    s, p, op, d = (pair(v, n) for v, n in ((stride, "stride"), (padding, "padding"),
                   (output_padding, "output_padding"), (dilation, "dilation")))  # fmt: skip
    groups = int(groups)
    if min(s) < 1 or min(d) < 1 or min(p) < 0 or min(op) < 0 or groups < 1:
        raise ValueError(
            f"conv_transpose2d: need stride, dilation, groups >= 1 and padding, "
            f"output_padding >= 0; got stride={s}, padding={p}, output_padding={op}, "
            f"dilation={d}, groups={groups}"
        )
    if any(op[i] >= s[i] and op[i] >= d[i] for i in range(2)):
        raise ValueError(
            f"conv_transpose2d: output padding must be smaller than either stride or "
            f"dilation, got output_padding={op}, stride={s}, dilation={d}"
        )
    if weight.ndim != 4:
        raise ValueError(
            f"conv_transpose2d: weight must be [C_in, C_out/groups, KH, KW]: {weight!r}"
        )

    def run(x: Tensor) -> Tensor:
        if x.ndim != 4:
            raise ValueError(f"conv_transpose2d: input must be [N, C_in, H, W], got {x!r}")
        cin, cout_g, kh, kw = weight.shape
        problem = None
        if x.shape[1] != cin or cin % groups:
            problem = (
                f"weight {list(weight.shape)} needs {cin} input channels, divisible by "
                f"groups={groups}"
            )
        elif x.dtype is not weight.dtype:
            problem = f"input and weight dtypes differ: {x.dtype} vs {weight.dtype}"
        elif bias is not None and (bias.shape != (cout_g * groups,) or bias.dtype is not x.dtype):
            problem = f"bias must be {x.dtype}[{cout_g * groups}], got {bias!r}"
        if problem:
            raise GraphTypeError(f"conv_transpose2d({x!r}, {weight!r}): {problem}")
        k = (kh, kw)
        hw = x.shape[2:]
        out = tuple((hw[i] - 1) * s[i] - 2 * p[i] + d[i] * (k[i] - 1) + op[i] + 1 for i in range(2))
        if min(out) < 1:
            raise ValueError(f"conv_transpose2d: output size {out} of input {list(hw)} is empty")
        rows = [out_size(out[i], k[i], s[i], p[i], d[i]) for i in range(2)]
        if rows != list(hw):  # output_padding >= stride: zero rows the conv2d would read
            x = pad(x, (0, rows[1] - hw[1], 0, rows[0] - hw[0]))
        attrs = {"stride": s, "padding": p, "dilation": d, "groups": groups, "input_size": out}
        y = x.builder.add("conv2d_backward_input", [x, weight], attrs)
        return y if bias is None else y + F.reshape(bias, (bias.shape[0], 1, 1))

    return unbatched(input, 4, run)

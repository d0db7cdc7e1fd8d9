"""QuantizedLinear: a frozen linear layer whose weight stays GGUF-quantized (Q8_0 or Q4_1) in
GPU memory and is dequantized inside the product kernels (``meganeura.ops.quantized``).

State dict (packed layout: ``meganeura.ops.quant_formats``), all Buffers (not trainable):
  * q8_0: ``weight_q8`` u32 [out, in/4] (int8 quants), ``weight_d`` u32 [out, ceil(in/64)]
    (f16 block scales, two per word);
  * q4_1: ``weight_q4`` u32 [out, in/8] (4-bit quants), ``weight_dm`` u32 [out, in/32]
    (f16 block scale d and minimum m per word);
  * ``bias`` f32 [out] when ``bias=True``.
Bytes per weight: q8_0 1.0625, q4_1 0.625 (f32 Linear: 4).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from ...ops import quant_formats as qf
from ...ops.quantized import quantized_linear
from ..module import Module
from ..parameter import Buffer
from .linear import Linear

# (packed quants, packed scales) state-dict names per qtype
NAMES = {"q8_0": ("weight_q8", "weight_d"), "q4_1": ("weight_q4", "weight_dm")}


class QuantizedLinear(Module):
    """``y = x @ W^T + bias`` with W [out_features, in_features] held as GGUF Q8_0 / Q4_1
    blocks; no gradient reaches W (nor the bias: a frozen base layer for LoRA), x gets one.

    Args:
        in_features: a positive multiple of 32 (the block size).
        out_features: any positive size.
        qtype: "q8_0" or "q4_1".
        bias: add a bias Buffer [out_features] (zeros until loaded).

    The weight is zero (all-zero blocks) until loaded through ``load_state_dict``, or built
    with ``from_float`` / ``from_blocks``.

    Raises:
        ValueError: for an in_features that is not a positive multiple of 32, a non-positive
            out_features, or an unknown qtype.
    """

    def __init__(
        self, in_features: int, out_features: int, qtype: str = "q8_0", bias: bool = False
    ) -> None:
        super().__init__()
        fmt = qf.qformat(qtype)
        qf.check_in_features(int(in_features))
        if int(out_features) <= 0:
            raise ValueError(f"out_features must be positive, got {out_features}")
        self.in_features, self.out_features = int(in_features), int(out_features)
        self.qtype = fmt.name
        shape = (self.out_features, self.in_features)
        q_name, s_name = NAMES[fmt.name]
        self.register_buffer(q_name, Buffer(np.zeros(fmt.qweight_shape(*shape), np.uint32)))
        self.register_buffer(s_name, Buffer(np.zeros(fmt.scales_shape(*shape), np.uint32)))
        if bias:
            self.register_buffer("bias", Buffer(np.zeros(self.out_features, np.float32)))
        else:
            self.register_buffer("bias", None)

    @classmethod
    def from_float(cls, weight, qtype: str = "q8_0", bias=None) -> QuantizedLinear:
        """Quantize a float weight [out, in] with ggml's rules (``quant_formats``).

        Raises:
            ValueError: for a weight that is not 2-D, an in_features not a multiple of 32, an
                unknown qtype, or a bias that is not [out_features].
        """
        w = np.asarray(weight, dtype=np.float32)
        blocks = qf.quantize_blocks(w, qtype)
        return cls.from_blocks(blocks, w.shape, qtype, bias=bias)

    @classmethod
    def from_blocks(cls, blocks, shape, qtype: str, bias=None) -> QuantizedLinear:
        """Build from raw GGUF tensor data: uint8 blocks of a weight of ``shape``
        (out_features, in_features), as stored in a .gguf file (GGUF lists the dims the other
        way round, ne = [in, out]); the bytes are kept, only regrouped.

        Raises:
            ValueError: for a byte count that does not match ``shape`` and ``qtype``, an
                in_features not a multiple of 32, or a bias that is not [out_features].
        """
        out, n = (int(s) for s in shape)
        layer = cls(n, out, qtype, bias=bias is not None)
        qweight, scales = qf.pack_blocks(blocks, (out, n), layer.qtype)
        q_name, s_name = NAMES[layer.qtype]
        layer._buffers[q_name].copy_(qweight)
        layer._buffers[s_name].copy_(scales)
        if bias is not None:
            b = np.asarray(bias, dtype=np.float32)
            if b.shape != (out,):
                raise ValueError(f"bias must have shape ({out},) (out_features), got {b.shape}")
            layer._buffers["bias"].copy_(b)
        return layer

    @classmethod
    def from_gguf(cls, tensor, bias=None) -> QuantizedLinear:
        """Build from a GGUF loader's ``QuantizedTensor`` (``meganeura.io.gguf``:
        ``checkpoint.quantized(name)``, with ``ggml_type`` "Q8_0" or "Q4_1", ``shape``
        (out, in) and ``data`` its blocks).

        Raises:
            ValueError: for another ggml type (dequantize those: ``checkpoint.tensor(name)``
                and ``from_float``), or as ``from_blocks``.
        """
        return cls.from_blocks(tensor.data, tensor.shape, tensor.ggml_type, bias=bias)

    def _packed(self) -> tuple[np.ndarray, np.ndarray]:
        q_name, s_name = NAMES[self.qtype]
        return self._buffers[q_name].data, self._buffers[s_name].data

    def dequantize(self) -> np.ndarray:
        """The weight the kernels multiply by, float32 [out_features, in_features]
        (``gguf.quants.dequantize``'s values)."""
        return qf.dequantize_packed(*self._packed(), self.qtype)

    def to_blocks(self) -> np.ndarray:
        """The weight as GGUF blocks, uint8 [out_features, in_features / 32 * block bytes]."""
        return qf.unpack_blocks(*self._packed(), self.qtype)

    def forward(self, input):  # noqa: A002
        q_name, s_name = NAMES[self.qtype]
        return quantized_linear(
            input, getattr(self, q_name), getattr(self, s_name), self.qtype, self.bias
        )

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, "
            f"qtype={self.qtype}, bias={self._buffers['bias'] is not None}"
        )


def quantize_linears(
    module: Module,
    qtype: str = "q8_0",
    blocks: Callable[[str], object | None] | None = None,
    include: Callable[[str, Linear], bool] | None = None,
) -> list[str]:
    """Replace the ``Linear`` submodules of ``module`` by ``QuantizedLinear`` s, in place.

    Args:
        module: the model; its Linears with in_features a multiple of 32 are replaced (the
            others cannot be and are kept).
        qtype: the format for weights quantized here from their f32 values ("q8_0", "q4_1").
        blocks: optional ``name -> QuantizedTensor or None`` (e.g. a GGUF checkpoint's
            ``quantized``, wrapped to return None for other types): a weight given this way
            keeps the file's own blocks (``from_gguf``), its ``qtype`` whatever ``qtype`` says;
            None quantizes the Linear's current weight. ``name`` is the weight's dotted name
            (``"model.layers.0.mlp.up_proj.weight"``).
        include: optional ``(dotted module name, Linear) -> bool`` choosing which to replace.

    Returns:
        The dotted names of the replaced modules, in ``named_modules`` order. Biases are kept
        (as frozen buffers); the replaced weights are no longer parameters.
    """
    done = []
    for name, parent in list(module.named_modules()):
        for child_name, child in list(parent.named_children()):
            full = f"{name}.{child_name}" if name else child_name
            if not isinstance(child, Linear) or child.in_features % qf.QK:
                continue
            if include is not None and not include(full, child):
                continue
            bias = None if child.bias is None else child.bias.data
            tensor = blocks(f"{full}.weight") if blocks is not None else None
            if tensor is not None:
                new = QuantizedLinear.from_gguf(tensor, bias=bias)
            else:
                new = QuantizedLinear.from_float(child.weight.data, qtype, bias=bias)
            setattr(parent, child_name, new)
            done.append(full)
    return done

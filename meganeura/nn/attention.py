"""``meganeura.nn.attention``, as torch.nn.attention.bias: causal biases to pass as
``attn_mask`` of ``scaled_dot_product_attention`` (defined in ``ops.attention_bias``)."""

from ..ops.attention_bias import CausalBias, causal_lower_right, causal_upper_left

__all__ = ["CausalBias", "causal_lower_right", "causal_upper_left"]

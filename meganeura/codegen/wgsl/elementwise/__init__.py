"""Elementwise kernels: maps over broadcast operands (scalar and vec4), fused groups, dropout
and binary cross-entropy with logits."""

"""WGSL code generation: one node of a typed graph -> the compute dispatches that compute it.

``lowering`` holds the table from op to lowering function and the two entry points the
scheduler calls, ``lower`` (a node's kernels, in order) and ``reads`` (the values they bind for
reading). The emitters are grouped by the kernels they write:

  core/         the kernel builder (bindings, f16 widening, assembly), literals, strides and
                grids, and the WGSL math library (erf, log1p, tanh ... with PyTorch semantics)
  elementwise/  elementwise maps and their vec4 path, fused groups, dropout and BCE
  matmul/       plan choice (tilings, split-K, the tuned table), operand layout, the
                register-tiled and gemv kernels
  attention/    flash-attention: work plans, the lane and register-tiled ("block") kernels,
                rotary embedding
  conv/         convolutions as implicit GEMMs, pooling
  rowwise/      row-parallel scaffolding, the team-per-row archetype, softmax, cross-entropy
  norm/         layer/rms/group/batch norm on the team archetype and the general kernels
  reduce/       reductions over any dims, cumsum
  indexing/     slice, pad, cat, gathers and their scatter-add backward
  optim.py      optimizer updates, per parameter or per update group
"""

from __future__ import annotations

from ..kernel import KernelSource, Limits
from .lowering import LOWERINGS, lower, reads

__all__ = ["LOWERINGS", "lower", "reads", "Limits", "KernelSource"]

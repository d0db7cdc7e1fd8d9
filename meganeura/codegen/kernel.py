"""What a lowering returns: WGSL sources with symbolic bindings, before buffers exist.

A lowering turns one node into one or more ``KernelSource``s. Bindings name graph values by
node id (``ValueRef``) or kernel-private scratch storage (``ScratchRef``); the compiler maps
them to buffers after memory planning. Constants are inlined as literals and never bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..dtypes import DType


@dataclass(frozen=True)
class Limits:
    """Adapter limits codegen must respect (queried from the device; these defaults are
    WebGPU's guaranteed minimums except where noted)."""

    max_workgroups_per_dimension: int = 65535
    max_workgroup_storage_size: int = 16384
    max_invocations_per_workgroup: int = 256
    max_storage_buffer_binding_size: int = 134217728
    shader_f16: bool = False
    subgroups: bool = False


@dataclass(frozen=True)
class ValueRef:
    """Binding of a graph value (node id); ``write`` when the kernel stores to it."""

    node: int
    write: bool = False


@dataclass(frozen=True)
class ScratchRef:
    """Binding of kernel-private scratch: ``key`` is unique within the node's kernels;
    ``nbytes`` its size. Scratch lives from the first to the last kernel of the node."""

    key: str
    nbytes: int
    dtype: DType = DType.f32
    write: bool = True


@dataclass(frozen=True)
class KernelSource:
    """One dispatch: WGSL with entry point ``main`` whose group-0 binding i is bindings[i]."""

    name: str
    wgsl: str
    bindings: tuple[ValueRef | ScratchRef, ...]
    grid: tuple[int, int, int]
    flops: int = 0
    bytes: int = 0

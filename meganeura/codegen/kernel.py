"""What a lowering returns: WGSL sources with symbolic bindings, before buffers exist.

A lowering turns one node into one or more ``KernelSource``s. Bindings name graph values by
node id (``ValueRef``) or kernel-private scratch storage (``ScratchRef``); the compiler maps
them to buffers after memory planning. Constants are inlined as literals and never bound.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..dtypes import DType

# Generated kernels index in u32, which stays exact while every flat index (and index + one
# workgroup) is below 2^31: the most elements one bound value (or an optimizer arena) may hold.
MAX_ELEMENTS = 2**31 - 1


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
    # A binding of part of a buffer must start at a multiple of this many bytes.
    min_storage_buffer_offset_alignment: int = 256
    max_storage_buffers_per_shader_stage: int = 8
    # One buffer may be larger than one binding of it (passes.split_bindings binds row blocks).
    max_buffer_size: int = 268435456
    # The adapter is a CPU (Mesa's llvmpipe / lavapipe, WebGPU adapter type "CPU"): it runs a
    # workgroup's invocations as SIMD lanes in loops, where workgroup memory, barriers and
    # per-lane loads cost far more than on a GPU, so some kernels pick other plans there.
    cpu: bool = False
    # Matmul plans measured on this very adapter (``meganeura.tune``: the per-device tuning
    # cache, loaded by ``training.device_limits``): ((M, K, N, layout, batch), plan name) pairs,
    # sorted. Part of the Limits so that codegen reads no file and a compile stays a function of
    # (graph, options, limits).
    matmul_plans: tuple[tuple[tuple[int, int, int, str, int], str], ...] = field(
        default=(), repr=False
    )
    # Flash-attention lane plans measured on this very adapter (``bench/attention_plans.py
    # --record``, the same per-device cache's ``attention`` table, loaded by
    # ``training.device_limits``): ((mode, b, hkv, group, lq, lk, d, dv), (rows, lanes, tile))
    # pairs, sorted; ``attention.plan.choose_plan`` takes them ahead of its static table, on
    # CPU adapters too (they were measured there).
    attention_plans: tuple[
        tuple[tuple[str, int, int, int, int, int, int, int], tuple[int, int, int]], ...
    ] = field(default=(), repr=False)


# The NVIDIA H200's adapter limits (Vulkan, wgpu 0.32; design.md), to compile programs as
# the H200 compiles them without a GPU (``bench/dispatch_counts.py``, the dispatch-count tests):
# not a CPU, so the GPU's matmul plans and split-K apply. The storage-buffer count per stage is
# set high: with it the training step's counts match bench/results/llm_profile_h200.txt (one
# found_inf pass).
H200_LIMITS = Limits(
    max_workgroup_storage_size=49152,
    max_invocations_per_workgroup=1024,
    max_storage_buffer_binding_size=2**31 - 4,
    max_storage_buffers_per_shader_stage=1024,
    max_buffer_size=2**40,
    shader_f16=True,
    subgroups=True,
)


@dataclass(frozen=True)
class ValueRef:
    """Binding of a graph value (node id); ``write`` when the kernel stores to it."""

    node: int
    write: bool = False


@dataclass(frozen=True)
class ScratchRef:
    """Binding of kernel-private scratch: ``key`` is unique within the node's kernels;
    ``nbytes`` its size. Scratch lives from the first to the last kernel binding it.

    ``owner`` is the node whose scratch it is when a kernel of another node binds it (a
    consumer reading a split-K matmul's partial sums, ``matmul.deferred``); None: the node of
    the kernel itself."""

    key: str
    nbytes: int
    dtype: DType = DType.f32
    write: bool = True
    owner: int | None = None

    def slot(self, node: int) -> tuple[int, str]:
        """The scratch's identity, (owning node, key), when bound by a kernel of ``node``."""
        return (node if self.owner is None else self.owner, self.key)


@dataclass(frozen=True)
class ArenaRef:
    """Binding of a whole arena: one buffer holding several values at aligned offsets
    (``schedule.update_groups``). ``key`` names it, e.g. ``("optim", 0, "param")``."""

    key: tuple
    write: bool = False


Binding = ValueRef | ScratchRef | ArenaRef


@dataclass(frozen=True)
class KernelSource:
    """One dispatch: WGSL with entry point ``main`` whose group-0 binding i is bindings[i]."""

    name: str
    wgsl: str
    bindings: tuple[Binding, ...]
    grid: tuple[int, int, int]
    flops: int = 0
    bytes: int = 0


@dataclass(frozen=True)
class UpdateGroup:
    """Update ops lowered as one kernel over shared arenas (planned by
    ``schedule.update_groups``).

    Attributes:
        index: position among the program's groups; arena keys are ``("optim", index, role)``.
        members: update node ids, in program order.
        offsets: element offset of each member in every arena of the group.
        length: elements in each arena (last member's offset + numel).
    """

    index: int
    members: tuple[int, ...]
    offsets: tuple[int, ...]
    length: int

    def arena_key(self, role: str) -> tuple:
        """Key of the arena for ``role``: ``"param"``, ``"grad"`` or ``"state0"``, ``"state1"``."""
        return ("optim", self.index, role)

    @property
    def sink(self) -> int:
        """The member at whose position the group's kernel runs (the last one)."""
        return self.members[-1]

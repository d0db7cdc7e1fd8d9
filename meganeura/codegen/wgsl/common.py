"""Shared pieces of every WGSL emitter: literals, bindings, grid folding and index math.

Invariants kept here, so that each emitter cannot get them wrong on its own:
  * a graph value is bound at most once per kernel (reads of the same value, or of views of
    it, share one binding; a value both read and written gets one ``read_write`` binding);
  * views (``reshape``, ``stop_gradient``) are resolved to the value that owns the buffer,
    and constants are inlined as exact literals, never bound;
  * literals never spell inf or NaN (WGSL rejects them): f32 constants are printed as the exact
    decimal of their float32 value, integers with an ``i``/``u`` suffix;
  * all index math is u32, with shapes and strides baked in; every bound value has fewer than
    2^31 elements and fits the adapter's storage-binding limit, else ``ValueError`` names it;
  * a value stored as f16 (fast mode, ``passes.precision``) is bound as ``array<f16>`` and
    the kernel starts with ``enable f16;``; emitters read and write bindings only through
    ``Src.at``, ``KernelBuilder.load`` and ``KernelBuilder.store``, which widen to f32 on
    load and narrow on store, so every kernel computes and accumulates in f32
    (``compute_dtype``); binding an f16 value for an adapter without ``shader-f16`` raises
    ``ValueError``;
  * a 1-D logical grid of G workgroups is folded into up to three dimensions of at most
    ``limits.max_workgroups_per_dimension`` each; shaders rebuild the linear id and drop the
    padding groups (``linear_workgroup``).
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from ...dtypes import DType
from ...graph.ir import VIEW_OPS, Graph, Node, TensorType  # VIEW_OPS re-exported
from ..kernel import ArenaRef, KernelSource, Limits, ScratchRef, ValueRef

# u32 index math stays exact while every flat index (and index + one workgroup) is below 2^31.
MAX_ELEMENTS = 2**31 - 1
WG = 256  # default workgroup size: WebGPU guarantees 256 invocations per workgroup
# Elements per thread in one-thread-per-element kernels. Issuing the loads of several elements
# before any store lets each thread keep more memory requests in flight: a 64M-element f32
# add ran at 0.81 TB/s with one element per thread and 1.43 TB/s with four (H200, Vulkan).
PER_THREAD = 4
ENTRY_ARGS = (
    "@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, "
    "@builtin(local_invocation_index) lid: u32"
)


# ---- literals ---------------------------------------------------------------------------------
def f32_literal(value: float) -> str:
    """Exact WGSL literal of ``float32(value)``, e.g. ``1.0``, ``1e-06``, ``(-0.5)``.

    Raises:
        ValueError: for inf or NaN, which WGSL cannot spell.
    """
    with np.errstate(over="ignore"):
        v = float(np.float32(value))
    if not math.isfinite(v):
        raise ValueError(f"{value!r} is not a finite float32; WGSL has no inf/NaN literals")
    # repr of the float64 holding a float32 is its exact shortest decimal, so WGSL's
    # abstract-float -> f32 conversion is exact (no second rounding at the range edge).
    text = repr(abs(v))
    if "." not in text and "e" not in text:
        text += ".0"
    return f"(-{text})" if math.copysign(1.0, v) < 0 else text


def int_literal(value: int, dtype: DType) -> str:
    """WGSL literal of an integer in ``dtype`` (i32 wraps like NumPy's astype; bool -> 0u/1u)."""
    if dtype is DType.bool:
        return "1u" if value else "0u"
    if dtype is DType.u32:
        return f"{int(value) % 2**32}u"
    v = int(np.array(value).astype(np.int64).astype(np.int32))
    if v == -(2**31):
        return "(-2147483647i - 1i)"  # 2147483648i alone is out of range
    return f"(-{-v}i)" if v < 0 else f"{v}i"


def literal(value: float | int | bool, dtype: DType) -> str:
    """Literal of a constant node's value in its dtype."""
    if dtype.is_floating:
        return f32_literal(float(value))
    return int_literal(int(value), dtype)


def zero(dtype: DType) -> str:
    return literal(0, dtype)


def u(n: int) -> str:
    """A u32 literal for index math."""
    return f"{n}u"


# ---- graph helpers ----------------------------------------------------------------------------
def resolve_view(graph: Graph, vid: int) -> int:
    """The id of the value that owns ``vid``'s buffer (following reshape/stop_gradient)."""
    while graph[vid].op in VIEW_OPS:
        vid = graph[vid].inputs[0]
    return vid


def is_constant(graph: Graph, vid: int) -> bool:
    return graph[resolve_view(graph, vid)].op == "constant"


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))


def broadcast_strides(src: Sequence[int], out: Sequence[int]) -> tuple[int, ...]:
    """Strides to read a contiguous ``src`` broadcast (NumPy rule) to ``out``; 0 on new dims."""
    st = contiguous_strides(src)
    pad = len(out) - len(src)
    return tuple(0 if d < pad or src[d - pad] == 1 else st[d - pad] for d in range(len(out)))


def coalesce(
    shape: Sequence[int], strides: Sequence[Sequence[int]]
) -> tuple[tuple[int, ...], list[tuple[int, ...]]]:
    """Drop size-1 dims and merge neighbours that every stride list walks contiguously.

    Fewer dims means fewer divisions per element; the flat iteration order is unchanged.
    """
    dims = [(n, [s[d] for s in strides]) for d, n in enumerate(shape) if n != 1]
    merged: list[tuple[int, list[int]]] = []
    for n, st in dims:
        if merged:
            pn, pst = merged[-1]
            if all(p == q * n for p, q in zip(pst, st, strict=True)):
                merged[-1] = (pn * n, st)
                continue
        merged.append((n, st))
    out_shape = tuple(n for n, _ in merged)
    return out_shape, [tuple(st[k] for _, st in merged) for k in range(len(strides))]


def strided_index(flat: str, shape: Sequence[int], strides: Sequence[int]) -> str:
    """u32 expression of the offset of flat row-major index ``flat`` over ``shape``, read
    with ``strides`` (shape and strides baked in, so divisions are by constants)."""
    terms, inner, total = [], 1, math.prod(shape)
    flat = flat if flat.isidentifier() else f"({flat})"
    for n, s in zip(reversed(shape), reversed(strides), strict=True):
        if n != 1 and s != 0:
            coord = flat if inner == 1 else f"({flat} / {u(inner)})"
            if inner * n < total:
                coord = f"({coord} % {u(n)})"
            terms.append(coord if s == 1 else f"{coord} * {u(s)}")
        inner *= n
    return " + ".join(reversed(terms)) or "0u"


def check_numel(graph: Graph, vid: int, limits: Limits) -> None:
    """Raise ValueError when value ``vid`` cannot be indexed in u32 or bound in one binding.

    The message names the value (its user name for leaves), its type, the limit and the line
    of user code that declared it.
    """
    n = graph[vid]
    t = n.type
    label = f"%{vid} {n.name!r}" if n.name else f"%{vid}"
    where = f" (declared at {n.loc})" if n.loc else ""
    if t.numel > MAX_ELEMENTS:
        raise ValueError(
            f"{label} ({n.op}: {t}) has {t.numel} elements; u32 index math in the "
            f"generated kernels needs fewer than 2^31{where}"
        )
    if t.nbytes > limits.max_storage_buffer_binding_size:
        raise ValueError(
            f"{label} ({n.op}: {t}) needs {t.nbytes} bytes, above the adapter's "
            f"storage binding limit of {limits.max_storage_buffer_binding_size}{where}"
        )


# ---- grid -------------------------------------------------------------------------------------
def fold_grid(groups: int, limits: Limits) -> tuple[int, int, int]:
    """Spread ``groups`` workgroups over (x, y, z) within the per-dimension limit.

    Raises:
        ValueError: when even three dimensions cannot hold them.
    """
    m = limits.max_workgroups_per_dimension
    x = max(1, min(groups, m))
    y = max(1, min(-(-groups // x), m))
    z = -(-groups // (x * y))
    if z > m:
        raise ValueError(f"{groups} workgroups exceed a {m}^3 grid")
    return (x, y, max(z, 1))


def linear_workgroup(groups: int, grid: tuple[int, int, int]) -> str:
    """Statements defining ``wg``, the linear workgroup id, and dropping padding groups.

    The early return depends only on workgroup-uniform builtins, so barriers after it stay in
    uniform control flow.
    """
    x, y, z = grid
    if y == 1 and z == 1:
        return "  let wg = wid.x;\n"
    expr = "wid.x + nwg.x * wid.y" if z == 1 else "wid.x + nwg.x * (wid.y + nwg.y * wid.z)"
    check = "" if x * y * z == groups else f"  if (wg >= {u(groups)}) {{ return; }}\n"
    return f"  let wg = {expr};\n{check}"


def element_slots(
    n: int, per_thread: int = PER_THREAD
) -> tuple[str, int, Callable[[int, str], str]]:
    """Scaffolding for kernels that map ``per_thread`` elements (or vec4s) to each thread.

    Element ``e`` of a thread is ``i{e}`` (block of ``per_thread * WG`` per workgroup, strided
    by ``WG`` so each load instruction of a warp stays coalesced); ``j{e}`` is the same id
    clamped into range, safe to read from even in the last, partial block.

    Returns:
        (statements defining i0.. and j0.., workgroup count, guard) where
        ``guard(e, stmt)`` wraps a store of element e so it is skipped past the end.
    """
    block = per_thread * WG
    tail = n % block != 0
    lines = [f"  let i0 = wg * {u(block)} + lid;"]
    lines += [f"  let i{e} = i0 + {u(e * WG)};" for e in range(1, per_thread)]
    for e in range(per_thread):
        lines.append(f"  let j{e} = min(i{e}, {u(n - 1)});" if tail else f"  let j{e} = i{e};")

    def guard(e: int, stmt: str) -> str:
        return f"if (i{e} < {u(n)}) {{ {stmt} }}" if tail else stmt

    return "\n".join(lines) + "\n", -(-n // block), guard


# ---- kernels ----------------------------------------------------------------------------------
@dataclass(frozen=True)
class Src:
    """How a kernel reads one IR value: a binding name, or an inlined literal."""

    type: TensorType
    name: str | None = None
    literal: str | None = None

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def at(self, index: str) -> str:
        """WGSL expression of element ``index`` in its compute type (the literal itself for
        constants; an f16-stored value is widened to f32)."""
        if self.literal is not None:
            return self.literal
        if self.type.dtype is DType.f16:
            return f"f32({self.name}[{index}])"
        return f"{self.name}[{index}]"


def guarded_read(read: Callable[[str], str], index: str, ok: str, fill: str) -> str:
    """WGSL reading ``read(index)`` where ``ok`` holds and ``fill`` elsewhere; the index is
    selected to 0 where ``ok`` fails, so the discarded read stays inside its binding (shader
    modules may be created without naga's bounds checks, ``runtime/pipelines.py``).

    Args:
        read: index expression -> load expression (``Src.at``, a vec4 read ...).
        index: u32 index expression, possibly out of range where ``ok`` is false.
        ok: bool expression.
        fill: the value where ``ok`` is false, of the load's type.
    """
    return f"select({fill}, {read(f'select(0u, {index}, {ok})')}, {ok})"


# storage element type -> the compute type it is widened to on load
_WIDEN = {"f16": "f32", "vec4<f16>": "vec4<f32>"}


def compute_dtype(dtype: DType) -> DType:
    """The type kernels compute in for values stored as ``dtype``: f16 storage computes in f32."""
    return DType.f32 if dtype is DType.f16 else dtype


class KernelBuilder:
    """Collects the bindings of one kernel and assembles its WGSL.

    Binding variables are named ``g_<name>`` so they never collide with the locals emitters
    use.

    Args:
        graph: the graph being lowered.
        node: the node this kernel belongs to (names the kernel, errors quote it).
        limits: adapter limits (binding sizes are checked against them).
    """

    def __init__(self, graph: Graph, node: Node, limits: Limits) -> None:
        self.graph, self.node, self.limits = graph, node, limits
        self._refs: list[ValueRef | ScratchRef | ArenaRef] = []
        self._decls: list[tuple[str, str]] = []  # (name, element type) per binding
        self._by_value: dict[int, int] = {}

    def _bind_value(self, vid: int, name: str, write: bool) -> str:
        root = resolve_view(self.graph, vid)
        if root in self._by_value:
            k = self._by_value[root]
            if write and not self._refs[k].write:
                self._refs[k] = ValueRef(root, write=True)
            return self._decls[k][0]
        check_numel(self.graph, root, self.limits)
        dtype = self.graph[root].type.dtype
        if dtype is DType.f16 and not self.limits.shader_f16:
            raise ValueError(
                f"%{root} ({self.graph[root].op}: {self.graph[root].type}) is stored as f16, "
                "which needs an adapter with the shader-f16 feature"
            )
        self._by_value[root] = len(self._refs)
        self._refs.append(ValueRef(root, write=write))
        return self._declare(name, dtype)

    def read(self, vid: int, name: str) -> Src:
        """Bind value ``vid`` for reading (or inline it when it is a constant)."""
        root = resolve_view(self.graph, vid)
        n = self.graph[root]
        t = self.graph[vid].type
        if n.op == "constant":
            return Src(t, literal=literal(n.attr("value"), n.type.dtype))
        return Src(t, name=self._bind_value(vid, name, write=False))

    def is_bound(self, vid: int) -> bool:
        """Whether value ``vid`` (or the value owning its buffer) already has a binding."""
        return resolve_view(self.graph, vid) in self._by_value

    def read_vec4(self, vid: int, name: str) -> str:
        """Bind value ``vid`` for reading as ``array<vec4<T>>`` (T its storage type) and
        return the variable. Element i of the value is lane ``i % 4`` of vector ``i / 4``.

        Raises:
            ValueError: when the value is a constant or already bound (one binding per value).
        """
        if is_constant(self.graph, vid) or self.is_bound(vid):
            raise ValueError(f"%{vid} cannot get a vec4 binding: constant or already bound")
        var = self._bind_value(vid, name, write=False)
        self.vectorize(var)
        return var

    def write(self, vid: int, name: str) -> str:
        """Bind value ``vid`` (the node's output, or an input updated in place) for writing."""
        return self._bind_value(vid, name, write=True)

    def scratch(self, key: str, count: int, dtype: DType, name: str) -> str:
        """Bind node-private scratch storage of ``count`` elements of ``dtype``.

        Scratch holds partial sums and statistics, so it is kept in the compute type: an f16
        ``dtype`` (a node stored as f16) gets f32 scratch."""
        dtype = compute_dtype(dtype)
        self._refs.append(ScratchRef(key, max(count, 1) * dtype.itemsize, dtype))
        return self._declare(name, dtype)

    def arena(self, key: tuple, dtype: DType, name: str, write: bool) -> str:
        """Bind the whole arena ``key`` (several values of ``dtype`` at aligned offsets)."""
        if dtype is DType.f16:
            raise NotImplementedError(f"arena {key}: f16 storage is not lowered yet")
        self._refs.append(ArenaRef(key, write))
        return self._declare(name, dtype)

    def element_type(self, var: str) -> str:
        """WGSL element type of the storage binding ``var`` (``f32``, ``f16``, ``i32``, ...)."""
        for name, ty in self._decls:
            if name == var:
                return ty
        raise KeyError(f"{var!r} is not a binding of this kernel")

    def load(self, var: str, index: str) -> str:
        """Expression reading element ``index`` of binding ``var`` in its compute type
        (f16 storage is widened to f32, vec4<f16> to vec4<f32>). Kernels read bound values
        through this or ``Src.at`` so that the fast (f16-storage) mode needs no change in the
        emitter."""
        ty = self.element_type(var)
        if ty in _WIDEN:
            return f"{_WIDEN[ty]}({var}[{index}])"
        return f"{var}[{index}]"

    def store(self, var: str, index: str, expr: str) -> str:
        """Statement writing compute-type ``expr`` to element ``index`` of binding ``var``
        (narrowed to f16 / vec4<f16> when the binding stores f16)."""
        ty = self.element_type(var)
        if ty in _WIDEN:
            return f"{var}[{index}] = {ty}({expr});"
        return f"{var}[{index}] = {expr};"

    def vectorize(self, var: str) -> None:
        """Re-declare binding ``var`` as ``array<vec4<T>>`` (T its element type): element q is
        scalars 4q .. 4q + 3. The caller reads and writes it only through ``load``/``store``
        (which widen and narrow vec4<f16>) and must keep every vec4 index below numel / 4.
        Idempotent.

        Raises:
            KeyError: when ``var`` is not a binding of this kernel.
        """
        for k, (name, ty) in enumerate(self._decls):
            if name == var:
                if not ty.startswith("vec4<"):
                    self._decls[k] = (name, f"vec4<{ty}>")
                return
        raise KeyError(f"{var!r} is not a binding of this kernel")

    def _declare(self, name: str, dtype: DType) -> str:
        var = f"g_{name}"
        if any(var == d for d, _ in self._decls):
            var = f"{var}_{len(self._decls)}"  # two bindings asked for the same name
        self._decls.append((var, dtype.wgsl))
        return var

    def finish(
        self,
        suffix: str,
        body: str,
        workgroup_size: int,
        groups: int,
        helpers: str = "",
        flops: int = 0,
        nbytes: int = 0,
        extra_args: str = "",
    ) -> KernelSource:
        """Assemble the kernel: declarations, helper functions, then ``main``.

        ``body`` runs after ``wg`` (the linear workgroup id, padding dropped) is defined;
        ``extra_args`` are more builtins of ``main`` (e.g. ``@builtin(subgroup_size) sgs: u32``).
        """
        grid = fold_grid(groups, self.limits)
        decls = []
        for i, ((name, ty), ref) in enumerate(zip(self._decls, self._refs, strict=True)):
            access = "read_write" if ref.write else "read"
            decls.append(f"@group(0) @binding({i}) var<storage, {access}> {name}: array<{ty}>;")
        src = "\n".join(decls) + "\n\n"
        # f16 bindings, or an f16 conversion in the code (a fused cast to f16 not stored)
        if any(re.search(r"\bf16\b", ty) for _, ty in self._decls) or re.search(
            r"\bf16\b", body + helpers
        ):
            src = "enable f16;\n\n" + src
        if helpers:
            src += helpers.strip("\n") + "\n\n"
        src += f"@compute @workgroup_size({workgroup_size})\nfn main({ENTRY_ARGS}{extra_args}) {{\n"
        src += linear_workgroup(groups, grid) + body.rstrip() + "\n}\n"
        name = f"%{self.node.id} {self.node.op}" + (f" {suffix}" if suffix else "")
        return KernelSource(name, src, tuple(self._refs), grid, flops, nbytes)


def indent(text: str, level: int = 1) -> str:
    """``text`` with every non-blank line indented by ``level`` steps of two spaces."""
    pad = "  " * level
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))


def next_pow2(n: int) -> int:
    """The smallest power of two >= n (1 for n <= 1)."""
    return 1 << max(0, (n - 1).bit_length())

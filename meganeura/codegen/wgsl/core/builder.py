"""``KernelBuilder``: the bindings of one kernel and the assembly of its WGSL.

Invariants kept here, so that each emitter cannot get them wrong on its own:
  * a graph value is bound at most once per kernel (reads of the same value, or of views of
    it, share one binding; a value both read and written gets one ``read_write`` binding);
  * views (``reshape``, ``stop_gradient``) are resolved to the value that owns the buffer
    (``graph.ir.resolve_view``), and constants are inlined as exact literals, never bound;
  * every bound value has fewer than 2^31 elements (``codegen.kernel.MAX_ELEMENTS``) and fits
    the adapter's storage-binding limit, else ``ValueError`` names it;
  * a value stored as f16 (fast mode, ``passes.precision``) is bound as ``array<f16>`` and
    the kernel starts with ``enable f16;``; emitters read and write bindings only through
    ``Src.at``, ``KernelBuilder.load`` and ``KernelBuilder.store``, which widen to f32 on
    load and narrow on store, so every kernel computes and accumulates in f32
    (``compute_dtype``); binding an f16 value for an adapter without ``shader-f16`` raises
    ``ValueError``;
  * loads that may fall outside their binding go through ``guarded_read``.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, replace

from ....dtypes import DType
from ....graph.ir import Graph, Node, TensorType, resolve_view
from ....passes import broadcast_views
from ....passes.permute_views import VIEW_READERS, read_view, write_view
from ...kernel import MAX_ELEMENTS, ArenaRef, KernelSource, Limits, ScratchRef, ValueRef
from .layout import coalesce, fold_grid, linear_workgroup, strided_index
from .literals import F32_BITS, F32_BITS_HELPER, F32_OPAQUE_INIT, literal, u

ENTRY_ARGS = (
    "@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>, "
    "@builtin(local_invocation_index) lid: u32"
)


def is_constant(graph: Graph, vid: int) -> bool:
    return graph[resolve_view(graph, vid)].op == "constant"


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


def view_index(index: str, shape: tuple[int, ...], strides: tuple[int, ...]) -> str:
    """u32 offset in storage of flat row-major ``index`` of a value of ``shape`` laid out
    with ``strides`` (``passes.permute_views``)."""
    cshape, (cstrides,) = coalesce(shape, [strides])
    return strided_index(index, cshape, cstrides)


@dataclass(frozen=True)
class Src:
    """How a kernel reads one IR value: a binding name, or an inlined literal.

    ``strides``: the value is read from another value's buffer (``passes.permute_views``)
    with these strides per dim of ``type``, or per dim of ``view_shape`` when given (a
    refinement of ``type.shape``: the same row-major elements over finer dims, element 0 at
    ``view_offset``, ``passes.broadcast_views``); ``at`` takes the flat row-major index of
    the value as always and maps it. ``summed``: the value is a split-K matmul product never stored;
    ``name`` binds its partial sums and element i is the helper call ``summed(i)``
    (``matmul.deferred``)."""

    type: TensorType
    name: str | None = None
    literal: str | None = None
    strides: tuple[int, ...] | None = None
    summed: str | None = None
    view_shape: tuple[int, ...] | None = None
    view_offset: int = 0
    summed4: str | None = None  # with ``summed``: helper of elements 4q .. 4q + 3 (``at4``)

    @property
    def dtype(self) -> DType:
        return self.type.dtype

    def at(self, index: str) -> str:
        """WGSL expression of element ``index`` in its compute type (the literal itself for
        constants; an f16-stored value is widened to f32)."""
        if self.literal is not None:
            return self.literal
        if self.strides is not None:
            shape = self.type.shape if self.view_shape is None else self.view_shape
            index = view_index(index, shape, self.strides)
            if self.view_offset:
                index = f"{u(self.view_offset)} + {index}"
        return self.at_offset(index)

    def at_offset(self, offset: str) -> str:
        """``at`` for a storage offset (from ``row_offset``): no strides applied."""
        if self.literal is not None:
            return self.literal
        if self.summed is not None:
            return f"{self.summed}({offset})"
        if self.type.dtype is DType.f16:
            return f"f32({self.name}[{offset}])"
        return f"{self.name}[{offset}]"

    def at4(self, base: str, start: int = 0) -> str:
        """vec4<f32> of the elements at storage offsets ``base`` + ``start`` .. + 3 of rows
        read through ``row_offset`` (``base`` a row's start plus a multiple of 4, ``start`` a
        multiple of 4, all inside the row): one vec4 sum of partials where the value is a
        deferred split-K product whose rows start at multiples of 4 (``summed4``), else four
        ``at_offset`` loads."""
        if self.summed4 is not None and self._rows_by_4():
            return f"{self.summed4}(({base} + {u(start)}) / 4u)"
        comps = ", ".join(self.at_offset(f"{base} + {u(start + e)}") for e in range(4))
        return f"vec4<f32>({comps})"

    def _rows_by_4(self) -> bool:
        if self.type.shape[-1] % 4:
            return False
        if self.strides is None:
            return True
        return self.view_shape is None and all(s % 4 == 0 for s in self.strides[:-1])

    def row_offset(self, row: str) -> str:
        """u32 storage offset of element 0 of row ``row`` (flat index over all dims but the
        last); the row's elements follow at stride 1 (``permute_views`` keeps the last dim),
        so a kernel reading whole rows maps one index per row instead of one per element."""
        n = self.type.shape[-1]
        if self.strides is None:
            return f"({row}) * {n}u" if n != 1 else f"({row})"
        if self.view_shape is not None:
            raise ValueError(f"{self.name}: read through a refined view, not by rows")
        if self.strides[-1] != 1:
            raise ValueError(f"{self.name}: rows are not contiguous (strides {self.strides})")
        return f"({view_index(row, self.type.shape[:-1], self.strides[:-1])})"


def all_of(conds: Sequence[str]) -> str:
    """The conjunction of WGSL bool expressions (free of side effects) with ``&``, which does not
    short-circuit: straight-line code. Tint (Chrome) compiles ``&&`` into branches, and
    Chromium's SwiftShader, compiling the conv gemm's guarded loads joined with ``&&`` inside
    the k loop, grew past 8 GB (docs/web.md); with ``&`` it compiles in 1.6 s."""
    return " & ".join(f"({c})" for c in conds) if len(conds) > 1 else conds[0]


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
        deferred: split-K matmuls whose partial sums this kernel reads in place of the
            product (``matmul.deferred.SplitPartials`` by node id): ``read`` binds the
            partials and returns a ``Src`` summing them. Only kernels that read operands
            through ``Src.at`` alone may be given any.
    """

    def __init__(
        self, graph: Graph, node: Node, limits: Limits, deferred: Mapping | None = None
    ) -> None:
        self.graph, self.node, self.limits = graph, node, limits
        self.deferred = deferred or {}
        self._refs: list[ValueRef | ScratchRef | ArenaRef] = []
        self._decls: list[tuple[str, str]] = []  # (name, element type) per binding
        self._by_value: dict[int, int] = {}
        # binding -> (shape, strides) of the value written through it in another's buffer
        self._views: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
        self._summed: dict[int, Src] = {}
        self._helpers: list[str] = []

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
        """Bind value ``vid`` for reading (or inline it when it is a constant). In a kernel of
        a ``permute_views.VIEW_READERS`` op, a permuted operand is read from its input's buffer
        and a placed one from its permute's (``permute_views.read_view``); in a kernel of a
        ``broadcast_views.READERS`` op, a broadcast operand is read from the buffer of the value
        broadcast (``broadcast_views.read_view``)."""
        root = resolve_view(self.graph, vid)
        n = self.graph[root]
        t = self.graph[vid].type
        if n.op == "constant":
            return Src(t, literal=literal(n.attr("value"), n.type.dtype))
        if root in self.deferred:
            return self._summed_src(root, t, name)
        if self.node.op in VIEW_READERS:
            view = read_view(self.graph, vid)
            if view is not None and resolve_view(self.graph, view[0]) in self.deferred:
                # a split-K product read in place through a permute by a forward attention
                # kernel (``attention.summed``): its partials' order is the product's
                return self._summed_src(resolve_view(self.graph, view[0]), t, name, view[1])
            if view is not None:  # read as the bound value is stored (f16 in fast mode)
                stored = self.graph[resolve_view(self.graph, view[0])].type.dtype
                return Src(replace(t, dtype=stored), name=self._bind_value(view[0], name, False),
                           strides=view[1])  # fmt: skip
        if broadcast_views.reads_in_place(self.graph, self.node.id):
            bview = broadcast_views.read_view(self.graph, vid)
            if bview is not None:
                x, shape, strides, offset = bview
                assert resolve_view(self.graph, x) not in self.deferred, bview
                var = self._bind_value(x, name, False)
                return Src(t, name=var, strides=strides, view_shape=shape, view_offset=offset)
        return Src(t, name=self._bind_value(vid, name, write=False))

    def _summed_src(
        self, root: int, t: TensorType, name: str, strides: tuple[int, ...] | None = None
    ) -> Src:
        """A ``Src`` reading deferred split-K product ``root`` (type ``t``, through
        ``strides`` when given) as the sums of its partials, bound once per kernel."""
        if root not in self._summed:
            part = self.deferred[root]
            var = self.scratch(part.key, part.count, DType.f32, name, owner=root)
            dtype = self.graph[root].type.dtype
            four = None
            if strides is not None and part.total % 4 == 0 and part.index == "i":
                # a view reader (attention) also loads vec4 runs of rows: a vec4 binding,
                # the scalar helper reading lanes of it (same values, same order)
                self.vectorize(var)
                self._helpers.append(part.helper(f"sum4_{var}", var, dtype, width=4))
                self._helpers.append(part.helper(f"sum_{var}", var, dtype, lanes_of_vec4=True))
                four = f"sum4_{var}"
            else:
                self._helpers.append(part.helper(f"sum_{var}", var, dtype))
            self._summed[root] = Src(t, name=var, summed=f"sum_{var}", summed4=four)
        summed = self._summed[root]
        return Src(t, name=summed.name, summed=summed.summed, strides=strides,
                   summed4=summed.summed4)  # fmt: skip

    def is_bound(self, vid: int) -> bool:
        """Whether value ``vid`` (or the value owning its buffer) already has a binding."""
        root = resolve_view(self.graph, vid)
        return root in self._by_value or root in self._summed

    def read_vec4(self, vid: int, name: str) -> str:
        """Bind value ``vid`` for reading as ``array<vec4<T>>`` (T its storage type) and
        return the variable. Element i of the value is lane ``i % 4`` of vector ``i / 4``.

        Raises:
            ValueError: when the value is a constant or already bound (one binding per value).
        """
        if is_constant(self.graph, vid) or self.is_bound(vid):
            raise ValueError(f"%{vid} cannot get a vec4 binding: constant or already bound")
        if resolve_view(self.graph, vid) in self.deferred:
            raise ValueError(f"%{vid} is read as a sum of split-K partials, not as vec4")
        var = self._bind_value(vid, name, write=False)
        self.vectorize(var)
        return var

    def write(self, vid: int, name: str) -> str:
        """Bind value ``vid`` (the node's output, or an input updated in place) for writing;
        a placed value (``permute_views.write_view``) binds its permute's buffer, and ``store``
        maps indices into it."""
        view = write_view(self.graph, vid)
        if view is None:
            return self._bind_value(vid, name, write=True)
        var = self._bind_value(view[0], name, write=True)
        self._views[var] = (self.graph[vid].type.shape, view[1])
        return var

    def _index(self, var: str, index: str) -> str:
        if var not in self._views:
            return index
        return view_index(index, *self._views[var])

    def row_offset(self, var: str, row: str, n: int) -> str:
        """u32 storage offset of element 0 of row ``row`` (rows of ``n``, the last dim) of the
        value written through binding ``var``; pass it to ``store(..., offset=True)`` plus a
        column. A value written in a permute's buffer (``write``) keeps its rows contiguous
        (``passes.permute_views``), so one index is mapped per row, not per element."""
        if var not in self._views:
            return f"({row}) * {n}u" if n != 1 else f"({row})"
        shape, strides = self._views[var]
        return f"({view_index(row, shape[:-1], strides[:-1])})"

    def scratch(
        self,
        key: str,
        count: int,
        dtype: DType,
        name: str,
        owner: int | None = None,
        write: bool | None = None,
    ) -> str:
        """Bind node-private scratch storage of ``count`` elements of ``dtype`` (``owner``:
        another node's scratch, read-only unless ``write``).

        Scratch holds partial sums and statistics, so it is kept in the compute type: an f16
        ``dtype`` (a node stored as f16) gets f32 scratch."""
        dtype = compute_dtype(dtype)
        nbytes = max(count, 1) * dtype.itemsize
        write = owner is None if write is None else write
        self._refs.append(ScratchRef(key, nbytes, dtype, write=write, owner=owner))
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
        index = self._index(var, index)
        if ty in _WIDEN:
            return f"{_WIDEN[ty]}({var}[{index}])"
        return f"{var}[{index}]"

    def store(self, var: str, index: str, expr: str, offset: bool = False) -> str:
        """Statement writing compute-type ``expr`` to element ``index`` of binding ``var``
        (narrowed to f16 / vec4<f16> when the binding stores f16). With ``offset``, ``index``
        is a storage offset (``row_offset`` plus a column), used as it is."""
        ty = self.element_type(var)
        index = index if offset else self._index(var, index)
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
        if var in self._views:
            raise ValueError(f"{var} is written through strides: it cannot be a vec4 binding")
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
        if self._helpers:
            helpers = "\n".join(self._helpers) + "\n" + helpers
        # f16 bindings, or an f16 conversion in the code (a fused cast to f16 not stored); the
        # substring tests first skip the regex scans of long unrolled kernels (0.39 s of W1's
        # 3.1 s training compile on a 2-core CPU)
        code = body + helpers
        if any(re.search(r"\bf16\b", ty) for _, ty in self._decls) or (
            "f16" in code and re.search(r"\bf16\b", code)
        ):
            src = "enable f16;\n\n" + src
        opaque = F32_BITS + "(" in code and re.search(rf"\b{F32_BITS}\(", code) is not None
        if opaque:  # a non-finite or zero constant
            helpers = F32_BITS_HELPER + "\n" + helpers
        if helpers:
            src += helpers.strip("\n") + "\n\n"
        src += f"@compute @workgroup_size({workgroup_size})\nfn main({ENTRY_ARGS}{extra_args}) {{\n"
        src += (F32_OPAQUE_INIT if opaque else "") + linear_workgroup(groups, grid)
        src += body.rstrip() + "\n}\n"
        name = f"%{self.node.id} {self.node.op}" + (f" {suffix}" if suffix else "")
        return KernelSource(name, src, tuple(self._refs), grid, flops, nbytes)


def indent(text: str, level: int = 1) -> str:
    """``text`` with every non-blank line indented by ``level`` steps of two spaces."""
    pad = "  " * level
    return "".join(pad + line if line.strip() else line for line in text.splitlines(True))

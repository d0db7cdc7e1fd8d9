"""Reductions over any set of dims: sum, mean, amax, amin, max, min, argmax, argmin, var and
logsumexp.

The input is viewed as kept dims x reduced dims, each coalesced (size-1 dims dropped,
neighbours merged), so output element ``o`` reduces ``x[base(o) + off(r)]`` for r < R, with
both offsets baked index math and ``r`` the row-major index over the reduced dims (what
argmax returns). The workgroup shape comes from ``rows.plan_rows``.

Each op is a ``_Spec``: the statistics one pass computes over a group (``stats``), how the
statistics of several chunks of a group combine (``combine``) and the value stored
(``finish``). Accuracy: no thread sums a long serial chain. Large groups are split over ``P``
chunks (one workgroup each, statistics into scratch, then a second dispatch combines them),
each thread sums a strided slice in blocks, and threads combine pairwise, so a 2^21-element
sum keeps f32 accuracy. Per op:
  * amax/amin/max/min over floats propagate NaN (``max_nan``), argmax/argmin rank a NaN above
    every number and return the first NaN, as torch; NaN tests are by bit pattern;
  * amax/amin/max/min/argmax start from a real element of the group (never from an infinite
    literal); argmax/argmin carry (value, index) pairs ordered by value then index, so the
    first index wins ties whatever the combining order;
  * mean divides by the group size once, at the end, as NumPy does;
  * var is two-pass per chunk (mean, then squared deviations) and chunks merge exactly by
    ``M2 = sum M2_p + n_p (mean_p - mean)^2`` (Chan et al., 1979), never ``E[x^2]-E[x]^2``;
  * logsumexp is ``m + log(sum exp(x - m'))`` with ``m'`` the maximum ``m``, or 0 where ``m``
    is infinite (torch.logsumexp's rule); chunks merge as ``sum s_p exp(m'_p - M')``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Callable
from dataclasses import dataclass

from ....dtypes import DType
from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, compute_dtype
from ..core.layout import contiguous_strides, strided_index
from ..core.literals import f32_literal, u
from ..core.mathlib import helper_source
from ..rowwise.rows import RowPlan, plan_rows, shared_decl, strided_loop, thread_coords, tree

# Aim for this many workgroups before splitting groups into chunks (fills a large GPU), but
# give each thread at least MIN_PER_THREAD elements so the extra pass stays cheap.
TARGET_GROUPS = 1024
MIN_PER_THREAD = 32
MAX_CHUNKS = 1024
F32_MAX = f32_literal(3.4028234663852886e38)

Layout = tuple[tuple[int, ...], tuple[int, ...]]  # coalesced (sizes, strides)
Read = Callable[[str], str]  # element at an index expression


def _layout(shape: tuple[int, ...], dims: tuple[int, ...]) -> tuple[Layout, Layout]:
    """Coalesced (kept, reduced) dims of a contiguous tensor of ``shape``: size-1 dims are
    dropped and neighbouring dims of the same kind merge (their strides chain)."""
    st = contiguous_strides(shape)
    groups: dict[bool, list[tuple[int, int]]] = {False: [], True: []}
    prev = None
    for d, n in enumerate(shape):
        if n == 1:
            continue
        red = d in dims
        if prev == red:
            groups[red][-1] = (groups[red][-1][0] * n, st[d])
        else:
            groups[red].append((n, st[d]))
        prev = red
    kept, red = groups[False], groups[True]
    return (
        (tuple(g[0] for g in kept), tuple(g[1] for g in kept)),
        (tuple(g[0] for g in red), tuple(g[1] for g in red)),
    )


def _plan(kept: Layout, red: Layout) -> RowPlan:
    contiguous = bool(red[1]) and red[1][-1] == 1
    return plan_rows(math.prod(kept[0]), math.prod(red[0]), contiguous)


@dataclass(frozen=True)
class Fold:
    """An accumulator: WGSL type, how two partial results combine, and the identity (None for
    idempotent combines, which start from an element instead)."""

    ty: str
    combine: Callable[[str, str], str]
    zero: str | None = None
    struct: bool = False  # select() cannot pick structs: guard loads with an if


def _sum(ty: str) -> Fold:
    return Fold(ty, lambda a, b: f"{a} + {b}", "0.0" if ty == "f32" else f"0{ty[0]}")


def _call(fn: str) -> Callable[[str, str], str]:
    return lambda a, b: f"{fn}({a}, {b})"


class _Pass:
    """The statements of one dispatch: thread coordinates, this chunk's bounds, and folds.

    Defines ``row`` (may be past the end), ``live``, ``rowc``, ``p`` (the chunk, when
    ``chunks > 1``), ``r_begin``/``r_end`` (this chunk of the group) and ``base``.
    """

    def __init__(self, kept: Layout, red: Layout, chunks: int) -> None:
        self.kept, self.red, self.chunks = kept, red, chunks
        self.n_out, self.n_red = math.prod(kept[0]), math.prod(red[0])
        self.plan = _plan(kept, red)
        self.row_groups = -(-self.n_out // self.plan.ox)
        self.chunk = -(-self.n_red // chunks)
        self.shared: dict[str, str] = {}
        self.unit = 1
        if chunks == 1:
            src = thread_coords(self.plan, "wg", self.n_out) + "  let r_begin = 0u;\n"
            src += f"  let r_end = {u(self.n_red)};\n"
        else:
            src = f"  let p = wg / {u(self.row_groups)};\n"
            src += thread_coords(self.plan, f"(wg % {u(self.row_groups)})", self.n_out)
            src += f"  let r_begin = p * {u(self.chunk)};\n"
            src += f"  let r_end = min(r_begin + {u(self.chunk)}, {u(self.n_red)});\n"
        self.src = src + f"  let base = {strided_index('rowc', *kept)};\n"

    def line(self, stmt: str) -> None:
        self.src += f"  {stmt}\n"

    def fold(self, value: Callable[[str, str], str], f: Fold, name: str) -> str:
        """Reduce ``value(index, r)`` over this chunk into ``name`` (in every thread of the
        row); ``r`` is the element's position in the group, ``index`` its memory index."""

        def elem(r: str) -> str:
            return value(f"base + {strided_index(r, *self.red)}", r)

        acc = f"{name}_acc"
        init = f.zero if f.zero is not None else elem("min(r_begin + y, r_end - 1u)")
        self.src += f"  var {acc} = {init};\n"
        per_thread = -(-self.chunk // self.plan.ry)
        self.src += strided_loop(
            self.plan, "r_begin", "r_end", elem, f.combine, per_thread, f.zero, acc, f.struct
        )
        shared = self.shared.setdefault(f.ty, f"red_{len(self.shared)}")
        self.src += tree(self.plan, shared, acc, f.combine, name)
        return name

    def finish(self, kb: KernelBuilder, suffix: str, store: str, helpers: str) -> KernelSource:
        body = self.src + f"  if (live && y == 0u) {{\n{store}  }}\n"
        decls = "".join(shared_decl(self.plan, n, ty) for ty, n in self.shared.items())
        groups = self.row_groups * self.chunks
        n = self.n_out * self.n_red * self.unit
        return kb.finish(suffix, body, self.plan.size, groups, helpers + decls, n, 4 * n)


@dataclass(frozen=True)
class _Spec:
    """What a reduction computes.

    ``stats(pass, read)`` folds the elements ``read(index)`` of a chunk and returns the WGSL
    expressions of its statistics (``dtypes`` gives their storage types); ``combine(pass,
    reads, count)`` folds the statistics of all chunks (``reads[i]`` reads statistic i,
    ``count(r)`` is the f32 size of chunk r) into the statistics of the whole group;
    ``finish(stats)`` is the value stored.
    """

    stats: Callable[[_Pass, Read], list[str]]
    combine: Callable[[_Pass, list[Read], Callable[[str], str]], list[str]]
    finish: Callable[[list[str]], str]
    dtypes: tuple[DType, ...]
    helpers: str = ""


def _monoid(f: Fold, dtype: DType, finish: Callable[[str], str] = lambda s: s) -> _Spec:
    return _Spec(
        lambda ps, read: [ps.fold(lambda i, r: read(i), f, "t")],
        lambda ps, reads, count: [ps.fold(lambda i, r: reads[0](i), f, "t")],
        lambda s: finish(s[0]),
        (dtype,),
    )


def _arg_spec(dtype: DType, better: str) -> _Spec:
    # Floating values: a NaN beats every number and the first NaN wins (torch.argmax); the
    # NaN test is by bit pattern (drivers fold x != x to false).
    pick = f"(b.v {better} a.v || (b.v == a.v && b.i < a.i))"
    nan_helpers = ""
    if dtype.is_floating:
        pick = (
            "let an = is_nan_f32(a.v);\n  let bn = is_nan_f32(b.v);\n"
            f"  if ((bn && (!an || b.i < a.i)) || (!an && {pick})) {{ return b; }}"
        )
        nan_helpers = helper_source(["is_nan_f32"]) + "\n\n"
    else:
        pick = f"if {pick} {{ return b; }}"
    helpers = (
        nan_helpers + f"struct VI {{ v: {dtype.wgsl}, i: u32 }}\n\n"
        "fn pick(a: VI, b: VI) -> VI {\n"
        f"  {pick}\n"
        "  return a;\n}\n"
    )
    f = Fold("VI", _call("pick"), struct=True)

    def stats(ps: _Pass, read: Read) -> list[str]:
        t = ps.fold(lambda i, r: f"VI({read(i)}, {r})", f, "t")
        return [f"{t}.v", f"{t}.i"]

    def combine(ps: _Pass, reads: list[Read], count: Callable[[str], str]) -> list[str]:
        t = ps.fold(lambda i, r: f"VI({reads[0](i)}, {reads[1](i)})", f, "t")
        return [f"{t}.v", f"{t}.i"]

    return _Spec(stats, combine, lambda s: f"i32({s[1]})", (dtype, DType.u32), helpers)


def _var_spec(n: int, correction: float) -> _Spec:
    add = _sum("f32")

    def stats(ps: _Pass, read: Read) -> list[str]:
        # Statistics of x - x[group's first element]: the variance is unchanged, and a large
        # common offset (mean 5e4, std 1) no longer costs the mean its low bits. Every chunk
        # uses the same shift, so the chunk sums still merge.
        first = "base + " + strided_index("0u", *ps.red)
        ps.line(f"let shift_v = {read(first)};")
        s = ps.fold(lambda i, r: f"({read(i)} - shift_v)", add, "s")
        ps.line(f"let mean_v = {s} / f32(r_end - r_begin);")
        return [s, ps.fold(lambda i, r: f"sq(({read(i)} - shift_v) - mean_v)", add, "m2")]

    def combine(ps: _Pass, reads: list[Read], count: Callable[[str], str]) -> list[str]:
        s = ps.fold(lambda i, r: reads[0](i), add, "s")
        ps.line(f"let mean_v = {s} / {f32_literal(n)};")
        merge = lambda i, r: f"merge_m2({reads[1](i)}, {reads[0](i)}, {count(r)}, mean_v)"  # noqa: E731
        return [s, ps.fold(merge, add, "m2")]

    helpers = (
        "fn sq(v: f32) -> f32 { return v * v; }\n\n"
        "// a chunk's squared deviations about the group mean (Chan et al.)\n"
        "fn merge_m2(m2: f32, s: f32, n: f32, mean: f32) -> f32 {\n"
        "  return m2 + n * sq(s / n - mean);\n}\n"
    )
    finish = lambda s: f"{s[1]} / {f32_literal(n - correction)}"  # noqa: E731
    return _Spec(stats, combine, finish, (DType.f32, DType.f32), helpers)


def _lse_spec() -> _Spec:
    mx, add = Fold("f32", _call("max")), _sum("f32")

    def stats(ps: _Pass, read: Read) -> list[str]:
        m = ps.fold(lambda i, r: read(i), mx, "m")
        ps.line(f"let mz = finite_or_zero({m});")
        return [m, ps.fold(lambda i, r: f"exp({read(i)} - mz)", add, "s")]

    def combine(ps: _Pass, reads: list[Read], count: Callable[[str], str]) -> list[str]:
        m = ps.fold(lambda i, r: reads[0](i), mx, "m")
        ps.line(f"let mz = finite_or_zero({m});")
        return [m, ps.fold(lambda i, r: f"rescale({reads[1](i)}, {reads[0](i)}, mz)", add, "s")]

    helpers = (
        f"fn finite_or_zero(m: f32) -> f32 {{ return select(m, 0.0, abs(m) > {F32_MAX}); }}\n\n"
        "// a chunk's sum of exp(x - mz_p) re-based to exp(x - mz); empty (all -inf) chunks\n"
        "// add 0, never 0 * exp(huge)\n"
        "fn rescale(s: f32, m: f32, mz: f32) -> f32 {\n"
        "  return select(0.0, s * exp(finite_or_zero(m) - mz), s > 0.0);\n}\n"
    )
    return _Spec(stats, combine, lambda s: f"log({s[1]}) + {s[0]}", (DType.f32, DType.f32), helpers)


def _spec(op: str, dtype: DType, n_red: int, node) -> _Spec:
    if op in ("sum", "mean"):
        if op == "sum" or not dtype.is_floating:
            suffix = "" if dtype.is_floating else ("i" if dtype is DType.i32 else "u")
            fin = (lambda s: s) if op == "sum" else (lambda s: f"{s} / {n_red}{suffix}")
        else:
            fin = lambda s: f"{s} / {f32_literal(float(n_red))}"  # noqa: E731
        return _monoid(_sum(dtype.wgsl), dtype, fin)
    if op in ("amax", "max", "amin", "min"):
        fn = "max" if "max" in op else "min"
        if not dtype.is_floating:
            return _monoid(Fold(dtype.wgsl, _call(fn)), dtype)
        # NaN-propagating (torch.amax): WGSL's max/min return the non-NaN operand.
        spec = _monoid(Fold(dtype.wgsl, _call(f"{fn}_nan")), dtype)
        return dataclasses.replace(spec, helpers=helper_source(["max_nan"]) + "\n")
    if op in ("argmax", "argmin"):
        return _arg_spec(dtype, ">" if op == "argmax" else "<")
    if op == "var":
        return _var_spec(n_red, node.attr("correction"))
    return _lse_spec()


def lower_reduce(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """Any reduction of this module over ``dims``: one dispatch, or two when groups are large
    and few (chunk statistics into scratch, then a combining pass)."""
    node = graph[node_id]
    x_node = graph[node.inputs[0]]
    kept, red = _layout(x_node.type.shape, tuple(node.attr("dims")))
    n_out, n_red = node.type.numel, math.prod(red[0])
    if n_out == 0:
        return []
    spec = _spec(node.op, compute_dtype(x_node.type.dtype), n_red, node)
    plan = _plan(kept, red)
    row_groups = -(-n_out // plan.ox)
    chunks = 1
    if row_groups < TARGET_GROUPS and n_red >= plan.ry * MIN_PER_THREAD * 2:
        chunks = min(
            -(-TARGET_GROUPS // row_groups), n_red // (plan.ry * MIN_PER_THREAD), MAX_CHUNKS
        )
        chunk = -(-n_red // chunks)
        chunks = -(-n_red // chunk)  # no empty chunk

    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    read, helpers = x.at, spec.helpers
    vec = _vec4_fold(node.op, kept, red, x)
    if vec is not None:
        # The same reduction over vec4 units, each folded horizontally first.
        kept, red, fold = vec
        kb.vectorize(x.name)
        read, helpers = (lambda i: f"h4({kb.load(x.name, i)})"), helpers + fold
        plan = _plan(kept, red)
        row_groups = -(-n_out // plan.ox)
        n4 = n_red // 4
        chunks = 1
        if row_groups < TARGET_GROUPS and n4 >= plan.ry * MIN_PER_THREAD * 2:
            chunks = min(
                -(-TARGET_GROUPS // row_groups), n4 // (plan.ry * MIN_PER_THREAD), MAX_CHUNKS
            )
            chunks = -(-n4 // -(-n4 // chunks))
    ps = _Pass(kept, red, chunks)
    ps.unit = 4 if vec is not None else 1  # elements per unit, for the profile's counts
    stats = spec.stats(ps, read)
    if chunks == 1:
        out = kb.write(node_id, "out")
        return [ps.finish(kb, "", f"    {kb.store(out, 'row', spec.finish(stats))}\n", helpers)]

    # Chunk statistics are laid out [chunks, n_out]; the second pass reduces the leading dim.
    scratch = [kb.scratch(f"s{k}", chunks * n_out, dt, f"s{k}") for k, dt in enumerate(spec.dtypes)]
    store = "".join(f"    {s}[p * {u(n_out)} + row] = {v};\n" for s, v in zip(scratch, stats))
    first = ps.finish(kb, "partial", store, helpers)

    kb2 = KernelBuilder(graph, node, limits)
    names = [kb2.scratch(f"s{k}", chunks * n_out, dt, f"s{k}") for k, dt in enumerate(spec.dtypes)]
    out = kb2.write(node_id, "out")
    ps2 = _Pass(((n_out,), (1,)), ((chunks,), (n_out,)), 1)
    size, total_units = ps.chunk, ps.n_red
    length = f"min({u(size)}, {u(total_units)} - p * {u(size)})"
    helpers = spec.helpers + f"\nfn chunk_len(p: u32) -> f32 {{ return f32({length}); }}\n"
    reads = [lambda i, s=s: f"{s}[{i}]" for s in names]
    total = spec.combine(ps2, reads, lambda r: f"chunk_len({r})")
    store = f"    {kb2.store(out, 'row', spec.finish(total))}\n"
    return [first, ps2.finish(kb2, "combine", store, helpers)]


# Reductions whose statistics are one monoid: a vec4 unit folds to one value with ``h4``.
_VEC_OPS = {"sum": "+", "mean": "+", "amax": "max", "max": "max", "amin": "min", "min": "min"}
VEC4 = True  # benchmarks flip this to compare with scalar loads


def takes_vec4(graph: Graph, node_id: int) -> bool:
    """Whether reduction ``node_id`` reads its operand, stored contiguously, in vec4 units
    (``passes.broadcast_views`` reads an operand in place only where it would not: the vec4
    path folds each unit first, another summation order than the scalar path)."""
    node = graph[node_id]
    x_type = graph[node.inputs[0]].type
    if node.type.numel == 0 or not VEC4 or node.op not in _VEC_OPS:
        return False
    kept, red = _layout(x_type.shape, tuple(node.attr("dims")))
    return (
        len(red[0]) == 1
        and red[1][0] == 1
        and red[0][0] % 4 == 0
        and not any(s % 4 for s in kept[1])
    )


def _vec4_fold(op: str, kept: Layout, red: Layout, x) -> tuple[Layout, Layout, str] | None:
    """(kept, reduced) layouts over vec4 units and the WGSL of ``h4`` (a unit folded to one
    value), when the reduced dims are one contiguous run of a multiple of 4 elements starting
    at multiples of 4; else None."""
    if not VEC4 or op not in _VEC_OPS or x.literal is not None or x.strides is not None:
        return None  # (a value read through strides, ``passes.broadcast_views``, is scalar)
    if len(red[0]) != 1 or red[1][0] != 1 or red[0][0] % 4 or any(s % 4 for s in kept[1]):
        return None
    ty = x.dtype.wgsl if x.dtype.wgsl != "f16" else "f32"
    f = _VEC_OPS[op]
    if f != "+" and ty == "f32":
        f += "_nan"  # the helper comes with the monoid's (``_spec``)
    body = "(v.x + v.y) + (v.z + v.w)" if f == "+" else f"{f}({f}(v.x, v.y), {f}(v.z, v.w))"
    fold = f"\nfn h4(v: vec4<{ty}>) -> {ty} {{ return {body}; }}\n"
    kept4 = (kept[0], tuple(s // 4 for s in kept[1]))
    return kept4, ((red[0][0] // 4,), (1,)), fold

"""The register-tiled matmul kernel (``Plan.kernel == "tiled"``), any M, N, K.

Each workgroup of 16x16 threads computes a BM x BN output tile, each thread ``tm x tn``
outputs in named vec4 accumulators (never a private array indexed by a loop variable: the
H200 measurement in design.md, 1.0 vs 35.7 TFLOP/s). K advances in steps of BK: a BM x BK
tile of A and a BK x BN tile of B are staged in workgroup memory as vec4 along M and N, and
the BK inner steps are emitted unrolled.

Global loads: each thread loads ``BK * BM / 1024`` runs of 4 elements of A (likewise B), the
runs laid along the operand's contiguous dim so consecutive threads read neighbouring
addresses whether or not it is transposed; a run is one vec4 load when the operand has a vec4
binding (``problem.vec_ok``), else four scalar loads. Runs along K are scattered into four K
rows of the workgroup tile; those rows get one vec4 of padding, so the scattered stores of
threads 4 K apart fall in different banks.

Prefetch (``Plan.prefetch``): the next K tile is loaded into registers before the current one
is multiplied, and stored into the other of two workgroup buffers afterwards; one barrier per
K step (a buffer is rewritten only after the barrier that ends every read of it). Two-deep
(``Plan.deep``): two register sets, the loads of step t + 2 issued before step t multiplies
and stored after step t + 1 does, so they are in flight over two multiplies (``_deep_loop``).
Without prefetch: load, barrier, multiply, barrier, one buffer.

Loads past M, N or K read zero through ``select``, with the index selected to 0 as well, so no
read leaves its binding (shader modules are created without naga's bounds checks,
``runtime/pipelines.py``); checks are emitted only for dims that do not divide evenly.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

from ..core.builder import KernelBuilder, all_of, guarded_read
from ..core.literals import u
from .plan import THREADS, WG, Plan
from .problem import Operand, Problem, Store, bind_operand, bind_operands, vec_ok

# (every product's value, flat output index, column) -> the statements storing an element
MultiStore = Callable[[list[str], str, str], str]


def _times(expr: str, n: int) -> str:
    return expr if n == 1 else f"{expr} * {u(n)}"


def _guarded(read, index: str, conds: list[str], vec: bool) -> str:
    """``read(index)``, or zero where ``conds`` fail (``core.builder.guarded_read``)."""
    if not conds:
        return read(index)
    return guarded_read(read, index, all_of(conds), "vec4<f32>(0.0)" if vec else "0.0")


@dataclass(frozen=True)
class _Stage:
    """How this thread stages its runs of one operand (A: prefix ``a``, B: ``b``)."""

    kb: KernelBuilder
    op: Operand
    p: str
    shared: str
    span: int  # BM for A, BN for B
    bk: int
    extent: int  # M for A, N for B
    k: int
    tile: str
    rowstride: int  # element stride along M (A) or N (B)
    kstride: int
    vec: bool

    @property
    def along_k(self) -> bool:
        return self.kstride == 1

    @property
    def units(self) -> int:
        return self.span * self.bk // (4 * WG)

    @property
    def row4(self) -> int:
        """Vec4s per K row of the workgroup tile (one of padding for runs along K)."""
        return self.span // 4 + (1 if self.along_k else 0)

    @property
    def size(self) -> int:
        return self.bk * self.row4

    def setup(self, prefetch: bool, deep: bool = False) -> list[str]:
        p, lines = self.p, []
        for j in range(self.units):
            unit = "lid" if j == 0 else f"(lid + {u(WG * j)})"
            if self.along_k:
                q = self.bk // 4
                lines += [
                    f"  let {p}l{j} = {unit} / {u(q)};",
                    f"  let {p}r{j} = {self.tile} * {u(self.span)} + {p}l{j};",
                    f"  let {p}k{j} = ({unit} % {u(q)}) * 4u;",
                    f"  let {p}s{j} = {p}k{j} * {u(self.row4)} + {p}l{j} / 4u;",
                    f"  let {p}c{j} = {p}l{j} % 4u;",
                ]
            else:
                q = self.span // 4
                lines += [
                    f"  let {p}r{j} = {self.tile} * {u(self.span)} + ({unit} % {u(q)}) * 4u;",
                    f"  let {p}k{j} = {unit} / {u(q)};",
                    f"  let {p}s{j} = {p}k{j} * {u(self.row4)} + {unit} % {u(q)};",
                ]
            lines.append(f"  let {p}b{j} = {p}_off + {_times(f'{p}r{j}', self.rowstride)};")
            if prefetch:
                lines.append(f"  var {p}v{j}: vec4<f32>;")
            if deep:
                lines.append(f"  var {p}w{j}: vec4<f32>;")
        return lines

    def fetch(self, k0: str, declare: bool, reg: str = "v") -> list[str]:
        """Load this thread's runs at K tile ``k0`` into ``{p}{reg}{j}``."""
        p, kb, op, lines = self.p, self.kb, self.op, []
        ragged_rows, ragged_k = self.extent % self.span != 0, self.k % self.bk != 0
        for j in range(self.units):
            kk = f"({k0} + {p}k{j})"
            if self.vec:
                conds = [f"{p}r{j} < {u(self.extent)}"] if ragged_rows else []
                conds += [f"{kk} < {u(self.k)}"] if ragged_k else []
                index = f"{p}b{j} + {_times(kk, self.kstride)}"
                value = _guarded(lambda i: op.vec4(kb, i), index, conds, True)
            else:
                elems = []
                for c in range(4):
                    conds = []
                    if self.along_k:
                        row, kc = f"{p}r{j}", f"{kk} + {u(c)}" if c else kk
                        index = f"{p}b{j} + {_times(f'({kc})', self.kstride)}"
                    else:
                        row, kc = (f"{p}r{j} + {u(c)}" if c else f"{p}r{j}"), kk
                        index = f"{p}b{j} + {u(c * self.rowstride)} + {_times(kk, self.kstride)}"
                    if ragged_rows:
                        conds.append(f"{row} < {u(self.extent)}")
                    if ragged_k:
                        conds.append(f"{kc} < {u(self.k)}")
                    elems.append(_guarded(lambda i: op.scalar(kb, i), index, conds, False))
                value = f"vec4<f32>({', '.join(elems)})"
            lines.append(f"    {'let ' if declare else ''}{p}{reg}{j} = {value};")
        return lines

    def stash(self, buf: str, reg: str = "v") -> list[str]:
        """Store the fetched runs (``{p}{reg}{j}``) into the workgroup buffer starting at vec4
        ``buf``."""
        p, lines = self.p, []
        for j in range(self.units):
            at = f"{self.shared}[{buf}{p}s{j}"
            if self.along_k:
                lines += [
                    f"    {at} + {u(c * self.row4)}][{p}c{j}] = {p}{reg}{j}.{'xyzw'[c]};"
                    for c in range(4)
                ]
            else:
                lines.append(f"    {at}] = {p}{reg}{j};")
        return lines


# Benchmark-only ablations (``bench/matmul_ablation.py``), to place time inside the kernel by
# difference, since Vulkan kernels cannot be read by NVIDIA's hardware profiler: "no_global"
# skips the global loads and workgroup stores (the K loop multiplies whatever the tiles
# hold), "no_shared" also reads each thread's operands once before the loop, leaving the
# unrolled FMAs and the loop itself. Results are wrong by design; never set outside a bench.
ABLATE: list[str] = []


def _want_b(p: Problem, b: Operand) -> bool:
    b_k = b.rows == 1
    return vec_ok(b, p.k if b_k else p.n, b.cols if b_k else b.rows)


def _b_stage(kb: KernelBuilder, p: Problem, b: Operand, j: int, t, want: bool) -> _Stage:
    """Product j's B stage: prefix ``b`` (``b{j}`` for j > 0), workgroup tile ``Bs{j}``."""
    pre, shared = ("b", "Bs") if j == 0 else (f"b{j}", f"Bs{j}")
    return _Stage(kb, b, pre, shared, t.bn, t.bk, p.n, p.k, "tile_n", b.cols, b.rows,
                  b.vec and want)  # fmt: skip


def _acc(j: int) -> str:
    return "acc" if j == 0 else f"acc{j}_"


def emit_tiled(
    kb: KernelBuilder,
    p: Problem,
    plan: Plan,
    splits: int,
    chunk: int,
    store: Store | MultiStore,
    extra_b: Sequence[Operand] = (),
    a_bound: bool = False,
) -> tuple[str, str, int]:
    """Bind A and B and emit the kernel body.

    Args:
        extra_b: right operands of further products with ``p``'s A, M, N and K (no batch),
            computed by the same threads into their own accumulators (``tiled_group``); then
            ``store`` is a ``MultiStore`` given every product's value of an element.
        a_bound: ``p.a`` is bound already (or reads computed values, ``tiled_group``'s norm
            prologue): only B is bound here.

    Returns:
        (body, workgroup-memory declarations, workgroups).

    Raises:
        ValueError: when the tile's workgroup memory exceeds the adapter's limit.
    """
    t = plan.tiling
    if extra_b and p.nb != 1:
        raise ValueError("products sharing one tile's threads must have no batch")
    a_k = p.a.cols == 1
    want_a = vec_ok(p.a, p.k if a_k else p.m, p.a.rows if a_k else p.a.cols)
    wants = [_want_b(p, b) for b in (p.b, *extra_b)]
    if a_bound:
        p = replace(p, b=bind_operand(kb, p.b, wants[0], "b"))
    else:
        p = bind_operands(kb, p, want_a, wants[0])
    bs = [p.b] + [bind_operand(kb, b, w, f"b{j}") for j, (b, w) in enumerate(
        zip(extra_b, wants[1:], strict=True), 1)]  # fmt: skip
    sa = _Stage(kb, p.a, "a", "As", t.bm, t.bk, p.m, p.k, "tile_m", p.a.rows, p.a.cols,
                p.a.vec and want_a)  # fmt: skip
    sbs = [_b_stage(kb, p, b, j, t, w) for j, (b, w) in enumerate(zip(bs, wants, strict=True))]
    tiles_m, tiles_n = -(-p.m // t.bm), -(-p.n // t.bn)
    mn = tiles_m * tiles_n
    lines = [
        f"  let tile_n = wg % {u(tiles_n)};",
        f"  let tile_m = (wg / {u(tiles_n)}) % {u(tiles_m)};",
        f"  let bi = (wg / {u(mn)}) % {u(p.nb)};",
    ]
    lines += p.k_range(mn * p.nb, splits, chunk)
    lines += p.offsets()
    lines += [f"  let {sb.p}_off = b_off;" for sb in sbs[1:]]
    lines += [f"  let tx = lid % {u(THREADS)};", f"  let ty = lid / {u(THREADS)};"]
    deep = plan.prefetch and plan.deep and not ABLATE
    stages = [sa, *sbs]
    for st in stages:
        lines += st.setup(plan.prefetch, deep)
    acc = [(g, i, h) for g in range(t.tm // 4) for i in range(4) for h in range(t.tn // 4)]
    products = range(len(sbs))
    lines += [f"  var {_acc(j)}{g}{i}{h} = vec4<f32>(0.0);" for j in products for g, i, h in acc]

    ablate = ABLATE[0] if ABLATE else ""
    if ablate == "no_shared":
        lines += [f"  let ra{g} = As[{u(g * THREADS)} + ty];" for g in range(t.tm // 4)]
        lines += [f"  let rb{h} = Bs[{u(h * THREADS)} + tx];" for h in range(t.tn // 4)]

    def b_name(j: int, h: int) -> str:
        return f"b{h}" if j == 0 else f"b{j}_{h}"

    def multiply(cur_a: str, cur_b: list[str]) -> list[str]:
        out = []
        for kk in range(t.bk):
            out.append("    {")
            if ablate == "no_shared":
                out += [f"      let a{g} = ra{g};" for g in range(t.tm // 4)]
                out += [f"      let {b_name(j, h)} = rb{h};" for j in products
                        for h in range(t.tn // 4)]  # fmt: skip
            else:
                out += [
                    f"      let a{g} = As[{cur_a}{u(kk * sa.row4 + g * THREADS)} + ty];"
                    for g in range(t.tm // 4)
                ]
                out += [
                    f"      let {b_name(j, h)} = "
                    f"{sb.shared}[{cur_b[j]}{u(kk * sb.row4 + h * THREADS)} + tx];"
                    for j, sb in enumerate(sbs)
                    for h in range(t.tn // 4)
                ]
            out += [
                f"      {_acc(j)}{g}{i}{h} += a{g}.{'xyzw'[i]} * {b_name(j, h)};"
                for j in products
                for g, i, h in acc
            ]
            out.append("    }")
        return out

    def fetch(k0: str, declare: bool = False) -> list[str]:
        return [line for st in stages for line in st.fetch(k0, declare)]

    step = f"k0 = k0 + {u(t.bk)}"
    none = [""] * len(sbs)
    if deep:
        lines += _deep_loop(sa, sbs, t.bk, multiply)
        buffers = 2
    elif plan.prefetch and not ablate:
        lines += fetch("k_begin")
        lines += [line for st in stages for line in st.stash("")]
        lines += ["  workgroupBarrier();", "  var par = 0u;"]
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines.append(f"    let cur_a = par * {u(sa.size)};")
        lines += [f"    let cur_{sb.p} = par * {u(sb.size)};" for sb in sbs]
        lines += [f"    let more = k0 + {u(t.bk)} < k_end;", "    if (more) {"]
        lines += fetch(f"k0 + {u(t.bk)}")
        lines.append("    }")
        lines += multiply("cur_a + ", [f"cur_{sb.p} + " for sb in sbs])
        lines.append("    if (more) {")
        lines += [line for st in stages for line in st.stash(f"{u(st.size)} - cur_{st.p} + ")]
        lines += ["    }", "    workgroupBarrier();", "    par = 1u - par;", "  }"]
        buffers = 2
    elif ablate:
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines.append("    workgroupBarrier();")
        lines += multiply("", none)
        lines += ["    workgroupBarrier();", "  }"]
        buffers = 1
    else:
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines += fetch("k0", True)
        lines += [line for st in stages for line in st.stash("")]
        lines.append("    workgroupBarrier();")
        lines += multiply("", none)
        lines += ["    workgroupBarrier();", "  }"]
        buffers = 1
    lines += _store(store, t, p.m, p.n, acc, len(sbs))
    shared = 16 * buffers * sum(st.size for st in stages)
    if shared > kb.limits.max_workgroup_storage_size:
        raise ValueError(
            f"matmul tile {t.name} needs {shared} B of workgroup memory; the limit is "
            f"{kb.limits.max_workgroup_storage_size}"
        )
    helpers = "".join(
        f"var<workgroup> {st.shared}: array<vec4<f32>, {buffers * st.size}>;\n" for st in stages
    )
    return "\n".join(lines), helpers, mn * p.nb * splits


def _deep_loop(sa: _Stage, sbs: list[_Stage], bk: int, multiply) -> list[str]:
    """The K loop with two-deep prefetch, two K steps per iteration.

    Buffers alternate by step (A's first half of ``As`` for even steps, second for odd), so
    their offsets are constants; register sets ``v`` and ``w`` alternate too: the loads for step
    t + 2 are issued before step t multiplies and stored after step t + 1 does. Each store goes
    to the buffer whose last reads ended at the barrier before it.
    """
    stages = [sa, *sbs]

    def fetch(k0: str, reg: str) -> list[str]:
        return [line for st in stages for line in st.fetch(k0, False, reg)]

    def stash(half: int, reg: str) -> list[str]:
        return [line for st in stages for line in st.stash(f"{u(half * st.size)} + ", reg)]

    def ahead(n: int) -> str:
        return f"k0 + {u(n * bk)} < k_end"

    lines = fetch("k_begin", "v") + stash(0, "v")
    lines += [f"  if (k_begin + {u(bk)} < k_end) {{"] + fetch(f"k_begin + {u(bk)}", "w")
    lines += ["  }", "  workgroupBarrier();"]
    lines.append(f"  for (var k0 = k_begin; k0 < k_end; k0 = k0 + {u(2 * bk)}) {{")
    lines += [f"    if ({ahead(2)}) {{"] + fetch(f"k0 + {u(2 * bk)}", "v") + ["    }"]
    lines += multiply(f"{u(0)} + ", [f"{u(0)} + " for _ in sbs])
    lines += [f"    if ({ahead(1)}) {{"] + stash(1, "w") + ["    }", "    workgroupBarrier();"]
    lines += [f"    if (!({ahead(1)})) {{ break; }}"]
    lines += [f"    if ({ahead(3)}) {{"] + fetch(f"k0 + {u(3 * bk)}", "w") + ["    }"]
    lines += multiply(f"{u(sa.size)} + ", [f"{u(sb.size)} + " for sb in sbs])
    lines += [f"    if ({ahead(2)}) {{"] + stash(0, "v") + ["    }", "    workgroupBarrier();"]
    lines.append("  }")
    return lines


def _store(store: Store | MultiStore, t, m: int, n: int, acc, products: int = 1) -> list[str]:
    lines = []
    for g, i, h in acc:
        row = f"tile_m * {u(t.bm)} + {u(g * 4 * THREADS + i)} + ty * 4u"
        col = f"tile_n * {u(t.bn)} + {u(h * 4 * THREADS)} + tx * 4u"
        lines.append("  {")
        lines.append(f"    let row = {row};")
        lines.append(f"    let col = {col};")
        lines.append(f"    let o = c_off + row * {u(n)} + col;")
        stores = []
        for c in range(4):
            vals = [f"{_acc(j)}{g}{i}{h}.{'xyzw'[c]}" for j in range(products)]
            value = vals if products > 1 else vals[0]
            s = store(value, f"o + {u(c)}", f"col + {u(c)}")  # type: ignore[arg-type]
            stores.append(f"if (col + {u(c)} < {u(n)}) {{ {s} }}" if n % t.bn else s)
        body = " ".join(stores)
        lines.append(f"    if (row < {u(m)}) {{ {body} }}" if m % t.bm else f"    {body}")
        lines.append("  }")
    return lines

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

from dataclasses import dataclass

from ..core.builder import KernelBuilder, all_of, guarded_read
from ..core.literals import u
from .plan import THREADS, WG, Plan
from .problem import Operand, Problem, Store, bind_operands, vec_ok


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


def emit_tiled(
    kb: KernelBuilder, p: Problem, plan: Plan, splits: int, chunk: int, store: Store
) -> tuple[str, str, int]:
    """Bind A and B and emit the kernel body.

    Returns:
        (body, workgroup-memory declarations, workgroups).

    Raises:
        ValueError: when the tile's workgroup memory exceeds the adapter's limit.
    """
    t = plan.tiling
    a_k, b_k = p.a.cols == 1, p.b.rows == 1
    want_a = vec_ok(p.a, p.k if a_k else p.m, p.a.rows if a_k else p.a.cols)
    want_b = vec_ok(p.b, p.k if b_k else p.n, p.b.cols if b_k else p.b.rows)
    p = bind_operands(kb, p, want_a, want_b)
    sa = _Stage(kb, p.a, "a", "As", t.bm, t.bk, p.m, p.k, "tile_m", p.a.rows, p.a.cols,
                p.a.vec and want_a)  # fmt: skip
    sb = _Stage(kb, p.b, "b", "Bs", t.bn, t.bk, p.n, p.k, "tile_n", p.b.cols, p.b.rows,
                p.b.vec and want_b)  # fmt: skip
    tiles_m, tiles_n = -(-p.m // t.bm), -(-p.n // t.bn)
    mn = tiles_m * tiles_n
    lines = [
        f"  let tile_n = wg % {u(tiles_n)};",
        f"  let tile_m = (wg / {u(tiles_n)}) % {u(tiles_m)};",
        f"  let bi = (wg / {u(mn)}) % {u(p.nb)};",
    ]
    lines += p.k_range(mn * p.nb, splits, chunk)
    lines += p.offsets()
    lines += [f"  let tx = lid % {u(THREADS)};", f"  let ty = lid / {u(THREADS)};"]
    deep = plan.prefetch and plan.deep and not ABLATE
    lines += sa.setup(plan.prefetch, deep) + sb.setup(plan.prefetch, deep)
    acc = [(g, i, h) for g in range(t.tm // 4) for i in range(4) for h in range(t.tn // 4)]
    lines += [f"  var acc{g}{i}{h} = vec4<f32>(0.0);" for g, i, h in acc]

    ablate = ABLATE[0] if ABLATE else ""
    if ablate == "no_shared":
        lines += [f"  let ra{g} = As[{u(g * THREADS)} + ty];" for g in range(t.tm // 4)]
        lines += [f"  let rb{h} = Bs[{u(h * THREADS)} + tx];" for h in range(t.tn // 4)]

    def multiply(cur_a: str, cur_b: str) -> list[str]:
        out = []
        for kk in range(t.bk):
            out.append("    {")
            if ablate == "no_shared":
                out += [f"      let a{g} = ra{g};" for g in range(t.tm // 4)]
                out += [f"      let b{h} = rb{h};" for h in range(t.tn // 4)]
                out += [f"      acc{g}{i}{h} += a{g}.{'xyzw'[i]} * b{h};" for g, i, h in acc]
                out.append("    }")
                continue
            out += [
                f"      let a{g} = As[{cur_a}{u(kk * sa.row4 + g * THREADS)} + ty];"
                for g in range(t.tm // 4)
            ]
            out += [
                f"      let b{h} = Bs[{cur_b}{u(kk * sb.row4 + h * THREADS)} + tx];"
                for h in range(t.tn // 4)
            ]
            out += [f"      acc{g}{i}{h} += a{g}.{'xyzw'[i]} * b{h};" for g, i, h in acc]
            out.append("    }")
        return out

    step = f"k0 = k0 + {u(t.bk)}"
    if deep:
        lines += _deep_loop(sa, sb, t.bk, multiply)
        buffers = 2
    elif plan.prefetch and not ablate:
        lines += sa.fetch("k_begin", False) + sb.fetch("k_begin", False)
        lines += sa.stash("") + sb.stash("")
        lines += ["  workgroupBarrier();", "  var par = 0u;"]
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines += [
            f"    let cur_a = par * {u(sa.size)};",
            f"    let cur_b = par * {u(sb.size)};",
            f"    let more = k0 + {u(t.bk)} < k_end;",
            "    if (more) {",
        ]
        lines += sa.fetch(f"k0 + {u(t.bk)}", False) + sb.fetch(f"k0 + {u(t.bk)}", False)
        lines.append("    }")
        lines += multiply("cur_a + ", "cur_b + ")
        lines.append("    if (more) {")
        lines += sa.stash(f"{u(sa.size)} - cur_a + ") + sb.stash(f"{u(sb.size)} - cur_b + ")
        lines += ["    }", "    workgroupBarrier();", "    par = 1u - par;", "  }"]
        buffers = 2
    elif ablate:
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines.append("    workgroupBarrier();")
        lines += multiply("", "")
        lines += ["    workgroupBarrier();", "  }"]
        buffers = 1
    else:
        lines.append(f"  for (var k0 = k_begin; k0 < k_end; {step}) {{")
        lines += sa.fetch("k0", True) + sb.fetch("k0", True)
        lines += sa.stash("") + sb.stash("")
        lines.append("    workgroupBarrier();")
        lines += multiply("", "")
        lines += ["    workgroupBarrier();", "  }"]
        buffers = 1
    lines += _store(store, t, p.m, p.n, acc)
    shared = 16 * buffers * (sa.size + sb.size)
    if shared > kb.limits.max_workgroup_storage_size:
        raise ValueError(
            f"matmul tile {t.name} needs {shared} B of workgroup memory; the limit is "
            f"{kb.limits.max_workgroup_storage_size}"
        )
    helpers = (
        f"var<workgroup> As: array<vec4<f32>, {buffers * sa.size}>;\n"
        f"var<workgroup> Bs: array<vec4<f32>, {buffers * sb.size}>;\n"
    )
    return "\n".join(lines), helpers, mn * p.nb * splits


def _deep_loop(sa: _Stage, sb: _Stage, bk: int, multiply) -> list[str]:
    """The K loop with two-deep prefetch, two K steps per iteration.

    Buffers alternate by step (A's first half of ``As`` for even steps, second for odd), so
    their offsets are constants; register sets ``v`` and ``w`` alternate too: the loads for step
    t + 2 are issued before step t multiplies and stored after step t + 1 does. Each store goes
    to the buffer whose last reads ended at the barrier before it.
    """

    def fetch(k0: str, reg: str) -> list[str]:
        return sa.fetch(k0, False, reg) + sb.fetch(k0, False, reg)

    def stash(half: int, reg: str) -> list[str]:
        return sa.stash(f"{u(half * sa.size)} + ", reg) + sb.stash(f"{u(half * sb.size)} + ", reg)

    def ahead(n: int) -> str:
        return f"k0 + {u(n * bk)} < k_end"

    lines = fetch("k_begin", "v") + stash(0, "v")
    lines += [f"  if (k_begin + {u(bk)} < k_end) {{"] + fetch(f"k_begin + {u(bk)}", "w")
    lines += ["  }", "  workgroupBarrier();"]
    lines.append(f"  for (var k0 = k_begin; k0 < k_end; k0 = k0 + {u(2 * bk)}) {{")
    lines += [f"    if ({ahead(2)}) {{"] + fetch(f"k0 + {u(2 * bk)}", "v") + ["    }"]
    lines += multiply(f"{u(0)} + ", f"{u(0)} + ")
    lines += [f"    if ({ahead(1)}) {{"] + stash(1, "w") + ["    }", "    workgroupBarrier();"]
    lines += [f"    if (!({ahead(1)})) {{ break; }}"]
    lines += [f"    if ({ahead(3)}) {{"] + fetch(f"k0 + {u(3 * bk)}", "w") + ["    }"]
    lines += multiply(f"{u(sa.size)} + ", f"{u(sb.size)} + ")
    lines += [f"    if ({ahead(2)}) {{"] + stash(0, "v") + ["    }", "    workgroupBarrier();"]
    lines.append("  }")
    return lines


def _store(store: Store, t, m: int, n: int, acc) -> list[str]:
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
            s = store(f"acc{g}{i}{h}.{'xyzw'[c]}", f"o + {u(c)}", f"col + {u(c)}")
            stores.append(f"if (col + {u(c)} < {u(n)}) {{ {s} }}" if n % t.bn else s)
        body = " ".join(stores)
        lines.append(f"    if (row < {u(m)}) {{ {body} }}" if m % t.bm else f"    {body}")
        lines.append("  }")
    return lines

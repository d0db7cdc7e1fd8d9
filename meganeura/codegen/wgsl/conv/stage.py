"""Operand staging and the K loop of the implicit GEMM (``gemm``), with or without prefetch.

Each K step of ``bk`` stages a ``bk x span`` tile of each operand in workgroup memory as
vec4 along M (A) or N (B): slot ``lid + 256 r`` of rep ``r`` holds 4 lines at one k. The
values are gathered by the operand's generated index math (``gemm.Operand``).

Without prefetch (``k_loop(..., prefetch=False)``): gather and store, barrier, multiply,
barrier; one buffer per operand. With prefetch (``matmul/tiled.py``'s design): the first K
step is gathered and stored before the loop; in the loop the next step's values are gathered
into registers (index math and loads) before the current step multiplies, and stored into
the other of two workgroup buffers after it; one barrier per K step (a buffer is rewritten
only after the barrier that ends every read of it). The multiplies are the same FMAs in the
same K order either way, so the results are bit-identical. Two-deep prefetch (``deep``, as
``matmul/tiled.py``'s): two register sets, each step's gathers in flight over two multiplies.

Every thread reaches every barrier: threads past the last slot of a rep skip only the gather
and the store. Gathers past M, N or K read zero by ``select`` with the index selected to 0.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..core.builder import all_of, guarded_read
from ..core.literals import u

if TYPE_CHECKING:
    from collections.abc import Callable

    from .gemm import Operand

THREADS = 256


@dataclass(frozen=True)
class Stage:
    """Staging of one operand's ``bk x span`` tile: ``span * bk / 4`` vec4 slots, slot
    ``lid + 256 r`` for rep ``r`` (threads past the last slot skip the gather and the store
    but still meet every barrier).

    Attributes:
        op: how the operand is addressed.
        p: name prefix (``a`` or ``b``).
        shared: the workgroup array's name.
        span: BM for A, BN for B.
        bk: the K step.
        extent: M for A, N for B.
        k: the GEMM's K.
        tile: the expression of this workgroup's tile index along M (A) or N (B).
    """

    op: Operand
    p: str
    shared: str
    span: int
    bk: int
    extent: int
    k: int
    tile: str

    @property
    def slots(self) -> int:
        """vec4 slots of one buffer (its size in vec4)."""
        return self.span * self.bk // 4

    def reps(self) -> range:
        return range(-(-self.slots // THREADS))

    def setup(self, prefetch: bool, deep: bool = False) -> list[str]:
        """Which k and which 4 lines each rep stages, the per-line setup, and (prefetch) the
        registers holding the next step's values (``deep``: a second set, ``{p}w{r}``)."""
        p, runs, lines = self.p, self.span // 4, []
        for r in self.reps():
            slot = "lid" if r == 0 else f"(lid + {u(r * THREADS)})"
            if self.op.along_k:
                lines += [f"  let l{p}{r}_k = {slot} % {u(self.bk)};"]
                lines += [f"  let l{p}{r}_r = {slot} / {u(self.bk)};"]
            else:
                lines += [f"  let l{p}{r}_r = {slot} % {u(runs)};"]
                lines += [f"  let l{p}{r}_k = {slot} / {u(runs)};"]
            lines.append(f"  let {p}{r}_first = {self.tile} * {u(self.span)} + l{p}{r}_r * 4u;")
            lines.append(f"  let {p}{r}_slot = l{p}{r}_k * {u(self.span // 4)} + l{p}{r}_r;")
            for jj in range(4):
                j = 4 * r + jj
                lines += ["  " + s for s in self.op.line(j, f"({p}{r}_first + {u(jj)})")]
                if self.extent % self.span:
                    lines.append(f"  let {p}_in{j} = {p}{r}_first + {u(jj)} < {u(self.extent)};")
            if prefetch:
                lines.append(f"  var {p}v{r}: vec4<f32>;")
            if deep:
                lines.append(f"  var {p}w{r}: vec4<f32>;")
        return lines

    def _guard(self, r: int, body: list[str], indent: str) -> list[str]:
        """``body`` for rep ``r``, inside ``if`` when some threads have no slot in it."""
        if (r + 1) * THREADS > self.slots:
            return (
                [f"{indent}if (lid + {u(r * THREADS)} < {u(self.slots)}) {{"]
                + [f"{indent}  {s}" for s in body]
                + [f"{indent}}}"]
            )
        return [f"{indent}{s}" for s in body]

    def _gather(self, r: int, k0: str) -> tuple[list[str], str]:
        """(statements, vec4 expression) of rep ``r``'s 4 values at K step ``k0``."""
        p = self.p
        body = [f"let {p}_k{r} = {k0} + l{p}{r}_k;"] + self.op.kstep(str(r), f"{p}_k{r}")
        vals = []
        for jj in range(4):
            j = 4 * r + jj
            stmts, index, conds = self.op.element(j, str(r))
            body += stmts
            conds = list(conds)
            if self.extent % self.span:
                conds.append(f"{p}_in{j}")
            if self.k % self.bk:
                conds.append(f"{p}_k{r} < {u(self.k)}")
            at = self.op.src.at
            vals.append(guarded_read(at, index, all_of(conds), "0.0") if conds else at(index))
        return body, f"vec4<f32>({', '.join(vals)})"

    def load(self, k0: str, indent: str = "    ") -> list[str]:
        """Gather the K step at ``k0`` straight into the (single) workgroup buffer."""
        lines = []
        for r in self.reps():
            body, value = self._gather(r, k0)
            body.append(f"{self.shared}[{self.p}{r}_slot] = {value};")
            lines += self._guard(r, body, indent)
        return lines

    def fetch(self, k0: str, indent: str = "    ", reg: str = "v") -> list[str]:
        """Gather the K step at ``k0`` into this thread's registers ``{p}{reg}{r}``."""
        lines = []
        for r in self.reps():
            body, value = self._gather(r, k0)
            # a block of its own: the gather's names are per rep and per K step
            lines += self._guard(r, ["{", *("  " + s for s in body),
                                     f"  {self.p}{reg}{r} = {value};", "}"], indent)  # fmt: skip
        return lines

    def stash(self, buf: str, indent: str = "    ", reg: str = "v") -> list[str]:
        """Store the registers ``{p}{reg}{r}`` into the workgroup buffer starting at vec4
        ``buf``."""
        lines = []
        for r in self.reps():
            at = f"{self.shared}[{buf}{self.p}{r}_slot]"
            lines += self._guard(r, [f"{at} = {self.p}{reg}{r};"], indent)
        return lines


def k_loop(
    sa: Stage,
    sb: Stage,
    bk: int,
    k_begin: str,
    k_end: str,
    multiply: Callable[[str, str], list[str]],
    prefetch: bool,
    deep: bool = False,
) -> list[str]:
    """The K loop over ``[k_begin, k_end)`` (``k_end`` a WGSL expression or name, K steps of
    ``bk``). ``multiply(cur_a, cur_b)`` emits one step's FMAs reading ``As[cur_a ...]`` and
    ``Bs[cur_b ...]`` (prefixes: empty or ``"<vec4 offset> + "``). With ``prefetch`` the
    buffers are doubled (``Stage.slots`` vec4 each half) and ``k_begin < k_end`` must hold
    (the first step is gathered before the loop, unconditionally); ``deep`` (with
    ``prefetch``): two register sets, ``_deep_loop``."""
    if prefetch and deep:
        return _deep_loop(sa, sb, bk, k_begin, k_end, multiply)
    step = f"k0 = k0 + {u(bk)}"
    if not prefetch:
        lines = [f"  for (var k0 = {k_begin}; k0 < {k_end}; {step}) {{"]
        lines += sa.load("k0") + sb.load("k0")
        lines.append("    workgroupBarrier();")
        lines += multiply("", "")
        return lines + ["    workgroupBarrier();", "  }"]
    lines = sa.fetch(k_begin, "  ") + sb.fetch(k_begin, "  ")
    lines += sa.stash("", "  ") + sb.stash("", "  ")
    lines += ["  workgroupBarrier();", "  var par = 0u;"]
    lines.append(f"  for (var k0 = {k_begin}; k0 < {k_end}; {step}) {{")
    lines += [
        f"    let cur_a = par * {u(sa.slots)};",
        f"    let cur_b = par * {u(sb.slots)};",
        f"    let more = k0 + {u(bk)} < {k_end};",
        "    if (more) {",
    ]
    lines += sa.fetch(f"k0 + {u(bk)}", "      ") + sb.fetch(f"k0 + {u(bk)}", "      ")
    lines.append("    }")
    lines += multiply("cur_a + ", "cur_b + ")
    lines.append("    if (more) {")
    lines += sa.stash(f"{u(sa.slots)} - cur_a + ", "      ")
    lines += sb.stash(f"{u(sb.slots)} - cur_b + ", "      ")
    lines += ["    }", "    workgroupBarrier();", "    par = 1u - par;", "  }"]
    return lines


def _deep_loop(sa: Stage, sb: Stage, bk: int, k_begin: str, k_end: str, multiply) -> list[str]:
    """Two-deep prefetch (``matmul/tiled.py``'s ``_deep_loop``), two K steps per iteration.

    Buffers alternate by step (the first half of each array for even steps, the second for
    odd), so their offsets are constants; register sets ``v`` and ``w`` alternate too: the
    gathers for step t + 2 are issued before step t multiplies and stored after step t + 1
    does. Each store goes to the buffer whose last reads ended at the barrier before it. The
    loop bounds are uniform in the workgroup, so every thread meets every barrier.
    """

    def fetch(k0: str, reg: str, indent: str) -> list[str]:
        return sa.fetch(k0, indent, reg) + sb.fetch(k0, indent, reg)

    def stash(half: int, reg: str, indent: str) -> list[str]:
        return sa.stash(f"{u(half * sa.slots)} + ", indent, reg) + sb.stash(
            f"{u(half * sb.slots)} + ", indent, reg
        )

    def ahead(n: int) -> str:
        return f"k0 + {u(n * bk)} < {k_end}"

    lines = fetch(k_begin, "v", "  ") + stash(0, "v", "  ")
    lines.append(f"  if ({k_begin} + {u(bk)} < {k_end}) {{")
    lines += fetch(f"{k_begin} + {u(bk)}", "w", "    ") + ["  }", "  workgroupBarrier();"]
    lines.append(f"  for (var k0 = {k_begin}; k0 < {k_end}; k0 = k0 + {u(2 * bk)}) {{")
    lines += [f"    if ({ahead(2)}) {{"] + fetch(f"k0 + {u(2 * bk)}", "v", "      ") + ["    }"]
    lines += multiply(f"{u(0)} + ", f"{u(0)} + ")
    lines += [f"    if ({ahead(1)}) {{"] + stash(1, "w", "      ") + ["    }"]
    lines += ["    workgroupBarrier();", f"    if (!({ahead(1)})) {{ break; }}"]
    lines += [f"    if ({ahead(3)}) {{"] + fetch(f"k0 + {u(3 * bk)}", "w", "      ") + ["    }"]
    lines += multiply(f"{u(sa.slots)} + ", f"{u(sb.slots)} + ")
    lines += [f"    if ({ahead(2)}) {{"] + stash(0, "v", "      ") + ["    }"]
    lines += ["    workgroupBarrier();", "  }"]
    return lines

"""Register-tiled flash-attention kernels ("block" kernels): the forward, its statistics and
the three gradients, as matmul-like tiles.

Same work split as ``lane`` (a workgroup owns ``rows`` rows of one (batch, kv head)
pair: query rows of the whole GQA group for ``fwd``/``stats``/``dq``, key rows for ``dk``/
``dv``/``dkv``; the other side streams through workgroup memory a tile at a time), but the
score tile is computed like a matmul: the rows' vectors sit in workgroup memory too, and thread
(tr, ts) computes the 4 x ``per_lane`` scores of rows ``4 tr .. 4 tr + 3`` and stream entries
``ts + lanes * j``, so each workgroup-memory read feeds 4 or ``per_lane`` dot products
(named accumulators, unrolled at generation time). Probabilities (or score gradients) go
through workgroup memory, transposed so one vec4 holds a stream entry's value for a
thread's 4 rows; the accumulate step gives thread (tr, ts) the same 4 rows and every
``lanes``-th vec4 column, so softmax rescaling stays in the thread. ``dkv`` (dk and dv in one
pass) stores both a tile's probabilities and its score gradients, then accumulates dv from
the dO tile and dk from the Q tile after one barrier.

Scores are kept in the log2 domain: ``z = (q . k) * scale * log2(e) + mask * log2(e)`` and
``p = exp2(z - m)`` (the same numbers as ``exp(s - m)``, one multiply cheaper; FlashAttention-2,
Dao 2023, Algorithm 1). The forward's running max is row-uniform (lanes exchange partial
maxima each tile); ``stats`` keeps a max and sum per thread and merges them at the end.
Masking, fully masked rows, clamped reads and the forward's runtime key count (``kv_length``:
the key loop stops at ``kvl``, lower-right causality) follow the lane kernel
(``lane_stream``) exactly.
"""

from __future__ import annotations

import math

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, Src
from ..core.layout import broadcast_strides
from ..core.literals import NEG_INF_BITS, f32_literal, u
from .common import LOWEST, OPERANDS, XYZW, key_end, read_extras, stride_sum
from .plan import QUERY_ROW_MODES, BlockPlan, Dims, block_layout, extents

LOG2E = f32_literal(1.0 / math.log(2.0))
LN2 = f32_literal(math.log(2.0))


class _Block:
    """Emits the statements of one block kernel into ``self.lines``."""

    def __init__(self, kb, mode, dims: Dims, plan: BlockPlan, src, mask, strides, attrs, kvlen):
        self.kb, self.mode, self.dims, self.plan, self.kvlen = kb, mode, dims, plan, kvlen
        self.src, self.mask, self.mstrides = src, mask, strides
        self.total, self.layout = block_layout(mode, dims, plan)
        self.scale, self.scale_nat, self.causal = attrs
        self.qrows = mode in QUERY_ROW_MODES
        self.n_rows, self.n_stream = extents(mode, dims)
        self.lines: list[str] = []

    def emit(self, *lines: str) -> None:
        self.lines.extend(lines)

    def off(self, seg: str) -> int:
        return self.layout[seg][0]

    def stride(self, seg: str) -> int:
        return self.layout[seg][1]

    # ---- cooperative copies ------------------------------------------------------------------
    def copy(self, seg: str, src: Src, row: str, n: int, count: int, first: str, last: int | str):
        """Copy ``count`` rows (``n`` floats each; row ``sr`` of ``src`` starts at ``row``)
        from ``first`` on, clamped to ``last`` (an int or a u32 expression), into ``seg``."""
        n4 = -(-n // 4)
        comps = []
        for e in range(4):
            if n % 4 == 0:
                comps.append(src.at(f"base + {u(e)}"))
            else:
                load = src.at(f"min(base + {u(e)}, {u(src.type.numel - 1)})")
                comps.append(f"select(0.0, {load}, c * 4u + {u(e)} < {u(n)})")
        self.emit(
            f"  for (var e = lid; e < {u(count * n4)}; e = e + {u(self.plan.size)}) {{",
            f"    let rr = e / {u(n4)};",
            f"    let c = e % {u(n4)};",
            f"    let sr = min({first} + rr, {u(last) if isinstance(last, int) else last});",
            f"    let base = ({row}) * {u(n)} + c * 4u;",
            f"    sh[{u(self.off(seg))} + rr * {u(self.stride(seg))} + c] = "
            f"vec4<f32>({', '.join(comps)});",
            "  }",
        )

    # ---- pieces ------------------------------------------------------------------------------
    def dots(self, prefix: str, a: str, b: str, n4: int) -> None:
        """``{prefix}{r}_{j} = sum_c a[row r][c] . b[entry j][c]`` for this thread's rows and
        entries; each loaded vec4 is used per_lane (or 4) times."""
        NJ = self.plan.per_lane
        self.emit(*(f"    var {prefix}{r}_{j} = 0.0;" for r in range(4) for j in range(NJ)))
        for c in range(n4):
            self.emit("    {")
            self.emit(*(f"      let x{r} = sh[{a}{r} + {u(c)}];" for r in range(4)))
            self.emit(*(f"      let y{j} = sh[{b}{j} + {u(c)}];" for j in range(NJ)))
            for r in range(4):
                for j in range(NJ):
                    self.emit(f"      {prefix}{r}_{j} = {prefix}{r}_{j} + dot(x{r}, y{j});")
            self.emit("    }")

    def accumulate(
        self, seg: str, n4: int, weights: str = "p", acc: str = "acc", cols: str = "cc"
    ) -> None:
        """acc[r][col] += sum over the tile's entries e of weights[e][r] * seg[e][col], for
        the thread's columns ``{cols}{i}`` (in a block of its own, so it may run twice)."""
        R4, C4 = self.plan.rows // 4, -(-n4 // self.plan.lanes)
        base, stride = self.off(seg), self.stride(seg)
        self.emit("    {")
        for e in range(self.plan.tile):
            self.emit(f"    let pv{e} = sh[{u(self.off(weights) + e * R4)} + tr];")
            for i in range(C4):
                self.emit(f"    let cv{e}_{i} = sh[{u(base + e * stride)} + {cols}{i}];")
                for r in range(4):
                    self.emit(f"    {acc}{r}_{i} = {acc}{r}_{i} + pv{e}.{XYZW[r]} * cv{e}_{i};")
        self.emit("    }")

    def store_p(self, prefix: str, seg: str = "p") -> None:
        R4 = self.plan.rows // 4
        for j in range(self.plan.per_lane):
            vals = ", ".join(f"{prefix}{r}_{j}" for r in range(4))
            self.emit(f"    sh[{u(self.off(seg))} + e{j} * {u(R4)} + tr] = vec4<f32>({vals});")

    def columns(self, name: str, n4: int) -> None:
        """``{name}{i}``: the vec4 columns of an ``n4``-wide accumulator this thread owns
        (every ``lanes``-th, clamped into range; stores skip the clamped ones)."""
        TS = self.plan.lanes
        C4 = -(-n4 // TS)
        for i in range(C4):
            cc = f"ts + {u(TS * i)}"
            self.emit(f"  let {name}{i} = {cc if TS * C4 == n4 else f'min({cc}, {u(n4 - 1)})'};")

    def store_rows(
        self, out: str, acc: str, cols: str, n: int, factor: str = "", inv: bool = False
    ) -> None:
        """Each live row of the thread writes its accumulator ``{acc}{r}_{i}`` (columns
        ``{cols}{i}``, ``n`` floats per row) times ``factor`` (times ``inv.r`` with ``inv``)."""
        TS, n4 = self.plan.lanes, -(-n // 4)
        C4 = -(-n4 // TS)
        rowvar = "qrow" if self.qrows else "krow"
        for r in range(4):
            f = f" * inv.{XYZW[r]}" if inv else factor
            self.emit(f"  if (live{r}) {{")
            for i in range(C4):
                for e in range(4):
                    cond = [f"{cols}{i} * 4u + {u(e)} < {u(n)}"] if n % 4 or TS * C4 != n4 else []
                    if TS * C4 != n4:
                        cond.append(f"ts + {u(TS * i)} < {u(n4)}")
                    idx = f"{rowvar}{r} * {u(n)} + {cols}{i} * 4u + {u(e)}"
                    stmt = self.kb.store(out, idx, f"{acc}{r}_{i}.{XYZW[e]}{f}")
                    self.emit(
                        f"    if ({' && '.join(cond)}) {{ {stmt} }}" if cond else f"    {stmt}"
                    )
            self.emit("  }")

    def scores(self) -> None:
        """z{r}_{j} (log2-domain scores) and ok{r}_{j} (unmasked) for this tile."""
        NJ = self.plan.per_lane
        ragged = self.n_stream % self.plan.tile != 0 or (self.causal and not self.qrows)
        sb, sh, si, sj = self.mstrides
        mstride = sj if self.qrows else si
        self.dots("s", "ra", "rb", self.dims.d4)
        for r in range(4):
            for j in range(NJ):
                conds = [f"sj{j} < {u(self.n_stream)}"] if ragged else []
                if self.kvlen is not None:  # the forward only: rows are queries
                    conds = [f"sj{j} < kvl"]
                    if self.causal:
                        conds.append(f"sj{j} + {u(self.dims.lq)} <= kvl + ri{r}")
                elif self.causal:
                    conds.append(f"sj{j} <= ri{r}" if self.qrows else f"kj{r} <= sj{j}")
                z = f"s{r}_{j} * {self.scale}"
                if self.mask is not None:
                    base = "mrow" if self.qrows else "mcol"
                    idx = stride_sum(
                        [(f"{base}{r}", 1), (f"min(sj{j}, {u(self.n_stream - 1)})", mstride)]
                    )
                    self.emit(f"    let mv{r}_{j} = {self.mask.at(idx)};")
                    if self.mask.literal is None:
                        conds.append(f"bitcast<u32>(mv{r}_{j}) != {NEG_INF_BITS}")
                    z += f" + mv{r}_{j} * {LOG2E}"
                self.emit(f"    let ok{r}_{j} = {' && '.join(conds) if conds else 'true'};")
                self.emit(f"    let z{r}_{j} = select({LOWEST}, {z}, ok{r}_{j});")

    def row_max(self, var: str) -> None:
        NJ = self.plan.per_lane
        comps = []
        for r in range(4):
            mx = f"z{r}_0"
            for j in range(1, NJ):
                mx = f"max({mx}, z{r}_{j})"
            comps.append(mx)
        self.emit(f"    let {var} = vec4<f32>({', '.join(comps)});")

    def probs(self, shift) -> None:
        """p{r}_{j} = exp2(z - shift(r, j)), 0 where masked."""
        for r in range(4):
            for j in range(self.plan.per_lane):
                self.emit(
                    f"    let p{r}_{j} = select(0.0, exp2(z{r}_{j} - {shift(r, j)}), ok{r}_{j});"
                )

    def row_sums(self) -> str:
        NJ = self.plan.per_lane
        return (
            "vec4<f32>("
            + ", ".join(" + ".join(f"p{r}_{j}" for j in range(NJ)) for r in range(4))
            + ")"
        )


def lower_block(
    graph: Graph,
    node_id: int,
    limits: Limits,
    mode: str,
    dims: Dims,
    plan: BlockPlan,
    value_node: int | None = None,
) -> list[KernelSource]:
    """One dispatch of the register-tiled kernel in ``mode`` (see the module docstring); in
    ``dkv`` mode ``node_id`` is the key-gradient node and ``value_node`` its value-gradient
    sibling, whose output the kernel writes too."""
    node = graph[node_id]
    if node.type.numel == 0:
        return []
    ins = node.inputs
    kb = KernelBuilder(graph, node, limits)
    src = {"q": kb.read(ins[0], "q"), "k": kb.read(ins[1], "k")}
    n_fixed = 2 + len(OPERANDS[mode])
    for name, vid in zip(OPERANDS[mode], ins[2:n_fixed], strict=True):
        src[name] = kb.read(vid, name)
    mask, kvlen = read_extras(kb, graph, ins[n_fixed:])
    d, lq, lk, G = dims.d, dims.lq, dims.lk, dims.group
    hq = dims.hkv * G
    strides = broadcast_strides(mask.type.shape, (dims.b, hq, lq, lk)) if mask else (0,) * 4
    scale2 = f32_literal(node.attr("scale") / math.log(2.0))
    k = _Block(
        kb,
        mode,
        dims,
        plan,
        src,
        mask,
        strides,
        (scale2, f32_literal(node.attr("scale")), bool(node.attr("is_causal"))),
        kvlen,
    )
    outs = {"out": kb.write(node_id, "out")}
    if mode == "dkv":
        outs["dv"] = kb.write(value_node, "dv")
    R, BS, TS = plan.rows, plan.tile, plan.lanes
    tiles = -(-k.n_rows // R)
    # accumulator (stats: delta) width; dkv's second accumulator (dv) is dims.dv4 wide
    n4c = dims.d4 if mode in ("dq", "dk", "dkv") else dims.dv4
    C4 = -(-n4c // TS)
    C4v = -(-dims.dv4 // TS)
    sb, sh, si, sj = strides

    k.emit(
        f"  let tile = wg % {u(tiles)};",
        f"  let bh = wg / {u(tiles)};",
        f"  let b = bh / {u(dims.hkv)};",
        f"  let hk = bh % {u(dims.hkv)};",
        f"  let tr = lid / {u(TS)};",
        f"  let ts = lid % {u(TS)};",
    )
    for r in range(4):
        k.emit(
            f"  let row{r} = tile * {u(R)} + tr * 4u + {u(r)};",
            f"  let live{r} = row{r} < {u(k.n_rows)};",
            f"  let rc{r} = min(row{r}, {u(k.n_rows - 1)});",
        )
        if k.qrows:
            k.emit(
                f"  let qrow{r} = bh * {u(G * lq)} + rc{r};",
                f"  let ri{r} = rc{r} % {u(lq)};",
                f"  let rh{r} = hk * {u(G)} + rc{r} / {u(lq)};",
                f"  let mrow{r} = {stride_sum([('b', sb), (f'rh{r}', sh), (f'ri{r}', si)])};",
            )
        else:
            k.emit(f"  let krow{r} = bh * {u(lk)} + rc{r};", f"  let kj{r} = rc{r};")
        k.emit(f"  let ra{r} = {u(k.off('a'))} + (tr * 4u + {u(r)}) * {u(k.stride('a'))};")
        if "a2" in k.layout:
            k.emit(f"  let ra2{r} = {u(k.off('a2'))} + (tr * 4u + {u(r)}) * {u(k.stride('a2'))};")
    for j in range(plan.per_lane):
        k.emit(
            f"  let e{j} = ts + {u(TS * j)};",
            f"  let rb{j} = {u(k.off('b'))} + e{j} * {u(k.stride('b'))};",
        )
        if "b2" in k.layout:
            k.emit(f"  let rb2{j} = {u(k.off('b2'))} + e{j} * {u(k.stride('b2'))};")
    k.columns("cc", n4c)
    if mode == "dkv":
        k.columns("vc", dims.dv4)
    if mode == "dq":
        st = src["st"]
        k.emit(
            "  let lse2 = vec4<f32>("
            + ", ".join(f"{st.at(f'qrow{r} * 2u')} * {LOG2E}" for r in range(4))
            + ");",
            "  let dlt = vec4<f32>("
            + ", ".join(st.at(f"qrow{r} * 2u + 1u") for r in range(4))
            + ");",
        )
    if mode != "stats":
        k.emit(*(f"  var acc{r}_{i} = vec4<f32>(0.0);" for r in range(4) for i in range(C4)))
    if mode == "dkv":
        k.emit(*(f"  var vacc{r}_{i} = vec4<f32>(0.0);" for r in range(4) for i in range(C4v)))
    if mode in ("fwd", "stats"):
        k.emit(f"  var m = vec4<f32>({LOWEST});", "  var l = vec4<f32>(0.0);")

    # the rows' own vectors, once
    first = f"tile * {u(R)}"
    if k.qrows:
        k.copy("a", src["q"], f"bh * {u(G * lq)} + sr", d, R, first, k.n_rows - 1)
        if mode == "dq":
            k.copy("a2", src["dout"], f"bh * {u(G * lq)} + sr", dims.dv, R, first, k.n_rows - 1)
    else:
        k.copy("a", src["k"], f"bh * {u(lk)} + sr", d, R, first, k.n_rows - 1)
        if mode in ("dk", "dkv"):
            k.copy("a2", src["v"], f"bh * {u(lk)} + sr", dims.dv, R, first, k.n_rows - 1)

    # the stream loop
    if k.qrows:
        k.emit(*key_end(kvlen, k.causal, R, k.n_rows, lq, lk))
        k.emit(f"  for (var s0 = 0u; s0 < s_end; s0 = s0 + {u(BS)}) {{", "  workgroupBarrier();")
        row = f"bh * {u(lk)} + sr"
        last = "kvl - 1u" if kvlen is not None else lk - 1  # never past the last kept key
        k.copy("b", src["k"], row, d, BS, "s0", last)
        if mode == "fwd":
            k.copy("c", src["v"], row, dims.dv, BS, "s0", last)
        if mode == "dq":
            k.copy("b2", src["v"], row, dims.dv, BS, "s0", lk - 1)
    else:
        k.emit(f"  for (var hg = 0u; hg < {u(G)}; hg = hg + 1u) {{")
        head = f"(hk * {u(G)} + hg)"
        for r in range(4):
            if mask is not None:
                k.emit(f"  let mcol{r} = {stride_sum([('b', sb), (head, sh), (f'kj{r}', sj)])};")
        start = f"tile * {u(R)}" if k.causal else "0u"
        k.emit(
            f"  for (var s0 = {start}; s0 < {u(lq)}; s0 = s0 + {u(BS)}) {{", "  workgroupBarrier();"
        )
        qhead = f"(bh * {u(G)} + hg)"  # the stream's head in q, dO and stats memory
        row = f"{qhead} * {u(lq)} + sr"
        k.copy("b", src["q"], row, d, BS, "s0", lq - 1)
        if mode in ("dk", "dkv"):
            k.copy("b2", src["dout"], row, dims.dv, BS, "s0", lq - 1)
        else:
            k.copy("c", src["dout"], row, dims.dv, BS, "s0", lq - 1)
        st = src["st"]
        k.emit(
            f"  for (var e = lid; e < {u(BS)}; e = e + {u(plan.size)}) {{",
            f"    let base = ({qhead} * {u(lq)} + min(s0 + e, {u(lq - 1)})) * 2u;",
            f"    sh[{u(k.off('st'))} + e] = "
            f"vec4<f32>({st.at('base')} * {LOG2E}, {st.at('base + 1u')}, 0.0, 0.0);",
            "  }",
        )
    k.emit("    workgroupBarrier();")
    k.emit(*(f"    let sj{j} = s0 + e{j};" for j in range(plan.per_lane)))
    k.scores()
    _tile_update(k, mode, C4, n4c)
    k.emit("  }")
    if not k.qrows:
        k.emit("  }")
    _finish(k, mode, outs, C4, n4c)
    helpers = f"var<workgroup> sh: array<vec4<f32>, {k.total}>;\n"
    per_pair = {"fwd": d + dims.dv, "stats": d, "dq": 2 * d + dims.dv, "dk": 2 * d + dims.dv,
                "dv": d + dims.dv, "dkv": 2 * d + 2 * dims.dv}  # fmt: skip
    flops = 2 * dims.b * hq * lq * lk * per_pair[mode] // (2 if k.causal else 1)
    body = "\n".join(k.lines)
    return [
        kb.finish(
            f"{mode} block {R}x{BS}/{plan.row_threads}x{TS}",
            body,
            plan.size,
            dims.b * dims.hkv * tiles,
            helpers,
            flops,
        )
    ]


def _tile_update(k: _Block, mode: str, C4: int, n4c: int) -> None:
    """What a tile's scores do in ``mode``: online softmax (fwd, stats) or gradients."""
    NJ, R4, TS = k.plan.per_lane, k.plan.rows // 4, k.plan.lanes
    red = k.off("red")
    if mode == "stats":
        k.row_max("mt")
        k.emit("    let mn = max(m, mt);", "    let alpha = exp2(m - mn);")
        k.probs(lambda r, j: f"mn.{XYZW[r]}")
        k.emit(f"    l = l * alpha + {k.row_sums()};", "    m = mn;")
        return
    if mode == "fwd":
        k.row_max("pm")
        k.emit(f"    sh[{u(red)} + ts * {u(R4)} + tr] = pm;", "    workgroupBarrier();")
        mt = f"sh[{u(red)} + tr]"
        for t in range(1, TS):
            mt = f"max({mt}, sh[{u(red + t * R4)} + tr])"
        k.emit(f"    let mn = max(m, {mt});", "    let alpha = exp2(m - mn);", "    m = mn;")
        k.probs(lambda r, j: f"mn.{XYZW[r]}")
        k.emit(f"    l = l * alpha + {k.row_sums()};")
        k.store_p("p")
        k.emit("    workgroupBarrier();")
        k.emit(*(f"    acc{r}_{i} = acc{r}_{i} * alpha.{XYZW[r]};" for r in range(4)
                 for i in range(C4)))  # fmt: skip
        k.accumulate("c", n4c)
        return
    if k.qrows:
        k.probs(lambda r, j: f"lse2.{XYZW[r]}")
    else:
        k.emit(*(f"    let st{j} = sh[{u(k.off('st'))} + e{j}];" for j in range(NJ)))
        k.probs(lambda r, j: f"st{j}.x")
    if mode == "dv":
        k.store_p("p")
        k.emit("    workgroupBarrier();")
        k.accumulate("c", n4c)
        return
    k.dots("dp", "ra2", "rb2", k.dims.dv4)
    for r in range(4):
        for j in range(NJ):
            delta = f"dlt.{XYZW[r]}" if k.qrows else f"st{j}.y"
            k.emit(f"    let ds{r}_{j} = p{r}_{j} * (dp{r}_{j} - {delta});")
    if mode == "dkv":  # dv += p^T dO, dk += ds^T Q: both weight tiles first, one barrier
        k.store_p("p")
        k.store_p("ds", "ds")
        k.emit("    workgroupBarrier();")
        k.accumulate("b", n4c, weights="ds")
        k.accumulate("b2", k.dims.dv4, weights="p", acc="vacc", cols="vc")
        return
    k.store_p("ds")
    k.emit("    workgroupBarrier();")
    k.accumulate("b", n4c)


def _finish(k: _Block, mode: str, outs: dict[str, str], C4: int, n4c: int) -> None:
    """Merge what lanes share (fwd: row sums; stats: max, sum, delta) and store (dkv: dk to
    ``outs["out"]``, dv to ``outs["dv"]``)."""
    R4, TS, red = k.plan.rows // 4, k.plan.lanes, k.off("red")
    dv = k.dims.dv
    kb, out = k.kb, outs["out"]
    if mode == "stats":
        k.emit("  var dlt = vec4<f32>(0.0);")
        for i in range(C4):
            ok = f"ts + {u(TS * i)} < {u(n4c)}"
            for r in range(4):
                terms = []
                for e in range(4):
                    idx = f"qrow{r} * {u(dv)} + cc{i} * 4u + {u(e)}"
                    if dv % 4:
                        idx = f"min({idx}, {u(k.src['o'].type.numel - 1)})"
                    term = f"{k.src['dout'].at(idx)} * {k.src['o'].at(idx)}"
                    if dv % 4:
                        term = f"select(0.0, {term}, cc{i} * 4u + {u(e)} < {u(dv)})"
                    terms.append(term)
                k.emit(f"  dlt.{XYZW[r]} = dlt.{XYZW[r]} + select(0.0, {' + '.join(terms)}, {ok});")
        for n, var in enumerate(("m", "l", "dlt")):
            k.emit(f"  sh[{u(red + n * TS * R4)} + ts * {u(R4)} + tr] = {var};")
        k.emit("  workgroupBarrier();", "  if (ts == 0u) {", f"    var mm = sh[{u(red)} + tr];")
        for t in range(1, TS):
            k.emit(f"    mm = max(mm, sh[{u(red + t * R4)} + tr]);")
        k.emit("    var ll = vec4<f32>(0.0);", "    var dd = vec4<f32>(0.0);")
        for t in range(TS):
            k.emit(
                f"    ll = ll + sh[{u(red + (TS + t) * R4)} + tr] * "
                f"exp2(sh[{u(red + t * R4)} + tr] - mm);",
                f"    dd = dd + sh[{u(red + (2 * TS + t) * R4)} + tr];",
            )
        k.emit(
            f"    let lse = select(vec4<f32>(0.0), (mm + log2(ll)) * {LN2}, ll > vec4<f32>(0.0));"
        )
        for r in range(4):
            k.emit(
                f"    if (live{r}) {{",
                "      " + kb.store(out, f"qrow{r} * 2u", f"lse.{XYZW[r]}"),
                "      " + kb.store(out, f"qrow{r} * 2u + 1u", f"dd.{XYZW[r]}"),
                "    }",
            )
        k.emit("  }")
        return
    if mode == "fwd":
        k.emit(
            "  workgroupBarrier();",
            f"  sh[{u(red)} + ts * {u(R4)} + tr] = l;",
            "  workgroupBarrier();",
            "  var lt = " + " + ".join(f"sh[{u(red + t * R4)} + tr]" for t in range(TS)) + ";",
            "  let inv = select(vec4<f32>(0.0), 1.0 / lt, lt > vec4<f32>(0.0));",
        )
        k.store_rows(out, "acc", "cc", dv, inv=True)
    elif mode == "dv":
        k.store_rows(out, "acc", "cc", dv)
    else:
        k.store_rows(out, "acc", "cc", k.dims.d, f" * {k.scale_nat}")
        if mode == "dkv":
            k.store_rows(outs["dv"], "vacc", "vc", dv)

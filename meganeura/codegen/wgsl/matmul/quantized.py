"""``quantized_linear`` and its input gradient: products with Q8_0 / Q4_1 weights dequantized
inside the kernel (packed layout: ``meganeura.ops.quant_formats``).

Two kernels:
  * GEMV (forward, M <= 8 rows: decode). Bound by reading the weight once. ``lanes`` threads
    share one output column (a weight row): lane l reads the row's 16-byte units l,
    l + lanes, ... (one ``vec4<u32>``: half a Q8_0 block, a whole Q4_1 block), so a warp
    reads one contiguous stretch of the row. Each unit is unpacked with shifts into four
    (Q8_0) or eight (Q4_1) vec4<f32>, dotted with the matching vec4s of every row of x, and
    scaled once per unit: ``d * dot(q, x)`` (Q8_0) and ``d * dot(q, x) + m * sum(x)``
    (Q4_1). All M sums live in named f32 registers; the lanes' sums are combined by
    subgroup shuffles where the adapter has subgroups, else by a pairwise tree in workgroup
    memory (both in a fixed order: deterministic).
  * tiled (forward for M > 8, and every input gradient ``g @ W``): 256 threads compute a
    64 x 64 output tile, 4 x 4 per thread in named vec4 accumulators, with the K loop
    stepping one block (32) at a time: the x (or g) tile and the dequantized weight tile are
    written to workgroup memory as [32][64] f32 each, then the 32 steps are unrolled.
    Forward, each of the 64 weight rows of the tile contributes one block; the gradient
    reads 32 weight rows (the reduction runs over out_features) of two blocks each.

Scales are f16 bits in u32 words, widened by ``half_to_f32`` with integer operations (exact
for subnormal, infinite and NaN halves; WGSL's ``unpack2x16float`` may flush subnormals).
Everything accumulates in f32.
"""

from __future__ import annotations

from ....dtypes import DType
from ....graph.ir import Graph
from ....ops.quant_formats import QK, qformat
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder, is_constant
from ..core.layout import WG, next_pow2
from ..core.literals import f32_literal, u
from .plan import GEMV_MAX_M

HELPERS = f"""
// IEEE binary16 bits (low 16 bits of h) -> f32, exactly
fn half_to_f32(h: u32) -> f32 {{
  let sign = (h & 0x8000u) << 16u;
  let e = (h >> 10u) & 31u;
  let m = h & 1023u;
  let normal = bitcast<f32>(sign | ((e + 112u) << 23u) | (m << 13u));
  let special = bitcast<f32>(sign | 0x7f800000u | (m << 13u));
  let sub = select(1.0, -1.0, sign != 0u) * f32(m) * {f32_literal(2.0**-24)};
  return select(select(normal, special, e == 31u), sub, e == 0u);
}}

// the 4 bytes of w as sign-extended int8 values (Q8_0), byte 0 first
fn q8_unpack(w: u32) -> vec4<f32> {{
  let b = bitcast<vec4<i32>>(vec4<u32>(w) << vec4<u32>(24u, 16u, 8u, 0u));
  return vec4<f32>(b >> vec4<u32>(24u));
}}

// the low (Q4_1 weights j) and high (weights j + 16) nibbles of the 4 bytes of w
fn q4_lo(w: u32) -> vec4<f32> {{
  return vec4<f32>((vec4<u32>(w) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(15u));
}}

fn q4_hi(w: u32) -> vec4<f32> {{
  return vec4<f32>((vec4<u32>(w) >> vec4<u32>(4u, 12u, 20u, 28u)) & vec4<u32>(15u));
}}
"""

TILE = 64  # output tile of the tiled kernel (rows and columns)
TPR = TILE // 4  # threads per tile row: each thread owns 4 x 4 outputs


class _Weights:
    """The packed weight's bindings and the WGSL reading them (i32 storage is bitcast)."""

    def __init__(self, kb: KernelBuilder, graph: Graph, node, vec: bool) -> None:
        self.fmt = qformat(node.attr("qtype"))
        self.out, self.n = node.attr("out_features"), node.attr("in_features")
        q_id, s_id = node.inputs[1], node.inputs[2]
        self.q_i32 = graph[q_id].type.dtype is DType.i32
        self.s_i32 = graph[s_id].type.dtype is DType.i32
        self.vec = vec
        self.q = kb.read_vec4(q_id, "qweight") if vec else kb.read(q_id, "qweight").name
        self.s = kb.read(s_id, "scales").name
        self.row_words = self.n // QK * self.fmt.q_words
        self.row_scales = self.fmt.scales_shape(1, self.n)[1]

    def word(self, index: str) -> str:
        """u32 word (or vec4<u32> when bound as vec4) ``index`` of qweight."""
        e = f"{self.q}[{index}]"
        if self.q_i32:
            return f"bitcast<{'vec4<u32>' if self.vec else 'u32'}>({e})"
        return e

    def scale_word(self, index: str) -> str:
        e = f"{self.s}[{index}]"
        return f"bitcast<u32>({e})" if self.s_i32 else e

    def block_scales(self, row: str, block: str, pre: str) -> list[str]:
        """Statements defining ``{pre}d`` (and ``{pre}m`` for Q4_1) of block ``block`` of
        weight row ``row``."""
        if self.fmt.name == "q8_0":
            sw = self.scale_word(f"{row} * {u(self.row_scales)} + {block} / 2u")
            return [
                f"let {pre}sw = {sw};",
                f"let {pre}d = half_to_f32(select({pre}sw & 0xffffu, {pre}sw >> 16u, "
                f"({block} & 1u) != 0u));",
            ]
        sw = self.scale_word(f"{row} * {u(self.row_scales)} + {block}")
        return [
            f"let {pre}sw = {sw};",
            f"let {pre}d = half_to_f32({pre}sw & 0xffffu);",
            f"let {pre}m = half_to_f32({pre}sw >> 16u);",
        ]


def lower_quantized_linear(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``x [..., in] @ W^T``: the GEMV kernel for at most 8 rows, else the tiled kernel."""
    node = graph[node_id]
    rows = graph[node.inputs[0]].type.numel // node.attr("in_features")
    if rows <= GEMV_MAX_M:
        return [_gemv(graph, node_id, limits, rows)]
    return [_tiled(graph, node_id, limits, rows, transposed=True)]


def lower_quantized_linear_backward(
    graph: Graph, node_id: int, limits: Limits
) -> list[KernelSource]:
    """``g [..., out] @ W``: the tiled kernel (the reduction runs over out_features)."""
    node = graph[node_id]
    rows = graph[node.inputs[0]].type.numel // node.attr("out_features")
    return [_tiled(graph, node_id, limits, rows, transposed=False)]


def _x_reader(kb: KernelBuilder, graph: Graph, vid: int):
    """Bind the activation operand; returns (vec4 reader or None, scalar reader)."""
    if not is_constant(graph, vid) and not kb.is_bound(vid):
        var = kb.read_vec4(vid, "x")
        return (lambda i: kb.load(var, i)), None
    src = kb.read(vid, "x")
    return None, src.at


# ---- GEMV ------------------------------------------------------------------------------------
def _gemv(graph: Graph, node_id: int, limits: Limits, rows: int) -> KernelSource:
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    x4, x1 = _x_reader(kb, graph, node.inputs[0])
    w = _Weights(kb, graph, node, vec=True)
    y = kb.write(node_id, "y")
    q8 = w.fmt.name == "q8_0"
    out, n = w.out, w.n
    units = w.row_words // 4  # vec4<u32> per weight row
    lanes = 32 if units >= 32 else next_pow2(units)
    cols = WG // lanes
    groups = -(-out // cols)

    def xv(index: str) -> str:  # vec4 ``index`` of x (element 4 * index ..)
        if x4 is not None:
            return x4(index)
        return "vec4<f32>(" + ", ".join(x1(f"({index}) * 4u + {u(c)}") for c in range(4)) + ")"

    lines = [
        f"  let lane = lid % {u(lanes)};",
        f"  let cl = lid / {u(lanes)};",
        f"  let colc = min(wg * {u(cols)} + cl, {u(out - 1)});",
        *(f"  var acc{m} = 0.0;" for m in range(rows)),
        f"  for (var t = lane; t < {u(units)}; t = t + {u(lanes)}) {{",
        f"    let w = {w.word(f'colc * {u(units)} + t')};",
    ]
    if q8:  # unit t: weights 16t .. 16t + 15, half of block t / 2
        lines += ["    " + s for s in w.block_scales("colc", "(t / 2u)", "")]
        lines += [f"    let q{j} = q8_unpack(w.{'xyzw'[j]});" for j in range(4)]
        for m in range(rows):
            base = f"{u(m * n // 4)} + t * 4u"
            dots = " + ".join(f"dot(q{j}, {xv(f'{base} + {u(j)}')})" for j in range(4))
            lines.append(f"    acc{m} += d * ({dots});")
    else:  # unit t: block t; word j: weights 4j .. 4j + 3 (low), 16 + 4j .. (high nibbles)
        lines += ["    " + s for s in w.block_scales("colc", "t", "")]
        lines += [f"    let l{j} = q4_lo(w.{'xyzw'[j]});" for j in range(4)]
        lines += [f"    let h{j} = q4_hi(w.{'xyzw'[j]});" for j in range(4)]
        for m in range(rows):
            base = f"{u(m * n // 4)} + t * 8u"
            lines.append("    {")
            lines += [f"      let x{j} = {xv(f'{base} + {u(j)}')};" for j in range(8)]
            dots = " + ".join(f"dot({'lh'[j // 4]}{j % 4}, x{j})" for j in range(8))
            total = " + ".join(f"x{j}" for j in range(8))
            lines.append(f"      acc{m} += d * ({dots}) + m * dot({total}, vec4<f32>(1.0));")
            lines.append("    }")
    lines.append("  }")
    tail, helpers, extra = _reduce_lanes(kb, y, rows, lanes, out, limits.subgroups)
    lines += tail
    return kb.finish(
        "gemv",
        "\n".join(lines),
        WG,
        groups,
        HELPERS + helpers,
        2 * rows * out * n,
        _nbytes(graph, node),
        extra,
    )


def _reduce_lanes(kb: KernelBuilder, y: str, rows: int, lanes: int, out: int, subgroups: bool):
    """Sum ``acc0 .. acc{rows-1}`` over the ``lanes`` threads of each column and store them.

    The sums travel as vectors of up to four rows. With subgroups: a butterfly of
    ``subgroupShuffleXor`` within the subgroup, then (only where subgroups are narrower
    than ``lanes``) one value per subgroup through workgroup memory, as
    ``rowwise.team`` does (subgroups are consecutive ranges of ``lid``). Without: a
    pairwise tree in workgroup memory. Fixed orders, so results are deterministic; barriers
    sit outside every branch. Returns (statements, helpers, extra entry-point arguments).
    """
    packs = [list(range(i, min(i + 4, rows))) for i in range(0, rows, 4)]
    ty = {1: "f32", 2: "vec2<f32>", 3: "vec3<f32>", 4: "vec4<f32>"}
    lines, helpers = [], ""
    for p, ms in enumerate(packs):
        args = ", ".join(f"acc{m}" for m in ms)
        lines.append(f"  var r{p} = {args if len(ms) == 1 else f'{ty[len(ms)]}({args})'};")
        helpers += f"var<workgroup> red{p}: array<{ty[len(ms)]}, {WG}>;\n"
    extra = ""
    if lanes > 1 and subgroups:
        extra = ", @builtin(subgroup_size) sgs: u32, @builtin(subgroup_invocation_id) sid: u32"
        lines.append(f"  for (var o = 1u; o < min({u(lanes)}, sgs); o = o << 1u) {{")
        lines += [f"    r{p} += subgroupShuffleXor(r{p}, o);" for p in range(len(packs))]
        lines.append("  }")
        stash = " ".join(f"red{p}[lid / sgs] = r{p};" for p in range(len(packs)))
        lines += [f"  if (sgs < {u(lanes)} && sid == 0u) {{ {stash} }}", "  workgroupBarrier();"]
        lines.append(f"  if (sgs < {u(lanes)} && lane == 0u) {{")
        lines.append("    let first = lid / sgs;")
        lines.append(f"    for (var j = 1u; j < {u(lanes)} / sgs; j = j + 1u) {{")
        lines += [f"      r{p} += red{p}[first + j];" for p in range(len(packs))]
        lines += ["    }", "  }"]
    elif lanes > 1:
        lines += [f"  red{p}[lid] = r{p};" for p in range(len(packs))]
        lines.append("  workgroupBarrier();")
        step = lanes // 2
        while step >= 1:
            adds = " ".join(
                f"red{p}[lid] = red{p}[lid] + red{p}[lid + {u(step)}];" for p in range(len(packs))
            )
            lines += [f"  if (lane < {u(step)}) {{ {adds} }}", "  workgroupBarrier();"]
            step //= 2
        lines += [f"  r{p} = red{p}[lid];" for p in range(len(packs))]
    stores = []
    for p, ms in enumerate(packs):
        for c, m in enumerate(ms):
            v = f"r{p}" if len(ms) == 1 else f"r{p}.{'xyzw'[c]}"
            stores.append(kb.store(y, f"{u(m * out)} + col", v))
    lines += [
        f"  let col = wg * {u(WG // lanes)} + cl;",
        f"  if (lane == 0u && col < {u(out)}) {{ {' '.join(stores)} }}",
    ]
    return lines, helpers, extra


def _nbytes(graph: Graph, node) -> int:
    return sum(graph[i].type.nbytes for i in node.inputs) + node.type.nbytes


# ---- tiled -----------------------------------------------------------------------------------
def _tiled(graph: Graph, node_id: int, limits: Limits, rows: int, transposed: bool):
    """Output [rows, N] = A [rows, K] @ B [K, N] with B = W^T (``transposed``: N = out,
    K = in) or B = W (N = in, K = out)."""
    node = graph[node_id]
    kb = KernelBuilder(graph, node, limits)
    w_k = graph[node.inputs[0]].type.shape[-1]
    vec_a = w_k % 4 == 0
    if vec_a:
        x4, x1 = _x_reader(kb, graph, node.inputs[0])
    else:
        x4, x1 = None, kb.read(node.inputs[0], "x").at
    w = _Weights(kb, graph, node, vec=False)
    y = kb.write(node_id, "y")
    k_dim, n_dim = (w.n, w.out) if transposed else (w.out, w.n)
    tiles_n = -(-n_dim // TILE)
    groups = -(-rows // TILE) * tiles_n
    lines = [
        f"  let n0 = (wg % {u(tiles_n)}) * {u(TILE)};",
        f"  let m0 = (wg / {u(tiles_n)}) * {u(TILE)};",
        f"  let tx = lid % {u(TPR)};",
        f"  let ty = lid / {u(TPR)};",
        *(f"  var acc{i} = vec4<f32>(0.0);" for i in range(4)),
        f"  for (var k0 = 0u; k0 < {u(k_dim)}; k0 = k0 + {u(QK)}) {{",
    ]
    lines += ["    " + s for s in _load_a(x4, x1, rows, k_dim)]
    load_b = _load_b_transposed if transposed else _load_b
    lines += ["    " + s for s in load_b(w)]
    lines.append("    workgroupBarrier();")
    for kk in range(QK):
        lines += [
            f"    {{ let a = As[{u(kk * TPR)} + ty]; let b = Bs[{u(kk * TPR)} + tx];",
            *(f"      acc{i} += a.{'xyzw'[i]} * b;" for i in range(4)),
            "    }",
        ]
    lines += ["    workgroupBarrier();", "  }"]
    for i in range(4):
        lines.append(f"  {{ let r = m0 + ty * 4u + {u(i)};")
        for c in range(4):
            col = f"n0 + tx * 4u + {u(c)}"
            st = kb.store(y, f"r * {u(n_dim)} + {col}", f"acc{i}.{'xyzw'[c]}")
            lines.append(f"    if (r < {u(rows)} && {col} < {u(n_dim)}) {{ {st} }}")
        lines.append("  }")
    helpers = HELPERS + (
        f"\nvar<workgroup> As: array<vec4<f32>, {QK * TPR}>;"
        f"\nvar<workgroup> Bs: array<vec4<f32>, {QK * TPR}>;\n"
    )
    flops = 2 * rows * n_dim * k_dim
    suffix = "tiled" if transposed else "tiled_backward"
    return kb.finish(suffix, "\n".join(lines), WG, groups, helpers, flops, _nbytes(graph, node))


def _load_a(x4, x1, rows: int, k: int) -> list[str]:
    """Statements writing A[m0 .. m0 + 63, k0 .. k0 + 31] transposed into As (row r of the
    tile is lane r % 4 of As[kk * 16 + r / 4]); rows past the end are clamped (their outputs
    are not stored), columns past K read zero."""
    out = []
    last = u(rows - 1)
    if x4 is not None:  # 512 vec4: two per thread
        kq = "k0 / 4u + kq" if k % QK == 0 else f"min(k0 / 4u + kq, {u(k // 4 - 1)})"
        for j in range(2):
            out += [
                f"{{ let v = lid + {u(j * WG)}; let r = v / 8u; let kq = v % 8u;",
                f"  let a = {x4(f'min(m0 + r, {last}) * {u(k // 4)} + {kq}')};",
            ]
            for c in range(4):
                val = f"a.{'xyzw'[c]}"
                if k % QK:
                    val = f"select(0.0, {val}, k0 + kq * 4u < {u(k)})"
                out.append(f"  As[(kq * 4u + {u(c)}) * {u(TPR)} + r / 4u][r % 4u] = {val};")
            out.append("}")
        return out
    for j in range(QK * TILE // WG):  # scalars: eight per thread
        idx = f"min(m0 + r, {last}) * {u(k)} + min(k0 + kk, {u(k - 1)})"
        out += [
            f"{{ let v = lid + {u(j * WG)}; let r = v / {u(QK)}; let kk = v % {u(QK)};",
            f"  As[kk * {u(TPR)} + r / 4u][r % 4u] = select(0.0, {x1(idx)}, k0 + kk < {u(k)});",
            "}",
        ]
    return out


def _load_b_transposed(w: _Weights) -> list[str]:
    """Forward: Bs[kk][c] = W[n0 + c, k0 + kk]; thread (r = lid / 4, p = lid % 4) unpacks
    weights 8p .. 8p + 7 of block k0 / 32 of row n0 + r."""
    lines = [
        "{ let r = lid / 4u; let p = lid % 4u;",
        f"  let row = min(n0 + r, {u(w.out - 1)});",
        "  let blk = k0 / 32u;",
    ]
    lines += ["  " + s for s in w.block_scales("row", "blk", "")]
    if w.fmt.name == "q8_0":
        base = f"row * {u(w.row_words)} + k0 / 4u + p * 2u"
        for h in range(2):
            lines.append(f"  let v{h} = d * q8_unpack({w.word(f'{base} + {u(h)}')});")
            for c in range(4):
                lines.append(
                    f"  Bs[(p * 8u + {u(4 * h + c)}) * {u(TPR)} + r / 4u][r % 4u] = "
                    f"v{h}.{'xyzw'[c]};"
                )
    else:
        lines += [
            f"  let q = {w.word(f'row * {u(w.row_words)} + blk * 4u + p')};",
            "  let lo = d * q4_lo(q) + m;",
            "  let hi = d * q4_hi(q) + m;",
        ]
        for name, off in (("lo", 0), ("hi", 16)):
            for c in range(4):
                lines.append(
                    f"  Bs[({u(off)} + p * 4u + {u(c)}) * {u(TPR)} + r / 4u][r % 4u] = "
                    f"{name}.{'xyzw'[c]};"
                )
    return lines + ["}"]


def _load_b(w: _Weights) -> list[str]:
    """Input gradient: Bs[kk][c] = W[k0 + kk, n0 + c] (zero past out_features or
    in_features); thread (r = lid / 8, p = lid % 8) unpacks 8 weights of row k0 + r:
    block n0 / 32 + p / 4, part p % 4."""
    nblk = w.n // QK
    lines = [
        "{ let r = lid / 8u; let p = lid % 8u;",
        f"  let row = min(k0 + r, {u(w.out - 1)});",
        f"  let ok = k0 + r < {u(w.out)} && n0 / 32u + p / 4u < {u(nblk)};",
        f"  let blk = min(n0 / 32u + p / 4u, {u(nblk - 1)});",
        "  let j = p % 4u;",
    ]
    lines += ["  " + s for s in w.block_scales("row", "blk", "")]
    if w.fmt.name == "q8_0":
        base = f"row * {u(w.row_words)} + blk * 8u + j * 2u"
        for h in range(2):
            val = f"d * q8_unpack({w.word(f'{base} + {u(h)}')})"
            lines.append(
                f"  Bs[r * {u(TPR)} + p * 2u + {u(h)}] = select(vec4<f32>(0.0), {val}, ok);"
            )
    else:
        lines.append(f"  let q = {w.word(f'row * {u(w.row_words)} + blk * 4u + j')};")
        for name, off in (("lo", 0), ("hi", 4)):
            fn = "q4_lo" if name == "lo" else "q4_hi"
            val = f"d * {fn}(q) + m"
            lines.append(
                f"  Bs[r * {u(TPR)} + (p / 4u) * 8u + {u(off)} + j] = "
                f"select(vec4<f32>(0.0), {val}, ok);"
            )
    return lines + ["}"]

"""Pooling kernels: one thread per output element (forward) or per input element (backward).

Forward kernels read each window with its taps unrolled at generation, every load issued
before the first use (a padded tap reads the plane's first element and is then ignored); a
runtime loop serves windows above ``UNROLL_TAPS`` taps. Backward kernels gather instead of
scatter (WGSL has no float atomics): input element (ih, iw) visits the windows containing it
in output scan order (rows, then columns, ascending), so each sum adds the same terms in the
same order as PyTorch's CPU loop. Without dilation only the ``ceil(k / s)`` taps per dim
congruent to ``ih + pad`` modulo the stride can reach an element, so only those are tried.

max_pool2d's backward runs two dispatches: the argmax of every window (tap index, u32, in
scratch; first max in scan order, a NaN winning, as PyTorch's ``val > max || isnan(val)``),
then the gather, which adds g where a window's argmax is this element. Divisors (avg_pool2d)
and adaptive windows are recomputed in the kernel from the baked geometry.
"""

from __future__ import annotations

from ....dtypes import DType
from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.literals import f32_literal, u
from ..core.mathlib import helper_source

WG = 256
UNROLL_TAPS = 64


def _prologue(total: int, what: str = "i") -> str:
    return f"  let {what} = wg * {u(WG)} + lid;\n  if ({what} >= {u(total)}) {{ return; }}\n"


def _window_origin(attrs, h: int, w: int, oh: int, ow: int, total: int) -> str:
    """Statements: ``plane``, ``oh``/``ow`` and the window's top-left ``hs``/``ws`` (u32,
    wrapping below zero) of output element ``i``."""
    (sh, sw), (ph, pw) = attrs["stride"], attrs["padding"]
    return (
        _prologue(total)
        + f"  let plane = i / {u(oh * ow)};\n  let r = i % {u(oh * ow)};\n"
        + f"  let oh = r / {u(ow)};\n  let ow = r % {u(ow)};\n"
        + f"  let hs = oh * {u(sh)} - {u(ph)};\n  let ws = ow * {u(sw)} - {u(pw)};\n"
        + f"  let base = plane * {u(h * w)};\n"
    )


def _in_range(attrs, dil, size: int, extent: int, axis: int) -> bool:
    """Whether every tap of every window along ``axis`` lies inside the input."""
    k, s, p = attrs["kernel_size"][axis], attrs["stride"][axis], attrs["padding"][axis]
    return p == 0 and (extent - 1) * s + dil[axis] * (k - 1) < size


def _window(x, attrs, dil, h: int, w: int, oh: int, ow: int, step) -> str:
    """Visit the taps of window ``i`` in scan order: ``step(ok, v, tap)`` -> statements, with
    ``ok`` whether the tap is inside the input, ``v`` its value (garbage when not ok), ``tap``
    its index ``kh * KW + kw``.

    Small windows are unrolled with every load issued before the first ``step`` (each thread
    keeps all its loads in flight; out-of-range taps read element ``base``); large ones loop.
    """
    (kh, kw), (dh, dw) = attrs["kernel_size"], dil
    full_h, full_w = _in_range(attrs, dil, h, oh, 0), _in_range(attrs, dil, w, ow, 1)

    def cond(i: str, j: str) -> str:
        conds = ([] if full_h else [f"hs + {i} * {u(dh)} < {u(h)}"]) + (
            [] if full_w else [f"ws + {j} * {u(dw)} < {u(w)}"]
        )
        return " && ".join(conds) or "true"

    def addr(i: str, j: str) -> str:
        return f"(hs + {i} * {u(dh)}) * {u(w)} + ws + {j} * {u(dw)}"

    def load(ok: str, c: str, a: str) -> str:
        return x.at("base + " + (a if c == "true" else f"select(0u, {a}, {ok})"))

    if kh * kw > UNROLL_TAPS:
        c = cond("th", "tw")
        return (
            f"  for (var th = 0u; th < {u(kh)}; th = th + 1u) {{\n"
            f"  for (var tw = 0u; tw < {u(kw)}; tw = tw + 1u) {{\n"
            f"    let ok = {c};\n    let v = {load('ok', c, addr('th', 'tw'))};\n"
            + step("ok", "v", f"th * {u(kw)} + tw")
            + "  }\n  }\n"
        )
    taps = [(i, j) for i in range(kh) for j in range(kw)]
    text = ""
    for t, (i, j) in enumerate(taps):
        c = cond(u(i), u(j))
        text += f"  let ok{t} = {c};\n  let v{t} = {load(f'ok{t}', c, addr(u(i), u(j)))};\n"
    return text + "".join(step(f"ok{t}", f"v{t}", u(t)) for t in range(len(taps)))


_NAN = helper_source(["is_nan_f32"])


def _argmax_body(x, attrs, dil, h: int, w: int, oh: int, ow: int) -> str:
    """Statements leaving ``m`` (max) and ``mi`` (tap index) of window ``i``: the first
    maximum in scan order, a NaN winning (PyTorch's ``val > max || isnan(val)``)."""

    def step(ok: str, v: str, tap: str) -> str:
        take = f"m = {v}; mi = {tap}; found = true;"
        # NaN by bit pattern (``_NAN``): drivers fold ``v != v`` to false.
        return f"  if ({ok} && (!found || {v} > m || is_nan_f32({v}))) {{ {take} }}\n"

    body = "  var m = 0.0;\n  var mi = 0u;\n  var found = false;\n"
    return body + _window(x, attrs, dil, h, w, oh, ow, step)


def _dims(graph: Graph, node_id: int, x_pos: int = 0):
    node = graph[node_id]
    n, c, h, w = graph[node.inputs[x_pos]].type.shape
    return node, n * c, h, w


def lower_max_pool2d(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    node, planes, h, w = _dims(graph, node_id)
    a = node.attr_dict
    oh, ow = node.type.shape[2:]
    total = node.type.numel
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    out = kb.write(node_id, "out")
    body = _window_origin(a, h, w, oh, ow, total)
    body += _argmax_body(x, a, a["dilation"], h, w, oh, ow) + f"  {kb.store(out, 'i', 'm')}\n"
    taps = a["kernel_size"][0] * a["kernel_size"][1]
    return [kb.finish("", body, WG, -(-total // WG), _NAN, flops=total * taps)]


def _gather(attrs, dil, h: int, w: int, oh: int, ow: int, loads, step) -> str:
    """For input element ``i``, visit the windows containing it in output scan order:
    ``step(ok, c, tap)`` -> statements, where ``ok`` says whether candidate ``c`` is a real
    window, ``tap`` is the element's tap index in it, and ``loads(c, f)`` -> statements
    loading what ``step`` needs from flat output index ``f`` (a valid index even when not ok).

    Candidates come from kernel taps kh, kw taken in descending order (so output rows and
    columns ascend); small kernels are unrolled with all loads issued first.
    """
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    text = (
        f"  let plane = i / {u(h * w)};\n  let r = i % {u(h * w)};\n"
        f"  let ty = r / {u(w)} + {u(ph)};\n  let tx = r % {u(w)} + {u(pw)};\n"
        "  var acc = 0.0;\n"
    )

    def valid(v: str, s: int, n: int) -> str:
        return f"{v} < {u(s * n)}" + (f" && {v} % {u(s)} == 0u" if s > 1 else "")

    def flat(y: str, x: str) -> str:
        return f"plane * {u(oh * ow)} + ({y} / {u(sh)}) * {u(ow)} + {x} / {u(sw)}"

    if kh * kw > UNROLL_TAPS:
        return text + (
            f"  for (var a = 0u; a < {u(kh)}; a = a + 1u) {{\n"
            f"  for (var b = 0u; b < {u(kw)}; b = b + 1u) {{\n"
            f"    let y = ty - ({u(kh - 1)} - a) * {u(dil[0])};\n"
            f"    let x = tx - ({u(kw - 1)} - b) * {u(dil[1])};\n"
            f"    let ok = {valid('y', sh, oh)} && {valid('x', sw, ow)};\n"
            f"    let f = select(0u, {flat('y', 'x')}, ok);\n"
            + loads("", "f")
            + step("ok", "", f"({u(kh - 1)} - a) * {u(kw)} + {u(kw - 1)} - b")
            + "  }\n  }\n"
        )
    lines: list[str] = []
    rows = _candidates(lines, "ty", kh, sh, dil[0], oh, "y")
    cols = _candidates(lines, "tx", kw, sw, dil[1], ow, "x")
    order = [(r, c) for r in rows for c in cols]
    for n, ((vr, cr, _), (vc, cc, _)) in enumerate(order):
        lines.append(f"  let ok{n} = {vr} && {vc};\n")
        flat = f"plane * {u(oh * ow)} + ({cr}) * {u(ow)} + {cc}"
        lines.append(f"  let f{n} = select(0u, {flat}, ok{n});\n")
    lines += [loads(str(n), f"f{n}") for n in range(len(order))]
    for n, ((_, _, tr), (_, _, tc)) in enumerate(order):
        lines.append(step(f"ok{n}", str(n), f"({tr}) * {u(kw)} + {tc}"))
    return text + "".join(lines)


def _candidates(lines: list[str], t: str, k: int, s: int, d: int, n: int, name: str):
    """Along one dim, the windows holding padded coordinate ``t`` (input + padding), in
    ascending output order: (valid, output coordinate, tap) expressions; ``lines`` gets the
    statements they need. Without dilation only the ``ceil(k / s)`` taps congruent to ``t``
    modulo ``s`` can reach it; with dilation every tap is tried."""
    if d == 1:
        lines.append(f"  let {name}q = {t} / {u(s)};\n  let {name}r = {t} % {u(s)};\n")
        out = []
        for a in reversed(range(-(-k // s))):
            tap = f"{name}r + {u(a * s)}" if a else f"{name}r"
            coord = f"{name}q - {u(a)}" if a else f"{name}q"
            conds = ([f"{tap} < {u(k)}"] if (a + 1) * s > k else []) + [f"{coord} < {u(n)}"]
            out.append((" && ".join(conds), coord, tap))
        return out
    out = []
    for i in reversed(range(k)):
        v = f"{name}{i}"
        lines.append(f"  let {v} = {t} - {u(i * d)};\n")
        cond = f"{v} < {u(s * n)}" + (f" && {v} % {u(s)} == 0u" if s > 1 else "")
        out.append((f"({cond})", f"{v} / {u(s)}", u(i)))
    return out


def lower_max_pool2d_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    node, planes, h, w = _dims(graph, node_id)
    a = node.attr_dict
    oh, ow = graph[node.inputs[1]].type.shape[2:]
    n_out = planes * oh * ow
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    idx = kb.scratch("argmax", n_out, DType.u32, "argmax")
    body = _window_origin(a, h, w, oh, ow, n_out)
    body += _argmax_body(x, a, a["dilation"], h, w, oh, ow) + f"  {kb.store(idx, 'i', 'mi')}\n"
    first = kb.finish("argmax", body, WG, -(-n_out // WG), _NAN)

    kb = KernelBuilder(graph, node, limits)
    g = kb.read(node.inputs[1], "g")
    idx = kb.scratch("argmax", n_out, DType.u32, "argmax")
    out = kb.write(node_id, "dx")
    total = node.type.numel

    def loads(c: str, f: str) -> str:
        return f"  let t{c} = {idx}[{f}];\n  let g{c} = {g.at(f)};\n"

    def step(ok: str, c: str, tap: str) -> str:
        return f"  acc += select(0.0, g{c}, {ok} && t{c} == {tap});\n"

    gather = _gather(a, a["dilation"], h, w, oh, ow, loads, step)
    body = _prologue(total) + gather + f"  {kb.store(out, 'i', 'acc')}\n"
    return [first, kb.finish("gather", body, WG, -(-total // WG))]


def _divisor_fn(attrs, h: int, w: int) -> str:
    """WGSL ``fn divisor(oh, ow) -> f32``: ATen avg_pool2d's divide factor."""
    if attrs["divisor_override"] is not None:
        d = f32_literal(attrs["divisor_override"])
        return f"fn divisor(oh: u32, ow: u32) -> f32 {{ return {d}; }}\n"
    (kh, kw), (sh, sw), (ph, pw) = attrs["kernel_size"], attrs["stride"], attrs["padding"]
    lines = ["fn divisor(oh: u32, ow: u32) -> f32 {"]
    for v, k, s, p, size in (("h", kh, sh, ph, h), ("w", kw, sw, pw, w)):
        lines.append(f"  var {v}0 = i32(o{v} * {u(s)}) - {p}i;")
        lines.append(f"  var {v}1 = min({v}0 + {k}i, {size + p}i);")
        if not attrs["count_include_pad"]:
            lines.append(f"  {v}0 = max({v}0, 0i);\n  {v}1 = min({v}1, {size}i);")
    lines.append("  return f32((h1 - h0) * (w1 - w0));\n}\n")
    return "\n".join(lines)


def lower_avg_pool2d(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    node, planes, h, w = _dims(graph, node_id)
    a = node.attr_dict
    oh, ow = node.type.shape[2:]
    total = node.type.numel
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    out = kb.write(node_id, "out")
    body = _window_origin(a, h, w, oh, ow, total) + "  var s = 0.0;\n"
    step = lambda ok, v, tap: f"  s += select(0.0, {v}, {ok});\n"  # noqa: E731
    body += (
        _window(x, a, (1, 1), h, w, oh, ow, step)
        + f"  {kb.store(out, 'i', 's / divisor(oh, ow)')}\n"
    )
    taps = a["kernel_size"][0] * a["kernel_size"][1]
    helpers = _divisor_fn(a, h, w)
    return [kb.finish("", body, WG, -(-total // WG), helpers, flops=total * taps)]


def lower_avg_pool2d_backward(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    node = graph[node_id]
    a = node.attr_dict
    _, _, h, w = node.type.shape
    oh, ow = graph[node.inputs[0]].type.shape[2:]
    total = node.type.numel
    kb = KernelBuilder(graph, node, limits)
    g = kb.read(node.inputs[0], "g")
    out = kb.write(node_id, "dx")

    def loads(c: str, f: str) -> str:
        o = f"{f} % {u(oh * ow)}"
        return f"  let g{c} = {g.at(f)} / divisor(({o}) / {u(ow)}, ({o}) % {u(ow)});\n"

    step = lambda ok, c, tap: f"  acc += select(0.0, g{c}, {ok});\n"  # noqa: E731
    gather = _gather(a, (1, 1), h, w, oh, ow, loads, step)
    body = _prologue(total) + gather + f"  {kb.store(out, 'i', 'acc')}\n"
    return [kb.finish("", body, WG, -(-total // WG), _divisor_fn(a, h, w))]


def _bounds(v: str, size: int, out: int) -> str:
    """``v0``/``v1``: adaptive window [floor(o size / out), ceil((o + 1) size / out))."""
    return (
        f"  let {v}0 = (o{v} * {u(size)}) / {u(out)};\n"
        f"  let {v}1 = ((o{v} + 1u) * {u(size)} + {u(out - 1)}) / {u(out)};\n"
    )


def lower_adaptive_avg_pool2d(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    node, planes, h, w = _dims(graph, node_id)
    oh, ow = node.type.shape[2:]
    total = node.type.numel
    kb = KernelBuilder(graph, node, limits)
    x = kb.read(node.inputs[0], "x")
    out = kb.write(node_id, "out")
    body = _prologue(total)
    body += f"  let plane = i / {u(oh * ow)};\n  let r = i % {u(oh * ow)};\n"
    body += f"  let oh = r / {u(ow)};\n  let ow = r % {u(ow)};\n"
    body += _bounds("h", h, oh) + _bounds("w", w, ow) + "  var s = 0.0;\n"
    body += (
        "  for (var y = h0; y < h1; y = y + 1u) {\n"
        "    for (var z = w0; z < w1; z = z + 1u) {\n"
        f"      s += {x.at(f'plane * {u(h * w)} + y * {u(w)} + z')};\n    }}\n  }}\n"
        f"  {kb.store(out, 'i', 's / f32((h1 - h0) * (w1 - w0))')}\n"
    )
    return [kb.finish("", body, WG, -(-total // WG), flops=planes * h * w)]


def lower_adaptive_avg_pool2d_backward(
    graph: Graph, node_id: int, limits: Limits
) -> list[KernelSource]:
    node = graph[node_id]
    _, _, h, w = node.type.shape
    oh, ow = graph[node.inputs[0]].type.shape[2:]
    total = node.type.numel
    kb = KernelBuilder(graph, node, limits)
    g = kb.read(node.inputs[0], "g")
    out = kb.write(node_id, "dx")
    body = _prologue(total)
    body += f"  let plane = i / {u(h * w)};\n  let r = i % {u(h * w)};\n"
    body += f"  let ih = r / {u(w)};\n  let iw = r % {u(w)};\n  var acc = 0.0;\n"
    # Outputs whose window holds ih: [floor(ih OH / H), ceil((ih + 1) OH / H)).
    body += (
        f"  let y0 = (ih * {u(oh)}) / {u(h)};\n"
        f"  let y1 = ((ih + 1u) * {u(oh)} + {u(h - 1)}) / {u(h)};\n"
        f"  let z0 = (iw * {u(ow)}) / {u(w)};\n"
        f"  let z1 = ((iw + 1u) * {u(ow)} + {u(w - 1)}) / {u(w)};\n"
        "  for (var oh = y0; oh < y1; oh = oh + 1u) {\n"
        "    for (var ow = z0; ow < z1; ow = ow + 1u) {\n"
        + _bounds("h", h, oh).replace("  let", "      let")
        + _bounds("w", w, ow).replace("  let", "      let")
        + f"      acc += {g.at(f'plane * {u(oh * ow)} + oh * {u(ow)} + ow')} / "
        "f32((h1 - h0) * (w1 - w0));\n    }\n  }\n"
        f"  {kb.store(out, 'i', 'acc')}\n"
    )
    return [kb.finish("", body, WG, -(-total // WG))]

"""The flash-attention kernel family: the forward, its statistics and the three gradients.

One generator, six modes. A workgroup owns a tile of rows of one (batch, kv head) pair and
streams the other side through workgroup memory, one tile of entries at a time:
  * ``fwd``, ``stats``, ``dq``: rows are query rows of the kv head's whole query group (heads
    hk*G .. hk*G+G-1 are contiguous in memory, so a GQA group is one run of G*Lq rows and each
    K/V tile is read once for all G heads); the stream is the keys (K, V tiles);
  * ``dk``, ``dv``, ``dkv``: rows are keys; the stream is the query rows of each head of the
    group in turn (Q, dO and stats tiles), so dk and dv sum over the group's heads; ``dkv``
    computes both from one pass (the probabilities it forms for dk's score gradients are the
    weights of dv), writing the outputs of a key-gradient node and its value-gradient sibling.
Each thread holds its row's vectors (q or k, v, dO) and accumulators in named vec4 registers,
unrolled over the head dim at generation time; the ``lanes`` threads of a row split the stream
(entry ``t + lanes * u`` of each tile for lane t), then merge pairwise in workgroup memory
(online-softmax rescaling for the forward, sums for gradients). Scores are f32 and
max-subtracted (online softmax with a running max and sum per row, FlashAttention-2). Work
decomposition: ``plan``.

This module sets the kernel up (``lower_flash``: its operands, outputs and row registers) and
writes the rows' results; the loop over the stream tiles, the masking and the runtime key count
(``kv_length``), and the lanes' merge are ``lane_stream``'s; operand names per mode and the
running-max sentinel are ``common``'s.
"""

from __future__ import annotations

from ....graph.ir import Graph
from ...kernel import KernelSource, Limits
from ..core.builder import KernelBuilder
from ..core.layout import broadcast_strides
from ..core.literals import f32_literal, u
from .common import LOWEST, OPERANDS, PARTIALS, XYZW, dims_of, load4, read_extras, stride_sum
from .dq_delta import delta_registers, delta_sources, delta_stores
from .lane_stream import _Kernel, _merge, _stream_loops
from .plan import SOFTMAX_MODES, choose_plan, extents, shared_layout
from .splits import Split


def lower_flash(
    graph: Graph,
    node_id: int,
    limits: Limits,
    mode: str,
    value_node: int | None = None,
    split: Split | None = None,
    prologue=None,
    lse_node: int | None = None,
    deferred=None,
    delta_node: int | None = None,
) -> list[KernelSource]:
    """One dispatch of the flash kernel in ``mode`` for node ``node_id``; in ``dkv`` mode
    ``node_id`` is the key-gradient node and ``value_node`` its value-gradient sibling, whose
    output the kernel writes too. With ``lse_node`` (``fwd``, no split) the forward also
    writes that ``..._lse`` node's per-row log-sum-exp (``plan_attention_lse``); ``lse`` mode
    computes it alone (one pass over the keys, no output row). With ``delta_node`` (``dq``)
    the kernel computes and writes that ``..._delta`` node's pairs itself (``dq_delta``).
    With ``split`` (``fwd`` and ``dq``; ``splits.choose_split``, ``splits.choose_long_split``) the
    keys are cut into ``split.chunks`` chunks of ``split.length``, one workgroup per (row
    tile, chunk), each writing to the scratch ``PARTIALS`` its rows' unnormalized state (max
    m, sum l, output row) for ``decode.lower_merge``, or (``dq``) its rows' unscaled part of
    dq for ``dq_split.lower_dq_sum`` (chunk 0 stores the delta pairs). With ``prologue``
    (``fwd``) the queries are read unrotated and rotated in registers, and either the
    workgroup first writes its kv head's new keys and values into the caches it streams
    (``rope_attention``) or each key tile is rotated as it is copied to workgroup memory
    (``rope_prefill``). ``deferred``: split-K products read as
    the sums of their partials (``attention.summed``)."""
    node = graph[node_id]
    ins = node.inputs
    dims = dims_of(graph, node, mode)
    b, hkv, lq, lk, d, dv = dims.b, dims.hkv, dims.lq, dims.lk, dims.d, dims.dv
    hq = hkv * dims.group
    plan = choose_plan(mode, dims, limits) if split is None else split.plan
    n_rows = extents(mode, dims)[0]
    tiles = -(-n_rows // plan.rows)
    if node.type.numel == 0:
        return []
    if split is not None and mode not in ("fwd", "dq"):
        raise ValueError(f"split keys are for the forward and dq only, not {mode!r}")
    chunks = 1 if split is None else split.chunks

    kb = KernelBuilder(graph, node, limits, deferred)
    q_src = kb.read(ins[0], "q") if prologue is None else prologue.queries(kb)
    keys = getattr(prologue, "keys", None)  # rope_prefill: keys rotated as tiles load
    src = {"q": q_src, "k": kb.read(ins[1], "k") if keys is None else keys(kb)}
    n_fixed = 2 + len(OPERANDS[mode])
    for name, vid in zip(OPERANDS[mode], ins[2:n_fixed], strict=True):
        if name != "st" or delta_node is None:
            src[name] = kb.read(vid, name)
    if delta_node is not None:
        src.update(delta_sources(kb, graph, delta_node))
    mask, kvlen = read_extras(kb, graph, ins[n_fixed:])
    strides = broadcast_strides(mask.type.shape, (b, hq, lq, lk)) if mask else (0, 0, 0, 0)
    total, layout = shared_layout(mode, dims, plan)
    if split is None:
        outs = {"out": kb.write(node_id, "out")}
    else:  # per (row, chunk): fwd (m, l, output row), dq its unscaled row of dq
        count = b * hq * lq * chunks * (dv + 2 if mode == "fwd" else d)
        outs = {"out": kb.scratch(PARTIALS, count, node.type.dtype, "part")}
    k = _Kernel(mode, dims, plan, layout, src, mask, strides,
                f32_literal(node.attr("scale")), bool(node.attr("is_causal")), kvlen,
                split, kb, outs["out"], prologue, delta_node is not None)  # fmt: skip
    if mode == "dkv":
        outs["dv"] = kb.write(value_node, "dv")
    if lse_node is not None:
        if mode != "fwd" or split is not None:
            raise ValueError(f"only an unsplit forward writes a log-sum-exp, not {mode!r}")
        outs["lse"] = kb.write(lse_node, "lse")
    if delta_node is not None:  # dq only (dq_delta)
        outs["delta"] = kb.write(delta_node, "st")

    lines = [] if split is None else [f"  let chunk = wg % {u(chunks)};"]
    wgt = "wg" if split is None else f"(wg / {u(chunks)})"
    lines += [
        f"  let tile = {wgt} % {u(tiles)};",
        f"  let bh = {wgt} / {u(tiles)};",
        f"  let b = bh / {u(hkv)};",
        f"  let hk = bh % {u(hkv)};",
        f"  let t = lid % {u(plan.lanes)};" if plan.lanes > 1 else "  let t = 0u;",
        f"  let r = lid / {u(plan.lanes)};" if plan.lanes > 1 else "  let r = lid;",
        f"  let row = tile * {u(plan.rows)} + r;",
        f"  let live = row < {u(n_rows)};",
        f"  let rowc = min(row, {u(n_rows - 1)});",
    ]
    if prologue is not None:
        lines += prologue.cache_writes(kb, plan.size)
    lines += _row_registers(k)
    lines += _stream_loops(k)
    lines += _merge(k)
    lines += _finish(k, kb, outs)
    helpers = f"var<workgroup> sh: array<vec4<f32>, {total}>;\n"
    if prologue is not None:
        helpers += prologue.helpers()
    per_pair = {"fwd": d + dv, "stats": d, "lse": d, "dq": 2 * d + dv, "dk": 2 * d + dv,
                "dv": d + dv, "dkv": 2 * d + 2 * dv}  # fmt: skip
    flops = 2 * b * hq * lq * lk * per_pair[mode] // (2 if k.causal else 1)
    groups = b * hkv * tiles * chunks
    suffix = mode if split is None else f"{mode} split {chunks}x{split.length}"
    return [kb.finish(suffix, "\n".join(lines), plan.size, groups, helpers, flops=flops)]


def _row_registers(k: _Kernel) -> list[str]:
    """The row's own vectors, loaded once, and zeroed accumulators."""
    d, dv, lq, G = k.dims.d, k.dims.dv, k.dims.lq, k.dims.group
    sb, sh, si, _ = k.mask_strides
    if k.query_rows:
        lines = [
            f"  let qrow = bh * {u(G * lq)} + rowc;",
            f"  let ri = rowc % {u(lq)};",
            f"  let rh = hk * {u(G)} + rowc / {u(lq)};",
            f"  let mrow = {stride_sum([('b', sb), ('rh', sh), ('ri', si)])};",
            f"  let qb = {k.src['q'].row_offset('qrow')};",
        ]
        if k.prologue is None:
            lines += [f"  let q{c} = {load4(k.src['q'], 'qb', c, d)};" for c in range(k.dims.d4)]
        else:  # q{c} from the rotation's operand, rotated (rope_attention, rope_prefill)
            lines += k.prologue.load_queries(k)
        if k.mode == "dq":
            lines.append(f"  let gb = {k.src['dout'].row_offset('qrow')};")
            lines += [
                f"  let g{c} = {load4(k.src['dout'], 'gb', c, dv)};" for c in range(k.dims.dv4)
            ]
            if k.delta:
                lines += delta_registers(k)
            else:
                lines.append(f"  let lse = {k.src['st'].at('qrow * 2u')};")
                lines.append(f"  let delta = {k.src['st'].at('qrow * 2u + 1u')};")
    else:
        lines = [f"  let krow = bh * {u(k.dims.lk)} + rowc;"]
        lines.append(f"  let ko = {k.src['k'].row_offset('krow')};")
        lines += [f"  let k{c} = {load4(k.src['k'], 'ko', c, d)};" for c in range(k.dims.d4)]
        if k.mode in ("dk", "dkv"):
            lines.append(f"  let vb = {k.src['v'].row_offset('krow')};")
            lines += [f"  let v{c} = {load4(k.src['v'], 'vb', c, dv)};" for c in range(k.dims.dv4)]
    lines += [f"  var {a} = vec4<f32>(0.0);" for a in k.accs]
    if k.mode in SOFTMAX_MODES:
        lines += [f"  var m = {LOWEST};", "  var l = 0.0;"]
    return lines


def _store(
    kb: KernelBuilder,
    out: str,
    base: str,
    n: int,
    count: int,
    factor: str = "",
    acc: str = "acc",
    offset: bool = False,
) -> list[str]:
    """Stores of the row's accumulators at ``base`` (a storage offset with ``offset``)."""
    return [
        "    " + kb.store(out, f"{base} + {u(4 * c + e)}", f"{acc}{c}.{XYZW[e]}{factor}", offset)
        for c in range(count)
        for e in range(4)
        if 4 * c + e < n
    ]


def _finish(k: _Kernel, kb: KernelBuilder, outs: dict[str, str]) -> list[str]:
    """Lane 0 of each live row writes its result (dkv: to ``outs["out"]`` and ``outs["dv"]``)."""
    d, dv = k.dims.d, k.dims.dv
    out = outs["out"]
    lines = ["  if (live && t == 0u) {" if k.plan.lanes > 1 else "  if (live) {"]
    if k.split is not None and k.mode == "dq":  # this chunk's part of dq, unscaled
        lines.append(f"    let pb = (qrow * {u(k.split.chunks)} + chunk) * {u(d)};")
        lines += _store(kb, out, "pb", d, k.dims.d4)
        if "delta" in outs:  # every chunk computed it; the first stores it
            lines += ["    if (chunk == 0u) {", *delta_stores(kb, outs["delta"]), "    }"]
    elif k.split is not None:  # unnormalized partial state: m, l, then the output row
        n = dv + 2
        lines += [
            f"    let pb = (qrow * {u(k.split.chunks)} + chunk) * {u(n)};",
            "    " + kb.store(out, "pb", "m"),
            "    " + kb.store(out, "pb + 1u", "l"),
        ]
        lines += _store(kb, out, "pb + 2u", dv, k.dims.dv4)
    elif k.mode == "fwd":
        ob = kb.row_offset(out, "qrow", dv)
        lines += ["    let inv = select(0.0, 1.0 / l, l > 0.0);", f"    let ob = {ob};"]
        lines += _store(kb, out, "ob", dv, k.dims.dv4, " * inv", offset=True)
        if "lse" in outs:
            lines.append("    " + kb.store(outs["lse"], "qrow", "select(0.0, m + log(l), l > 0.0)"))
    elif k.mode == "lse":
        lines.append("    " + kb.store(out, "qrow", "select(0.0, m + log(l), l > 0.0)"))
    elif k.mode == "stats":
        lines.append(f"    let gb = {k.src['dout'].row_offset('qrow')};")
        lines.append(f"    let ob = {k.src['o'].row_offset('qrow')};")
        lines.append("    var delta = 0.0;")
        for c in range(k.dims.dv4):
            g, o = load4(k.src["dout"], "gb", c, dv), load4(k.src["o"], "ob", c, dv)
            lines.append(f"    delta = delta + dot({g}, {o});")
        lines += [
            "    " + kb.store(out, "qrow * 2u", "select(0.0, m + log(l), l > 0.0)"),
            "    " + kb.store(out, "qrow * 2u + 1u", "delta"),
        ]
    elif k.mode == "dq":
        lines.append(f"    let ob = {kb.row_offset(out, 'qrow', d)};")
        lines += _store(kb, out, "ob", d, k.dims.d4, f" * {k.scale}", offset=True)
        if "delta" in outs:
            lines += delta_stores(kb, outs["delta"])
    elif k.mode in ("dk", "dkv"):
        lines.append(f"    let kob = {kb.row_offset(out, 'krow', d)};")
        lines += _store(kb, out, "kob", d, k.dims.d4, f" * {k.scale}", offset=True)
        if k.mode == "dkv":
            lines.append(f"    let ob = {kb.row_offset(outs['dv'], 'krow', dv)};")
            lines += _store(kb, outs["dv"], "ob", dv, k.dims.dv4, acc="vacc", offset=True)
    else:
        lines.append(f"    let ob = {kb.row_offset(out, 'krow', dv)};")
        lines += _store(kb, out, "ob", dv, k.dims.dv4, offset=True)
    return lines + ["  }"]

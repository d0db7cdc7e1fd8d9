"""Optimizer update lowerings: ``sgd_update``, ``sgd_momentum_update``, ``adam_update``, one
kernel per parameter (``lower_update``) or one per update group (``lower_update_group``); and
``accumulate``, the in-place gradient accumulation of micro-batch training (``lower_accumulate``);
and the non-finite guard's kernels (``lower_found_inf``, ``lower_guard_clip``,
``lower_guard_count``).

Four parameter elements per thread (``core.layout.element_slots``). Operands are ``(param, grad,
hyper, clip, *state)``; the param and state buffers are bound ``read_write`` and updated in
place, and the op's token value is never bound. ``hyper`` (learning rate, bias corrections) is
read from its buffer so schedules change without recompiling; ``clip`` is read, or inlined when
it is a constant. A ``clip`` that is not a constant is tested first: non-finite (the guard
tripped, ``ops/update.py``), the kernel returns before any load or store, so the parameter and
its state keep their bits.

The statements mirror ``meganeura/ops/update.py`` (``_sgd_np``, ``_adam_np``) operation by
operation, with Python-float attributes rounded to f32 as NumPy does when it combines them with
float32 arrays, so results match torch.optim to float32 rounding.
"""

from __future__ import annotations

from collections.abc import Callable

from ...dtypes import DType
from ...graph.ir import Graph
from ..kernel import KernelSource, Limits, UpdateGroup
from .core.builder import KernelBuilder, Src
from .core.layout import PER_THREAD, WG, element_slots
from .core.literals import f32_literal, nonfinite_f32, u

# A non-finite f32 has every exponent bit set. Tested on the bits: WGSL compilers may assume
# floats are finite and fold ``x != x`` to false.
EXP_MASK = "0x7f800000u"


def is_nonfinite(expr: str) -> str:
    """WGSL bool: whether f32 ``expr`` is inf or NaN, by its bit pattern."""
    return f"((bitcast<u32>({expr}) & {EXP_MASK}) == {EXP_MASK})"


# found_inf's first pass: at most this many workgroups, each thread striding over the elements,
# UNROLL loads at a time (a read-only pass over every gradient: on the H200, SmolVLA's 399 MB
# took 147 us, 2.7 TB/s, with one load a thread per iteration)
FOUND_INF_GROUPS = 1024
UNROLL = 4


def set_found_inf_unroll(on: bool) -> None:
    """found_inf's first pass loads ``UNROLL`` = 4 strides at a time (True, the default) or
    one (False: as before 2026-12-04's tenth session; lever ``found_inf_unroll``)."""
    global UNROLL
    UNROLL = 4 if on else 1


# Workgroup memory is not zeroed for us (pipelines may be created without wgpu's zero
# initialization): one thread clears the workgroup's maximum before anyone uses it.
ZERO_WORST = ["  if (lid == 0u) { atomicStore(&worst, 0u); }", "  workgroupBarrier();"]


def lower_found_inf(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``found_inf(*xs)`` (``ops/update.py``) in two kernels: workgroups stride over every
    element of every operand (``UNROLL`` strides at a time, then one) and keep the largest
    exponent field (``bits & 0x7f800000``, a workgroup ``atomicMax``) in scratch; one
    workgroup reduces those and writes inf when it is all ones, else 0. Integer max is exact
    and order-free, so the result is deterministic."""
    node = graph[node_id]
    total = sum(graph[x].type.numel for x in node.inputs)
    groups = max(1, min(FOUND_INF_GROUPS, -(-total // (PER_THREAD * WG))))
    stride = groups * WG
    shared = "var<workgroup> worst: atomic<u32>;\n"
    kb = KernelBuilder(graph, node, limits)
    srcs = [(kb.read(x, f"x{k}"), graph[x].type.numel) for k, x in enumerate(node.inputs)]
    part = kb.scratch("part", groups, DType.u32, "part")
    lines = [*ZERO_WORST, f"  let gid = wg * {u(WG)} + lid;"]
    lines += [f"  var e{k} = 0u;" for k in range(UNROLL)]
    for src, n in srcs:
        if n == 0 or src.literal is not None:  # constants are finite
            continue

        def exponent(k: int, at: str, src=src) -> str:
            return f"e{k} = max(e{k}, bitcast<u32>({src.at(at)}) & {EXP_MASK});"

        # UNROLL independent loads in flight a thread (one loop-carried max each), then the
        # elements left one at a time
        lines += ["  {", "    var i = gid;"]
        if (UNROLL - 1) * stride < n:  # else no thread has UNROLL strides of this operand
            at = ["i", *(f"i + {u(k * stride)}" for k in range(1, UNROLL))]
            body = " ".join(exponent(k, a) for k, a in enumerate(at))
            lines.append(
                f"    for (; i + {u((UNROLL - 1) * stride)} < {u(n)}; "
                f"i = i + {u(UNROLL * stride)}) {{ {body} }}"
            )
        lines += [f"    for (; i < {u(n)}; i = i + {u(stride)}) {{ {exponent(0, 'i')} }}", "  }"]
    e = "e0"
    for k in range(1, UNROLL):
        e = f"max({e}, e{k})"
    lines += [
        f"  let e = {e};",
        "  atomicMax(&worst, e);",
        "  workgroupBarrier();",
        f"  if (lid == 0u) {{ {part}[wg] = atomicLoad(&worst); }}",
    ]
    first = kb.finish(
        "partial", "\n".join(lines), WG, groups, shared, flops=total, nbytes=4 * total
    )
    kb = KernelBuilder(graph, node, limits)
    part = kb.scratch("part", groups, DType.u32, "part")
    out = kb.write(node_id, "out")
    inf = nonfinite_f32(float("inf"))
    lines = [
        *ZERO_WORST,
        "  var e = 0u;",
        f"  for (var i = lid; i < {u(groups)}; i = i + {u(WG)}) {{ e = max(e, {part}[i]); }}",
        "  atomicMax(&worst, e);",
        "  workgroupBarrier();",
        "  if (lid == 0u) { "
        + kb.store(out, "0u", f"select(0.0, {inf}, atomicLoad(&worst) == {EXP_MASK})")
        + " }",
    ]
    second = kb.finish("combine", "\n".join(lines), WG, 1, shared, flops=groups, nbytes=4 * groups)
    return [first, second]


def lower_guard_clip(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``guard_clip(clip, skipped, reset, *checked)`` (``ops/update.py``): one thread writes
    ``clip``, or NaN when a checked scalar is non-finite (or, ``sticky``, when steps were
    skipped since the host's last read)."""
    node = graph[node_id]
    c_id, s_id, r_id, *checked = node.inputs
    kb = KernelBuilder(graph, node, limits)
    out = kb.write(node_id, "out")
    clip = kb.read(c_id, "clip")
    srcs = [kb.read(v, f"checked{k}") for k, v in enumerate(checked)]
    trips = [is_nonfinite(src.at("0u")) for src in srcs]
    if node.attr("sticky"):
        skipped, reset = kb.read(s_id, "skipped"), kb.read(r_id, "reset")
        trips.append(f"({reset.at('0u')} == 0.0 && {skipped.at('0u')} != 0.0)")
    lines = [
        f"  let trip = {' || '.join(trips)};",
        "  " + kb.store(out, "0u", f"select({clip.at('0u')}, {nonfinite_f32(float('nan'))}, trip)"),
    ]
    return [kb.finish("", "\n".join(lines), 1, 1, flops=len(trips), nbytes=4 * (len(trips) + 2))]


def lower_guard_count(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``guard_count(skipped, clip, reset)``: ``skipped = (0 if reset else skipped) + (1 if
    clip is non-finite else 0)`` in place, one thread."""
    node = graph[node_id]
    s_id, c_id, r_id = node.inputs
    kb = KernelBuilder(graph, node, limits)
    skipped = kb.write(s_id, "skipped")
    clip, reset = kb.read(c_id, "clip"), kb.read(r_id, "reset")
    base = f"select({kb.load(skipped, '0u')}, 0.0, {reset.at('0u')} != 0.0)"
    bad = f"select(0.0, 1.0, {is_nonfinite(clip.at('0u'))})"
    lines = ["  " + kb.store(skipped, "0u", f"{base} + {bad}")]
    return [kb.finish("", "\n".join(lines), 1, 1, flops=2, nbytes=12)]


def lower_update(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """SGD (plain or momentum/Nesterov) or Adam/AdamW step on one parameter tensor.

    ``PER_THREAD`` elements per thread: every load first, then per element the update and
    its guarded stores (see ``core.layout.element_slots``).
    """
    node = graph[node_id]
    p_id, g_id, h_id, c_id, *state = node.inputs
    n = graph[p_id].type.numel
    if n == 0:
        return []
    kb = KernelBuilder(graph, node, limits)
    p = kb.write(p_id, "param")
    g = kb.read(g_id, "grad")
    hyper = kb.read(h_id, "hyper")
    clip = kb.read(c_id, "clip")
    names = ("state0", "state1")[: len(state)]
    st = [kb.write(s, name) for s, name in zip(state, names, strict=True)]
    slots, groups, guard = element_slots(n)
    load_g = lambda e: g.at(f"j{e}")  # noqa: E731
    lines = [slots.rstrip(), *_preamble(node.op, hyper, clip, bool(st))]
    lines += _elements(kb, node.attr_dict, node.op, p, load_g, st, guard, "i")
    # p and g read, p written, each state read and written (Adam: 7 x 4 bytes an element)
    nbytes = graph[p_id].type.nbytes * (3 + 2 * len(state))
    return [kb.finish("", "\n".join(lines), WG, groups, flops=10 * n, nbytes=nbytes)]


def lower_accumulate(graph: Graph, node_id: int, limits: Limits) -> list[KernelSource]:
    """``acc = first ? value : acc + value`` in place (``ops/update.py``), ``PER_THREAD``
    elements per thread; ``select`` rather than ``first * acc``, so a NaN left in ``acc`` by an
    earlier step is dropped on a first micro-batch."""
    node = graph[node_id]
    a_id, v_id, f_id = node.inputs
    t = graph[a_id].type
    if t.numel == 0:
        return []
    kb = KernelBuilder(graph, node, limits)
    acc = kb.write(a_id, "acc")
    value = kb.read(v_id, "value")
    first = kb.read(f_id, "first")
    slots, groups, guard = element_slots(t.numel)
    lines = [slots.rstrip(), f"  let first = {first.at('0u')} != 0.0;"]
    for e in range(PER_THREAD):
        lines.append(f"  let a_{e} = {kb.load(acc, f'j{e}')};")
        lines.append(f"  let v_{e} = {value.at(f'j{e}')};")
    for e in range(PER_THREAD):
        stmt = kb.store(acc, f"i{e}", f"select(a_{e} + v_{e}, v_{e}, first)")
        lines.append("  " + guard(e, stmt))
    nbytes = 3 * t.nbytes
    return [kb.finish("", "\n".join(lines), WG, groups, flops=t.numel, nbytes=nbytes)]


def lower_update_group(graph: Graph, group: UpdateGroup, limits: Limits) -> KernelSource:
    """One kernel running the update ops of ``group`` (``schedule.update_groups``).

    The parameter, gradient and state arenas are bound whole. Member ``k`` covers
    ``ceil(numel_k / (PER_THREAD * WG))`` workgroups; a workgroup finds its member in a baked
    binary search over the first workgroup of each member, then runs exactly the statements of
    ``lower_update`` on elements ``offsets[k] + i`` for ``i < numel_k``, so every parameter gets
    the same f32 operations as with one kernel per parameter and no padding is touched.
    """
    node = graph[group.sink]
    _, _, h_id, c_id, *state = node.inputs
    kb = KernelBuilder(graph, node, limits)
    dtype = graph[node.inputs[0]].type.dtype
    p = kb.arena(group.arena_key("param"), dtype, "param", write=True)
    g = kb.arena(group.arena_key("grad"), dtype, "grad", write=False)
    hyper = kb.read(h_id, "hyper")
    clip = kb.read(c_id, "clip")
    st = [
        kb.arena(group.arena_key(f"state{k}"), dtype, f"state{k}", write=True)
        for k in range(len(state))
    ]
    block = PER_THREAD * WG
    numels = [graph[graph[m].inputs[0]].type.numel for m in group.members]
    first_wg = [0]
    for n in numels:
        first_wg.append(first_wg[-1] + -(-n // block))

    def search(lo: int, hi: int, pad: str) -> list[str]:
        if hi - lo == 1:
            return [
                f"{pad}seg_wg = {u(first_wg[lo])}; seg_base = {u(group.offsets[lo])}; "
                f"seg_n = {u(numels[lo])};"
            ]
        mid = (lo + hi) // 2
        return [
            f"{pad}if (wg < {u(first_wg[mid])}) {{",
            *search(lo, mid, pad + "  "),
            f"{pad}}} else {{",
            *search(mid, hi, pad + "  "),
            f"{pad}}}",
        ]

    lines = ["  var seg_wg = 0u;", "  var seg_base = 0u;", "  var seg_n = 0u;"]
    lines += search(0, len(numels), "  ")
    lines.append(f"  let i0 = (wg - seg_wg) * {u(block)} + lid;")
    lines += [f"  let i{e} = i0 + {u(e * WG)};" for e in range(1, PER_THREAD)]
    lines += [f"  let j{e} = seg_base + min(i{e}, seg_n - 1u);" for e in range(PER_THREAD)]
    lines += [f"  let k{e} = seg_base + i{e};" for e in range(PER_THREAD)]
    lines += _preamble(node.op, hyper, clip, bool(st))

    def guard(e: int, stmt: str) -> str:
        return f"if (i{e} < seg_n) {{ {stmt} }}"

    load_g = lambda e: kb.load(g, f"j{e}")  # noqa: E731
    lines += _elements(kb, node.attr_dict, node.op, p, load_g, st, guard, "k")
    total = sum(numels)
    nbytes = total * dtype.itemsize * (3 + 2 * len(state))  # as lower_update's
    suffix = f"group of {len(group.members)}"
    return kb.finish(suffix, "\n".join(lines), WG, first_wg[-1], flops=10 * total, nbytes=nbytes)


def _preamble(op: str, hyper: Src, clip: Src, has_state: bool) -> list[str]:
    lines = [f"  let lr = {hyper.at('0u')};", f"  let clip = {clip.at('0u')};"]
    if clip.literal is None:  # the guard's NaN: skip the step (a uniform branch)
        lines.append(f"  if {is_nonfinite('clip')} {{ return; }}")
    if op == "adam_update":
        lines += [f"  let step_size = {hyper.at('1u')};", f"  let bc2_sqrt = {hyper.at('2u')};"]
    elif has_state:
        lines.append(f"  let first = {hyper.at('1u')} != 0.0;")
    return lines


def _elements(
    kb: KernelBuilder,
    a: dict,
    op: str,
    p: str,
    load_g: Callable[[int], str],
    st: list[str],
    guard: Callable[[int, str], str],
    store_at: str,
) -> list[str]:
    """Every element's loads (at ``j{e}``), then per element the update and its guarded stores
    (at ``{store_at}{e}``)."""
    wd = float(a.get("weight_decay") or 0.0)
    lines = []
    for e in range(PER_THREAD):
        lines.append(f"  let p_{e} = {kb.load(p, f'j{e}')};")
        lines.append(f"  let g_{e} = {load_g(e)};")
        lines += [f"  let s{k}_{e} = {kb.load(b, f'j{e}')};" for k, b in enumerate(st)]
    for e in range(PER_THREAD):
        state_in = [f"s{k}_{e}" for k in range(len(st))]
        if op == "adam_update":
            body = _adam(a, wd, f"g_{e}", state_in)
        else:
            body = _sgd(a, wd, f"g_{e}", state_in)
        at = f"{store_at}{e}"
        stores = [kb.store(p, at, "p")] + [kb.store(b, at, f"s{k}") for k, b in enumerate(st)]
        lines.append(f"  {{\n    var p = p_{e};")
        lines += ["  " + line for line in body]
        lines.append("    " + guard(e, " ".join(stores)) + "\n  }")
    return lines


def _sgd(a: dict, wd: float, g: str, state: list[str]) -> list[str]:
    """Update ``p`` (and ``s0``, the momentum buffer) as ``_sgd_np`` does."""
    lines = [f"  var d = {g} * clip;"]
    if a["maximize"]:
        lines.append("  d = -d;")
    if wd:
        lines.append(f"  d = d + {f32_literal(wd)} * p;")
    if state:
        mom = f32_literal(a["momentum"])
        damp = f32_literal(1 - a["dampening"])
        lines += [
            f"  let s0 = select({mom} * {state[0]} + {damp} * d, d, first);",
            f"  d = d + {mom} * s0;" if a["nesterov"] else "  d = s0;",
        ]
    lines.append("  p = p - lr * d;")
    return lines


def _adam(a: dict, wd: float, g: str, state: list[str]) -> list[str]:
    """Update ``p``, ``s0`` (first moment) and ``s1`` (second moment) as ``_adam_np`` does."""
    b1, b2 = a["beta1"], a["beta2"]
    lines = [f"  var g = {g} * clip;"]
    if a["maximize"]:
        lines.append("  g = -g;")
    if wd and a["decoupled"]:
        lines.append(f"  p = p * (1.0 - lr * {f32_literal(wd)});")
    elif wd:
        lines.append(f"  g = g + {f32_literal(wd)} * p;")
    m, v = state
    lines += [
        f"  let s0 = {m} + {f32_literal(1 - b1)} * (g - {m});",
        f"  let s1 = {f32_literal(b2)} * {v} + {f32_literal(1 - b2)} * g * g;",
        f"  p = p - step_size * s0 / (sqrt(s1) / bc2_sqrt + {f32_literal(a['eps'])});",
    ]
    return lines

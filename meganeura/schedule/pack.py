"""Packing: neighbouring dispatches that do not depend on each other run as one dispatch.

Every dispatch of a step that writes storage waits for the one before it: wgpu records a
pipeline barrier before it whenever one of its buffers changes use, and a written buffer
always does. On the H200 (Vulkan) a dispatch that does almost nothing still occupies 5.6-7.5
us of GPU time (``docs/profiling.md``), so a training step of ~900 small kernels spends a third
of its time between kernels. Kernels that neither read nor write what the other writes (a
linear layer's input gradient and its weight gradient, a norm's weight-gradient sum and the
next matmul, BatchNorm statistics of four layers) can share one dispatch instead: workgroups
``[0, g0)`` run the first kernel, ``[g0, g0 + g1)`` the second, and so on. What each workgroup
computes is unchanged, so the results are the same bits.

``pack_program`` walks the dispatch list in order and packs runs of dispatches that:
  * have the same ``@workgroup_size`` and an entry point of the shape the kernel builder
    writes (``fn main`` last, builtins only among ``ENTRY_BUILTINS``);
  * bind no buffer range that another member writes, and no buffer both read-only and
    writable (``program.binding_conflict``: wgpu tracks use per buffer, not per range);
  * fit the adapter's storage bindings per stage and workgroup storage together
    (``Limits``), at most ``MAX_MEMBERS`` kernels;
  * run no ``accumulate`` into a gradient accumulator: those stay their own dispatches, so that
    the overlapped data-parallel step (``runtime.segments.plan_segments``) can move each one up
    to just after its gradient.
A run starts at the first dispatch not yet placed and takes members from the dispatches
after it, in order, looking past at most ``LOOKAHEAD`` (4) that cannot join; a member taken
from past others must commute with each of them (``program.commute``: neither writes a byte
range the other binds, the hazards ``runtime.segments`` also reorders by), and those passed run
after the run in their order. So every kernel still reads exactly the bytes it read in
program order: the results are the same bits. The lookahead finds what neighbours alone miss
in conv nets (a bottleneck block's shortcut conv beside its main branch, a BatchNorm's
gradient pieces across the conv gradients between them): on the H200's limits ResNet-50's
training step at batch 4 355 -> 346 dispatches, whisper-tiny's encoder step 158 -> 141,
SmolLM2's 769 -> 768, for 0.02-0.03 s more of compile time (lookahead 16: no more dispatches
saved, up to 0.12 s more).

The packed WGSL keeps each member's module: its declarations renamed with a ``_p<k>`` suffix
(bindings renumbered after the previous members'), its entry point turned into a function
``main_p<k>`` taking its builtins as arguments, and a new ``main`` that picks the member from
the linear workgroup id (its ``num_workgroups`` the member's grid, z kept opaque to the
shader compiler as the builder's kernels need: ``codegen.wgsl.core.literals``).
``workgroup_id`` and ``num_workgroups`` are uniform builtins (WGSL spec, "Uniformity
analysis"), so each member's barriers stay in uniform control flow.
Workgroup variables of the same name and element type are declared once at the largest
length: only one member runs in any workgroup.

Switches: ``set_enabled`` (default on; ``bench/lever_ab.py`` lever ``pack``) and
``set_lookahead`` (default on; lever ``pack_lookahead``).
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from dataclasses import dataclass, replace

from ..codegen.kernel import Limits
from ..codegen.wgsl.core.layout import fold_grid
from .program import Dispatch, Program, binding_conflict, commute, read_write_ranges

ENABLED = True
MAX_MEMBERS = 4  # kernels in one packed dispatch
# dispatches a run may look past for members (0: neighbours only, as before 2026-12-04's tenth
# session); a member from further on commutes with every dispatch it passes
LOOKAHEAD = 4
SEPARATOR = " & "  # between member names in a packed dispatch's name
# builtins a member's entry point may take, and how the packed main passes each on
ENTRY_BUILTINS = frozenset(
    {
        "workgroup_id",
        "num_workgroups",
        "local_invocation_index",
        "local_invocation_id",
        "subgroup_size",
        "subgroup_invocation_id",
    }
)


def set_enabled(on: bool) -> None:
    """Pack independent neighbouring dispatches (True, the default) or leave each alone."""
    global ENABLED
    ENABLED = bool(on)


def set_lookahead(on: bool | int) -> None:
    """Let a run take members from up to 4 dispatches on (True, the default; an int: that
    many) or from its neighbours only (False or 0)."""
    global LOOKAHEAD
    LOOKAHEAD = 4 if on is True else int(on)


@dataclass(frozen=True)
class Module:
    """One kernel's WGSL split into the parts packing rewrites."""

    enables: tuple[str, ...]
    items: tuple[str, ...]  # module-scope declarations other than workgroup variables
    names: tuple[str, ...]  # identifiers those declare
    workgroup: tuple[tuple[str, str], ...]  # (name, type) of each workgroup variable
    size: str  # the @workgroup_size argument text
    args: tuple[tuple[str, str, str], ...]  # (builtin, name, type) of main's arguments
    body: str  # main's body, without its braces


_ENTRY = re.compile(r"@compute\s+@workgroup_size\(([^)]*)\)\s*fn\s+main\s*\(")
_ARG = re.compile(r"@builtin\((\w+)\)\s*(\w+)\s*:\s*(.+)")
_DECL = re.compile(
    r"(?:@\w+(?:\([^)]*\))?\s+)*(?:var(?:<[^>]*>)?|const|override|fn|struct|alias)\s+(\w+)"
)
_WORKGROUP = re.compile(r"var<workgroup>\s+(\w+)\s*:\s*(.+?)\s*;", re.S)
_HELD = re.compile(r"(?:^|[ +])accumulate\b")  # ops whose dispatches are never packed
_UNINDENTED = re.compile(r"^[^\s]", re.M)
_SCALAR_BYTES = {"f32": 4, "u32": 4, "i32": 4, "f16": 2, "bool": 4}


def parse(wgsl: str) -> Module | None:
    """Split ``wgsl`` into a ``Module``, or None when it is not of the builder's shape (then
    the kernel is never packed): ``fn main`` last, its body's lines indented and its closing
    brace the last character."""
    src = re.sub(r"//[^\n]*", "", wgsl) if "//" in wgsl else wgsl
    m = _ENTRY.search(src)
    if m is None:
        return None
    close = _matching(src, m.end() - 1, "(", ")")
    if close is None:
        return None
    open_brace = src.find("{", close)
    end = src.rstrip().rfind("}")
    if open_brace < 0 or src[close + 1 : open_brace].strip() or end != len(src.rstrip()) - 1:
        return None
    body = src[open_brace + 1 : end]
    if _UNINDENTED.search(body):
        return None  # a line at column 0: maybe a declaration after main
    args = []
    for a in _split_top(src[m.end() : close]):
        am = _ARG.fullmatch(a.strip())
        if am is None or am.group(1) not in ENTRY_BUILTINS:
            return None
        args.append((am.group(1), am.group(2), am.group(3).strip()))
    if {"workgroup_id", "num_workgroups"} - {a[0] for a in args}:
        return None
    enables, items, names, workgroup = [], [], [], []
    for item in _top_items(src[: m.start()]):
        if item.startswith("enable "):
            enables.extend(e.strip() for e in item[len("enable ") :].rstrip(";").split(","))
            continue
        wm = _WORKGROUP.fullmatch(item)
        if wm is not None:
            workgroup.append((wm.group(1), " ".join(wm.group(2).split())))
            continue
        dm = _DECL.match(item)
        if dm is None:
            return None
        items.append(item)
        names.append(dm.group(1))
    return Module(
        tuple(enables),
        tuple(items),
        tuple(names),
        tuple(workgroup),
        " ".join(m.group(1).split()),
        tuple(args),
        body,
    )


def _matching(src: str, start: int, open_: str, close: str) -> int | None:
    """Index of the bracket closing the one at ``start``."""
    depth = 0
    for b in re.compile(f"[{re.escape(open_ + close)}]").finditer(src, start):
        depth += 1 if b.group() == open_ else -1
        if depth == 0:
            return b.start()
    return None


def _split_top(text: str) -> list[str]:
    """``text`` split at commas outside brackets."""
    parts, depth, cur = [], 0, []
    for c in text:
        if c in "(<[":
            depth += 1
        elif c in ")>]":
            depth -= 1
        if c == "," and depth == 0:
            parts.append("".join(cur))
            cur = []
        else:
            cur.append(c)
    if "".join(cur).strip():
        parts.append("".join(cur))
    return parts


def _top_items(text: str) -> list[str]:
    """Module-scope items of ``text``: each ends at a ``;`` or a ``}`` outside braces."""
    items, depth, start = [], 0, 0
    for b in re.finditer(r"[{};]", text):
        c, i = b.group(), b.start()
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                items.append(text[start : i + 1].strip())
                start = i + 1
        elif depth == 0:
            items.append(text[start : i + 1].strip())
            start = i + 1
    if text[start:].strip():
        items.append(text[start:].strip())
    return [it for it in items if it]


def type_bytes(ty: str) -> int | None:
    """Bytes of a workgroup variable of WGSL type ``ty`` (scalars, vectors, atomics and fixed
    arrays of them; WGSL's "Alignment and Size" rules), or None for any other type."""
    ty = "".join(ty.split())
    am = re.fullmatch(r"array<(.+),(\d+)u?>", ty)
    if am is not None:
        elem = _element_bytes(am.group(1))
        return None if elem is None else elem * int(am.group(2))
    return _element_bytes(ty)


def _element_bytes(ty: str) -> int | None:
    """Stride of one element of type ``ty`` in an array, or None."""
    am = re.fullmatch(r"atomic<(u32|i32)>", ty)
    if am is not None:
        return 4
    if ty in _SCALAR_BYTES:
        return _SCALAR_BYTES[ty]
    vm = re.fullmatch(r"vec([234])<(\w+)>", ty)
    if vm is not None and vm.group(2) in _SCALAR_BYTES:
        n = int(vm.group(1))
        return _SCALAR_BYTES[vm.group(2)] * (4 if n == 3 else n)
    return None


def _element_type(ty: str) -> tuple[str, int | None]:
    """(element type, length) of an array type, (ty, None) for any other."""
    am = re.fullmatch(r"array<(.+),\s*(\d+)u?>", ty)
    return (" ".join(am.group(1).split()), int(am.group(2))) if am else (ty, None)


def workgroup_layout(
    modules: Sequence[Module],
) -> tuple[list[str], list[dict[str, str]], int | None]:
    """The packed module's workgroup declarations, each member's renames of its workgroup
    variables, and their bytes (None if a type is not understood).

    A name declared by several members with one element type is declared once at the largest
    length (only one member runs in any workgroup); otherwise each member's is renamed apart.
    """
    kinds: dict[str, set[str]] = {}
    for mod in modules:
        for name, ty in mod.workgroup:
            kinds.setdefault(name, set()).add(_element_type(ty)[0])
    decls: dict[str, str] = {}
    renames: list[dict[str, str]] = []
    for k, mod in enumerate(modules):
        ren = {}
        for name, ty in mod.workgroup:
            elem, n = _element_type(ty)
            if len(kinds[name]) == 1:
                old = decls.get(name)
                if old is None or (n is not None and n > (_element_type(old)[1] or 0)):
                    decls[name] = ty
            else:
                ren[name] = f"{name}_p{k}"
                decls[ren[name]] = ty
        renames.append(ren)
    sizes = [type_bytes(ty) for ty in decls.values()]
    total = None if None in sizes else sum(sizes)
    lines = [f"var<workgroup> {name}: {ty};" for name, ty in decls.items()]
    return lines, renames, total


def _rename(text: str, mapping: dict[str, str]) -> str:
    """``text`` with each identifier of ``mapping`` replaced (member accesses ``.x`` kept)."""
    if not mapping:
        return text
    pattern = re.compile(r"(?<![\w.])(" + "|".join(map(re.escape, mapping)) + r")\b")
    return pattern.sub(lambda m: mapping[m.group(1)], text)


def _renumber(item: str, base: int) -> str:
    return re.sub(r"@binding\((\d+)\)", lambda m: f"@binding({int(m.group(1)) + base})", item)


def _wid(flat: str, grid: tuple[int, int, int]) -> str:
    gx, gy, gz = grid
    if gy == 1 and gz == 1:
        return f"vec3<u32>({flat}, 0u, 0u)"
    return f"vec3<u32>({flat} % {gx}u, ({flat} / {gx}u) % {gy}u, {flat} / {gx * gy}u)"


def packed_wgsl(
    modules: Sequence[Module], dispatches: Sequence[Dispatch], limits: Limits
) -> tuple[str, tuple[int, int, int]] | None:
    """WGSL and grid of one dispatch running ``dispatches`` (parsed as ``modules``), or None
    when the members' workgroup memory together exceeds the adapter's."""
    wg_lines, wg_renames, wg_bytes = workgroup_layout(modules)
    if wg_bytes is None or wg_bytes > limits.max_workgroup_storage_size:
        return None
    enables = sorted({e for mod in modules for e in mod.enables})
    out = [f"enable {', '.join(enables)};\n"] if enables else []
    out += wg_lines
    base = 0
    funcs, calls = [], []
    builtins: dict[str, str] = {}  # builtin -> type, for the packed main
    first = 0
    for k, (mod, d) in enumerate(zip(modules, dispatches, strict=True)):
        mapping = {name: f"{name}_p{k}" for name in mod.names}
        mapping.update(wg_renames[k])
        out += [_renumber(_rename(item, mapping), base) for item in mod.items]
        base += len(d.bindings)
        params = ", ".join(f"{name}: {ty}" for _, name, ty in mod.args)
        funcs.append(f"fn main_p{k}({params}) {{{_rename(mod.body, mapping)}}}")
        groups = d.grid[0] * d.grid[1] * d.grid[2]
        values = []
        for builtin, _, ty in mod.args:
            if builtin == "workgroup_id":
                values.append(_wid(f"f{k}", d.grid))
            elif builtin == "num_workgroups":
                # z ORed with the real z >> 31 (0 at run time): kernels derive their opaque
                # zero from nwg.z (codegen.wgsl.core.literals.F32_OPAQUE_INIT), which a literal
                # would let the shader compiler fold (inf * 0 -> 0)
                gx, gy, gz = d.grid
                values.append(f"vec3<u32>({gx}u, {gy}u, {gz}u | (pk_nwg.z >> 31u))")
            else:
                builtins[builtin] = ty
                values.append(f"pk_{builtin}")
        calls.append(
            f"  if (flat < {first + groups}u) {{\n    let f{k} = flat - {first}u;\n"
            f"    main_p{k}({', '.join(values)});\n    return;\n  }}"
        )
        first += groups
    grid = fold_grid(first, limits)
    args = [
        "@builtin(workgroup_id) pk_wid: vec3<u32>",
        "@builtin(num_workgroups) pk_nwg: vec3<u32>",
    ]
    args += [f"@builtin({b}) pk_{b}: {ty}" for b, ty in sorted(builtins.items())]
    if grid[1] == 1 and grid[2] == 1:
        flat = "pk_wid.x"
    else:
        flat = "pk_wid.x + pk_nwg.x * (pk_wid.y + pk_nwg.y * pk_wid.z)"
    src = "\n".join(out) + "\n\n" + "\n\n".join(funcs) + "\n\n"
    src += f"@compute @workgroup_size({modules[0].size})\nfn main({', '.join(args)}) {{\n"
    src += f"  let flat = {flat};\n" + "\n".join(calls) + "\n}\n"
    return src, grid


def _ranges(program: Program, d: Dispatch) -> list[tuple[int, int, int]]:
    out = []
    for i, b in enumerate(d.bindings):
        off, size = d.span(i, program.buffers[b].size)
        out.append((b, off, off + size))
    return out


def pack_program(program: Program, limits: Limits) -> Program:
    """``program`` with runs of independent dispatches packed into one each (module
    docstring); the program itself when packing is off or nothing packs."""
    if not ENABLED:
        return program
    ds = program.dispatches
    parsed: dict[str, Module | None] = {}  # by source: the layers of a model repeat kernels

    def module(d: Dispatch) -> Module | None:
        if 0 in d.grid or _HELD.search(d.name):
            return None
        if d.wgsl not in parsed:
            parsed[d.wgsl] = parse(d.wgsl)
        return parsed[d.wgsl]

    rw = [read_write_ranges(program, d) for d in ds]
    cache: dict[tuple, tuple[str, tuple[int, int, int]]] = {}
    out: list[Dispatch] = []
    pending = list(range(len(ds)))  # not yet placed, in program order
    while pending:
        i = pending.pop(0)
        members = [i]
        first = module(ds[i])
        if first is not None:
            mods = [first]
            ranges, writes = _ranges(program, ds[i]), list(ds[i].writes)
            passed: list[int] = []  # looked past: they stay, in order, after the run
            at = 0
            while at < len(pending) and len(members) < MAX_MEMBERS and len(passed) <= LOOKAHEAD:
                j = pending[at]
                mod = module(ds[j])
                fit = None
                if mod is not None and mod.size == first.size:
                    if all(commute(rw[j], rw[k]) for k in passed):
                        fit = _fits(program, ds, members, j, mods, ranges, writes, mod, limits)
                if fit is not None:
                    mods, ranges, writes = fit
                    members.append(j)
                    pending.pop(at)
                else:
                    passed.append(j)
                    at += 1
        if len(members) == 1:
            out.append(ds[i])
        else:
            out.append(_packed(program, parsed, [ds[k] for k in members], limits, cache))
    if len(out) == len(ds):
        return program
    return replace(program, dispatches=tuple(out))


def _fits(program, ds, members, j, mods, ranges, writes, mod, limits):
    """(modules, ranges, writes) of the run ``members`` with dispatch ``j`` (parsed as ``mod``,
    of the run's workgroup size) joined, or None when ``j`` cannot join: a binding conflict
    with a member, or the adapter's limits (bindings, workgroups, workgroup memory)."""
    r2, w2 = ranges + _ranges(program, ds[j]), writes + list(ds[j].writes)
    if len(r2) > limits.max_storage_buffers_per_shader_stage:
        return None
    if binding_conflict(r2, w2) is not None:
        return None
    groups = sum(ds[k].grid[0] * ds[k].grid[1] * ds[k].grid[2] for k in [*members, j])
    if groups > limits.max_workgroups_per_dimension**3:
        return None
    wg_bytes = workgroup_layout([*mods, mod])[2]
    if wg_bytes is None or wg_bytes > limits.max_workgroup_storage_size:
        return None
    return [*mods, mod], r2, w2


def _packed(program, parsed, ds: Sequence[Dispatch], limits: Limits, cache: dict) -> Dispatch:
    key = tuple((d.wgsl, d.grid, len(d.bindings)) for d in ds)
    if key not in cache:
        packed = packed_wgsl([parsed[d.wgsl] for d in ds], ds, limits)
        assert packed is not None  # its workgroup memory was checked while the run was built
        cache[key] = packed
    src, grid = cache[key]
    partial = any(d.offsets or d.sizes for d in ds)
    offsets, sizes = [], []
    for d in ds:
        n = len(d.bindings)
        offsets += list(d.offsets or (0,) * n)
        sizes += list(d.sizes or (0,) * n)
    return Dispatch(
        SEPARATOR.join(d.name for d in ds),
        src,
        tuple(b for d in ds for b in d.bindings),
        tuple(w for d in ds for w in d.writes),
        grid,
        sum(d.flops for d in ds),
        sum(d.bytes for d in ds),
        tuple(offsets) if partial else (),
        tuple(sizes) if partial else (),
    )

"""The bundle manifest: schema ``meganeura-bundle/1``, what a Program requires of an adapter,
and the compatibility checks run at export.

A bundle is a folder (docs/export.md)::

    manifest.json            this schema
    weights.safetensors      parameters and states, in the dtype the program stores
    kernels/<sha256>.wgsl    one file per distinct WGSL source, named by its hash

Everything here is pure Python over a :class:`~meganeura.schedule.program.Program`; nothing
touches a GPU.

Invariants:
  * ``requires.features`` lists every optional WebGPU feature a kernel's WGSL uses:
    ``shader-f16`` for ``enable f16;`` (any f16 binding), ``subgroup`` for subgroup builtins;
  * ``requires.limits`` are the values the program actually needs (largest binding, most storage
    buffers one kernel binds, largest workgroup-memory footprint ...), never the exporting
    adapter's maxima;
  * the manifest's ``files`` maps every other file of the bundle to its sha256.
"""

from __future__ import annotations

import re

from ..schedule.program import Program

SCHEMA = "meganeura-bundle/1"

# WebGPU's default limits (https://www.w3.org/TR/webgpu/#limit-default): what a browser grants
# without asking; the export's default target for storage buffers per stage.
WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS = 8

# The limits every WebGPU implementation grants by default, by WebGPU name (same source): the
# ``target="web"`` export compiles within them and refuses a kernel exceeding one.
WEB_LIMITS = {
    "max-storage-buffers-per-shader-stage": WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    "max-storage-buffer-binding-size": 134217728,
    "max-buffer-size": 268435456,
    "max-compute-workgroup-storage-size": 16384,
    "max-compute-invocations-per-workgroup": 256,
    "max-compute-workgroup-size-x": 256,
    "max-compute-workgroup-size-y": 256,
    "max-compute-workgroup-size-z": 64,
    "max-compute-workgroups-per-dimension": 65535,
}

ROLES = {
    "input": "input",
    "output": "output",
    "parameter": "parameter",
    "state": "state",
    "intermediate": "scratch",
}

RUNTIME_CHECKS_NOTE = (
    "Browsers always compile WGSL with bounds checks (naga/Tint clamp indices); the kernels of "
    "this bundle are exported to run with those checks on and runtimes must not rely on "
    "unchecked shader modules."
)

SUBGROUPS_NOTE = (
    "Kernels whose features include 'subgroup' use subgroup builtins without an "
    "'enable subgroups;' directive: naga (wgpu-native 29) rejects that directive and Tint "
    "(Chrome) requires it, so a browser runtime prepends it to those kernels. Export with "
    "target features lacking 'subgroup' for kernels without subgroups."
)


class ExportError(ValueError):
    """A program or model that cannot be exported (training program, kernel incompatible with
    the target, missing weights); the message names the kernel, tensor or limit."""


def wgsl_features(wgsl: str) -> list[str]:
    """Optional WebGPU features a WGSL source uses, by WebGPU name.

    ``shader-f16`` when it enables f16 (every kernel with an f16 binding or value does);
    ``subgroup`` when it uses a subgroup builtin or function.
    """
    found = []
    if re.search(r"\benable\s+f16\s*;", wgsl):
        found.append("shader-f16")
    if re.search(r"\bsubgroup\w*|\bquad\w+\(", wgsl):
        found.append("subgroup")
    return found


_SCALAR_BYTES = {"f32": 4, "i32": 4, "u32": 4, "f16": 2, "bool": 4}


def _type_bytes(ty: str) -> int:
    """Bytes of a WGSL storable type as written in a declaration (arrays, vectors, atomics);
    an upper bound (vec3 counted as vec4)."""
    ty = ty.replace(" ", "")
    m = re.fullmatch(r"array<(.+),(\d+)u?>", ty)
    if m:
        return _type_bytes(m.group(1)) * int(m.group(2))
    m = re.fullmatch(r"vec([234])<(\w+)>", ty)
    if m:
        n = int(m.group(1))
        return (4 if n == 3 else n) * _SCALAR_BYTES.get(m.group(2), 4)
    m = re.fullmatch(r"atomic<(\w+)>", ty)
    if m:
        return 4
    m = re.fullmatch(r"mat(\d)x(\d)<(\w+)>", ty)
    if m:
        return int(m.group(1)) * (4 if m.group(2) == "3" else int(m.group(2))) * 4
    return _SCALAR_BYTES.get(ty, 4)


def workgroup_storage_bytes(wgsl: str) -> int:
    """Bytes of ``var<workgroup>`` memory a WGSL source declares (an upper bound)."""
    return sum(
        _type_bytes(m.group(1)) for m in re.finditer(r"var<workgroup>\s*\w+\s*:\s*([^;]+);", wgsl)
    )


def workgroup_size(wgsl: str) -> tuple[int, int, int]:
    """(x, y, z) of a WGSL source's ``@workgroup_size`` ((1, 1, 1) when absent)."""
    m = re.search(r"@workgroup_size\(([^)]*)\)", wgsl)
    dims = [int(p.strip().rstrip("u")) for p in m.group(1).split(",") if p.strip()] if m else []
    return tuple(dims + [1] * (3 - len(dims)))


def workgroup_invocations(wgsl: str) -> int:
    """Invocations per workgroup of a WGSL source's ``@workgroup_size`` (1 when absent)."""
    x, y, z = workgroup_size(wgsl)
    return x * y * z


def requirements(program: Program) -> dict:
    """What the program needs of an adapter: ``{"features": [...], "limits": {...}}``.

    Limits (WebGPU names): ``max-storage-buffers-per-shader-stage`` (most bindings of one
    kernel), ``max-storage-buffer-binding-size`` (largest binding, bytes),
    ``max-buffer-size`` (largest buffer), ``max-compute-workgroup-storage-size``,
    ``max-compute-invocations-per-workgroup``, ``max-compute-workgroup-size-x/y/z``,
    ``max-compute-workgroups-per-dimension`` (largest grid count) and
    ``min-storage-buffer-offset-alignment`` (the gcd of the non-zero binding offsets, which the
    adapter's alignment must divide; 256 when there are none).
    """
    from math import gcd

    features: set[str] = set()
    lim = dict.fromkeys(
        (
            "max-storage-buffers-per-shader-stage",
            "max-storage-buffer-binding-size",
            "max-buffer-size",
            "max-compute-workgroup-storage-size",
            "max-compute-invocations-per-workgroup",
            "max-compute-workgroup-size-x",
            "max-compute-workgroup-size-y",
            "max-compute-workgroup-size-z",
            "max-compute-workgroups-per-dimension",
        ),
        0,
    )
    align = 0
    for b in program.buffers:
        lim["max-buffer-size"] = max(lim["max-buffer-size"], _allocated(b.size))
    for d in program.dispatches:
        features.update(wgsl_features(d.wgsl))
        lim["max-storage-buffers-per-shader-stage"] = max(
            lim["max-storage-buffers-per-shader-stage"], len(d.bindings)
        )
        for i, bid in enumerate(d.bindings):
            off, size = d.span(i, _allocated(program.buffers[bid].size))
            lim["max-storage-buffer-binding-size"] = max(
                lim["max-storage-buffer-binding-size"], size
            )
            align = gcd(align, off)
        lim["max-compute-workgroup-storage-size"] = max(
            lim["max-compute-workgroup-storage-size"], workgroup_storage_bytes(d.wgsl)
        )
        lim["max-compute-invocations-per-workgroup"] = max(
            lim["max-compute-invocations-per-workgroup"], workgroup_invocations(d.wgsl)
        )
        lim["max-compute-workgroups-per-dimension"] = max(
            lim["max-compute-workgroups-per-dimension"], *d.grid
        )
        for axis, n in zip("xyz", workgroup_size(d.wgsl)):
            k = f"max-compute-workgroup-size-{axis}"
            lim[k] = max(lim[k], n)
    lim["min-storage-buffer-offset-alignment"] = align or 256
    return {"features": sorted(features), "limits": lim}


def _allocated(size: int) -> int:
    """Bytes a runtime allocates for a buffer of ``size`` bytes (a multiple of 4, at least 4)."""
    return max(-(-size // 4) * 4, 4)


def kernel_needs(program: Program, d) -> dict[str, int]:
    """The limits one dispatch ``d`` of ``program`` needs (the keys of :data:`WEB_LIMITS`)."""
    x, y, z = workgroup_size(d.wgsl)
    spans = [
        d.span(i, _allocated(program.buffers[bid].size))[1] for i, bid in enumerate(d.bindings)
    ]
    return {
        "max-storage-buffers-per-shader-stage": len(d.bindings),
        "max-storage-buffer-binding-size": max(spans, default=0),
        "max-buffer-size": max(
            (_allocated(program.buffers[b].size) for b in d.bindings), default=0
        ),
        "max-compute-workgroup-storage-size": workgroup_storage_bytes(d.wgsl),
        "max-compute-invocations-per-workgroup": x * y * z,
        "max-compute-workgroup-size-x": x,
        "max-compute-workgroup-size-y": y,
        "max-compute-workgroup-size-z": z,
        "max-compute-workgroups-per-dimension": max(d.grid),
    }


def check_compatible(
    program: Program,
    max_storage_buffers: int | None,
    features: set[str] | None,
    limits: dict[str, int] | None = None,
) -> None:
    """Refuse a program a target could not run.

    Args:
        program: the program to export.
        max_storage_buffers: the target's ``maxStorageBuffersPerShaderStage`` (WebGPU's default
            is 8; None: no check).
        features: optional features the target has (None: no check).
        limits: the target's limits by WebGPU name (keys of :data:`WEB_LIMITS`; None: no check).

    Raises:
        ExportError: naming the first kernel that binds more storage buffers than allowed,
            needs a feature the target lacks, or exceeds one of ``limits``.
    """
    for d in program.dispatches:
        if max_storage_buffers is not None and len(d.bindings) > max_storage_buffers:
            raise ExportError(
                f"kernel {d.name!r} binds {len(d.bindings)} storage buffers; the target allows "
                f"{max_storage_buffers} per shader stage (raise --max-storage-buffers if the "
                "target's adapter grants more)"
            )
        if features is not None:
            lacking = [f for f in wgsl_features(d.wgsl) if f not in features]
            if lacking:
                raise ExportError(
                    f"kernel {d.name!r} needs the feature(s) {lacking}, which the target lacks "
                    f"(target features: {sorted(features)}); export with strict f32 "
                    "(--strict) for targets without shader-f16"
                )
        for k, need in kernel_needs(program, d).items() if limits else ():
            if k in limits and need > limits[k]:
                raise ExportError(
                    f"kernel {d.name!r} needs {k} = {need:,}; the target allows {limits[k]:,} "
                    "(WebGPU's default; compile for the target's limits or pass its limits)"
                )


def check_inference(program: Program) -> None:
    """Refuse a training program (backward pass, optimizer, gradients).

    Raises:
        ExportError: naming what makes it a training program.
    """
    grads = [b.id for b in program.buffers if b.role == "gradient"]
    if "optimizer" in program.meta or grads:
        what = "an optimizer update" if "optimizer" in program.meta else f"gradient buffers {grads}"
        raise ExportError(
            f"only inference programs can be exported; this one has {what} (compile the "
            "module's forward without loss/optimizer, or pass the module to export)"
        )
    grad_out = sorted(n for n in program.outputs if n.endswith(".grad"))
    if grad_out:
        raise ExportError(
            f"only inference programs can be exported; this one outputs gradients {grad_out}"
        )

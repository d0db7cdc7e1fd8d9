"""``mn.export``: write an inference Program (or a module's compiled forward) as a bundle folder
that :mod:`meganeura.runtime.bundle` (wgpu + NumPy only) or a browser's WebGPU can run.

The format is described in docs/export.md and :mod:`.manifest`. The folder is written under a
temporary name next to the target and renamed onto it, so a crash leaves either no bundle or a
complete one.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import struct
import tempfile
from collections.abc import Iterable, Mapping, Sequence
from pathlib import Path

import numpy as np

from ..dtypes import DType
from ..schedule.program import Program, TensorSlot
from .manifest import (
    ROLES,
    RUNTIME_CHECKS_NOTE,
    SCHEMA,
    SUBGROUPS_NOTE,
    WEB_LIMITS,
    WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    ExportError,
    check_compatible,
    check_inference,
    requirements,
    wgsl_features,
    workgroup_invocations,
    workgroup_storage_bytes,
)

_SB = "max-storage-buffers-per-shader-stage"


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def safetensors_bytes(tensors: Mapping[str, np.ndarray], metadata: Mapping[str, str]) -> bytes:
    """A safetensors file (https://huggingface.co/docs/safetensors) of little-endian arrays."""
    header: dict = {"__metadata__": dict(metadata)}
    names = {np.dtype("<f4"): "F32", np.dtype("<f2"): "F16"}
    names |= {np.dtype("<i4"): "I32", np.dtype("<u4"): "U32"}
    chunks, at = [], 0
    for name, arr in tensors.items():
        raw = np.ascontiguousarray(arr).tobytes()
        header[name] = {
            "dtype": names[arr.dtype.newbyteorder("<")],
            "shape": list(arr.shape),
            "data_offsets": [at, at + len(raw)],
        }
        chunks.append(raw)
        at += len(raw)
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    return struct.pack("<Q", len(head)) + head + b"".join(chunks)


def _slot_json(name: str, s: TensorSlot) -> dict:
    return {
        "name": name,
        "dtype": s.host.value,  # what the host feeds or reads (NumPy name)
        "storage": s.dtype.value,  # what the GPU holds (bool: u32 0/1)
        "shape": list(s.shape),
        "buffer": s.buffer,
        "offset": s.offset,
    }


def _stored(name: str, s: TensorSlot, value) -> np.ndarray:
    arr = np.asarray(value)
    if arr.shape != s.shape:
        raise ExportError(f"weight {name!r}: expected shape {s.shape}, got {arr.shape}")
    if s.dtype is DType.bool:
        return arr.astype(np.uint32)
    with np.errstate(over="ignore"):
        out = arr.astype(s.dtype.numpy)
    if s.dtype is DType.f16 and (np.isinf(out) & np.isfinite(arr)).any():
        raise ExportError(f"weight {name!r}: is stored as f16 and a value exceeds its range")
    return out


def write_bundle(
    program: Program,
    path: str | Path,
    weights: Mapping[str, np.ndarray],
    *,
    max_storage_buffers: int | None = WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    target_features: Iterable[str] | None = None,
    target_limits: Mapping[str, int] | None = None,
    target: str = "any",
    overwrite: bool = False,
    extra: Mapping | None = None,
) -> Path:
    """Write ``program`` with its ``weights`` as a bundle folder at ``path``.

    Args:
        program: an inference Program (no backward pass, no optimizer).
        path: the folder to create.
        weights: a value for every parameter (by slot name, any shape-matching array;
            converted to the slot's storage dtype); states default to zeros.
        max_storage_buffers: the target's storage buffers per shader stage (None: unchecked).
        target_features: the target's optional features (None: unchecked).
        target_limits: the target's limits by WebGPU name (``WEB_LIMITS``'s keys; None:
            unchecked).
        target: the target's name stored in the manifest (``"any"`` or ``"web"``).
        overwrite: replace an existing folder at ``path``.
        extra: JSON-serializable facts stored under the manifest's ``"meta"``.

    Returns:
        ``path`` as a Path.

    Raises:
        ExportError: a training program, a missing or mis-shaped weight, a kernel the target
            cannot run (named), or ``path`` exists and ``overwrite`` is False.
    """
    path = Path(path)
    check_inference(program)
    feats = None if target_features is None else set(target_features)
    check_compatible(program, max_storage_buffers, feats, target_limits)
    if path.exists() and not overwrite:
        raise ExportError(f"{path} exists (pass overwrite=True to replace it)")
    tensors: dict[str, np.ndarray] = {}
    weight_slots = []
    for kind, slots in (("parameter", program.parameters), ("state", program.state)):
        for name, s in slots.items():
            if name in weights:
                tensors[name] = _stored(name, s, weights[name])
            elif kind == "state":
                tensors[name] = np.zeros(
                    s.shape, np.uint32 if s.dtype is DType.bool else s.dtype.numpy
                )
            else:
                raise ExportError(f"no value for parameter {name!r} (shape {s.shape})")
            weight_slots.append({**_slot_json(name, s), "kind": kind})
    weights_file = safetensors_bytes(tensors, {"format": "meganeura-bundle"})
    files: dict[str, bytes] = {"weights.safetensors": weights_file}
    kernels: dict[str, dict] = {}
    dispatches = []
    for d in program.dispatches:
        src = d.wgsl.encode("utf-8")
        h = sha256_bytes(src)
        if h not in kernels:
            files[f"kernels/{h}.wgsl"] = src
            kernels[h] = {
                "file": f"kernels/{h}.wgsl",
                "features": wgsl_features(d.wgsl),
                "workgroup_storage_bytes": workgroup_storage_bytes(d.wgsl),
                "invocations": workgroup_invocations(d.wgsl),
            }
        binds = []
        for i, bid in enumerate(d.bindings):
            off, size = d.span(i, max(-(-program.buffers[bid].size // 4) * 4, 4))
            access = "read_write" if d.writes[i] else "read"
            binds.append({"buffer": bid, "offset": off, "size": size, "access": access})
        dispatches.append(
            {
                "name": d.name,
                "kernel": h,
                "grid": list(d.grid),
                "bindings": binds,
                "flops": d.flops,
                "bytes": d.bytes,
            }
        )
    manifest = {
        "schema": SCHEMA,
        "precision": program.meta.get("precision", "strict"),
        "target": target,
        "inputs": [_slot_json(n, s) for n, s in program.inputs.items()],
        "outputs": [_slot_json(n, s) for n, s in program.outputs.items()],
        "weights": {"file": "weights.safetensors", "tensors": weight_slots},
        "label_checks": [
            {
                "name": lc.name,
                "num_classes": lc.num_classes,
                "ignore_index": lc.ignore_index,
                "what": lc.what,
            }
            for lc in program.label_checks
        ],
        "buffers": [
            {"id": b.id, "size": b.size, "role": ROLES.get(b.role, b.role), "name": b.name}
            for b in program.buffers
        ],
        "kernels": kernels,
        "dispatches": dispatches,
        "requires": {**requirements(program), "runtime_checks": True},
        "notes": [RUNTIME_CHECKS_NOTE, SUBGROUPS_NOTE],
        "meta": dict(extra or {}),
        "files": {name: sha256_bytes(data) for name, data in sorted(files.items())},
    }
    files["manifest.json"] = json.dumps(manifest, indent=1).encode()
    _write_folder(path, files, overwrite)
    return path


def _write_folder(path: Path, files: Mapping[str, bytes], overwrite: bool) -> None:
    """Write ``files`` into a temporary sibling folder, fsync them, then rename it to ``path``."""
    parent = path.parent if str(path.parent) else Path(".")
    parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}.", suffix=".tmp"))
    os.chmod(tmp, 0o755)  # mkdtemp's 0700 would hide the bundle from a web server's user
    old = None
    try:
        for name, data in files.items():
            f = tmp / name
            f.parent.mkdir(parents=True, exist_ok=True)
            with open(f, "wb") as fh:
                fh.write(data)
                fh.flush()
                os.fsync(fh.fileno())
        if path.exists():
            if not overwrite:
                raise ExportError(f"{path} exists (pass overwrite=True to replace it)")
            old = Path(tempfile.mkdtemp(dir=parent, prefix=f".{path.name}.", suffix=".old"))
            os.replace(path, old / "bundle")
        os.replace(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None and not path.exists():
            os.replace(old / "bundle", path)
        raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


def trace_program(
    model,
    example_inputs: Sequence,
    *,
    precision: str = "strict",
    strict: bool = False,
    max_storage_buffers: int | None = WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    target_features: Iterable[str] | None = None,
    target_limits: Mapping[str, int] | None = None,
    cpu: bool | None = None,
    device=None,
) -> tuple[Program, dict[str, np.ndarray]]:
    """Trace ``model.forward(*example_inputs)`` and compile it for inference.

    The program is compiled with the device's limits narrowed to the target's (storage buffers
    per stage; ``shader-f16`` and subgroups only where the target has them, never with
    ``strict``; workgroup memory, invocations and binding sizes within ``target_limits``), so
    the kernels fit the target rather than being refused. ``cpu``: plan the kernels for a CPU
    adapter (True) or a GPU (False); None: as the exporting device is.

    Returns:
        (Program, weights by slot name).
    """
    import dataclasses

    from ..compile import CompileOptions
    from ..compile import compile as compile_graph
    from ..nn.compiled import trace_call
    from ..runtime import get_device
    from ..training import device_limits

    if strict:
        precision = "strict"
    device = device or get_device()
    limits = device_limits(device)
    feats = None if target_features is None else set(target_features)
    changes: dict = {}
    if max_storage_buffers is not None:
        changes["max_storage_buffers_per_shader_stage"] = min(
            limits.max_storage_buffers_per_shader_stage, max_storage_buffers
        )
    # Browsers grant 256 unless asked: row-block bindings at offsets that any target accepts.
    changes["min_storage_buffer_offset_alignment"] = max(
        limits.min_storage_buffer_offset_alignment, 256
    )
    if strict or (feats is not None and "shader-f16" not in feats):
        changes["shader_f16"] = False
    if feats is not None and "subgroup" not in feats:
        changes["subgroups"] = False
    narrowed = {
        "max_workgroup_storage_size": "max-compute-workgroup-storage-size",
        "max_invocations_per_workgroup": "max-compute-invocations-per-workgroup",
        "max_storage_buffer_binding_size": "max-storage-buffer-binding-size",
        "max_buffer_size": "max-buffer-size",
        "max_workgroups_per_dimension": "max-compute-workgroups-per-dimension",
    }
    for field, key in narrowed.items() if target_limits else ():
        if key in target_limits:
            changes[field] = min(getattr(limits, field), target_limits[key])
    if cpu is not None:
        changes["cpu"] = cpu
    # A bundle runs on another adapter (a browser's WebGPU): plans tuned on this one do not apply.
    changes["matmul_plans"] = ()
    changes["attention_plans"] = ()
    limits = dataclasses.replace(limits, **changes)
    traced = trace_call(model, model.forward, tuple(example_inputs), {})
    program = compile_graph(traced.graph, CompileOptions(precision=precision), limits)
    objects = traced.trace.objects
    weights = {}
    for name in (*program.parameters, *program.state):
        if name in objects:
            weights[name] = objects[name].data
        elif name in traced.trace.constants:
            weights[name] = traced.trace.constants[name]
    return program, weights


def export(
    model_or_program,
    path: str | Path,
    example_inputs: Sequence = (),
    *,
    precision: str = "strict",
    strict: bool = False,
    weights: Mapping[str, np.ndarray] | None = None,
    max_storage_buffers: int | None = WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    target_features: Iterable[str] | None = None,
    target: str = "any",
    overwrite: bool = False,
    device=None,
    meta: Mapping | None = None,
) -> Path:
    """Export a module's forward (traced on ``example_inputs``) or an inference Program as a
    bundle folder (docs/export.md) that ``meganeura.runtime.bundle.BundleSession`` runs.

    Args:
        model_or_program: an ``mn.nn.Module`` (its current mode; call ``.eval()`` first) or a
            :class:`~meganeura.schedule.program.Program` compiled without loss/optimizer.
        path: the bundle folder to create.
        example_inputs: arrays as ``forward`` takes them positionally (fix every shape and
            dtype of the bundle); ignored for a Program.
        precision: ``"strict"`` (f32 everywhere) or ``"fast"`` (f16 storage where the
            compiler chooses it; the bundle then requires ``shader-f16``).
        strict: force strict f32 and no ``shader-f16`` (targets without it).
        weights: for a Program, every parameter's value by name (states default to zeros).
        max_storage_buffers: the target's ``maxStorageBuffersPerShaderStage`` (default 8,
            WebGPU's default); None: unchecked.
        target_features: optional features the target has (None: unchecked; ``strict``
            excludes ``shader-f16``).
        target: ``"any"`` (only the checks above) or ``"web"``: what every browser's WebGPU
            runs without asking for more: strict f32, no optional feature (no ``shader-f16``,
            no subgroups unless ``target_features`` grants them), and WebGPU's default limits
            (``WEB_LIMITS``: 8 storage buffers per stage, 16 KiB workgroup memory, 256
            invocations, 128 MiB bindings); a module is compiled within them, with the kernel
            plans for a GPU (not the exporting adapter's CPU plans where it is lavapipe), and a
            Program exceeding one is refused naming the kernel.
        overwrite: replace an existing bundle.
        device: the runtime Device a module is compiled for (default: the default device).
        meta: JSON-serializable facts stored in the manifest's ``"meta"``.

    Returns:
        The bundle's path.

    Raises:
        ExportError: a training program, a kernel the target cannot run (named), a missing
            weight, or an existing ``path`` without ``overwrite``.
    """
    if target not in ("any", "web"):
        raise ExportError(f"target must be 'any' or 'web', got {target!r}")
    feats = None if target_features is None else set(target_features)
    limits = None
    if target == "web":
        strict, limits = True, WEB_LIMITS
        feats = set() if feats is None else feats
        if max_storage_buffers is None or max_storage_buffers > WEB_LIMITS[_SB]:
            max_storage_buffers = WEB_LIMITS[_SB]
    if strict:
        feats = (feats if feats is not None else {"subgroup"}) - {"shader-f16"}
    if isinstance(model_or_program, Program):
        program = model_or_program
        if weights is None and program.parameters:
            raise ExportError("exporting a Program needs weights= (a value per parameter)")
        values = dict(weights or {})
    else:
        program, values = trace_program(
            model_or_program,
            example_inputs,
            precision=precision,
            strict=strict,
            max_storage_buffers=max_storage_buffers,
            target_features=feats,
            target_limits=limits,
            cpu=False if target == "web" else None,
            device=device,
        )
        values.update(weights or {})
    return write_bundle(
        program,
        path,
        values,
        max_storage_buffers=max_storage_buffers,
        target_features=feats,
        target_limits=limits,
        target=target,
        overwrite=overwrite,
        extra=meta,
    )

"""``meganeura export CHECKPOINT``: a ``train mnist`` checkpoint as a bundle (docs/export.md).

The bundle classifies ``batch`` standardized images f32[batch, 784] into logits f32[batch, 10]
(input ``x``, output ``output``); the manifest's ``meta`` carries the training set's ``mean`` and
``std`` so a page can standardize raw pixels ``(pixel / 255 - mean) / std`` itself.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..export import export
from ..export.manifest import WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS


def export_checkpoint(
    checkpoint: str,
    out: str | None = None,
    *,
    strict: bool = False,
    batch: int = 1,
    max_storage_buffers: int | None = WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
    target: str = "web",
    overwrite: bool = True,
    device=None,
) -> dict:
    """Export the MLP of a ``train mnist`` checkpoint.

    Args:
        checkpoint: the ``checkpoint.safetensors`` ``train mnist`` wrote.
        out: bundle folder (default: ``bundle`` next to the checkpoint).
        strict: strict f32, no ``shader-f16`` (the MLP is strict unless asked otherwise; this
            also rules f16 out for the target check).
        batch: images per call of the bundle.
        max_storage_buffers: the target's storage buffers per shader stage.
        target: ``"web"`` (default: what any browser's WebGPU runs, docs/web.md) or ``"any"``.
        overwrite: replace an existing bundle at ``out``.

    Returns:
        ``{"path", "bytes": {part: bytes}, "kernels", "dispatches", "features", "limits"}``.

    Raises:
        CheckpointError: not a ``train mnist`` checkpoint. ExportError: as ``mn.export``.
        ValueError: ``batch`` < 1.
    """
    from .mnist import load_model

    if batch < 1:
        raise ValueError(f"batch must be >= 1, got {batch}")
    model, meta = load_model(checkpoint)
    model.eval()
    path = Path(out) if out else Path(checkpoint).parent / "bundle"
    x = np.zeros((batch, model.sizes[0]), np.float32)
    export(
        model,
        path,
        (x,),
        strict=strict,
        max_storage_buffers=max_storage_buffers,
        target=target,
        overwrite=overwrite,
        device=device,
        meta={"model": "mnist-mlp", "mean": meta["mean"], "std": meta["std"], "batch": batch},
    )
    return summarize(path)


def summarize(path: str | Path) -> dict:
    """Sizes per part and requirements of a bundle folder."""
    path = Path(path)
    manifest = json.loads((path / "manifest.json").read_bytes())
    sizes = {"manifest.json": (path / "manifest.json").stat().st_size}
    kernels = 0
    for name in manifest["files"]:
        size = (path / name).stat().st_size
        if name.startswith("kernels/"):
            kernels += size
        else:
            sizes[name] = size
    sizes["kernels/*.wgsl"] = kernels
    return {
        "path": str(path),
        "bytes": sizes,
        "total_bytes": sum(sizes.values()),
        "kernels": len(manifest["kernels"]),
        "dispatches": len(manifest["dispatches"]),
        "features": manifest["requires"]["features"],
        "limits": manifest["requires"]["limits"],
    }


def format_summary(s: dict) -> str:
    """The lines ``meganeura export`` prints."""
    lines = [f"bundle: {s['path']}"]
    lines += [f"  {part:<22} {n:>10,} bytes" for part, n in s["bytes"].items()]
    lines.append(f"  {'total':<22} {s['total_bytes']:>10,} bytes")
    lines.append(f"kernels: {s['kernels']} distinct, {s['dispatches']} dispatches")
    lines.append(f"required features: {', '.join(s['features']) or 'none'}")
    lim = s["limits"]
    lines.append(
        f"storage buffers per stage: {lim['max-storage-buffers-per-shader-stage']}, "
        f"largest binding: {lim['max-storage-buffer-binding-size']:,} bytes"
    )
    return "\n".join(lines)


def add_commands(sub) -> None:
    """Register ``export`` on the CLI's subparsers."""
    e = sub.add_parser(
        "export",
        help="write a train mnist checkpoint as a bundle (WGSL kernels, dispatch list, weights, "
        "manifest) that meganeura.runtime.bundle or a browser's WebGPU runs",
    )
    e.add_argument("checkpoint", help="checkpoint.safetensors from train mnist")
    e.add_argument("--out", help="bundle folder (default: bundle/ next to the checkpoint)")
    e.add_argument(
        "--strict", action="store_true", help="strict f32, no shader-f16 (targets without it)"
    )
    e.add_argument("--batch", type=int, default=1, help="images per call (default 1)")
    e.add_argument(
        "--max-storage-buffers",
        type=int,
        default=WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS,
        help="the target's storage buffers per shader stage; a kernel binding more is refused "
        f"(default {WEBGPU_DEFAULT_MAX_STORAGE_BUFFERS}, WebGPU's default limit)",
    )
    e.add_argument(
        "--target",
        choices=["web", "any"],
        default="web",
        help="web (default): strict f32, no optional feature, WebGPU's default limits, so any "
        "browser runs it (docs/web.md); any: also subgroups where the exporting adapter has them",
    )
    e.set_defaults(handler=cmd_export)


def cmd_export(args) -> int:
    from ..cli import _device
    from ..export import ExportError
    from ..io.checkpoint import CheckpointError

    try:
        s = export_checkpoint(
            args.checkpoint,
            args.out,
            strict=args.strict,
            batch=args.batch,
            max_storage_buffers=args.max_storage_buffers,
            target=args.target,
            device=_device(args),
        )
    except (OSError, ValueError, CheckpointError, ExportError) as e:
        raise SystemExit(str(e)) from None
    print(format_summary(s))
    return 0

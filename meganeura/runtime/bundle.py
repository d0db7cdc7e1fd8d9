"""A minimal runtime for exported bundles (docs/export.md): wgpu and NumPy only.

This file imports nothing from meganeura, so it runs where the compiler is absent: copy it next
to an application, or load it by path (``importlib.util.spec_from_file_location``); imported as
``meganeura.runtime.bundle`` it works too, but then Python imports the package first. It
never imports meganeura's graph, compiler, code generator, scheduler or torch (tests check it).

``BundleSession(path).run({"x": x})`` returns ``{output name: np.ndarray}``. Shader modules are
created through wgpu's ordinary (checked) path, as a browser would: bounds checks stay on.

Invariants:
  * every file's sha256 is checked against the manifest before anything is created;
  * the adapter's features and limits are checked against ``requires`` before any pipeline;
  * feeds are checked (names, exact shapes and dtypes, index ranges) before any upload.
"""

from __future__ import annotations

import hashlib
import json
import struct
from collections.abc import Mapping
from pathlib import Path

import numpy as np
import wgpu

SCHEMA = "meganeura-bundle/1"
_USAGE = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
_ST = {"F32": "<f4", "F16": "<f2", "I32": "<i4", "U32": "<u4"}
_STORE = {"float32": "<f4", "float16": "<f2", "int32": "<i4", "uint32": "<u4", "bool": "<u4"}


class BundleError(ValueError):
    """A bundle that cannot be loaded or run here: a bad schema, a file whose hash differs, an
    adapter without a required feature or limit, or a feed that does not match an input."""


def _load_safetensors(data: bytes, where: str) -> dict[str, np.ndarray]:
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8 : 8 + n])
    body = memoryview(data)[8 + n :]
    out = {}
    for name, info in header.items():
        if name == "__metadata__":
            continue
        start, end = info["data_offsets"]
        if info["dtype"] not in _ST or not 0 <= start <= end <= len(body):
            raise BundleError(f"{where}: tensor {name!r} is malformed")
        arr = np.frombuffer(body[start:end], _ST[info["dtype"]])
        out[name] = arr.reshape(info["shape"])
    return out


def _align(n: int, k: int = 4) -> int:
    return -(-n // k) * k


class BundleSession:
    """The GPU objects of one bundle, and the step that replays it.

    Attributes:
        manifest: the parsed ``manifest.json``.
        inputs, outputs: name -> (shape, NumPy dtype).
        device: the ``wgpu.GPUDevice`` it runs on.
    """

    def __init__(self, path, device: wgpu.GPUDevice | None = None):
        """Load, verify and build a bundle.

        Args:
            path: the bundle folder.
            device: a ``wgpu.GPUDevice`` (default: one requested from the default adapter
                with exactly the bundle's required features and limits).

        Raises:
            BundleError: unknown schema, a missing file or one whose sha256 differs from the
                manifest (names the file), or an adapter/device without a required feature or
                below a required limit (names it).
            FileNotFoundError: no manifest at ``path``.
        """
        self.path = Path(path)
        m = self.manifest = json.loads((self.path / "manifest.json").read_bytes())
        if m.get("schema") != SCHEMA:
            raise BundleError(f"{self.path}: schema {m.get('schema')!r}, expected {SCHEMA!r}")
        blobs = {}
        for name, digest in m["files"].items():
            f = self.path / name
            if not f.is_file():
                raise BundleError(f"{self.path}: file {name} is missing")
            data = f.read_bytes()
            got = hashlib.sha256(data).hexdigest()
            if got != digest:
                raise BundleError(
                    f"{self.path}: {name} has sha256 {got}, the manifest says {digest} "
                    "(the file was changed or damaged)"
                )
            blobs[name] = data
        req = m["requires"]
        self.device = device if device is not None else _request_device(req)
        _check_device(self.device, req)
        gpu = self.device
        self._queue = gpu.queue
        self._buffers = [
            gpu.create_buffer(
                label=f"b{b['id']} {b['role']}", size=_align(max(b["size"], 4)), usage=_USAGE
            )
            for b in m["buffers"]
        ]
        weights = _load_safetensors(blobs[m["weights"]["file"]], m["weights"]["file"])
        for t in m["weights"]["tensors"]:
            self._write(t, weights[t["name"]])
        self._inputs = {s["name"]: s for s in m["inputs"]}
        self._outputs = {s["name"]: s for s in m["outputs"]}
        self.inputs = {
            n: (tuple(s["shape"]), np.dtype(s["dtype"])) for n, s in self._inputs.items()
        }
        self.outputs = {
            n: (tuple(s["shape"]), np.dtype(s["dtype"])) for n, s in self._outputs.items()
        }
        layouts, pipelines, self._plan = {}, {}, []
        for d in m["dispatches"]:
            access = tuple(b["access"] == "read_write" for b in d["bindings"])
            if access not in layouts:
                entries = [
                    {
                        "binding": i,
                        "visibility": wgpu.ShaderStage.COMPUTE,
                        "buffer": {
                            "type": wgpu.BufferBindingType.storage
                            if w
                            else wgpu.BufferBindingType.read_only_storage
                        },
                    }
                    for i, w in enumerate(access)
                ]
                bgl = gpu.create_bind_group_layout(entries=entries)
                layouts[access] = (bgl, gpu.create_pipeline_layout(bind_group_layouts=[bgl]))
            bgl, pl = layouts[access]
            key = (d["kernel"], access)
            if key not in pipelines:
                k = m["kernels"][d["kernel"]]
                try:
                    module = gpu.create_shader_module(
                        label=d["name"], code=blobs[k["file"]].decode("utf-8")
                    )
                    pipelines[key] = gpu.create_compute_pipeline(
                        label=d["name"],
                        layout=pl,
                        compute={"module": module, "entry_point": "main"},
                    )
                except wgpu.GPUError as e:
                    raise BundleError(f"kernel {d['name']!r} failed to compile here:\n{e}") from e
            bg = gpu.create_bind_group(
                layout=bgl,
                entries=[
                    {
                        "binding": i,
                        "resource": {
                            "buffer": self._buffers[b["buffer"]],
                            "offset": b["offset"],
                            "size": b["size"],
                        },
                    }
                    for i, b in enumerate(d["bindings"])
                ],
            )
            if 0 not in d["grid"]:
                self._plan.append((pipelines[key], bg, tuple(d["grid"])))
        self._staging = {}
        for name, s in self._outputs.items():
            start, length = self._span(s)
            if length:
                self._staging[name] = gpu.create_buffer(
                    size=length, usage=wgpu.BufferUsage.MAP_READ | wgpu.BufferUsage.COPY_DST
                )

    @staticmethod
    def _span(s: Mapping) -> tuple[int, int]:
        """(4-aligned start, 4-aligned length) of a slot's bytes in its buffer."""
        n = int(np.prod(s["shape"], dtype=np.int64)) * np.dtype(_STORE[s["storage"]]).itemsize
        start = s["offset"] - s["offset"] % 4
        return start, _align(s["offset"] + n) - start

    def _write(self, s: Mapping, stored: np.ndarray) -> None:
        raw = np.ascontiguousarray(stored).reshape(-1).view(np.uint8)
        if raw.size == 0:
            return
        start, length = self._span(s)
        buf = self._buffers[s["buffer"]]
        if start != s["offset"] or length != raw.size:  # an odd-length or 2-aligned f16 slot
            block = np.frombuffer(self._queue.read_buffer(buf, start, length), np.uint8).copy()
            head = s["offset"] - start
            block[head : head + raw.size] = raw
            raw = block
        self._queue.write_buffer(buf, start, raw)

    def _checked(self, name: str, value) -> np.ndarray:
        s = self._inputs[name]
        shape, want = tuple(s["shape"]), np.dtype(s["dtype"])
        if not isinstance(value, np.ndarray):
            raise BundleError(
                f"input {name!r}: expected a NumPy array of shape {shape} and dtype {want}, "
                f"got {type(value).__name__}"
            )
        if value.dtype != want:
            raise BundleError(f"input {name!r}: expected dtype {want}, got {value.dtype}")
        if value.shape != shape:
            raise BundleError(f"input {name!r}: expected shape {shape}, got {value.shape}")
        for lc in self.manifest.get("label_checks", ()):
            if lc["name"] != name:
                continue
            bad = (value < 0) | (value >= lc["num_classes"])
            if lc["ignore_index"] is not None:
                bad &= value != lc["ignore_index"]
            if bad.any():
                v = value.reshape(-1)[int(np.argmax(bad.reshape(-1)))]
                raise BundleError(
                    f"input {name!r}: {lc['what']} {v} is outside [0, {lc['num_classes']})"
                )
        with np.errstate(over="ignore"):
            return np.ascontiguousarray(value, dtype=_STORE[s["storage"]])

    def run(self, feeds: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Upload ``feeds``, run every dispatch, and read every output back.

        Args:
            feeds: every input by name, of the exact shape and dtype in ``inputs``.

        Returns:
            ``{output name: array}`` in the manifest's shapes and dtypes.

        Raises:
            BundleError: a missing or unknown input, or a wrong shape, dtype or index value
                (names the input, expected and actual); nothing is uploaded then.
        """
        missing = sorted(set(self._inputs) - set(feeds))
        unknown = sorted(set(feeds) - set(self._inputs))
        if missing or unknown:
            raise BundleError(
                f"feeds do not match the bundle's inputs: missing {missing}, unknown {unknown} "
                f"(inputs: {sorted(self._inputs)})"
            )
        ready = [(self._inputs[n], self._checked(n, v)) for n, v in feeds.items()]
        for s, data in ready:
            self._write(s, data)
        enc = self.device.create_command_encoder()
        cp = enc.begin_compute_pass()
        for pipeline, bg, grid in self._plan:
            cp.set_pipeline(pipeline)
            cp.set_bind_group(0, bg)
            cp.dispatch_workgroups(*grid)
        cp.end()
        for name, staging in self._staging.items():
            start, length = self._span(self._outputs[name])
            enc.copy_buffer_to_buffer(
                self._buffers[self._outputs[name]["buffer"]], start, staging, 0, length
            )
        self._queue.submit([enc.finish()])
        out = {}
        for name, s in self._outputs.items():
            shape, dtype = tuple(s["shape"]), np.dtype(s["dtype"])
            if name not in self._staging:
                out[name] = np.zeros(shape, dtype)
                continue
            st = self._staging[name]
            st.map_sync(wgpu.MapMode.READ)
            try:
                raw = bytes(st.read_mapped(copy=False))
            finally:
                st.unmap()
            start, _ = self._span(s)
            n = int(np.prod(shape, dtype=np.int64))
            arr = np.frombuffer(raw, _STORE[s["storage"]], n, s["offset"] - start).reshape(shape)
            out[name] = arr != 0 if s["dtype"] == "bool" else arr.astype(dtype)
        return out


def _request_device(req: Mapping) -> wgpu.GPUDevice:
    adapter = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
    if adapter is None:
        raise BundleError("no WebGPU adapter is available")
    _check_limits(set(adapter.features), dict(adapter.limits), req, "adapter")
    # The adapter's own values of the limits the bundle names (as meganeura's runtime asks).
    limits = {
        k: int(adapter.limits[k])
        for k in req["limits"]
        if k != "min-storage-buffer-offset-alignment"
    }
    return adapter.request_device_sync(
        label="meganeura bundle", required_features=list(req["features"]), required_limits=limits
    )


def _check_device(device: wgpu.GPUDevice, req: Mapping) -> None:
    _check_limits(set(device.features), dict(device.limits), req, "device")


def _check_limits(features: set, limits: Mapping, req: Mapping, what: str) -> None:
    features = {str(f) for f in features}
    for f in req["features"]:
        if f not in features:
            raise BundleError(
                f"the bundle needs the {what} feature {f!r}, which this {what} lacks "
                "(re-export with strict=True / --strict for targets without shader-f16)"
            )
    for k, v in req["limits"].items():
        have = int(limits[k])
        if k == "min-storage-buffer-offset-alignment":
            if v % have:
                raise BundleError(
                    f"the bundle binds at offsets that are multiples of {v}; this {what}'s "
                    f"{k} is {have}"
                )
        elif have < v:
            raise BundleError(f"the bundle needs {k} >= {v:,}; this {what} allows {have:,}")

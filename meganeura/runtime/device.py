"""Adapter selection and the process-wide device cache.

This is the only place that requests wgpu adapters and devices. A :class:`Device` wraps one
``GPUDevice`` requested with the adapter's maximum limits and the optional features meganeura
uses (``shader-f16``, ``subgroup``, ``timestamp-query``, ``timestamp-query-inside-passes``) when
the adapter has them.

Invariants:
  * one ``Device`` per adapter-selection string per process (:func:`get_device` caches them),
    so pipelines compiled for one Session are reused by the next;
  * limits are read back from the created device, never assumed; they are plain ints;
  * library code never reads environment variables: the CLI passes the selection string in.
    The one environment access is :func:`_quiet_vulkan_device_select`, which sets a Vulkan
    loader variable (no meganeura setting) before the first adapter request.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

import wgpu

from .pipelines import PipelineCache

# Optional features requested when the adapter offers them: f16 storage for the fast path,
# subgroup operations for reductions, timestamps for profiles (inside a pass where possible, so
# a profiled step keeps the ordinary step's single compute pass).
USEFUL_FEATURES = ("shader-f16", "subgroup", "timestamp-query", "timestamp-query-inside-passes")

# Limits a compute-only runtime depends on; if the adapter refuses its own maximum for some
# graphics limit we retry with only these.
_COMPUTE_LIMITS = (
    "max-storage-buffer-binding-size",
    "max-buffer-size",
    "max-compute-workgroups-per-dimension",
    "max-compute-workgroup-storage-size",
    "max-compute-invocations-per-workgroup",
    "max-compute-workgroup-size-x",
    "max-compute-workgroup-size-y",
    "max-compute-workgroup-size-z",
    "max-storage-buffers-per-shader-stage",
    "max-bindings-per-bind-group",
    "min-storage-buffer-offset-alignment",
)

_DEVICES: dict[str | None, Device] = {}


def describe_adapter(info: Mapping[str, Any]) -> str:
    """One line naming an adapter, e.g. ``llvmpipe (LLVM 15.0.6, 256 bits) [Vulkan, CPU]``.

    Args:
        info: an adapter's ``info`` mapping (``device``, ``backend_type``, ``adapter_type`` ...).
    """
    name = info.get("device") or info.get("description") or info.get("vendor") or "unknown"
    return f"{name} [{info.get('backend_type', '?')}, {info.get('adapter_type', '?')}]"


def _matches(info: Mapping[str, Any], needle: str) -> bool:
    fields = ("device", "description", "vendor", "backend_type")
    return any(needle in str(info.get(f, "")).casefold() for f in fields)


# Variables with which a user asks Mesa's device-select layer to pick the GPU (DRI_PRIME is
# implemented by that layer on Vulkan); while one is set the layer stays on.
_DEVICE_SELECT_REQUESTS = (
    "MESA_VK_DEVICE_SELECT",
    "MESA_VK_DEVICE_SELECT_FORCE_DEFAULT_DEVICE",
    "DRI_PRIME",
)


def _quiet_vulkan_device_select() -> None:
    """Turn off Mesa's implicit ``VK_LAYER_MESA_device_select`` for this process.

    That layer (``libVkLayer_MESA_device_select.so``) reorders the physical devices so that the
    display's GPU comes first; to find that GPU it calls ``wl_display_connect`` inside
    ``vkEnumeratePhysicalDevices``, and without a Wayland session (a server, CI, lavapipe) every
    call prints ``error: XDG_RUNTIME_DIR is invalid or not set in the environment.`` to stderr
    before anything else. meganeura picks its adapter itself (power preference or the
    ``adapter`` substring), so the display's choice is not needed for compute.
    ``NODEVICE_SELECT=1`` is the layer manifest's ``disable_environment``; the Vulkan loader
    reads it when wgpu creates its instance (at the first adapter request or enumeration), so
    this runs just before that. It only sets a loader variable, never one of meganeura's
    settings (those come from the CLI), and it overrides nothing: a ``NODEVICE_SELECT`` the
    user set is kept, and while a variable asking the layer to choose is set
    (:data:`_DEVICE_SELECT_REQUESTS`) the layer stays on. Errors still reach stderr.
    """
    if not any(name in os.environ for name in _DEVICE_SELECT_REQUESTS):
        os.environ.setdefault("NODEVICE_SELECT", "1")


def _select_adapter(adapter: str | None) -> wgpu.GPUAdapter:
    _quiet_vulkan_device_select()  # before wgpu's instance exists; see there
    if adapter is None:
        found = wgpu.gpu.request_adapter_sync(power_preference="high-performance")
        if found is None:
            raise RuntimeError("no WebGPU adapter is available (no Vulkan, Metal or DX12 driver)")
        return found
    needle = adapter.strip().casefold()
    candidates = wgpu.gpu.enumerate_adapters_sync()
    for cand in candidates:
        if _matches(cand.info, needle):
            return cand
    listing = "\n".join(f"  - {describe_adapter(c.info)}" for c in candidates) or "  (none)"
    raise RuntimeError(f"no adapter matches {adapter!r}; available adapters:\n{listing}")


def _request_device(adapter: wgpu.GPUAdapter) -> wgpu.GPUDevice:
    features = [f for f in USEFUL_FEATURES if f in adapter.features]
    limits = dict(adapter.limits)
    compute_limits = {k: v for k, v in limits.items() if k in _COMPUTE_LIMITS}
    errors = []
    for required in (limits, compute_limits):
        try:
            return adapter.request_device_sync(
                label="meganeura", required_features=features, required_limits=required
            )
        except Exception as e:  # retried with fewer limits, then all reasons reported
            errors.append(f"{type(e).__name__}: {e}")
    raise RuntimeError(
        f"could not create a device on {describe_adapter(adapter.info)}:\n" + "\n".join(errors)
    )


class Device:
    """A wgpu device with its adapter facts, limits and pipeline cache.

    Attributes:
        adapter: the ``GPUAdapter`` it came from.
        gpu: the ``GPUDevice``.
        info: adapter info as a plain dict (``device``, ``vendor``, ``backend_type`` ...).
        features: enabled feature names.
        limits: every device limit, by WebGPU name (``max-buffer-size`` ...).
        max_storage_buffer_binding_size: bytes one storage binding may span.
        max_buffer_size: bytes one buffer may hold.
        max_compute_workgroups_per_dimension: largest workgroup count per grid axis.
        max_compute_workgroup_storage_size: bytes of ``var<workgroup>`` memory.
        max_compute_invocations_per_workgroup: product of a workgroup size's axes.
        max_storage_buffers_per_shader_stage: storage bindings one kernel may declare.
        min_storage_buffer_offset_alignment: bytes a binding's offset must be a multiple of.
        pipelines: compute pipelines compiled on this device, by WGSL hash.
    """

    def __init__(self, adapter: wgpu.GPUAdapter, gpu: wgpu.GPUDevice):
        self.adapter = adapter
        self.gpu = gpu
        self.info: dict[str, Any] = dict(adapter.info)
        self.features: frozenset[str] = frozenset(str(f) for f in gpu.features)
        self.limits: dict[str, int] = {k: int(v) for k, v in dict(gpu.limits).items()}
        lim = self.limits
        self.max_storage_buffer_binding_size = lim["max-storage-buffer-binding-size"]
        self.max_buffer_size = lim["max-buffer-size"]
        self.max_compute_workgroups_per_dimension = lim["max-compute-workgroups-per-dimension"]
        self.max_compute_workgroup_storage_size = lim["max-compute-workgroup-storage-size"]
        self.max_compute_invocations_per_workgroup = lim["max-compute-invocations-per-workgroup"]
        self.max_storage_buffers_per_shader_stage = lim["max-storage-buffers-per-shader-stage"]
        self.min_storage_buffer_offset_alignment = lim.get(
            "min-storage-buffer-offset-alignment", 256
        )
        self.pipelines = PipelineCache(gpu, backend=self.info.get("backend_type"))

    @classmethod
    def open(cls, adapter: str | None = None) -> Device:
        """Request a new (uncached) device; prefer :func:`get_device`.

        Args:
            adapter: case-insensitive substring of the adapter's device name, description,
                vendor or backend (``"llvmpipe"``, ``"nvidia"``, ``"vulkan"``); None takes the
                high-performance default.

        Raises:
            RuntimeError: no adapter at all, none matching (the message lists them), or the
                device request failed.
        """
        found = _select_adapter(adapter)
        return cls(found, _request_device(found))

    @property
    def name(self) -> str:
        """The adapter's one-line description (:func:`describe_adapter`)."""
        return describe_adapter(self.info)

    def __repr__(self) -> str:
        return f"<meganeura Device {self.name}>"


def get_device(adapter: str | None = None) -> Device:
    """The cached device for an adapter selection, created on first use.

    Args:
        adapter: see :meth:`Device.open`. The cache key is the stripped, case-folded string.

    Raises:
        RuntimeError: as :meth:`Device.open`.
    """
    key = None if adapter is None else adapter.strip().casefold()
    dev = _DEVICES.get(key)
    if dev is None:
        dev = _DEVICES[key] = Device.open(adapter)
    return dev


def get_local_device(local_rank: int) -> Device:
    """The cached device for process ``local_rank`` of a host (``meganeura.distributed``):
    the ``local_rank % n``-th of the host's ``n`` GPU adapters (discrete or integrated, in
    enumeration order, those of the first backend listed: one per physical device),
    or the default device when the host has no GPU adapter (lavapipe: every rank shares it).

    Raises:
        RuntimeError: as :meth:`Device.open`.
    """
    key = f"#local{int(local_rank)}"
    dev = _DEVICES.get(key)
    if dev is not None:
        return dev
    _quiet_vulkan_device_select()
    gpus = [
        c
        for c in wgpu.gpu.enumerate_adapters_sync()
        if "gpu" in str(c.info.get("adapter_type", "")).casefold()  # DiscreteGPU, IntegratedGPU
    ]
    if gpus:  # one adapter per physical device: those of the first backend listed
        backend = gpus[0].info.get("backend_type")
        gpus = [c for c in gpus if c.info.get("backend_type") == backend]
    if not gpus:
        dev = get_device(None)
    else:
        found = gpus[int(local_rank) % len(gpus)]
        dev = Device(found, _request_device(found))
    _DEVICES[key] = dev
    return dev


def format_info(device: Device) -> str:
    """A human-readable report for ``meganeura info``: adapter, backend, features, limits.

    Args:
        device: the device to describe.
    """
    info = device.info
    lines = [
        f"adapter:      {info.get('device', '')}",
        f"vendor:       {info.get('vendor', '')} (0x{int(info.get('vendor_id', 0)):04x})",
        f"backend:      {info.get('backend_type', '')}",
        f"adapter type: {info.get('adapter_type', '')}",
        f"driver:       {info.get('description', '')}",
        "features:     "
        + ", ".join(f"{f}={'yes' if f in device.features else 'no'}" for f in USEFUL_FEATURES),
        f"adapter has:  {len(device.adapter.features)} features, {len(device.features)} enabled",
        "limits:",
    ]
    main = (
        "max_storage_buffer_binding_size",
        "max_buffer_size",
        "max_compute_workgroups_per_dimension",
        "max_compute_workgroup_storage_size",
        "max_compute_invocations_per_workgroup",
        "max_storage_buffers_per_shader_stage",
    )
    lines += [f"  {k:<40} {getattr(device, k):>14,}" for k in main]
    return "\n".join(lines)

"""The runtime: the only part of meganeura that imports wgpu.

It turns a :class:`~meganeura.schedule.program.Program` into GPU objects once and replays it:
:func:`get_device` picks and caches an adapter's device, :class:`Session` owns one program's
buffers, pipelines and bind groups and runs steps, and ``Session.profile`` times each dispatch
with timestamp queries (:mod:`.profiler`).
"""

from .device import Device, describe_adapter, format_info, get_device
from .pipelines import KernelError
from .profiler import Profile, ProfilerError
from .session import InputError, Session

__all__ = [
    "Device",
    "InputError",
    "KernelError",
    "Profile",
    "ProfilerError",
    "Session",
    "describe_adapter",
    "format_info",
    "get_device",
]

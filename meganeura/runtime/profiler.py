"""GPU time per dispatch, from timestamp queries: where a step's time goes.

``Session.profile`` checks the feeds and runs the warm-up steps, then hands its dispatches,
pipelines and bind groups to :func:`profile_dispatches`, which replays them with timestamps
around every dispatch in one of two ways (:func:`choose_method` picks one). This module never
sees a Session, so the Session's GPU objects and feed checks stay its own:

  * ``inside`` (preferred; needs wgpu-native's ``timestamp-query-inside-passes``): the ordinary
    step's single compute pass with a timestamp before the first dispatch and after each one,
    written with ``wgpu.backends.wgpu_native.extras.write_timestamp`` (wgpu-py 0.32 has no public
    ``GPUComputePassEncoder.write_timestamp``); a dispatch's time runs from the previous
    timestamp to its own, so it includes the barrier and launch before it;
  * ``passes`` (WebGPU's portable way, needing only ``timestamp-query``; Metal on Apple GPUs
    offers nothing finer): each dispatch in a compute pass of its own whose ``timestamp_writes``
    record the pass's beginning and end; the gaps between passes are profiling overhead.

The query sets are resolved into buffers in the same command encoder and read back after the
submit. The ordinary step (``Session.run``) is untouched: no queries, nothing extra recorded.

Timestamps are raw ticks; ``ticks * period`` is nanoseconds. wgpu-py 0.32 has no Python method
for the period, so it is read through wgpu-native's ``wgpuQueueGetTimestampPeriod`` (1.0 on
lavapipe and NVIDIA Vulkan); if that call is unavailable the period is taken as 1 ns and
``Profile.period_source`` says so.

Invariants:
  * one :class:`DispatchTiming` per executed dispatch per repeat, in program order (dispatches
    with an empty grid are not executed by the step either, and are left out);
  * times are nanoseconds relative to the first timestamp of the profile;
  * a query set holds at most 4096 queries (WebGPU's limit), so long programs use several.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

import numpy as np
import wgpu

from ..schedule.pack import SEPARATOR

if TYPE_CHECKING:
    from ..schedule.program import Dispatch
    from .device import Device

_MAX_QUERIES = 4096  # WebGPU: a GPUQuerySet holds at most 4096 queries
_INSIDE = "timestamp-query-inside-passes"
Method = Literal["auto", "inside", "passes"]


class ProfilerError(RuntimeError):
    """The device cannot time dispatches (no ``timestamp-query`` feature)."""


@dataclass(frozen=True)
class DispatchTiming:
    """One dispatch of one profiled step.

    Attributes:
        index: position in ``Program.dispatches``.
        name: ``Dispatch.name`` (``"%6 matmul"``).
        repeat: which profiled step (0-based).
        start_ns: pass beginning, ns after the profile's first timestamp.
        duration_ns: pass end minus beginning, ns.
        flops: ``Dispatch.flops`` (0 when the kernel does not report it).
        bytes: ``Dispatch.bytes``, read + written (0 when unknown).
        grid: workgroup counts.
    """

    index: int
    name: str
    repeat: int
    start_ns: float
    duration_ns: float
    flops: int
    bytes: int
    grid: tuple[int, int, int]


@dataclass(frozen=True)
class KernelStat:
    """Aggregate over the timings sharing one name (see :meth:`Profile.stats`).

    ``bytes`` and ``flops`` are totals over all ``count`` calls; rates are totals over total
    time; ``share`` is this kernel's fraction of the summed dispatch time.
    """

    name: str
    count: int
    total_ns: float
    bytes: int
    flops: int
    share: float

    @property
    def mean_ns(self) -> float:
        return self.total_ns / self.count

    @property
    def gb_per_s(self) -> float:
        return self.bytes / self.total_ns if self.total_ns > 0 else 0.0  # B/ns == GB/s

    @property
    def gflop_per_s(self) -> float:
        return self.flops / self.total_ns if self.total_ns > 0 else 0.0


@dataclass(frozen=True)
class Profile:
    """Per-dispatch GPU times of ``repeats`` profiled steps.

    Attributes:
        timings: one entry per executed dispatch per repeat, in order.
        repeats: profiled steps.
        device: the adapter's one-line name.
        timestamp_period: ns per timestamp tick.
        period_source: where the period came from.
        method: ``"inside"`` (one pass, a timestamp after each dispatch: a dispatch's time runs
            from the previous one's end to its own) or ``"passes"`` (a pass per dispatch with
            begin/end timestamps).
    """

    timings: tuple[DispatchTiming, ...]
    repeats: int
    device: str
    timestamp_period: float
    period_source: str
    method: str = "passes"

    def step_ns(self) -> float:
        """Mean over repeats of the summed dispatch durations (gaps between passes excluded)."""
        return sum(t.duration_ns for t in self.timings) / self.repeats

    def repeat_ns(self) -> list[float]:
        """Each repeat's summed dispatch durations, in repeat order."""
        per = [0.0] * self.repeats
        for t in self.timings:
            per[t.repeat] += t.duration_ns
        return per

    def span_ns(self) -> float:
        """Mean over repeats of first pass beginning to last pass end (gaps included)."""
        spans = []
        for r in range(self.repeats):
            ts = [t for t in self.timings if t.repeat == r]
            if ts:
                spans.append(max(t.start_ns + t.duration_ns for t in ts) - ts[0].start_ns)
        return sum(spans) / len(spans) if spans else 0.0

    def stats(self, by: Literal["dispatch", "op"] = "dispatch") -> list[KernelStat]:
        """Aggregates sorted by total time, longest first.

        Args:
            by: ``"dispatch"`` groups by the full dispatch name (``"%6 matmul"``: count is the
                number of repeats); ``"op"`` drops the ``%id`` prefixes (``op_name``), so every
                matmul of the step shares one row.
        """
        groups: dict[str, list[DispatchTiming]] = {}
        for t in self.timings:
            key = op_name(t.name) if by == "op" else t.name
            groups.setdefault(key, []).append(t)
        total = sum(t.duration_ns for t in self.timings) or 1.0
        rows = [
            KernelStat(
                name,
                len(ts),
                sum(t.duration_ns for t in ts),
                sum(t.bytes for t in ts),
                sum(t.flops for t in ts),
                sum(t.duration_ns for t in ts) / total,
            )
            for name, ts in groups.items()
        ]
        return sorted(rows, key=lambda k: -k.total_ns)

    def table(self, by: Literal["dispatch", "op"] = "dispatch") -> str:
        """A text table of :meth:`stats`, longest first, with a summary line.

        Columns: kernel name; calls; total and mean GPU µs; bytes and FLOPs per call; achieved
        TB/s and TFLOP/s (total bytes or FLOPs over total time); share of the summed step time.
        """
        rows = self.stats(by)
        width = max([len("kernel"), *(len(k.name) for k in rows)])
        head = (
            f"{'kernel':<{width}} {'count':>5} {'total us':>10} {'mean us':>9} {'bytes':>8} "
            f"{'FLOPs':>8} {'TB/s':>7} {'TFLOP/s':>8} {'share':>6}"
        )
        lines = [head, "-" * len(head)]
        for k in rows:
            lines.append(
                f"{k.name:<{width}} {k.count:>5} {k.total_ns / 1e3:>10.1f} "
                f"{k.mean_ns / 1e3:>9.2f} {_si(k.bytes / k.count):>8} "
                f"{_si(k.flops / k.count):>8} {k.gb_per_s / 1e3:>7.3g} "
                f"{k.gflop_per_s / 1e3:>8.3g} {100 * k.share:>5.1f}%"
            )
        n = len(self.timings) // self.repeats
        lines.append("-" * len(head))
        lines.append(
            f"step: {self.step_ns() / 1e3:.1f} us GPU summed over {n} dispatches, "
            f"{self.span_ns() / 1e3:.1f} us first start to last end "
            f"(mean of {self.repeats} step{'s' if self.repeats != 1 else ''}; timestamps "
            f"{'inside one pass' if self.method == 'inside' else 'around a pass per dispatch'})"
        )
        return "\n".join(lines)

    def trace(self) -> dict:
        """The timings as a Chrome / Perfetto trace (``chrome://tracing``, ui.perfetto.dev).

        Returns:
            ``{"traceEvents": [...], ...}``: one complete event (``ph: "X"``) per timing with
            ``ts``/``dur`` in µs and ``args`` holding index, repeat, grid, flops, bytes,
            ``GB/s`` and ``GFLOP/s``; plus process/thread name metadata events.
        """
        events: list[dict] = [
            {"name": "process_name", "ph": "M", "pid": 0, "args": {"name": self.device}},
            {"name": "thread_name", "ph": "M", "pid": 0, "tid": 0, "args": {"name": "GPU"}},
        ]
        for t in self.timings:
            dur = t.duration_ns
            events.append(
                {
                    "name": t.name,
                    "cat": "dispatch",
                    "ph": "X",
                    "ts": t.start_ns / 1e3,
                    "dur": dur / 1e3,
                    "pid": 0,
                    "tid": 0,
                    "args": {
                        "index": t.index,
                        "repeat": t.repeat,
                        "grid": list(t.grid),
                        "flops": t.flops,
                        "bytes": t.bytes,
                        "GB/s": t.bytes / dur if dur > 0 else 0.0,
                        "GFLOP/s": t.flops / dur if dur > 0 else 0.0,
                    },
                }
            )
        return {
            "traceEvents": events,
            "displayTimeUnit": "ns",
            "otherData": {
                "device": self.device,
                "repeats": self.repeats,
                "timestamp_period_ns": self.timestamp_period,
                "timestamp_period_source": self.period_source,
                "timestamp_method": self.method,
            },
        }

    def write_trace(self, path: str | Path) -> Path:
        """Write :meth:`trace` as JSON (parent folders are created); returns the path."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(self.trace()))
        return path


def op_name(name: str) -> str:
    """A dispatch name without its node ids: ``"%6+7 matmul"`` -> ``"matmul"``, a packed
    dispatch's ``"%6 matmul & %9 sum"`` -> ``"matmul & sum"`` (``schedule.pack``)."""
    parts = [p.partition(" ")[2] or p if p.startswith("%") else p for p in name.split(SEPARATOR)]
    return SEPARATOR.join(parts)


def _si(x: float) -> str:
    for scale, unit in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= scale:
            return f"{x / scale:.3g}{unit}"
    return f"{x:.3g}"


def timestamp_period(device: Device) -> tuple[float, str]:
    """Nanoseconds per timestamp tick of ``device``'s queue, and where the number came from.

    wgpu-py 0.32 exposes no ``get_timestamp_period``; wgpu-native's C function is reached
    through wgpu-py's FFI handle. Should that fail (another backend, a changed private API), the
    WebGPU convention of nanosecond timestamps is assumed.
    """
    try:
        from wgpu.backends.wgpu_native._ffi import lib

        period = float(lib.wgpuQueueGetTimestampPeriod(device.gpu.queue._internal))
        if period > 0:
            return period, "wgpuQueueGetTimestampPeriod"
    except Exception:  # any failure of the private path falls back to the documented default
        pass
    return 1.0, "assumed 1 ns per tick (wgpuQueueGetTimestampPeriod unavailable)"


def require_timestamps(device: Device) -> None:
    """Raise :class:`ProfilerError` unless ``device`` has ``timestamp-query`` enabled."""
    if "timestamp-query" in device.features:
        return
    if "timestamp-query" in {str(f) for f in device.adapter.features}:
        why = "the adapter offers it but this Device was created without it"
    else:
        why = "the adapter does not offer it"
    raise ProfilerError(
        f"profiling needs the WebGPU feature 'timestamp-query' and {device.name} cannot "
        f"provide it: {why}. Try another adapter (meganeura --adapter ..., `meganeura info` "
        f"lists the features)."
    )


def choose_method(device: Device, method: Method = "auto") -> Literal["inside", "passes"]:
    """How :func:`profile_dispatches` will take timestamps on ``device``.

    Args:
        device: the Device the step runs on.
        method: ``"inside"``, ``"passes"``, or ``"auto"`` (``"inside"`` when the device has
            ``timestamp-query-inside-passes``, else ``"passes"``).

    Returns:
        ``"inside"`` or ``"passes"``.

    Raises:
        ValueError: an unknown ``method``.
        ProfilerError: no ``timestamp-query`` on the device, or ``method="inside"`` without
            ``timestamp-query-inside-passes``.
    """
    if method not in ("auto", "inside", "passes"):
        raise ValueError(f"method must be 'auto', 'inside' or 'passes', got {method!r}")
    require_timestamps(device)
    inside = _INSIDE in device.features
    if method == "inside" and not inside:
        raise ProfilerError(f"{device.name} has no '{_INSIDE}' feature; use method='passes'")
    return "inside" if inside and method != "passes" else "passes"


def profile_dispatches(
    device: Device,
    dispatches: Sequence[Dispatch],
    pipelines: Sequence[wgpu.GPUComputePipeline],
    bind_groups: Sequence[wgpu.GPUBindGroup],
    repeats: int = 1,
    method: Literal["inside", "passes"] = "passes",
    replays: int = 1,
) -> Profile:
    """Replay a step's dispatches ``repeats`` times with timestamps; see :meth:`Session.profile`.

    Each repeat is one command buffer and one submission, followed by a read-back of the
    resolved timestamps; with ``replays`` > 1 the submission holds the step's dispatches that
    many times over, back to back, each replay counted as a repeat of the Profile. Inputs must
    already be uploaded: nothing is checked or written here but the dispatches' own bindings.

    Args:
        device: the Device that owns the pipelines and bind groups.
        dispatches: the step's dispatches in program order; those with an empty grid are
            skipped, as the step skips them.
        pipelines: one per dispatch, in the same order.
        bind_groups: one per dispatch, in the same order.
        repeats: profiled submissions (at least 1).
        method: from :func:`choose_method`.
        replays: the step's dispatches per submission (at least 1).

    Returns:
        One :class:`DispatchTiming` per executed dispatch per repeat and replay, in a
        :class:`Profile` of ``repeats * replays`` repeats.

    Raises:
        ValueError: ``repeats`` or ``replays`` < 1.
    """
    if repeats < 1:
        raise ValueError(f"need repeats >= 1, got {repeats}")
    if replays < 1:
        raise ValueError(f"need replays >= 1, got {replays}")
    inside = method == "inside"
    step = [
        (i, d, pipelines[i], bind_groups[i]) for i, d in enumerate(dispatches) if 0 not in d.grid
    ]
    todo = step * replays
    gpu, queue = device.gpu, device.gpu.queue
    count = len(todo) + 1 if inside else 2 * len(todo)
    sizes = [min(_MAX_QUERIES, count - k) for k in range(0, count, _MAX_QUERIES)]
    sets = [gpu.create_query_set(type="timestamp", count=n) for n in sizes]
    usage = wgpu.BufferUsage.QUERY_RESOLVE | wgpu.BufferUsage.COPY_SRC
    resolved = [gpu.create_buffer(size=8 * n, usage=usage) for n in sizes]
    record = _record_inside if inside else _record_passes
    ticks: list[np.ndarray] = []
    try:
        for _ in range(repeats):
            enc = gpu.create_command_encoder(label="profiled step")
            record(enc, todo, lambda g: (sets[g // _MAX_QUERIES], g % _MAX_QUERIES))
            for qs, n, buf in zip(sets, sizes, resolved):
                enc.resolve_query_set(qs, 0, n, buf, 0)
            queue.submit([enc.finish()])
            raw = [
                np.frombuffer(queue.read_buffer(b), np.uint64).astype(np.int64) for b in resolved
            ]
            ticks.append(np.concatenate(raw) if raw else np.zeros(0, np.int64))
    finally:
        for qs in sets:
            qs.destroy()
        for b in resolved:
            b.destroy()

    period, source = timestamp_period(device)
    origin = min((int(t[0]) for t in ticks if t.size), default=0)
    timings = []
    for r, t in enumerate(ticks):
        for k, (i, d, _, _) in enumerate(todo):
            begin, end = (
                (int(t[k]), int(t[k + 1])) if inside else (int(t[2 * k]), int(t[2 * k + 1]))
            )
            timings.append(
                DispatchTiming(
                    index=i,
                    name=d.name,
                    repeat=r * replays + k // max(len(step), 1),
                    start_ns=(begin - origin) * period,
                    duration_ns=(end - begin) * period,
                    flops=d.flops,
                    bytes=d.bytes,
                    grid=tuple(d.grid),
                )
            )
    return Profile(tuple(timings), repeats * replays, device.name, period, source, method)


def _record_passes(enc, todo, slot) -> None:
    # One pass per dispatch; 2k and 2k + 1 always share a query set (its size is even).
    for k, (_, d, pipeline, bg) in enumerate(todo):
        qs, at = slot(2 * k)
        writes = {
            "query_set": qs,
            "beginning_of_pass_write_index": at,
            "end_of_pass_write_index": at + 1,
        }
        cp = enc.begin_compute_pass(label=d.name, timestamp_writes=writes)
        cp.set_pipeline(pipeline)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*d.grid)
        cp.end()


def _record_inside(enc, todo, slot) -> None:
    # The ordinary step's single pass, with a timestamp before the first dispatch and after each.
    from wgpu.backends.wgpu_native.extras import write_timestamp

    cp = enc.begin_compute_pass(label="profiled step")
    write_timestamp(cp, *slot(0))
    for k, (_, d, pipeline, bg) in enumerate(todo):
        cp.set_pipeline(pipeline)
        cp.set_bind_group(0, bg)
        cp.dispatch_workgroups(*d.grid)
        write_timestamp(cp, *slot(k + 1))
    cp.end()

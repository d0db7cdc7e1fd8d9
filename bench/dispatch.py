"""Benchmark: host cost per step. (1) Dispatch overhead: a program of N tiny dispatches
(N = 100, 1000) replayed by ``Session.run``, against N tiny PyTorch eager ops; the issue's
target is < 3 ms of host time per step for 1,000 dispatches. (2) Upload paths for per-step
inputs (4 KiB, 256 KiB, 4 MiB), prototyped here in raw wgpu.

Dispatch rows:
  * ours: a chain of N elementwise ops (``y = y * 1.001``, ``y = y + 0.5`` alternately) on a
    1 KiB parameter, compiled with fusion off (``CompileOptions(fuse=False)`` where that option
    exists) so it keeps N dispatches; ``Session.run({})`` uploads and fetches nothing.
    ``*_host``: perf_counter around ``run`` alone, the GPU idle before each step (the sync is
    outside the timed region; ``*_pipelined_ms`` extras: steps back to back, one final sync);
    ``*_synced``: ``run`` + ``Session.synchronize`` (a 4-byte read-back) per step.
  * torch: the same chain in eager mode (N kernel launches), without / with
    ``cuda.synchronize``.
  * extras: µs per dispatch; the raw-wgpu floor (the same N dispatches of a hand-written
    shader encoded directly, with and without re-binding per dispatch); the fused program's
    dispatch count and host time (the compiler's default).
Upload rows (ours vs the PyTorch analogue), each step = upload + one submit holding a 4-byte
copy that consumes the data:
  * write_buffer: ``queue.write_buffer`` (wgpu-py's public API) vs ``tensor.to(dev)``;
  * native_write: the same native call without wgpu-py's wrapper (``runtime/fastpath.py``,
    what ``Session.run`` uses) vs ``tensor.to(dev)``;
  * mapped_staging: a ring of MAP_WRITE | COPY_SRC buffers, ``map_sync`` + ``write_mapped`` +
    ``unmap`` + ``copy_buffer_to_buffer`` in the step's encoder vs a pinned host buffer
    (``pinned.copy_(x)`` + ``dst.copy_(pinned, non_blocking=True)``);
  * buffer_with_data: ``create_buffer_with_data`` per step + copy, vs ``tensor.to(dev)``.

Usage: python bench/dispatch.py [--quick] [--repeats 20] [--out-name dispatch]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.common import (  # noqa: E402
    add_args,
    resolve_args,
    result,
    start,
    stats,
    timeit,
    torch_sync,
)

SIZE = 256  # f32 elements of the chained tensor (1 KiB)
RAW_WGSL = """
@group(0) @binding(0) var<storage, read_write> buf: array<f32>;
@compute @workgroup_size(64)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    if (gid.x < arrayLength(&buf)) { buf[gid.x] = buf[gid.x] * 1.001 + 0.5; }
}
"""


def host_times(step, sync, warmup: int, repeats: int) -> dict:
    """perf_counter around ``step`` alone, the device idle before each (synced outside the
    timed region), so GPU back-pressure cannot leak into the host time. Adds ``pipelined``:
    ``repeats`` steps back to back then one sync, per step (throughput when the host never
    waits)."""
    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeats):
        sync()
        t = time.perf_counter()
        step()
        times.append((time.perf_counter() - t) * 1e3)
    sync()
    t = time.perf_counter()
    for _ in range(repeats):
        step()
    sync()
    return {**stats(times), "pipelined": (time.perf_counter() - t) * 1e3 / repeats}


def chain_program(n: int, device, fuse: bool):
    import meganeura as mn
    from meganeura.compile import CompileOptions
    from meganeura.training import compile_for

    g = mn.GraphBuilder()
    y = g.parameter("x", (SIZE,))
    for i in range(n):
        y = y * 1.001 if i % 2 == 0 else y + 0.5
    g.output("y", y)
    has_fuse = "fuse" in {f.name for f in dataclasses.fields(CompileOptions)}
    options = CompileOptions(fuse=fuse) if has_fuse else CompileOptions()
    program, sess = compile_for(g.build(), options, device)
    sess.load_state_dict({"x": np.zeros(SIZE, np.float32)})
    return program, sess, has_fuse


class Raw:
    """The chain's floor in raw wgpu: one pipeline and bind group, N dispatches per pass."""

    def __init__(self, gpu):
        import wgpu

        self.gpu, self.queue = gpu, gpu.queue
        usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        self.buf = gpu.create_buffer(size=4 * SIZE, usage=usage)
        module = gpu.create_shader_module(code=RAW_WGSL)
        self.pipeline = gpu.create_compute_pipeline(
            layout="auto", compute={"module": module, "entry_point": "main"}
        )
        self.bg = gpu.create_bind_group(
            layout=self.pipeline.get_bind_group_layout(0),
            entries=[{"binding": 0, "resource": {"buffer": self.buf}}],
        )
        self._sync = gpu.create_buffer(
            size=4, usage=wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
        )

    def sync(self) -> None:
        self.queue.read_buffer(self._sync, 0, 4)

    def step(self, n: int, rebind: bool) -> None:
        enc = self.gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        groups = (SIZE + 63) // 64
        if rebind:
            for _ in range(n):
                cp.set_pipeline(self.pipeline)
                cp.set_bind_group(0, self.bg)
                cp.dispatch_workgroups(groups, 1, 1)
        else:
            cp.set_pipeline(self.pipeline)
            cp.set_bind_group(0, self.bg)
            for _ in range(n):
                cp.dispatch_workgroups(groups, 1, 1)
        cp.end()
        self.queue.submit([enc.finish()])


def breakdown(sess, reps: int) -> dict:
    """Median ms of the host phases of ``Session.run``'s step, the device idle before each
    (Session internals, bench only): encoding the dispatches (``record``),
    ``GPUCommandEncoder.finish`` (wgpu-core's validation and the driver's command buffer) and
    ``queue.submit``."""
    rows = {"record": [], "finish": [], "submit": []}
    for _ in range(reps + 2):
        sess.synchronize()
        t0 = time.perf_counter()
        enc = sess._gpu.create_command_encoder()
        cp = enc.begin_compute_pass()
        sess._plan.record(cp)
        cp.end()
        t1 = time.perf_counter()
        cb = enc.finish()
        t2 = time.perf_counter()
        sess._queue.submit([cb])
        t3 = time.perf_counter()
        rows["record"].append(1e3 * (t1 - t0))
        rows["finish"].append(1e3 * (t2 - t1))
        rows["submit"].append(1e3 * (t3 - t2))
    sess.synchronize()
    return {f"ours_{k}_ms": float(np.median(v[2:])) for k, v in rows.items()}


def dispatch_rows(args, device, torch, dev, rec, raw: Raw) -> None:
    tsync = torch_sync(dev)
    reps = args.repeats
    for n in (100, 1000):
        program, sess, has_fuse = chain_program(n, device, fuse=False)
        nd = len(program.dispatches)
        if nd != n:
            print(f"  note: the unfused chain of {n} ops compiled to {nd} dispatches")

        def ours_step(sess=sess):
            sess.run({})

        o_host = host_times(ours_step, sess.synchronize, args.warmup, reps)
        o_sync = timeit(ours_step, sess.synchronize, args.warmup, reps)
        phases = breakdown(sess, reps)
        raw_rebind = host_times(lambda n=n: raw.step(n, True), raw.sync, args.warmup, reps)
        raw_once = host_times(lambda n=n: raw.step(n, False), raw.sync, args.warmup, reps)
        sess.close()
        fprog, fsess, _ = chain_program(n, device, fuse=True)
        f_host = host_times(lambda fsess=fsess: fsess.run({}), fsess.synchronize, 1, reps)
        f_nd = len(fprog.dispatches)
        fsess.close()

        tx = torch.zeros(SIZE, device=dev)

        def torch_step(tx=tx, n=n):
            y = tx
            for i in range(n):
                y = y * 1.001 if i % 2 == 0 else y + 0.5
            return y

        t_host = host_times(torch_step, tsync, args.warmup, reps)
        t_sync = timeit(torch_step, tsync, args.warmup, reps)
        common = {
            "dispatches": nd,
            "fusion_option": has_fuse,
            "torch_ops": n,
        }
        rec.add(
            result(
                f"dispatch_N{n}_host",
                "ms",
                o_host["median"],
                t_host["median"],
                ours_us_per_dispatch=1e3 * o_host["median"] / nd,
                torch_us_per_op=1e3 * t_host["median"] / n,
                ours_min=o_host["min"],
                torch_min=t_host["min"],
                ours_pipelined_ms=o_host["pipelined"],
                torch_pipelined_ms=t_host["pipelined"],
                raw_wgpu_host_ms=raw_rebind["median"],
                raw_wgpu_bind_once_host_ms=raw_once["median"],
                fused_dispatches=f_nd,
                fused_host_ms=f_host["median"],
                target_ms=3.0 if n == 1000 else None,
                **phases,
                **common,
            )
        )
        rec.add(
            result(
                f"dispatch_N{n}_synced",
                "ms",
                o_sync["median"],
                t_sync["median"],
                ours_us_per_dispatch=1e3 * o_sync["median"] / nd,
                torch_us_per_op=1e3 * t_sync["median"] / n,
                ours_min=o_sync["min"],
                torch_min=t_sync["min"],
                **common,
            )
        )

    # The sync itself, device idle: Session.synchronize (wgpuDevicePoll wait, fastpath.py) vs
    # cuda.synchronize; extra: the public-API fallback, a 4-byte read-back.
    from meganeura.runtime import fastpath

    o = timeit(lambda: fastpath.wait_idle(raw.gpu, raw.sync), lambda: None, args.warmup, reps)
    o_read = timeit(raw.sync, lambda: None, args.warmup, reps)
    t = timeit(tsync, lambda: None, args.warmup, reps)
    rec.add(
        result(
            "sync_idle",
            "ms",
            o["median"],
            t["median"],
            ours_how="wgpuDevicePoll(wait=True)" if fastpath.AVAILABLE else "queue.read_buffer",
            read_back_4B_ms=o_read["median"],
        )
    )


def upload_rows(args, device, torch, dev, rec) -> None:
    import wgpu

    from meganeura.runtime import fastpath

    gpu = device.gpu
    queue = gpu.queue
    tsync = torch_sync(dev)
    reps = args.repeats
    usage = wgpu.BufferUsage.STORAGE | wgpu.BufferUsage.COPY_SRC | wgpu.BufferUsage.COPY_DST
    sink = gpu.create_buffer(size=4, usage=usage)
    sync_buf = gpu.create_buffer(size=4, usage=usage)

    def sync():
        queue.read_buffer(sync_buf, 0, 4)

    sizes = {"4KiB": 4 << 10, "256KiB": 256 << 10, "4MiB": 4 << 20}
    for label, nbytes in sizes.items():
        data = np.random.default_rng(nbytes).standard_normal(nbytes // 4, dtype=np.float32)
        dst = gpu.create_buffer(size=nbytes, usage=usage)
        ring = [
            gpu.create_buffer(
                size=nbytes, usage=wgpu.BufferUsage.MAP_WRITE | wgpu.BufferUsage.COPY_SRC
            )
            for _ in range(3)
        ]
        at = [0]

        def consume(enc, dst=dst):
            enc.copy_buffer_to_buffer(dst, 0, sink, 0, 4)
            queue.submit([enc.finish()])

        def write_buffer(data=data, dst=dst, consume=consume):
            queue.write_buffer(dst, 0, data)
            consume(gpu.create_command_encoder())

        def native_write(data=data, dst=dst, consume=consume):
            fastpath.write(queue, dst, 0, data)  # what Session.run uses
            consume(gpu.create_command_encoder())

        def mapped_staging(data=data, dst=dst, ring=ring, nbytes=nbytes, at=at, consume=consume):
            buf = ring[at[0] % len(ring)]
            at[0] += 1
            buf.map_sync(wgpu.MapMode.WRITE)  # waits until the GPU is done with it
            buf.write_mapped(data)
            buf.unmap()
            enc = gpu.create_command_encoder()
            enc.copy_buffer_to_buffer(buf, 0, dst, 0, nbytes)
            consume(enc)

        def with_data(data=data, dst=dst, nbytes=nbytes, consume=consume):
            src = gpu.create_buffer_with_data(data=data, usage=wgpu.BufferUsage.COPY_SRC)
            enc = gpu.create_command_encoder()
            enc.copy_buffer_to_buffer(src, 0, dst, 0, nbytes)
            consume(enc)
            src.destroy()  # freed once the GPU is done with it

        tdst = torch.empty(nbytes // 4, device=dev)
        pinned = torch.empty(nbytes // 4, pin_memory=True) if dev == "cuda" else torch.empty(0)

        def t_pageable(data=data, tdst=tdst):
            tdst.copy_(torch.from_numpy(data).to(dev))

        def t_pinned(data=data, tdst=tdst, pinned=pinned):
            if dev != "cuda":
                return tdst.copy_(torch.from_numpy(data))
            pinned.copy_(torch.from_numpy(data))
            tdst.copy_(pinned, non_blocking=True)

        for path, ours_fn, torch_fn, torch_how in (
            ("write_buffer", write_buffer, t_pageable, "tensor.to(dev) from pageable"),
            ("native_write", native_write, t_pageable, "tensor.to(dev) from pageable"),
            ("mapped_staging", mapped_staging, t_pinned, "pinned copy_ + non_blocking copy_"),
            ("buffer_with_data", with_data, t_pageable, "tensor.to(dev) from pageable"),
        ):
            o_host = host_times(ours_fn, sync, args.warmup, reps)
            o_sync = timeit(ours_fn, sync, args.warmup, reps)
            t_host = host_times(torch_fn, tsync, args.warmup, reps)
            t_sync = timeit(torch_fn, tsync, args.warmup, reps)
            for kind, o, t in (("host", o_host, t_host), ("synced", o_sync, t_sync)):
                rec.add(
                    result(
                        f"upload_{label}_{path}_{kind}",
                        "ms",
                        o["median"],
                        t["median"],
                        bytes=nbytes,
                        ours_min=o["min"],
                        torch_min=t["min"],
                        ours_pipelined_ms=o.get("pipelined"),
                        torch_pipelined_ms=t.get("pipelined"),
                        torch_how=torch_how,
                        ours_GBps=nbytes / o["median"] / 1e6,
                    )
                )
        dst.destroy()
        for b in ring:
            b.destroy()
        del tdst, pinned


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_args(ap, "dispatch", repeats=20)
    args = ap.parse_args()
    resolve_args(args)
    device, torch, dev, rec = start(args)
    raw = Raw(device.gpu)
    dispatch_rows(args, device, torch, dev, rec, raw)
    upload_rows(args, device, torch, dev, rec)
    rec.finish()
    r = {r["case"]: r for r in rec.rows}.get("dispatch_N1000_host")
    if r:
        ok = "meets" if r["ours"] < 3.0 else "misses"
        print(f"1,000 dispatches: {r['ours']:.2f} ms host per step ({ok} the < 3 ms target)")


if __name__ == "__main__":
    main()

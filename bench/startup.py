"""Benchmark: how long a fresh process takes until the MNIST training step is ready, by stage,
cold (empty driver shader cache) and warm (the same cache again), against ``torch.compile`` of
the same model's training step in a fresh process.

Stages of one run (seconds): ``import`` (meganeura and wgpu), ``device`` (adapter + device),
``compile.<stage>`` (``meta["compile_seconds"]``: graph, autodiff, passes, codegen ...),
``session.<part>`` (``Session.setup_seconds``: buffers, pipelines, bind_groups, validate) and
``first_step`` (one step with the loss fetched). ``ready`` = everything before the first step.
Each run is its own process. The NVIDIA driver's on-disk cache is pointed at a fresh folder
(``__GL_SHADER_DISK_CACHE_PATH``) so that the first run is cold and the second warm; wgpu-py
0.32 exposes no pipeline-cache object of its own (see docs/performance.md).

Usage: python bench/startup.py [--runs 2] [--no-torch] [--out-name startup]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

CHILD = r"""
import json, sys, time
t0 = time.perf_counter()
import numpy as np
import meganeura as mn
from meganeura.models.mlp import build_mlp
from meganeura.optim import AdamW
from meganeura.runtime import get_device
from meganeura.training import Trainer
t1 = time.perf_counter()
device = get_device()
t2 = time.perf_counter()
net = build_mlp(64)
trainer = Trainer(net.graph, AdamW(lr=1e-3, weight_decay=0.01), device=device)
t3 = time.perf_counter()
rng = np.random.default_rng(0)
x = rng.standard_normal((64, 784)).astype(np.float32)
y = rng.integers(0, 10, 64).astype(np.int32)
trainer.step({"x": x, "y": y})
t4 = time.perf_counter()
out = {"import": t1 - t0, "device": t2 - t1}
for k, v in trainer.program.meta.get("compile_seconds", {}).items():
    out["compile." + k] = v
for k, v in trainer.session.setup_seconds.items():
    out["session." + k] = v
out["trainer_total"] = t3 - t2
out["ready"] = t3 - t0
out["first_step"] = t4 - t3
out["pipelines_compiled"] = trainer.session.pipelines_compiled
print("RESULT " + json.dumps(out))
"""

TORCH_CHILD = r"""
import json, time
t0 = time.perf_counter()
import torch
t1 = time.perf_counter()
dev = "cuda" if torch.cuda.is_available() else "cpu"
nn = torch.nn
model = nn.Sequential(nn.Linear(784, 128), nn.ReLU(), nn.Linear(128, 10)).to(dev)
opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
cmodel = torch.compile(model)
x = torch.randn(64, 784, device=dev)
y = torch.randint(0, 10, (64,), device=dev)
t2 = time.perf_counter()
loss = torch.nn.functional.cross_entropy(cmodel(x), y)
loss.backward()
opt.step()
loss.item()
t3 = time.perf_counter()
print("RESULT " + json.dumps({"import": t1 - t0, "setup": t2 - t1, "first_step": t3 - t2,
                              "ready": t3 - t0}))
"""


def child(code: str, env: dict) -> dict:
    p = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT
    )
    for line in p.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    raise RuntimeError(f"child failed ({p.returncode}):\n{p.stdout[-2000:]}\n{p.stderr[-4000:]}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--no-torch", action="store_true")
    ap.add_argument("--out-name", default="startup")
    args = ap.parse_args()
    from bench.common import write
    from meganeura.runtime import get_device

    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    results = []
    with tempfile.TemporaryDirectory() as cache:
        env["__GL_SHADER_DISK_CACHE_PATH"] = cache
        env["__GL_SHADER_DISK_CACHE"] = "1"
        env["__GL_SHADER_DISK_CACHE_SKIP_CLEANUP"] = "1"
        runs = []
        for i in range(args.runs):
            t = time.perf_counter()
            r = child(CHILD, env)
            r["process_wall"] = time.perf_counter() - t
            runs.append(r)
            print(
                f"run {i} ({'cold' if i == 0 else 'warm'}): "
                + ", ".join(f"{k} {v:.3f}" for k, v in r.items() if isinstance(v, float))
            )
    torch_runs = []
    if not args.no_torch:
        for i in range(args.runs):
            r = child(TORCH_CHILD, env)
            torch_runs.append(r)
            print(f"torch.compile run {i}: " + ", ".join(f"{k} {v:.3f}" for k, v in r.items()))
    for i, r in enumerate(runs):
        theirs = torch_runs[i]["ready"] if torch_runs else None
        ours = r["ready"] + r["first_step"]
        results.append(
            {
                "case": f"mnist_step_ready_{'cold' if i == 0 else 'warm'}",
                "metric": "s",
                "ours": ours,
                "torch": theirs,
                "speedup": (theirs / ours) if theirs else None,
                "ours_stages": r,
                "torch_stages": torch_runs[i] if torch_runs else None,
                "note": "ours: process start to first step done; torch: the same with "
                "torch.compile(model) (compilation happens in the first step)",
            }
        )
    path = write(args.out_name, get_device(), results)
    print(f"wrote {path}")


if __name__ == "__main__":
    main()

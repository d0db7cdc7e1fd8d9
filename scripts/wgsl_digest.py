"""Digest of the WGSL meganeura generates, for refactors that must not change a kernel.

Compiles, without a GPU, every sample of the op database (its forward graph, and its forward +
backward graph where it has one) and a few whole training programs (the MNIST MLP and conv net,
a small transformer: the ``meganeura.models`` modules as ``build_*`` traces them; SGD with
momentum, AdamW, gradient clipping), each for several adapter limit sets (WebGPU's minimums,
lavapipe-like, H200-like) and, where the limits allow f16, in both precisions. Every
dispatch's name, grid, bindings and WGSL text go into one SHA-256 per case; the script prints
one line per case and a final total.

Usage (from the repository root)::

    python scripts/wgsl_digest.py --forced > before.txt
    ... refactor ...
    python scripts/wgsl_digest.py > after.txt && diff before.txt after.txt

A program's digest covers its node ids (dispatch names, fused kernels' local names), so a
change in the order a model's forward creates nodes changes it even when every kernel is the
same up to those names.

``--forced`` adds every matmul plan and attention block plan forced onto the database's
samples of those ops. A case that fails to compile is recorded with its error's type and
message, so a change in what fails also shows up in the diff.
"""

from __future__ import annotations

import hashlib
import sys
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from meganeura.codegen.kernel import Limits  # noqa: E402
from meganeura.compile import CompileOptions, compile  # noqa: E402
from meganeura.graph.builder import GraphBuilder  # noqa: E402
from meganeura.models.convnet import build_convnet  # noqa: E402
from meganeura.models.mlp import build_mlp  # noqa: E402
from meganeura.models.transformer import TransformerConfig, build_transformer  # noqa: E402
from meganeura.optim import SGD, AdamW  # noqa: E402
from tests.opinfo import DATABASE  # noqa: E402
from tests.opinfo.runner import (  # noqa: E402
    entry_samples,
    graph_operands,
    host_args,
    symbolic_graph,
)

LIMITS = {
    "webgpu": Limits(),
    "lavapipe": Limits(
        max_workgroup_storage_size=32768,
        max_storage_buffers_per_shader_stage=32,
        shader_f16=True,
        subgroups=True,
    ),
    "h200": Limits(
        max_workgroup_storage_size=49152,
        max_invocations_per_workgroup=1024,
        max_storage_buffer_binding_size=2**31 - 4,
        max_storage_buffers_per_shader_stage=32,
        shader_f16=True,
        subgroups=True,
    ),
}
ATTENTION_MODES = ("fwd", "stats", "dq", "dk", "dv", "dkv")


def _digest(graph, options: CompileOptions, limits: Limits) -> str:
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            program = compile(graph, options, limits)
    except Exception as e:  # a change in what fails must show in the diff too
        return f"error {type(e).__name__}: {str(e).splitlines()[0][:120]}"
    h = hashlib.sha256()
    for d in program.dispatches:
        h.update(repr((d.name, d.grid, d.bindings, d.writes, d.offsets, d.sizes)).encode())
        h.update(d.wgsl.encode())
    return f"{len(program.dispatches)} {h.hexdigest()[:16]}"


def _forward_graph(info, sample):
    b = GraphBuilder()
    ops, _, _ = graph_operands(b, host_args(sample), mid=False)
    b.output("out", info.fn(*ops, **sample.kwargs))
    return b.build_unverified()


def _cases():
    for info in DATABASE:
        for sample in entry_samples(info):
            key = f"{info.name}-{sample.name}"
            yield f"{key}:forward", lambda i=info, s=sample: _forward_graph(i, s), None
            yield f"{key}:backward", lambda i=info, s=sample: symbolic_graph(i, s), None
    tiny = TransformerConfig(
        vocab_size=96, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
        num_kv_heads=2,
    )  # fmt: skip
    programs = {
        "mlp": lambda: build_mlp(64).graph,
        "convnet": lambda: build_convnet(16).graph,
        "convnet_eval": lambda: build_convnet(16, labels=False, training=False).graph,
        "transformer": lambda: build_transformer(2, 16, tiny).graph,
    }
    optimizers = {
        "sgd": CompileOptions(loss="loss", optimizer=SGD(lr=0.1, momentum=0.9)),
        "adamw_clip": CompileOptions(
            loss="loss", optimizer=AdamW(lr=1e-3, weight_decay=0.01), max_grad_norm=1.0
        ),
        "unfused": CompileOptions(loss="loss", optimizer=AdamW(lr=1e-3), fuse=False),
    }
    for name, build in programs.items():
        yield f"program-{name}:inference", build, CompileOptions()
        if name != "convnet_eval":
            for opt_name, options in optimizers.items():
                yield f"program-{name}:{opt_name}", build, options


def _forced_cases():
    """Every matmul plan and attention block plan forced onto the database's samples of those
    ops (the plans the sweeps try and the codegen tests force, beyond each shape's default)."""
    try:  # the layout by kernel family, then the flat one it replaced
        from meganeura.codegen.wgsl.attention import plan as attention_plan
        from meganeura.codegen.wgsl.matmul import plan as matmul
    except ImportError:
        from meganeura.codegen.wgsl import attention_plan, matmul

    plans = [f"{t}{s}{d}" for t in matmul.TILINGS for s in ("", "/s4") for d in ("", "/np", "/d2")]
    plans += ["gemv8", "gemv32/s2", "gemv64"]
    for info in DATABASE:
        if "matmul" in info.ops:
            knobs = [(p, lambda p=p: matmul.force_plan(p)) for p in plans]
            reset = lambda: matmul.force_plan(None)  # noqa: E731
        elif "scaled_dot_product_attention" in info.ops:
            knobs = [
                (
                    f"block{p}",
                    lambda p=p: attention_plan.BLOCK_OVERRIDE.update(
                        dict.fromkeys(ATTENTION_MODES, p)
                    ),
                )
                for p in attention_plan.BLOCK_PLANS
            ]
            knobs.append(
                (
                    "lane",
                    lambda: attention_plan.BLOCK_OVERRIDE.update(dict.fromkeys(ATTENTION_MODES)),
                )
            )
            reset = attention_plan.BLOCK_OVERRIDE.clear
        else:
            continue
        for sample in entry_samples(info):
            for name, knob in knobs:
                key = f"forced-{name}-{info.name}-{sample.name}"
                yield key, lambda i=info, s=sample: symbolic_graph(i, s), knob, reset


def _record(total, key, build, options, knob=None, reset=None) -> None:
    try:
        graph = build()
    except Exception as e:
        line = f"{key} build-error {type(e).__name__}"
        print(line)
        total.update(line.encode())
        return
    for lname, limits in LIMITS.items():
        precisions = ("strict", "fast") if limits.shader_f16 else ("strict",)
        for precision in precisions:
            base = options or CompileOptions()
            opts = CompileOptions(**{**base.__dict__, "precision": precision})
            if knob:
                knob()
            try:
                line = f"{key} {lname} {precision} {_digest(graph, opts, limits)}"
            finally:
                if reset:
                    reset()
            print(line)
            total.update(line.encode())


def main() -> None:
    total = hashlib.sha256()
    for key, build, options in _cases():
        _record(total, key, build, options)
    if "--forced" in sys.argv:
        for key, build, knob, reset in _forced_cases():
            _record(total, key, build, None, knob, reset)
    print(f"TOTAL {total.hexdigest()}")


if __name__ == "__main__":
    main()

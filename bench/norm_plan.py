"""The group_norm plans and the dispatch count of the W5 conv U-Net training step
(``bench/workloads_lib/w5_unet.py``, train_small_b2: batch 2, Adam, strict), compiled for
H200-like limits without running anything (no GPU needed).

Per group_norm shape: groups x elements per group, the one-team plan (threads per team,
workgroups) and the chunks per group ``norm.split`` chooses; then the step's dispatches by
kernel name. ``--no-pairs`` leaves out ``passes.fuse_norm``'s groups (norm + SiLU, gradients) and
``--no-split`` the split (``norm.split.FORCE_CHUNKS = 1``): both give the kernels before them.

Usage: python bench/norm_plan.py [--size small|tiny] [--batch 2] [--no-pairs] [--no-split]
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
from dataclasses import replace

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The H200's adapter limits that the plans read (subgroups on, 1024 invocations, 48 KiB of
# workgroup memory); the other fields keep their defaults.
H200 = dict(
    max_workgroup_storage_size=49152,
    max_invocations_per_workgroup=1024,
    max_storage_buffer_binding_size=2**31 - 4,
    subgroups=True,
)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", default="small", choices=("small", "tiny"))
    ap.add_argument("--batch", type=int, default=2)
    ap.add_argument("--no-pairs", action="store_true")
    ap.add_argument("--no-split", action="store_true")
    args = ap.parse_args()

    import meganeura as mn
    import meganeura.schedule.schedule as sched
    from bench.workloads_lib.base import Case
    from bench.workloads_lib.w5_unet import UNetWorkload
    from meganeura.codegen.kernel import Limits
    from meganeura.codegen.wgsl.norm import split
    from meganeura.codegen.wgsl.norm.team import plan_groups
    from meganeura.compile import compile as compile_graph
    from meganeura.nn.compiled import trace_call
    from meganeura.nn.parameter import Parameter
    from meganeura.ops.norm_ref import group_dims
    from meganeura.training.batches import check_loss

    if args.no_pairs:
        sched.plan_norm_activation = lambda *a, **k: ()
    if args.no_split:
        split.FORCE_CHUNKS = 1
    limits = Limits(**H200)
    wl = UNetWorkload()
    case = Case("train", "train", {"size": args.size, "batch": args.batch}, ("adam", 1e-3))
    model = wl.build_ours(case, False)
    batch = wl.batch(case, False)
    tr = mn.Trainer(model, mn.optim.Adam(lr=1e-3), wl.ours_loss)
    traced = trace_call(model, tr._fn, batch, {}, "loss", check_loss)
    objects = traced.trace.objects
    trainable = tuple(n for n, o in objects.items() if isinstance(o, Parameter) and o.requires_grad)
    graph = traced.graph
    shapes = collections.Counter(
        (graph[n.inputs[0]].type.shape, n.attr("num_groups"))
        for n in graph.nodes
        if n.op == "group_norm"
    )
    print(f"W5 U-Net {args.size} batch {args.batch}, H200-like limits")
    print("group_norm shape         G  count  groups x length  team  workgroups  chunks")
    for (shape, g), k in shapes.items():
        attrs = {"num_groups": g, "eps": 1e-5}
        count, length, _ = group_dims(shape, "group_norm", attrs)
        plan = plan_groups(shape, "group_norm", attrs, limits)
        chunks = split.split_chunks(shape, attrs, limits)
        print(f"{str(list(shape)):22s} {g:3d} {k:5d}  {count:6d} x {length:6d}"
              f"  {plan.team:4d}  {plan.groups:10d}  {chunks:6d}")  # fmt: skip
    prog = compile_graph(graph, replace(tr._options, trainable=trainable), limits)
    names = collections.Counter(" ".join(d.name.split()[1:]) or d.name for d in prog.dispatches)
    print(f"dispatches per training step: {len(prog.dispatches)}")
    for name, k in sorted(names.items(), key=lambda kv: -kv[1]):
        if k >= 5 or "norm" in name or "silu" in name:
            print(f"  {k:4d}  {name}")


if __name__ == "__main__":
    main()

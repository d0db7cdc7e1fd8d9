"""Attention kernels and dispatch count of the W4 training program (the Whisper-tiny encoder +
head, forward and backward, ``bench/workloads.py``'s ``w4`` cell), compiled with the H200's
limits but not run: no GPU needed. It prints each attention dispatch, in program order, and
the totals, with the current plan rules, and with the attention forward writing its
log-sum-exp switched off (``--no-lse``: the backward's separate lse pass) for comparison.

Usage: python bench/attention_dispatches.py [--quick] [--no-lse] [--fuse-kv {auto,on,off}]
       [--dkv-half]
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import Counter

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The H200 (Vulkan) adapter's limits that attention plans read.
H200 = {
    "max_workgroup_storage_size": 49152,
    "max_invocations_per_workgroup": 1024,
    "max_storage_buffer_binding_size": 2**31 - 4,
    "subgroups": True,
}


def build_program(quick: bool):
    """The W4 forward + backward program (loss and every trained parameter's gradient)."""
    from bench.workloads_lib.base import Case
    from bench.workloads_lib.w4_whisper import Whisper
    from meganeura.codegen.kernel import Limits
    from meganeura.compile import CompileOptions, compile
    from meganeura.nn.compiled import trace_call
    from meganeura.nn.parameter import Parameter

    w = Whisper()
    case = Case("train", "train")
    model = w.build_ours(case, quick)
    args = w.batch(case, quick)

    def fn(*batch):
        return {"loss": w.ours_loss(model, *batch)}

    traced = trace_call(model, fn, args, {})
    trainable = tuple(
        n for n, o in traced.trace.objects.items() if isinstance(o, Parameter) and o.requires_grad
    )
    options = CompileOptions(
        loss="loss", output_grads=True, trainable=trainable, shared_parameters=True
    )
    return compile(traced.graph, options, Limits(**H200))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="the small W4 sizes")
    ap.add_argument("--no-lse", action="store_true", help="forward without its log-sum-exp")
    kv_help = "dk and dv in one dkv kernel: by the plan's rule, forced, forbidden"
    ap.add_argument("--fuse-kv", choices=("auto", "on", "off"), default="auto", help=kv_help)
    ap.add_argument("--dkv-half", action="store_true", help="plan.DKV_HALF on (needs subgroups)")
    args = ap.parse_args()
    from meganeura.codegen.wgsl.attention import plan

    plan.FUSE_KEY_VALUE = {"auto": None, "on": True, "off": False}[args.fuse_kv]
    plan.SAVE_LSE = not args.no_lse
    plan.DKV_HALF = args.dkv_half
    program = build_program(args.quick)
    names = [d.name for d in program.dispatches]
    attention = [n for n in names if "attention" in n]
    for n in attention:
        print("  " + n)
    kinds = Counter(" ".join(n.split()[1:3]) for n in attention)
    print(f"dispatches: {len(names)} in all, {len(attention)} attention ({dict(kinds)})")


if __name__ == "__main__":
    main()

"""Completeness of the op set: every op of ``meganeura.ops.OPS`` is lowered, differentiable
or marked not differentiable, and tested by the op database.

(a) a WGSL lowering in ``meganeura.codegen.wgsl.LOWERINGS``, or a view op, a row-block alias or
    a placed concatenation (no kernel);
(b) a gradient rule, or ``differentiable=False``;
(c) named in some ``OpInfo.ops`` of ``tests.opinfo.DATABASE``. Exempt: ops with no gradient
    whose name ends in ``_backward`` or that are listed in ``INTERNAL`` with a reason; a
    ``_backward`` op must then really occur in the backward graph of some database sample,
    which is how the generic gradient test covers it.

Leaves (``input``, ``parameter``, ``state``, ``constant``) are not ops of ``OPS``. No GPU needed.
While new ops are being added these tests fail for ops without entries; that is the point.
"""

from __future__ import annotations

from functools import cache

import pytest

from meganeura.codegen.wgsl import LOWERINGS
from meganeura.graph.ir import LEAF_OPS, PLACED_OPS, SUBRANGE_OPS, VIEW_OPS
from meganeura.ops import OPS

from .opinfo import DATABASE
from .opinfo.runner import entry_samples, symbolic_graph

# Ops exempt from (c) besides *_backward ops, each with the reason and where it is tested.
INTERNAL: dict[str, str] = {
    "scaled_dot_product_attention_stats": "attention's one-pass (lse, delta), which the gradient "
    "rule no longer emits (the forward writes the lse, a delta op adds delta); tested against "
    "torch in tests/codegen/test_attention_lse.py",
    "sgd_update": "optimizer effect op (writes in place, returns a token); tested against "
    "torch.optim.SGD in tests/codegen/test_optim.py and tests/optim",
    "sgd_momentum_update": "optimizer effect op; tested against torch.optim.SGD with momentum "
    "in tests/codegen/test_optim.py and tests/optim",
    "adam_update": "optimizer effect op; tested against torch.optim.Adam/AdamW in "
    "tests/codegen/test_optim.py and tests/optim",
    "accumulate": "gradient-accumulation effect op (writes its accumulator in place, returns a "
    "token); tested against its reference in tests/codegen/test_optim.py and end to end "
    "(micro-batches equal one full batch) in tests/training/test_module_trainer.py",
    "found_inf": "the non-finite guard's check of every gradient element; tested against its "
    "reference and end to end in tests/training/test_nonfinite_guard.py",
    "guard_clip": "the non-finite guard's clip coefficient (NaN when a step must be skipped); "
    "tested against its reference and end to end in tests/training/test_nonfinite_guard.py",
    "batch_norm_stats": "BatchNorm's batch statistics for a deferred running-statistics update "
    "(gradient accumulation with the non-finite guard); tested through "
    "batch_norm_update_stats_into in tests/training/test_nonfinite_batchnorm.py and "
    "tests/optim/test_guard_running_stats.py",
    "batch_norm_update_stats_into": "BatchNorm's running-statistics update staged in pending "
    "copies under gradient accumulation with the non-finite guard (writes in place, returns a "
    "token); tested against torch's per-forward formula and through skipped steps in "
    "tests/training/test_nonfinite_batchnorm.py, its reference in "
    "tests/optim/test_guard_running_stats.py",
    "index_copy_": "in-place write of a state leaf that later ops read (the KV cache; an "
    "effect op whose value aliases the state, which the op database's input-only samples cannot "
    "express); tested in tests/ops/test_index_copy.py (type rule, verify, interpreter, passes, "
    "schedule) and tests/nn/test_kv_cache.py (prefill and decode programs sharing the cache, "
    "on the GPU against NumPy and torch)",
    "row_block": "rows of a leaf bound at a byte offset, made after autodiff by "
    "passes.split_bindings (no kernel); tested against the unsplit program on the interpreter "
    "and the GPU in tests/passes/test_split_bindings.py",
    "row_concat": "an output over the storage-binding limit whose row blocks its operands' "
    "kernels write in place, made by passes.split_bindings (no kernel); tested on the "
    "interpreter and the GPU in tests/passes/test_split_bindings.py",
    "guard_count": "the non-finite guard's effect op (counts skipped steps in place); tested "
    "in tests/training/test_nonfinite_guard.py",
}

ALL_OPS = sorted(OPS)


def _exempt(name: str) -> bool:
    d = OPS[name]
    return not d.differentiable and (name.endswith("_backward") or name in INTERNAL)


@cache
def covered() -> frozenset[str]:
    """Every op named in some entry's ``ops``."""
    return frozenset(op for info in DATABASE for op in info.ops)


@cache
def graph_ops() -> frozenset[str]:
    """Every op occurring in the forward or backward graph of some database sample."""
    seen: set[str] = set()
    for info in DATABASE:
        for s in entry_samples(info):
            try:
                seen |= {n.op for n in symbolic_graph(info, s).nodes}
            except Exception:  # a broken sample fails test_opinfo; it covers nothing here
                continue
    return frozenset(seen)


def test_leaves_are_not_ops():
    assert not LEAF_OPS & set(OPS)


@pytest.mark.parametrize("op", ALL_OPS)
def test_op_is_lowered(op):
    kernel_free = VIEW_OPS | SUBRANGE_OPS | PLACED_OPS
    assert op in LOWERINGS or op in kernel_free, f"{op}: no WGSL lowering and not a view op"


def test_lowerings_name_real_ops():
    stale = sorted(set(LOWERINGS) - set(OPS))
    assert not stale, f"lowerings for ops that do not exist: {stale}"


@pytest.mark.parametrize("op", ALL_OPS)
def test_op_has_gradient_or_mark(op):
    d = OPS[op]
    assert d.name == op, f"OPS[{op!r}] is named {d.name!r}"
    assert d.grad is not None or not d.differentiable, (
        f"{op}: no gradient rule; give it one or mark it differentiable=False"
    )


@pytest.mark.parametrize("op", ALL_OPS)
def test_op_has_database_entry(op):
    if _exempt(op):
        if op.endswith("_backward"):
            assert op in graph_ops(), (
                f"{op} is exempt as a backward op, but no database sample's backward graph "
                f"uses it, so nothing tests it"
            )
        return
    entries = [info.name for info in DATABASE if op in info.ops]
    assert entries, f"{op}: no OpInfo in tests/opinfo lists it in `ops`"


def test_internal_exemptions_are_real():
    for op, reason in INTERNAL.items():
        assert op in OPS, f"INTERNAL lists {op!r}, which is not an op"
        assert not OPS[op].differentiable, f"{op} is differentiable; it needs an entry"
        assert reason

"""Memory planning: invariants of ``plan_memory`` on random lifetimes (hypothesis), hand
cases, and the plan of the whole MLP training program (no GPU)."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from meganeura.schedule.planner import Interval, MemoryPlan, plan_memory


def _overlap(a: Interval, b: Interval) -> bool:
    """Closed intervals [start, end] share at least one kernel position."""
    return a.start <= b.end and b.start <= a.end


def check_plan(intervals: list[Interval], plan: MemoryPlan) -> None:
    assert set(plan.assignment) == {iv.key for iv in intervals}
    for buf in plan.assignment.values():
        assert 0 <= buf < len(plan.buffer_sizes)
    for iv in intervals:
        assert plan.buffer_sizes[plan.assignment[iv.key]] >= iv.size
    for i, a in enumerate(intervals):
        for b in intervals[i + 1 :]:
            if _overlap(a, b):
                assert plan.assignment[a.key] != plan.assignment[b.key], (a, b)
    for size in plan.buffer_sizes:
        assert size % 4 == 0 and size >= 4
    # No buffer is larger than its largest occupant needs (4-byte aligned), or unused.
    for buf, size in enumerate(plan.buffer_sizes):
        occupants = [iv.size for iv in intervals if plan.assignment[iv.key] == buf]
        assert occupants, f"buffer {buf} holds nothing"
        assert size == max(max(4, (s + 3) // 4 * 4) for s in occupants)
    assert plan.naive_bytes == sum(max(4, (iv.size + 3) // 4 * 4) for iv in intervals)
    assert plan.planned_bytes == sum(plan.buffer_sizes)
    assert plan.planned_bytes <= plan.naive_bytes


@st.composite
def interval_sets(draw) -> list[Interval]:
    n = draw(st.integers(0, 40))
    out = []
    for k in range(n):
        a = draw(st.integers(0, 50))
        b = draw(st.integers(0, 50))
        size = draw(st.integers(1, 10**6))
        out.append(Interval(k, size, min(a, b), max(a, b)))
    return out


@settings(max_examples=300, deadline=None)
@given(interval_sets())
def test_random_intervals_keep_invariants(intervals):
    check_plan(intervals, plan_memory(intervals))


@settings(max_examples=100, deadline=None)
@given(interval_sets())
def test_plan_does_not_depend_on_input_order(intervals):
    # Validity must not depend on order; keys carry the identity.
    plan = plan_memory(list(reversed(intervals)))
    check_plan(intervals, plan)


def test_chain_reuses_buffers():
    # a -> b -> c: a is read by the kernel that writes b, b by the one that writes c.
    ivs = [Interval("a", 1000, 0, 1), Interval("b", 1000, 1, 2), Interval("c", 1000, 2, 3)]
    plan = plan_memory(ivs)
    check_plan(ivs, plan)
    assert plan.assignment["a"] == plan.assignment["c"]
    assert plan.assignment["a"] != plan.assignment["b"]
    assert plan.planned_bytes == 2000 < plan.naive_bytes == 3000


def test_intervals_touching_at_one_position_do_not_share():
    ivs = [Interval("a", 64, 0, 3), Interval("b", 64, 3, 5)]
    plan = plan_memory(ivs)
    assert plan.assignment["a"] != plan.assignment["b"]
    assert plan.planned_bytes == plan.naive_bytes == 128


def test_best_fit_picks_the_smallest_buffer_that_fits():
    ivs = [Interval("small", 100, 0, 0), Interval("big", 1000, 0, 0), Interval("x", 90, 1, 1)]
    plan = plan_memory(ivs)
    assert plan.assignment["x"] == plan.assignment["small"]
    assert plan.buffer_sizes == (1000, 100) or plan.buffer_sizes == (100, 1000)


def test_free_buffer_grows_instead_of_a_new_one():
    ivs = [Interval("a", 100, 0, 0), Interval("b", 400, 1, 1)]
    plan = plan_memory(ivs)
    assert plan.assignment["a"] == plan.assignment["b"]
    assert plan.buffer_sizes == (400,)
    assert plan.naive_bytes == 500


def test_sizes_are_aligned_to_4_bytes():
    plan = plan_memory([Interval("a", 1, 0, 0), Interval("b", 6, 0, 0), Interval("z", 0, 0, 0)])
    assert sorted(plan.buffer_sizes) == [4, 4, 8]
    assert plan.naive_bytes == 16


def test_empty():
    plan = plan_memory([])
    assert plan.buffer_sizes == () and plan.planned_bytes == 0 and plan.naive_bytes == 0


def test_duplicate_keys_rejected():
    with pytest.raises(ValueError, match="duplicate"):
        plan_memory([Interval("a", 4, 0, 1), Interval("a", 8, 2, 3)])


@pytest.mark.parametrize(
    "args",
    [pytest.param((4, 3, 2), id="end_before_start"), pytest.param((-1, 0, 1), id="negative_size")],
)
def test_invalid_interval_rejected(args):
    with pytest.raises(ValueError, match="invalid interval"):
        Interval("a", *args)


# ---- the whole MLP training program -----------------------------------------------------------
def _codegen_ready() -> bool:
    try:
        from meganeura.codegen.wgsl import lower  # noqa: F401
    except ImportError:
        return False
    return True


@pytest.mark.skipif(not _codegen_ready(), reason="meganeura.codegen.wgsl.lower not available yet")
def test_mlp_training_program_memory_plan():
    from meganeura.compile import CompileOptions, compile
    from meganeura.models.mlp import build_mlp
    from meganeura.optim import AdamW

    graph = build_mlp(batch=64).graph
    program = compile(graph, CompileOptions(loss="loss", optimizer=AdamW()))
    mem = program.memory
    assert mem is not None
    assert 0 < mem.planned_bytes < mem.naive_bytes

    params = {n.name: n.type for n in graph.leaves("parameter")}
    assert set(params) == {"fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"}
    assert set(program.parameters) == set(params)
    want_state = {f"{p}.{s}" for p in params for s in ("exp_avg", "exp_avg_sq")}
    assert set(program.state) == want_state
    assert set(program.inputs) == {"x", "y", "optim.hyper"}

    pinned = {**program.parameters, **program.state, **program.inputs}
    roles = {
        **{k: "parameter" for k in program.parameters},
        **{k: "state" for k in program.state},
        **{k: "input" for k in program.inputs},
    }
    # Pinned tensors own disjoint byte ranges; the optimizer's update group keeps parameters
    # (and each state) in one arena buffer, each at its own aligned offset.
    spans = sorted((s.buffer, s.offset, s.offset + s.nbytes) for s in pinned.values())
    for (b1, _, e1), (b2, o2, _) in zip(spans, spans[1:], strict=False):
        assert b1 != b2 or e1 <= o2, "two pinned tensors overlap"
    for name, slot in pinned.items():
        buf = program.buffers[slot.buffer]
        assert buf.role == roles[name]
        assert buf.name == name or buf.name.startswith("optim group")
        assert buf.size >= slot.offset + slot.nbytes
    assert len({program.parameters[k].buffer for k in params}) == 1
    for name, t in params.items():
        assert program.parameters[name].shape == t.shape
        assert program.state[f"{name}.exp_avg"].shape == t.shape
    assert program.inputs["x"].shape == (64, 784)
    assert program.inputs["optim.hyper"].shape == (3,)
    intermediate = [b for b in program.buffers if b.role == "intermediate"]
    assert sum(b.size for b in intermediate) == mem.planned_bytes
    pinned_total = sum(b.size for b in program.buffers if b.role != "intermediate")
    assert mem.pinned_bytes == pinned_total

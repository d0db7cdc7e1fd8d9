"""The segmented step under the overlapped reduce (``runtime.segments``), in one process:
the accumulate program run in segments leaves the same accumulators, bit for bit, as
``Session.run``; the plan moves each accumulate to just after its gradient; buckets follow
the order backward finishes them. And ``distributed.rank_seed``."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
from meganeura.distributed import rank_seed
from meganeura.models.mlp import MLP
from meganeura.optim import AdamW
from meganeura.optim.accumulate import ACCUM_FIRST_INPUT, LOSS_ACCUMULATOR
from meganeura.runtime.segments import SegmentedRun, plan_segments
from meganeura.training import Trainer
from tests.distributed.workloads import loss_fn


def _accumulate_program(device):
    mn.manual_seed(0)
    trainer = Trainer(MLP((16, 32, 32, 8)), AdamW(lr=1e-3), loss_fn, device=device)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((12, 16)).astype(np.float32)
    y = rng.integers(0, 8, 12).astype(np.int32)
    prog, feeds = trainer._prepare("accumulate", (x, y), {})
    feeds[ACCUM_FIRST_INPUT] = np.asarray(1.0, np.float32)
    session = prog.entry.runner.session
    slots = [n for n in session.program.state if n.endswith(".grad_accum")]
    return trainer, session, feeds, [*slots, LOSS_ACCUMULATOR]


@pytest.mark.gpu
@pytest.mark.parametrize("cap", [0, 1500, 10**9], ids=["cap0", "cap1500", "capall"])
def test_segmented_run_equals_session_run(cap, gpu_device):
    trainer, session, feeds, slots = _accumulate_program(gpu_device)
    with trainer:
        session.run(feeds)
        want = {n: session.read(n) for n in slots}
        for n in slots:
            session.write(n, np.zeros_like(want[n]))
        sizes = {n: session.program.state[n].nbytes for n in slots}
        plan = plan_segments(session.program, slots, cap, sizes)
        # every dispatch once; cuts increasing, the last at the end
        assert sorted(plan.order) == list(range(len(session.program.dispatches)))
        assert list(plan.cuts) == sorted(plan.cuts) and plan.cuts[-1] == len(plan.order)
        assert sorted(s for g in plan.groups for s in g) == sorted(slots)
        # backward finishes the last layer first: fc3's gradients before fc1's
        assert plan.final["fc3.weight.grad_accum"] < plan.final["fc1.weight.grad_accum"]
        # the first bucket is final well before the end of the step (overlap is possible)
        if cap == 0:
            assert len(plan.groups) == len(slots)
            assert plan.cuts[0] < len(plan.order) // 2
        if cap == 10**9:
            assert len(plan.groups) == 1
        run = SegmentedRun(session, plan)
        run.start(feeds)
        got = {}
        with pytest.raises(ValueError, match="bucket 0 has not been read back"):
            run.bucket(0)
        for k in range(len(plan.groups)):
            if k % 2:  # a caller's array (the shared-memory slot), padded with a sentinel
                into = np.full(run.staging_bytes(k) // 4 + 3, 7.0, np.float32)
                got.update(run.wait(k, into=into))
                assert np.shares_memory(run.bucket(k)[0], into) and (into[-3:] == 7).all()
            else:
                got.update(run.wait(k))
            # the bucket's one float32 vector: every slot at its offset, zeros in between
            flat, layout = run.bucket(k)
            assert [name for name, _, _ in layout] == list(plan.groups[k])
            covered = np.zeros(flat.size, bool)
            for name, first, size in layout:
                assert np.array_equal(flat[first : first + size], want[name].ravel()), name
                covered[first : first + size] = True
            assert not flat[~covered].any()
        with pytest.raises(ValueError, match="into must be a C-contiguous, writable array"):
            run.wait(0, into=np.zeros(run.staging_bytes(0) // 4 - 1, np.float32))  # checked first
        run.close()
        for n in slots:
            assert np.array_equal(got[n], want[n]), n
            assert np.array_equal(session.read(n), want[n]), n
        # the trainer's batched read of its Buffers (one map) equals one read per Buffer
        held = list(trainer._accumulators.values())
        batched = held[0]._store.read_many(held)
        assert all(np.array_equal(a, b.data) for a, b in zip(batched, held, strict=True))


def test_rank_seed():
    assert rank_seed(12345, 0) == 12345  # rank 0: the Trainer's own seed
    seeds = [rank_seed(12345, r) for r in range(8)]
    assert len(set(seeds)) == 8 and all(0 <= s < 2**32 for s in seeds)
    assert seeds == [rank_seed(12345, r) for r in range(8)]  # deterministic
    assert rank_seed(12346, 1) != seeds[1]


def test_bucket_cap_must_be_positive():
    from meganeura.distributed.overlap import BucketReducer

    with pytest.raises(ValueError, match="bucket_cap_mb must be positive, got 0"):
        BucketReducer(0)
    assert BucketReducer(25).cap_bytes == 25 * 1024 * 1024  # MiB, as PyTorch DDP


def test_reduce_must_be_auto_mpi_or_shm():
    from meganeura.distributed import DistributedTrainer

    with pytest.raises(ValueError, match="reduce must be 'auto', 'mpi' or 'shm', got 'nccl'"):
        DistributedTrainer(None, None, None, reduce="nccl")


def test_reduce_dtype_is_float32_or_float64():
    from meganeura.distributed.overlap import BucketReducer

    assert BucketReducer(25).reduce_dtype == np.float32  # DDP reduces in the gradients' dtype
    assert BucketReducer(25, np.float64).reduce_dtype == np.float64
    with pytest.raises(ValueError, match="reduce_dtype must be float32 or float64, got float16"):
        BucketReducer(25, np.float16)

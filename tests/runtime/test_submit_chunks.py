"""A step submitted in chunks (``Session.set_submit_chunks``, ``MEGANEURA_SUBMIT_CHUNKS``) gives
the values of the step submitted as one command buffer, bit for bit: training steps of an MLP
with AdamW (every dispatch reads what the one before wrote, across submissions) and the chunk
ranges themselves."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.nn import Linear, Module
from meganeura.runtime import fastpath
from meganeura.runtime.session import SUBMIT_CHUNKS, submit_chunks


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(12, 16)
        self.fc2 = Linear(16, 16)
        self.fc3 = Linear(16, 4)

    def forward(self, x):
        return self.fc3(F.gelu(self.fc2(F.relu(self.fc1(x)))))


def _loss(model, x, y):
    return F.cross_entropy(model(x), y)


def _train(chunks, steps: int = 3):
    mn.manual_seed(3)
    model = Net()
    rng = np.random.default_rng(7)
    tr = mn.Trainer(model, mn.optim.AdamW(lr=1e-2), _loss)
    losses = []
    for i in range(steps):
        x = rng.standard_normal((6, 12)).astype(np.float32)
        y = rng.integers(0, 4, 6).astype(np.int32)
        if i == 1:  # compiled at the first step; the later steps run with ``chunks``
            sess = next(iter(tr._cache.values())).entry.runner.session
            sess.set_submit_chunks(*chunks)
            submissions = sess.submissions
        losses.append(float(tr.step(x, y)))
    params = {k: np.array(v) for k, v in tr.state_dict().items()}
    tr.close()
    return losses, params, submissions


@pytest.mark.gpu
def test_chunked_steps_equal_one_submission_bit_for_bit():
    one_l, one_p, one_n = _train((0, 0))
    many_l, many_p, many_n = _train((1, 2))
    assert one_n == 1 and many_n > 5
    assert one_l == many_l
    assert one_p.keys() == many_p.keys()
    for k in one_p:
        np.testing.assert_array_equal(one_p[k], many_p[k], err_msg=k)
    # and the run moved the parameters (the comparison is not between two untouched states)
    mn.manual_seed(3)
    init = {k: np.array(v) for k, v in Net().state_dict().items()}
    assert any(not np.array_equal(init[k], one_p[k]) for k in init)


@pytest.mark.parametrize(
    "n,first,size,want",
    [
        (10, 16, 64, [(0, 10)]),
        (80, 16, 64, [(0, 80)]),
        (81, 16, 64, [(0, 16), (16, 81)]),
        (200, 16, 64, [(0, 16), (16, 80), (80, 144), (144, 200)]),
        (150, 16, 64, [(0, 16), (16, 80), (80, 150)]),
        (200, 16, 0, [(0, 200)]),
        (5, 1, 2, [(0, 1), (1, 3), (3, 5)]),
        (10, 0, 4, [(0, 4), (4, 8), (8, 10)]),
    ],
    ids=["short", "at_bound", "one_past", "four", "tail_merged", "size0", "tiny", "first0"],
)
def test_chunk_bounds_cover_the_plan_in_order(n, first, size, want):
    got = list(fastpath.chunk_bounds(n, first, size))
    assert got == want
    assert got[0][0] == 0 and got[-1][1] == n
    assert all(a < b for a, b in got)  # no empty chunk
    assert all(a[1] == b[0] for a, b in zip(got, got[1:]))


@pytest.mark.parametrize(
    "n,want",
    [
        (31, [(0, 31)]),
        (32, [(0, 16), (16, 32)]),
        (80, [(0, 16), (16, 80)]),
        (81, [(0, 16), (16, 81)]),
        (150, [(0, 16), (16, 80), (80, 150)]),
    ],
    ids=["below", "at_twice_first", "at_bound", "one_past", "long"],
)
def test_split_short_gives_a_short_step_its_first_chunk(n, want):
    assert list(fastpath.chunk_bounds(n, 16, 64, split_short=True)) == want
    assert list(fastpath.chunk_bounds(n, 16, 0, split_short=True)) == [(0, n)]  # size 0: one


def test_submit_chunks_environment(monkeypatch):
    monkeypatch.delenv("MEGANEURA_SUBMIT_CHUNKS", raising=False)
    assert submit_chunks() == SUBMIT_CHUNKS
    monkeypatch.setenv("MEGANEURA_SUBMIT_CHUNKS", "0")
    assert submit_chunks() == (0, 0)
    monkeypatch.setenv("MEGANEURA_SUBMIT_CHUNKS", "8, 32")
    assert submit_chunks() == (8, 32)
    for bad in ("8", "a,b", "-1,4", "1,2,3"):
        monkeypatch.setenv("MEGANEURA_SUBMIT_CHUNKS", bad)
        with pytest.raises(ValueError, match="MEGANEURA_SUBMIT_CHUNKS"):
            submit_chunks()

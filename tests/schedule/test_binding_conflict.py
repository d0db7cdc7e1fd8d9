"""``binding_conflict``: the one rule both the compiler and the Session apply to a dispatch's
bindings (wgpu's per-buffer usage tracking)."""

from __future__ import annotations

import pytest

from meganeura.schedule.program import binding_conflict


@pytest.mark.parametrize(
    "ranges, writes, want",
    [
        pytest.param([(0, 0, 64), (1, 0, 64)], [True, True], None, id="different_buffers"),
        pytest.param([(0, 0, 64), (0, 0, 64)], [False, False], None, id="overlapping_reads"),
        pytest.param([(0, 0, 256), (0, 256, 512)], [True, True], None, id="disjoint_writes"),
        pytest.param([(0, 0, 256), (0, 128, 512)], [True, True], 1, id="overlapping_writes"),
        pytest.param([(0, 0, 256), (0, 128, 512)], [False, True], 1, id="overlap_one_written"),
        # read-only and writable views of one buffer conflict even when disjoint: whole buffer
        pytest.param([(0, 0, 256), (0, 256, 512)], [False, True], 1, id="disjoint_read_and_write"),
        pytest.param(
            [(1, 0, 4), (0, 0, 256), (2, 0, 4), (0, 256, 512)],
            [False, True, True, False],
            3,
            id="conflict_found_past_other_buffers",
        ),
    ],
)
def test_binding_conflict(ranges, writes, want):
    assert binding_conflict(ranges, writes) == want

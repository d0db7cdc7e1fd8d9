"""``binding_conflict``: the one rule both the compiler and the Session apply to a dispatch's
bindings (wgpu's per-buffer usage tracking)."""

from __future__ import annotations

import pytest

from meganeura.schedule.program import binding_conflict


@pytest.mark.parametrize(
    "ranges, writes, want",
    [
        ([(0, 0, 64), (1, 0, 64)], [True, True], None),  # different buffers
        ([(0, 0, 64), (0, 0, 64)], [False, False], None),  # reads may overlap
        ([(0, 0, 256), (0, 256, 512)], [True, True], None),  # disjoint writes
        ([(0, 0, 256), (0, 128, 512)], [True, True], 1),  # overlapping writes
        ([(0, 0, 256), (0, 128, 512)], [False, True], 1),  # overlap, one written
        ([(0, 0, 256), (0, 256, 512)], [False, True], 1),  # read-only and writable: whole buffer
        ([(1, 0, 4), (0, 0, 256), (2, 0, 4), (0, 256, 512)], [False, True, True, False], 3),
    ],
)
def test_binding_conflict(ranges, writes, want):
    assert binding_conflict(ranges, writes) == want

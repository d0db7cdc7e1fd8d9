"""Shared pytest fixtures.

``gpu_device`` yields the cached wgpu Device (lavapipe on CI) or skips the test with the reason
when no adapter can be obtained, so GPU tests never fail for lack of a GPU.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def gpu_device():
    """The default meganeura runtime Device; skips when no WebGPU adapter is available."""
    try:
        from meganeura.runtime import get_device

        return get_device()
    except Exception as e:  # any failure to get an adapter means "no GPU here", not a bug
        pytest.skip(f"no WebGPU adapter available: {type(e).__name__}: {e}")

"""Shared pytest fixtures.

``gpu_device`` yields the cached wgpu Device (lavapipe on CI) or skips the test with the reason
when no adapter can be obtained, so GPU tests never fail for lack of a GPU.

Every collected item is also kept (before ``-k``/``-m`` deselect any) for tests/test_ids.py,
which checks that all test ids are readable and stable.
"""

from __future__ import annotations

import pytest

COLLECTED = pytest.StashKey[list]()


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    """Keep the whole collection, so ``pytest tests -k readable`` checks every id cheaply."""
    config.stash[COLLECTED] = list(items)


@pytest.fixture(scope="session")
def gpu_device():
    """The default meganeura runtime Device; skips when no WebGPU adapter is available."""
    try:
        from meganeura.runtime import get_device

        return get_device()
    except Exception as e:  # any failure to get an adapter means "no GPU here", not a bug
        pytest.skip(f"no WebGPU adapter available: {type(e).__name__}: {e}")

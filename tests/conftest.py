"""Shared pytest fixtures and collection hooks.

``gpu_device`` yields the cached wgpu Device (lavapipe on CI) or skips the test with the reason
when no adapter can be obtained, so GPU tests never fail for lack of a GPU.

Every collected item is also kept (before ``-k``/``-m`` deselect any) for tests/test_ids.py,
which checks that all test ids are readable and stable.

Many test modules draw their data from one module-level generator (``rng = default_rng(11)``),
so a test's data depends on which tests of its module ran before it in the same process. Those
modules get an ``xdist_group`` mark: under ``pytest -n N --dist loadgroup`` (as ``make test``
runs) each such module runs whole, in order, on one worker, and every test sees the data it
sees in a serial run, instead of data that changes with how xdist happened to spread the tests.
"""

from __future__ import annotations

import numpy as np
import pytest

COLLECTED = pytest.StashKey[list]()


def pytest_configure(config):
    # pytest-xdist registers it too; this keeps a run without xdist free of unknown-mark warnings.
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")


def shares_a_generator(module) -> bool:
    """Whether a test module holds a NumPy Generator at module level (shared by its tests)."""
    return any(isinstance(v, np.random.Generator) for v in vars(module).values())


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads xdist_group marks
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED] = list(items)  # so `pytest tests -k readable` checks every id
    shared: dict[str, bool] = {}
    for item in items:
        module = getattr(item, "module", None)
        if module is None:
            continue
        if module.__name__ not in shared:
            shared[module.__name__] = shares_a_generator(module)
        if shared[module.__name__]:
            item.add_marker(pytest.mark.xdist_group(module.__name__))


@pytest.fixture(scope="session")
def gpu_device():
    """The default meganeura runtime Device; skips when no WebGPU adapter is available."""
    try:
        from meganeura.runtime import get_device

        return get_device()
    except Exception as e:  # any failure to get an adapter means "no GPU here", not a bug
        pytest.skip(f"no WebGPU adapter available: {type(e).__name__}: {e}")

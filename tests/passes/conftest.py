"""The pass tests compare dispatch names and counts with a pass on and off, so here every
kernel keeps its own dispatch (the ``kernels_unpacked`` fixture of tests/conftest.py)."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def _kernels_unpacked(kernels_unpacked):
    yield

"""The codegen tests read dispatch names, counts and each kernel's WGSL as the lowering wrote
them, so here every kernel keeps its own dispatch: packing independent neighbours into one
(``schedule.pack``) is off. It is tested in tests/schedule/test_pack.py and, on as shipped,
by every model and training test outside this folder."""

from __future__ import annotations

import pytest

from meganeura.schedule import pack


@pytest.fixture(autouse=True)
def _kernels_unpacked():
    pack.set_enabled(False)
    yield
    pack.set_enabled(True)

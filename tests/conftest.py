"""Shared pytest fixtures and collection hooks.

``gpu_device`` yields the cached wgpu Device (lavapipe on CI) or skips the test with the reason
when no adapter can be obtained, so GPU tests never fail for lack of a GPU.

Every collected item is also kept (before ``-k``/``-m`` deselect any) for tests/test_ids.py,
which checks that all test ids are readable and stable.

Many test modules draw their data from a module-level generator (``rng = default_rng(11)``).
Shared as it is, a test's data would depend on which tests of its module ran before it in the
same process, so under pytest-xdist (``make test``) or ``-k`` it would change from run to run.
``_own_generator`` gives each test a fresh generator seeded from its id instead: the same data
whatever runs before it, on whichever worker.

The op-database tests of one entry (forward, gradients, mid-graph, fast mode) run many of the
same kernels, and on a cold shader cache compiling a kernel costs far more than running it
(lavapipe compiles on first dispatch: up to a second for an attention kernel). Each entry's
tests therefore form one ``xdist_group``: under ``--dist loadgroup`` (``make test``) they run on
one worker, one after another, and each kernel is compiled once.

``--fuzz-examples`` and ``--fuzz-seed`` run the fuzzer (tests/fuzz) longer than CI does
(docs/testing.md).
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest

COLLECTED = pytest.StashKey[list]()


OP_DATABASE_MODULES = frozenset({"tests.test_opinfo", "tests.test_opinfo_fast"})


def pytest_addoption(parser):
    group = parser.getgroup("fuzz", "the property-based fuzzer (tests/fuzz, docs/testing.md)")
    group.addoption(
        "--fuzz-examples",
        type=int,
        default=None,
        help="examples per fuzz suite, with a random seed and hypothesis's example database "
        "(default: CI's fixed count, derandomized, no database)",
    )
    group.addoption(
        "--fuzz-seed", type=int, default=None, help="fix the fuzz seed (with --fuzz-examples)"
    )


def pytest_configure(config):
    # pytest-xdist registers it too; this keeps a run without xdist free of unknown-mark warnings.
    config.addinivalue_line("markers", "xdist_group(name): run these tests on one xdist worker")


@pytest.hookimpl(tryfirst=True)  # before xdist's worker reads xdist_group marks
def pytest_collection_modifyitems(config, items):
    config.stash[COLLECTED] = list(items)  # so `pytest tests -k readable` checks every id
    for item in items:
        module = getattr(item, "module", None)
        callspec = getattr(item, "callspec", None)
        if module is not None and module.__name__ in OP_DATABASE_MODULES and callspec:
            item.add_marker(pytest.mark.xdist_group(f"op-{callspec.params['entry']}"))


@pytest.fixture(autouse=True)
def _own_generator(request, monkeypatch):
    """Replace each module-level NumPy Generator with one seeded by the test's id."""
    module = getattr(request, "module", None)
    if module is None:
        return
    seed = zlib.crc32(request.node.nodeid.encode())
    for name, value in list(vars(module).items()):
        if isinstance(value, np.random.Generator):
            monkeypatch.setattr(module, name, np.random.default_rng(seed))


@pytest.fixture(autouse=True)
def _no_tuning_cache(monkeypatch):
    """Keep the user's tuning cache (~/.cache/meganeura/tuning, ``meganeura.tune``) out of
    tests: plans come from the static sources unless a test points the cache at its own
    folder; and a test's ``meganeura tune`` (``MEGANEURA_CACHE_DIR``) does not leak to the next."""
    from meganeura.tune import set_cache_dir

    monkeypatch.delenv("MEGANEURA_CACHE_DIR", raising=False)
    set_cache_dir(None)
    yield
    set_cache_dir(None)


@pytest.fixture
def kernels_unpacked():
    """Every kernel its own dispatch during the test: packing independent neighbours into one
    (``schedule.pack``) off, then on again. For tests that read dispatch names, counts and each
    kernel's WGSL as a pass or lowering wrote them (tests/codegen and tests/passes use it for
    every test); packing itself is tested in tests/schedule/test_pack.py and, on as shipped, by
    the model and training tests."""
    from meganeura.schedule import pack

    pack.set_enabled(False)
    yield
    pack.set_enabled(True)


@pytest.fixture(scope="session")
def gpu_device():
    """The default meganeura runtime Device; skips when no WebGPU adapter is available."""
    try:
        from meganeura.runtime import get_device

        return get_device()
    except Exception as e:  # any failure to get an adapter means "no GPU here", not a bug
        pytest.skip(f"no WebGPU adapter available: {type(e).__name__}: {e}")


@pytest.fixture
def compiled_names(monkeypatch) -> list[list[str]]:
    """The dispatch names of every program ``meganeura.nn.compiled`` compiles during the
    test, one list per program, in compile order."""
    from meganeura.nn import compiled

    names: list[list[str]] = []
    compile_graph = compiled.compile_graph

    def record(*args, **kwargs):
        program = compile_graph(*args, **kwargs)
        names.append([d.name for d in program.dispatches])
        return program

    monkeypatch.setattr(compiled, "compile_graph", record)
    return names

"""Every collected test id is short, printable and free of pytest's positional fallbacks.

pytest-xdist needs each worker to collect the same ids, so an id must not carry random bytes or
object addresses; and an id should say which case it is. This checks every item collected in
the same run, before ``-k`` or ``-m`` deselect any (tests/conftest.py keeps them): under
``make test`` the whole suite, and ``pytest tests -k readable`` checks all ids in seconds.
"""

from __future__ import annotations

import enum
import re

import pytest

from .conftest import COLLECTED
from .ids import attention_dims_id, dims_id, plan_id, shape_id, shapes_id

NAMED_BY_PYTEST = (str, bytes, int, float, complex, type(None), enum.Enum, type)
MAX_ID = 80  # characters between the brackets
# Fragments of ids that pytest makes up for values it cannot name, or that change per process.
UNSTABLE_OR_OPAQUE = ("\\", "<lambda>", "<function", " object", " at 0x", "(", ")", "[", "{", " ")


def _bad_id_reason(item: pytest.Item) -> str | None:
    callspec = getattr(item, "callspec", None)
    if callspec is None:
        return None
    ident = callspec.id
    if len(ident) > MAX_ID:
        return f"longer than {MAX_ID} characters"
    if not ident.isascii() or not ident.isprintable():
        return "not printable ASCII"
    for frag in UNSTABLE_OR_OPAQUE:
        if frag in ident:
            return f"contains {frag!r}"
    for argname, value in callspec.params.items():
        # pytest names str, numbers, bools, None, enums, classes and named functions by value;
        # anything else (a tuple, list, dict, array, object) becomes the argname and an index.
        if isinstance(value, NAMED_BY_PYTEST) or callable(value):
            continue
        if re.search(rf"(^|-){re.escape(argname)}\d+($|-)", ident):
            return f"pytest's positional fallback for {argname!r}"
    return None


def test_every_collected_id_is_readable(request):
    bad = []
    for item in request.config.stash.get(COLLECTED, request.session.items):
        reason = _bad_id_reason(item)
        if reason:
            bad.append(f"{item.nodeid}: {reason}")
    assert not bad, "unreadable test ids (give ids= or pytest.param(id=...)):\n" + "\n".join(bad)


def test_the_check_catches_fallback_and_random_ids():
    class Spec:
        def __init__(self, ident, params):
            self.id, self.params = ident, params

    class Item:
        def __init__(self, ident, params):
            self.callspec = Spec(ident, params)

    assert _bad_id_reason(Item("shape0-dims0", {"shape": (3,), "dims": (0,)})) is not None
    assert _bad_id_reason(Item("<lambda>3", {"call": None})) is not None
    assert _bad_id_reason(Item("\\xa6\\xa4", {"content": b""})) is not None
    assert _bad_id_reason(Item("(64, 32, 16, 8)", {"plan": (64, 32, 16, 8)})) is not None
    assert _bad_id_reason(Item("x" * (MAX_ID + 1), {"n": 1})) is not None
    # readable ids pass, even where a value ends in digits or a shape is a bare number
    assert _bad_id_reason(Item("3x1x5-dim-1-vec4", {"shape": (3, 1, 5), "dim": -1})) is None
    assert _bad_id_reason(Item("lead_37-relu", {"lead": (37,), "act": "relu"})) is None
    assert _bad_id_reason(Item("smem16384", {"storage": 16384})) is None
    assert _bad_id_reason(Item("dim0-7x300", {"dim": 0, "shape": (7, 300)})) is None


def test_id_helpers():
    from meganeura.codegen.wgsl.attention.plan import Dims

    assert shape_id((3, 1, 5)) == "3x1x5" and shape_id(()) == "scalar" and shape_id((0,)) == "0"
    assert shapes_id((4, 5), ()) == "4x5_scalar"
    assert dims_id(None) == "all" and dims_id(-1) == "dim-1" and dims_id((1,)) == "dim1"
    assert dims_id((0, 2)) == "dims0_2"
    assert plan_id(None) == "lane" and plan_id((64, 32, 16, 8)) == "block64x32x16x8"
    whisper = Dims(1, 6, 1, 1500, 1500, 64, 64)
    assert attention_dims_id(whisper) == "b1-hkv6x1-l1500x1500-d64x64"

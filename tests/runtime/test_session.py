"""Runtime tests on the real adapter (lavapipe on CI): hand-built Programs checked against NumPy."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.dtypes import DType
from meganeura.schedule.program import BufferSpec, Dispatch, LabelCheck, Program, TensorSlot

pytestmark = pytest.mark.gpu

N = 1000  # > one 64-wide workgroup, not a multiple of 64
B = 6  # label batch
WG = (N + 63) // 64
CLASSES = 5
IGNORE = -100


def _kernel(decls: str, body: str, n: int = N) -> str:
    return (
        decls
        + "\n@compute @workgroup_size(64)\nfn main(@builtin(global_invocation_id) g: vec3<u32>) {\n"
        + f"  let i = g.x;\n  if (i >= {n}u) {{ return; }}\n  {body}\n}}\n"
    )


def _ro(i: int, name: str, t: str = "f32") -> str:
    return f"@group(0) @binding({i}) var<storage, read> {name}: array<{t}>;\n"


def _rw(i: int, name: str, t: str = "f32") -> str:
    return f"@group(0) @binding({i}) var<storage, read_write> {name}: array<{t}>;\n"


ADD = _kernel(_ro(0, "x") + _ro(1, "w") + _rw(2, "out"), "out[i] = x[i] + w[i];")
MASK = _kernel(
    _ro(0, "x") + _ro(1, "m", "u32") + _rw(2, "out") + _rw(3, "pos", "u32"),
    "out[i] = select(0.0, x[i], m[i] != 0u);\n  pos[i] = u32(out[i] > 0.0);",
)
# w <- w - lr * x; v <- v + 1 (a "state" counter)
UPDATE = _kernel(
    _ro(0, "x") + _ro(1, "lr") + _rw(2, "w") + _rw(3, "v"),
    "w[i] = w[i] - lr[0] * x[i];\n  v[i] = v[i] + 1.0;",
)
# picked[i] = f32(y[i]) * 2 for the label input
LABELS = _kernel(_ro(0, "y", "i32") + _rw(1, "picked"), "picked[i] = f32(y[i]) * 2.0;", n=B)

# buffer ids
X, MBUF, LR, Y, W, V, OUT, MASKED, POS, PICKED = range(10)


def make_program(**overrides) -> Program:
    f32, i32, b = DType.f32, DType.i32, DType.bool
    buffers = (
        BufferSpec(X, N * 4, "input", "x"),
        BufferSpec(MBUF, N * 4, "input", "mask"),
        BufferSpec(LR, 4, "input", "lr"),
        BufferSpec(Y, B * 4, "input", "y"),
        BufferSpec(W, N * 4, "parameter", "w"),
        BufferSpec(V, N * 4, "state", "w.count"),
        BufferSpec(OUT, N * 4, "output", "out"),
        BufferSpec(MASKED, N * 4, "output", "masked"),
        BufferSpec(POS, N * 4, "output", "positive"),
        BufferSpec(PICKED, B * 4, "output", "picked"),
    )
    dispatches = (
        Dispatch("%1 add", ADD, (X, W, OUT), (False, False, True), (WG, 1, 1)),
        Dispatch("%2 mask", MASK, (X, MBUF, MASKED, POS), (False, False, True, True), (WG, 1, 1)),
        Dispatch("%3 labels", LABELS, (Y, PICKED), (False, True), (1, 1, 1)),
        Dispatch("%4 sgd", UPDATE, (X, LR, W, V), (False, False, True, True), (WG, 1, 1)),
    )
    fields = dict(
        buffers=buffers,
        dispatches=dispatches,
        inputs={
            "x": TensorSlot(X, (N,), f32),
            "mask": TensorSlot(MBUF, (N,), b),
            "lr": TensorSlot(LR, (), f32),
            "y": TensorSlot(Y, (2, 3), i32),
        },
        outputs={
            "out": TensorSlot(OUT, (N,), f32),
            "masked": TensorSlot(MASKED, (N,), f32),
            "positive": TensorSlot(POS, (N,), b),
            "picked": TensorSlot(PICKED, (2, 3), f32),
        },
        parameters={"w": TensorSlot(W, (N,), f32)},
        state={"w.count": TensorSlot(V, (N,), f32)},
        label_checks=(LabelCheck("y", CLASSES, IGNORE),),
    )
    fields.update(overrides)
    return Program(**fields)


def make_feeds(seed: int = 0) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {
        "x": rng.standard_normal(N).astype(np.float32),
        "mask": rng.random(N) < 0.5,
        "lr": np.array(0.5, np.float32),
        "y": np.array([[0, 4, 2], [IGNORE, 1, 3]], np.int32),
    }


@pytest.fixture
def session(gpu_device):
    from meganeura.runtime import Session

    s = Session(make_program(), gpu_device)
    s.write("w", np.linspace(-1, 1, N, dtype=np.float32))
    yield s
    s.close()


def test_run_matches_numpy_and_updates_parameters(session):
    feeds = make_feeds()
    w0 = session.read("w")
    out = session.run(feeds, fetch=["out", "masked", "positive", "picked"])
    x = feeds["x"]
    np.testing.assert_allclose(out["out"], x + w0, rtol=1e-6)
    masked = np.where(feeds["mask"], x, 0).astype(np.float32)
    np.testing.assert_array_equal(out["masked"], masked)
    assert out["positive"].dtype == np.bool_ and out["positive"].shape == (N,)
    np.testing.assert_array_equal(out["positive"], masked > 0)
    np.testing.assert_array_equal(out["picked"], feeds["y"].astype(np.float32) * 2)
    np.testing.assert_allclose(session.read("w"), w0 - 0.5 * x, rtol=1e-6)
    np.testing.assert_array_equal(session.read("w.count"), np.ones(N, np.float32))

    # A second step sees the updated parameter and accumulated state.
    feeds2 = make_feeds(seed=1)
    out2 = session.run(feeds2, fetch="out")
    assert set(out2) == {"out"}
    np.testing.assert_allclose(out2["out"], feeds2["x"] + w0 - 0.5 * x, rtol=1e-6, atol=1e-6)
    np.testing.assert_array_equal(session.read("w.count"), np.full(N, 2, np.float32))


def test_run_without_fetch_returns_empty_and_read_any_slot(session):
    feeds = make_feeds()
    assert session.run(feeds) == {}
    np.testing.assert_array_equal(session.read("x"), feeds["x"])
    np.testing.assert_array_equal(session.read("mask"), feeds["mask"])
    assert session.read("lr").shape == () and session.read("lr") == np.float32(0.5)
    np.testing.assert_array_equal(session.read("y"), feeds["y"])
    assert session.read("out").dtype == np.float32


@pytest.mark.parametrize(
    ("name", "value", "needle"),
    [
        pytest.param("x", np.zeros(N, np.float64), "astype(np.float32)", id="x-float64"),
        pytest.param("x", np.zeros(N + 1, np.float32), f"({N + 1},)", id="x-wrong_length"),
        pytest.param("mask", np.zeros(N, np.uint32), "bool", id="mask-uint32"),
        pytest.param("lr", 0.5, "float", id="lr-python_float"),
        pytest.param("y", np.zeros((3, 2), np.int32), "(2, 3)", id="y-transposed_shape"),
        pytest.param("y", np.full((2, 3), 2**31, np.int64), "2147483648", id="y-int64_too_large"),
        pytest.param("y", np.full((2, 3), -(2**31) - 1, np.int64), "int32", id="y-int64_too_small"),
        pytest.param("x", np.zeros(N, np.int64), "float32", id="x-int64_for_float"),
    ],
)
def test_bad_feed_raises_before_any_upload(session, name, value, needle):
    from meganeura.runtime import InputError

    good = make_feeds()
    session.run(good)
    before = {n: session.read(n) for n in ("x", "w", "w.count")}
    feeds = make_feeds(seed=2)
    feeds[name] = value
    with pytest.raises(InputError, match=repr(name)) as info:
        session.run(feeds)
    assert needle in str(info.value)
    for n, v in before.items():  # not even the valid feeds were uploaded
        np.testing.assert_array_equal(session.read(n), v)


def test_int64_feed_of_an_int32_input_is_narrowed(session):
    feeds = make_feeds()
    wide = {**feeds, "y": feeds["y"].astype(np.int64)}
    out = session.run(wide, fetch=["picked"])["picked"]
    np.testing.assert_array_equal(out, feeds["y"].astype(np.float32) * 2)
    np.testing.assert_array_equal(session.read("y"), feeds["y"])
    assert session.read("y").dtype == np.int32


def test_int64_feed_is_range_checked_after_narrowing(session):
    from meganeura.runtime import InputError

    feeds = {**make_feeds(), "y": np.array([[0, 1, 2], [3, 5, IGNORE]], np.int64)}
    with pytest.raises(InputError, match="class index 5 at position \\(1, 1\\)"):
        session.run(feeds)


def test_missing_unknown_feeds_and_fetch(session):
    from meganeura.runtime import InputError

    assert issubclass(InputError, ValueError)
    feeds = make_feeds()
    del feeds["lr"]
    with pytest.raises(InputError, match="missing \\['lr'\\]"):
        session.run(feeds)
    feeds = {**make_feeds(), "z": np.zeros(3, np.float32)}
    with pytest.raises(InputError, match="unknown \\['z'\\]"):
        session.run(feeds)
    with pytest.raises(InputError, match="'nope'"):
        session.run(make_feeds(), fetch=["nope"])
    with pytest.raises(InputError, match="'w'"):
        session.run(make_feeds(), fetch=["w"])  # a parameter is read(), not fetched


def test_written_inputs_stay_resident(session):
    """An input written with ``write`` may be left out of later feeds (its value stays on the
    GPU across steps); a feed replaces it; an input never written is still missing; a label
    input is range-checked when written, and a rejected write changes nothing."""
    from meganeura.runtime import InputError

    feeds = make_feeds()
    session.write("x", feeds["x"])
    session.write("y", feeds["y"])
    assert session.resident_inputs == ("x", "y")
    w0 = session.read("w")
    rest = {n: v for n, v in feeds.items() if n not in ("x", "y")}
    out = session.run(rest, fetch=["out", "picked"])
    np.testing.assert_allclose(out["out"], feeds["x"] + w0, rtol=1e-6)
    np.testing.assert_array_equal(out["picked"], (feeds["y"] * 2).astype(np.float32))
    w1 = session.read("w")
    out = session.run(rest, fetch=["out"])  # the second step reads the same x
    np.testing.assert_allclose(out["out"], feeds["x"] + w1, rtol=1e-6)
    x2, w2 = make_feeds(1)["x"], session.read("w")
    out = session.run({**rest, "x": x2}, fetch=["out"])  # a feed replaces the written value
    np.testing.assert_allclose(out["out"], x2 + w2, rtol=1e-6)
    with pytest.raises(InputError, match="missing \\['lr'\\]"):
        session.run({"mask": feeds["mask"]})
    bad = np.array([[0, 1, 2], [7, 4, 1]], np.int32)
    with pytest.raises(InputError, match="class index 7"):
        session.write("y", bad)
    picked = session.run(rest, fetch=["picked"])["picked"]
    np.testing.assert_array_equal(picked, (feeds["y"] * 2).astype(np.float32))


def test_label_check_failure_leaves_parameters_untouched(session):
    from meganeura.runtime import InputError

    w0, c0 = session.read("w"), session.read("w.count")
    feeds = make_feeds()
    feeds["y"] = np.array([[0, 1, 2], [3, 5, IGNORE]], np.int32)  # 5 == CLASSES: out of range
    with pytest.raises(InputError) as info:
        session.run(feeds, fetch=["out"])
    msg = str(info.value)
    assert "'y'" in msg and " 5 " in msg and "(1, 1)" in msg and "[0, 5)" in msg
    np.testing.assert_array_equal(session.read("w"), w0)
    np.testing.assert_array_equal(session.read("w.count"), c0)
    feeds["y"] = np.array([[0, 1, 2], [-1, 4, IGNORE]], np.int32)
    with pytest.raises(InputError, match="class index -1 at position \\(1, 0\\)"):
        session.run(feeds)
    np.testing.assert_array_equal(session.read("w"), w0)


def test_write_is_strict(session):
    from meganeura.runtime import InputError

    with pytest.raises(InputError, match="'w'.*astype"):
        session.write("w", np.zeros(N))
    with pytest.raises(InputError, match="'out'"):
        session.write("out", np.zeros(N, np.float32))
    with pytest.raises(InputError, match="'ghost'"):
        session.read("ghost")


def test_state_dict_round_trip(session):
    sd = session.state_dict()
    assert set(sd) == {"w", "w.count"}
    np.testing.assert_array_equal(sd["w"], np.linspace(-1, 1, N, dtype=np.float32))
    np.testing.assert_array_equal(sd["w.count"], np.zeros(N, np.float32))
    session.run(make_feeds())
    assert not np.array_equal(session.read("w"), sd["w"])
    assert session.load_state_dict(sd) == ([], [])
    for k, v in sd.items():
        np.testing.assert_array_equal(session.read(k), v)


def test_load_state_dict_errors_write_nothing(session):
    from meganeura.runtime import InputError

    sd = session.state_dict()
    new_w = sd["w"] + 1
    with pytest.raises(InputError, match="missing keys \\['w.count'\\]"):
        session.load_state_dict({"w": new_w})
    with pytest.raises(InputError, match="unexpected keys \\['extra'\\]"):
        session.load_state_dict({**sd, "extra": new_w})
    with pytest.raises(InputError, match="'w.count'.*shape"):
        session.load_state_dict({"w": new_w, "w.count": np.zeros(N + 1, np.float32)})
    with pytest.raises(InputError, match="'w.count'.*dtype"):
        session.load_state_dict({"w": new_w, "w.count": np.zeros(N, np.float16)})
    np.testing.assert_array_equal(session.read("w"), sd["w"])  # w was never written
    missing, unexpected = session.load_state_dict({"w": new_w, "extra": new_w}, strict=False)
    assert (missing, unexpected) == (["w.count"], ["extra"])
    np.testing.assert_array_equal(session.read("w"), new_w)


def test_broken_wgsl_raises_kernel_error(gpu_device):
    from meganeura.runtime import KernelError, Session

    broken = ADD.replace("x[i] + w[i]", "x[i] + bogus_name")
    d = Dispatch("%7 broken_add", broken, (X, W, OUT), (False, False, True), (WG, 1, 1))
    with pytest.raises(KernelError, match="%7 broken_add") as info:
        Session(make_program(dispatches=(d,)), gpu_device)
    assert "WGSL failed to compile" in str(info.value)
    assert "bogus_name" in str(info.value)  # wgpu's own message is carried along


@pytest.mark.parametrize(
    ("bindings", "writes", "needle"),
    [
        # shader writes binding 2
        pytest.param((X, W, OUT), (False, False, False), "doesn't match", id="output_read_only"),
        # shader only reads binding 0
        pytest.param((X, W, OUT), (True, False, True), "doesn't match", id="input_writable"),
        pytest.param((X, W), (False, False), "missing from the pipeline layout", id="too_few"),
    ],
)
def test_mismatched_bindings_raise_kernel_error(gpu_device, bindings, writes, needle):
    from meganeura.runtime import KernelError, Session

    d = Dispatch("%8 add", ADD, bindings, writes, (WG, 1, 1))
    with pytest.raises(KernelError, match="%8 add") as info:
        Session(make_program(dispatches=(d,)), gpu_device)
    assert needle in str(info.value)


def test_draw_time_validation_fails_at_construction(gpu_device):
    from meganeura.runtime import KernelError, Session

    # Only checked when a dispatch is recorded: the shader needs 1200 bytes, the buffer has 24.
    src = """@group(0) @binding(0) var<storage, read_write> c: array<f32, 300>;
@compute @workgroup_size(1) fn main() { c[0] = 1.0; }"""
    d = Dispatch("%12 fixed", src, (PICKED,), (True,), (1, 1, 1))
    with pytest.raises(KernelError, match="%12 fixed.*failed validation") as info:
        Session(make_program(dispatches=(d,)), gpu_device)
    assert "1200" in str(info.value)


def test_limits_are_checked_at_construction(gpu_device):
    from meganeura.runtime import KernelError, Session

    lim = gpu_device.max_compute_workgroups_per_dimension
    d = Dispatch("%9 huge", ADD, (X, W, OUT), (False, False, True), (1, lim + 1, 1))
    with pytest.raises(KernelError, match="%9 huge.*max_compute_workgroups_per_dimension"):
        Session(make_program(dispatches=(d,)), gpu_device)

    big = gpu_device.max_storage_buffer_binding_size + 4
    buffers = list(make_program().buffers)
    buffers[OUT] = BufferSpec(OUT, big, "output", "out")
    d = Dispatch("%10 wide", ADD, (X, W, OUT), (False, False, True), (WG, 1, 1))
    with pytest.raises(KernelError, match="%10 wide.*buffer 6.*max_storage_buffer_binding_size"):
        Session(make_program(buffers=tuple(buffers), dispatches=(d,)), gpu_device)

    d = Dispatch("%11 alias", ADD, (X, OUT, OUT), (False, False, True), (WG, 1, 1))
    with pytest.raises(KernelError, match="%11 alias.*more than once"):
        Session(make_program(dispatches=(d,)), gpu_device)


def test_pipelines_are_cached_by_source(gpu_device):
    from meganeura.runtime import Session

    cache = gpu_device.pipelines
    tagged = ADD + "// cache-test\n"
    d1 = Dispatch("a", tagged, (X, W, OUT), (False, False, True), (WG, 1, 1))
    d2 = Dispatch("b", tagged, (X, W, MASKED), (False, False, True), (WG, 1, 1))
    before = cache.compiled
    s1 = Session(make_program(dispatches=(d1, d2)), gpu_device)
    assert cache.compiled == before + 1
    s2 = Session(make_program(dispatches=(d2,)), gpu_device)
    assert cache.compiled == before + 1
    s1.close()
    s2.close()


def test_unaligned_f16_slots_sharing_a_buffer(gpu_device):
    from meganeura.runtime import Session

    f16 = DType.f16
    prog = Program(
        buffers=(BufferSpec(0, 12, "parameter"), BufferSpec(1, 8, "parameter")),
        dispatches=(),
        inputs={},
        outputs={},
        parameters={
            "a": TensorSlot(0, (3,), f16),  # bytes 0..6
            "b": TensorSlot(0, (3,), f16, offset=6),  # bytes 6..12: shares a 4-byte word
            "c": TensorSlot(1, (3,), f16),  # alone: padded with zeros
        },
    )
    with Session(prog, gpu_device) as s:
        a = np.array([1, 2, 3], np.float16)
        b = np.array([-4, 5.5, 6e4], np.float16)
        s.load_state_dict({"a": a, "b": b, "c": b[::-1].copy()})
        s.write("a", a * 2)
        np.testing.assert_array_equal(s.read("a"), a * 2)
        np.testing.assert_array_equal(s.read("b"), b)
        np.testing.assert_array_equal(s.read("c"), b[::-1])


def test_empty_and_scalar_outputs(gpu_device):
    from meganeura.runtime import Session

    src = _kernel(_ro(0, "x") + _rw(1, "s"), "if (i == 0u) { s[0] = x[0] + x[1]; }", n=1)
    prog = Program(
        buffers=(BufferSpec(0, 8, "input", "x"), BufferSpec(1, 4, "output", "s")),
        dispatches=(Dispatch("sum2", src, (0, 1), (False, True), (1, 1, 1)),),
        inputs={"x": TensorSlot(0, (2,), DType.f32)},
        outputs={"s": TensorSlot(1, (), DType.f32), "none": TensorSlot(1, (0, 3), DType.i32)},
        parameters={},
    )
    with Session(prog, gpu_device) as s:
        out = s.run({"x": np.array([1.5, 2.25], np.float32)}, fetch=["s", "none"])
        assert out["s"].shape == () and out["s"] == np.float32(3.75)
        assert out["none"].shape == (0, 3) and out["none"].dtype == np.int32
        assert s.run({"x": np.array([1.0, 2.0], np.float32)}, fetch=["none"])["none"].size == 0


def test_label_check_must_name_an_integer_input(gpu_device):
    from meganeura.runtime import Session

    with pytest.raises(ValueError, match="'x'.*not an integer input"):
        Session(make_program(label_checks=(LabelCheck("x", 3, None),)), gpu_device)


def test_closed_session_refuses_work(gpu_device):
    from meganeura.runtime import Session

    s = Session(make_program(), gpu_device)
    s.close()
    with pytest.raises(RuntimeError, match="closed"):
        s.run(make_feeds())


def test_device_cache_limits_and_info(gpu_device):
    from meganeura.runtime import format_info, get_device

    assert get_device() is gpu_device
    for k in (
        "max_storage_buffer_binding_size",
        "max_buffer_size",
        "max_compute_workgroups_per_dimension",
        "max_compute_workgroup_storage_size",
        "max_compute_invocations_per_workgroup",
    ):
        assert type(getattr(gpu_device, k)) is int and getattr(gpu_device, k) > 0
    text = format_info(gpu_device)
    assert gpu_device.info["device"] in text and "max_buffer_size" in text
    with pytest.raises(RuntimeError, match="no adapter matches 'no-such-gpu-xyz'.*available"):
        get_device("no-such-gpu-xyz")
    name = gpu_device.info["device"]
    assert get_device(name.upper()[:6]).info["device"]  # case-insensitive substring

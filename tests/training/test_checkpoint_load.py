"""Loading a checkpoint is atomic (issue 11, item 6): every kind of bad file raises
CheckpointError naming the key, the expected and the actual value, and leaves the trainer as it
was (parameters bit-identical on the GPU, optimizer moments, step counter, global RNG), still
training exactly as a twin that never saw the file. Also: a checkpoint holds parameters the
loss does not read (item 10b)."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.dtypes import f32
from meganeura.graph.builder import GraphBuilder
from meganeura.io.checkpoint import CheckpointError, load_checkpoint, save_checkpoint
from meganeura.nn import Linear, Module
from meganeura.optim import Adam, AdamW
from meganeura.training import GraphTrainer, Trainer

pytestmark = pytest.mark.gpu


class Net(Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1 = Linear(6, 5)
        self.fc2 = Linear(5, 3)
        self.spare = Linear(2, 2)  # read by no loss: still part of the model and its checkpoint

    def forward(self, x):
        return self.fc2(F.relu(self.fc1(x)))


def loss_fn(model, x, y):
    return F.cross_entropy(model(x), y)


def _batch(seed: int):
    r = np.random.default_rng(seed)
    return r.standard_normal((4, 6)).astype(np.float32), r.integers(0, 3, 4).astype(np.int32)


def _module_trainer(gpu_device) -> Trainer:
    mn.manual_seed(3)
    tr = Trainer(Net(), AdamW(lr=1e-2), loss_fn, device=gpu_device)
    tr.step(*_batch(0))
    return tr


def _rng_state():
    return mn.random.get_rng_state()


def _with(meta: dict, **changes) -> dict:
    out = dict(meta)
    for k, v in changes.items():
        if v is _MISSING:
            out.pop(k)
        else:
            out[k] = v
    return out


_MISSING = object()


def _rng_with(meta: dict, **fields) -> dict:
    rng = {**meta["rng"], "state": dict(meta["rng"]["state"])}
    for k, v in fields.items():
        if k in ("state", "inc"):
            rng["state"][k] = v
        else:
            rng[k] = v
    return rng


# name -> (tensors, meta) -> (tensors, meta) of a bad file, and the message it must raise
MODULE_CASES = {
    "step_negative": (lambda t, m: (t, _with(m, step=-1)), r"'step' is -1; expected .*>= 0"),
    "step_string": (lambda t, m: (t, _with(m, step="3")), r"'step' is '3'; expected"),
    "step_bool": (lambda t, m: (t, _with(m, step=True)), r"'step' is True; expected"),
    "step_null": (lambda t, m: (t, _with(m, step=None)), r"'step' is None; expected"),
    "step_float": (lambda t, m: (t, _with(m, step=1.0)), r"'step' is 1.0; expected"),
    "step_missing": (lambda t, m: (t, _with(m, step=_MISSING)), r"no 'step'"),
    "rng_missing": (lambda t, m: (t, _with(m, rng=_MISSING)), r"no 'rng'; expected a PCG64"),
    "rng_null": (lambda t, m: (t, _with(m, rng=None)), r"'rng' is None; expected a PCG64"),
    "rng_other_generator": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, bit_generator="MT19937"))),
        r"'rng' .*bit_generator 'MT19937', not 'PCG64'",
    ),
    "rng_state_float": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, state=1.5))),
        r"'rng' .*not an integer in \[0, 2\*\*128\)",
    ),
    "rng_state_negative": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, inc=-1))),
        r"'rng' .*not an integer in \[0, 2\*\*128\)",
    ),
    "rng_has_uint32": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, has_uint32=5))),
        r"'rng' .*has_uint32 5, not 0 or 1",
    ),
    "rng_uinteger_float": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, uinteger=2.5))),
        r"'rng' .*uinteger 2.5",
    ),
    "rng_unknown_key": (
        lambda t, m: (t, _with(m, rng=_rng_with(m, extra=1))),
        r"'rng' .*keys \['bit_generator', 'extra'",
    ),
    "optimizer_missing": (
        lambda t, m: (t, _with(m, optimizer=_MISSING)),
        r"'optimizer' is None; expected .*'AdamW'",
    ),
    "optimizer_string": (
        lambda t, m: (t, _with(m, optimizer="AdamW")),
        r"'optimizer' is 'AdamW'; expected",
    ),
    "optimizer_other": (
        lambda t, m: (t, _with(m, optimizer={**m["optimizer"], "type": "Adam"})),
        r"'optimizer' type is 'Adam'.*this one uses AdamW",
    ),
    "moment_shape": (
        lambda t, m: ({**t, "optimizer/fc1.bias.exp_avg": np.zeros(4, np.float32)}, m),
        r"'optimizer/fc1.bias.exp_avg': expected float32\[5\], got float32\[4\]",
    ),
    "moment_dtype": (
        lambda t, m: ({**t, "optimizer/fc1.bias.exp_avg": np.zeros(5, np.float64)}, m),
        r"'optimizer/fc1.bias.exp_avg': expected float32\[5\], got float64\[5\]",
    ),
    "moment_unknown_parameter": (
        lambda t, m: ({**t, "optimizer/fc9.bias.exp_avg": np.zeros(5, np.float32)}, m),
        r"unknown optimizer state 'optimizer/fc9.bias.exp_avg'",
    ),
    "moment_unknown_suffix": (
        lambda t, m: ({**t, "optimizer/fc1.bias.momentum_buffer": np.zeros(5, np.float32)}, m),
        r"unknown optimizer state 'optimizer/fc1.bias.momentum_buffer'",
    ),
    "weight_dtype": (
        lambda t, m: ({**t, "fc2.bias": t["fc2.bias"].astype(np.float64)}, m),
        r"'fc2.bias': expected float32\[3\], got float64\[3\]",
    ),
    "weight_shape": (
        lambda t, m: ({**t, "fc2.bias": np.zeros(4, np.float32)}, m),
        r"size mismatch for fc2.bias|'fc2.bias': expected float32\[3\], got float32\[4\]",
    ),
    "unknown_key": (
        lambda t, m: ({**t, "fc3.weight": np.zeros(2, np.float32)}, m),
        r"unexpected keys: \['fc3.weight'\]",
    ),
    "missing_key": (
        lambda t, m: ({k: v for k, v in t.items() if k != "spare.bias"}, m),
        r"missing keys: \['spare.bias'\]",
    ),
}


@pytest.mark.parametrize("case", list(MODULE_CASES))
def test_module_trainer_load_of_a_bad_file_changes_nothing(gpu_device, tmp_path, case):
    tr, twin = _module_trainer(gpu_device), _module_trainer(gpu_device)
    good = tmp_path / "good.safetensors"
    tr.save(good)
    tensors, meta = load_checkpoint(good)
    tr.step(*_batch(1))
    twin.step(*_batch(1))
    # Different values everywhere, so a partly applied load would show.
    tensors = {k: v + np.ones((), v.dtype) for k, v in tensors.items()}
    meta = {**meta, "step": 7}
    make, message = MODULE_CASES[case]
    bad_tensors, bad_meta = make(tensors, meta)
    save_checkpoint(tmp_path / "bad.safetensors", bad_tensors, bad_meta)
    before, rng = tr.state_dict(), _rng_state()
    with pytest.raises(CheckpointError, match=message) as info:
        tr.load(tmp_path / "bad.safetensors")
    assert "bad.safetensors" in str(info.value)
    assert tr.step_count == 2 and _rng_state() == rng
    after = tr.state_dict()  # read back from the GPU: parameters and moments
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    # still trains, exactly as the twin that never saw the file
    x, y = _batch(2)
    assert tr.step(x, y) == twin.step(x, y)
    ours, theirs = tr.state_dict(), twin.state_dict()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_module_trainer_checkpoint_keeps_parameters_the_loss_does_not_read(gpu_device, tmp_path):
    tr = _module_trainer(gpu_device)
    spare = tr.model.spare.weight.data
    tr.save(tmp_path / "ck.safetensors")
    tensors, _ = load_checkpoint(tmp_path / "ck.safetensors")
    np.testing.assert_array_equal(tensors["spare.weight"], spare)
    mn.manual_seed(9)
    other = Trainer(Net(), AdamW(lr=1e-2), loss_fn, device=gpu_device)
    other.load(tmp_path / "ck.safetensors")
    np.testing.assert_array_equal(other.model.spare.weight.data, spare)


# ----------------------------------------------------------------------------- GraphTrainer


def _graph(spare: bool = True):
    b = GraphBuilder()
    x = b.input("x", (4, 6), f32)
    w = b.parameter("w", (6, 3), f32)
    if spare:
        b.parameter("spare", (2,), f32)  # read by nothing: compiled away, still checkpointed
    b.output("loss", F.mean((x @ w) ** 2))
    return b.build()


def _graph_trainer(gpu_device, optimizer=None) -> GraphTrainer:
    tr = Trainer(_graph(), optimizer or Adam(lr=1e-2), device=gpu_device)
    tr.load_parameters(
        {
            "w": np.arange(18, dtype=np.float32).reshape(6, 3) / 10,
            "spare": np.array([1.5, -2.0], np.float32),
        }
    )
    tr.step({"x": _batch(0)[0]})
    return tr


GRAPH_CASES = {
    "step_string": (lambda t, m: (t, _with(m, step="1")), r"'step' is '1'; expected"),
    "step_missing": (lambda t, m: (t, _with(m, step=_MISSING)), r"no 'step'"),
    "optimizer_missing": (lambda t, m: (t, _with(m, optimizer=_MISSING)), r"'optimizer' is None"),
    "optimizer_string": (lambda t, m: (t, _with(m, optimizer="Adam")), r"'optimizer' is 'Adam'"),
    # AdamW's state has Adam's names: only the metadata tells them apart
    "optimizer_other": (
        lambda t, m: (t, _with(m, optimizer={**m["optimizer"], "type": "AdamW"})),
        r"'optimizer' type is 'AdamW'.*this one uses Adam",
    ),
    "moment_dtype": (
        lambda t, m: ({**t, "w.exp_avg": t["w.exp_avg"].astype(np.float16)}, m),
        r"'w.exp_avg': expected float32\[6, 3\], got float16\[6, 3\]",
    ),
    "unknown_key": (
        lambda t, m: ({**t, "v": np.zeros(2, np.float32)}, m),
        r"unknown keys \['v'\]",
    ),
    "missing_spare": (
        lambda t, m: ({k: v for k, v in t.items() if k != "spare"}, m),
        r"missing keys \['spare'\]",
    ),
    "spare_shape": (
        lambda t, m: ({**t, "spare": np.zeros(3, np.float32)}, m),
        r"'spare': expected float32\[2\], got float32\[3\]",
    ),
}


@pytest.mark.parametrize("case", list(GRAPH_CASES))
def test_graph_trainer_load_of_a_bad_file_changes_nothing(gpu_device, tmp_path, case):
    tr, twin = _graph_trainer(gpu_device), _graph_trainer(gpu_device)
    tr.save(tmp_path / "good.safetensors")
    tensors, meta = load_checkpoint(tmp_path / "good.safetensors")
    tensors = {k: v + np.ones((), v.dtype) for k, v in tensors.items()}
    make, message = GRAPH_CASES[case]
    save_checkpoint(tmp_path / "bad.safetensors", *make(tensors, {**meta, "step": 5}))
    before = tr.state_dict()
    with pytest.raises(CheckpointError, match=message):
        tr.load(tmp_path / "bad.safetensors")
    assert tr.step_count == 1
    after = tr.state_dict()
    assert after.keys() == before.keys()
    for k in before:
        np.testing.assert_array_equal(after[k], before[k], err_msg=k)
    x = _batch(1)[0]
    assert tr.step({"x": x}) == twin.step({"x": x})
    ours, theirs = tr.state_dict(), twin.state_dict()
    for k in theirs:
        np.testing.assert_array_equal(ours[k], theirs[k], err_msg=k)


def test_graph_trainer_checkpoint_keeps_parameters_the_loss_does_not_read(gpu_device, tmp_path):
    tr = _graph_trainer(gpu_device)
    assert "spare" not in tr.program.parameters  # compiled away
    np.testing.assert_array_equal(tr.parameters()["spare"], [1.5, -2.0])
    tr.save(tmp_path / "ck.safetensors")
    tensors, _ = load_checkpoint(tmp_path / "ck.safetensors")
    np.testing.assert_array_equal(tensors["spare"], [1.5, -2.0])
    other = Trainer(_graph(), Adam(lr=1e-2), device=gpu_device)
    other.load(tmp_path / "ck.safetensors")
    assert other.step_count == 1
    for k, v in tr.state_dict().items():
        np.testing.assert_array_equal(other.state_dict()[k], v, err_msg=k)

"""Module registration, names, state dicts and their loading, against torch.nn (no GPU)."""

from __future__ import annotations

from collections import OrderedDict

import numpy as np
import pytest
import torch

import meganeura as mn
from meganeura.io.safetensors_io import load_file
from meganeura.nn import Buffer, Module, Parameter, StateDictError, UninitializedParameterError


class Block(Module):
    def __init__(self, d):
        super().__init__()
        self.fc = mn.nn.Linear(d, d)
        self.register_buffer("scale", np.ones(d, np.float32))
        self.register_buffer("cache", np.zeros(d, np.float32), persistent=False)


class Net(Module):
    def __init__(self):
        super().__init__()
        self.embed = mn.nn.Linear(3, 4, bias=False)
        self.layers = mn.nn.ModuleList([Block(4), Block(4)])
        self.head = mn.nn.Sequential(mn.nn.Linear(4, 2), mn.nn.Identity())
        self.gain = Parameter(np.ones(2, np.float32))


class TorchBlock(torch.nn.Module):
    def __init__(self, d):
        super().__init__()
        self.fc = torch.nn.Linear(d, d)
        self.register_buffer("scale", torch.ones(d))
        self.register_buffer("cache", torch.zeros(d), persistent=False)


class TorchNet(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = torch.nn.Linear(3, 4, bias=False)
        self.layers = torch.nn.ModuleList([TorchBlock(4), TorchBlock(4)])
        self.head = torch.nn.Sequential(torch.nn.Linear(4, 2), torch.nn.Identity())
        self.gain = torch.nn.Parameter(torch.ones(2))


def test_names_and_order_match_torch():
    ours, ref = Net(), TorchNet()
    assert [n for n, _ in ours.named_parameters()] == [n for n, _ in ref.named_parameters()]
    assert [n for n, _ in ours.named_buffers()] == [n for n, _ in ref.named_buffers()]
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert [n for n, _ in ours.named_modules()] == [n for n, _ in ref.named_modules()]
    shapes = {k: tuple(v.shape) for k, v in ref.state_dict().items()}
    assert {k: v.shape for k, v in ours.state_dict().items()} == shapes


def test_default_init_is_seeded_and_bounded():
    mn.manual_seed(3)
    a = Net().state_dict()
    mn.manual_seed(3)
    b = Net().state_dict()
    mn.manual_seed(4)
    c = Net().state_dict()
    w = a["layers.0.fc.weight"]
    assert np.array_equal(w, b["layers.0.fc.weight"])
    assert not np.array_equal(w, c["layers.0.fc.weight"])
    assert 0 < np.abs(w).max() <= 0.5 and np.abs(w).std() > 0.05  # U(-1/sqrt(4), 1/sqrt(4))


def test_load_torch_state_dict_round_trip(tmp_path):
    ref = TorchNet()
    ours = Net()
    result = ours.load_state_dict({k: v.numpy() for k, v in ref.state_dict().items()})
    assert result == ([], [])
    for k, v in ref.state_dict().items():
        np.testing.assert_array_equal(ours.state_dict()[k], v.numpy())
    # and back: our state dict loads into torch strictly
    ref2 = TorchNet()
    ref2.load_state_dict({k: torch.from_numpy(v) for k, v in ours.state_dict().items()})
    assert torch.equal(ref2.layers[1].fc.weight, ref.layers[1].fc.weight)


def test_load_converts_half_bfloat16_double_and_torch_tensors():
    ref = TorchNet()
    sd = ref.state_dict()
    mixed = {}
    for i, (k, v) in enumerate(sd.items()):
        mixed[k] = [v.half().numpy(), v.double().numpy(), v.bfloat16(), v][i % 4]
    ours = Net()
    ours.load_state_dict(mixed)
    for i, (k, v) in enumerate(sd.items()):
        want = [v.half().float(), v.double().float(), v.bfloat16().float(), v][i % 4].numpy()
        got = ours.state_dict()[k]
        assert got.dtype == np.float32
        np.testing.assert_array_equal(got, want)


def test_load_reports_missing_unexpected_and_mis_shaped_and_changes_nothing():
    ours = Net()
    before = ours.state_dict()
    sd = dict(before)
    del sd["head.0.bias"]
    sd["extra.weight"] = np.zeros(3, np.float32)
    sd["layers.0.fc.weight"] = np.zeros((4, 5), np.float32)
    with pytest.raises(StateDictError) as e:
        ours.load_state_dict(sd)
    msg = str(e.value)
    assert "head.0.bias" in msg and "extra.weight" in msg
    assert "layers.0.fc.weight" in msg and "(4, 5)" in msg and "(4, 4)" in msg
    for k, v in ours.state_dict().items():
        np.testing.assert_array_equal(v, before[k])
    del sd["layers.0.fc.weight"]
    missing, unexpected = ours.load_state_dict(sd, strict=False)
    assert missing == ["layers.0.fc.weight", "head.0.bias"] and unexpected == ["extra.weight"]


def test_known_extra_keys_are_skipped():
    ours = Net()
    sd = dict(ours.state_dict())
    sd["layers.0.num_batches_tracked"] = np.array(5, np.int64)
    sd["embeddings.position_ids"] = np.arange(8)[None]
    assert ours.load_state_dict(sd) == ([], [])


def test_safetensors_file_with_bfloat16(tmp_path):
    import safetensors.torch

    ref = TorchNet()
    path = tmp_path / "w.safetensors"
    safetensors.torch.save_file({k: v.bfloat16() for k, v in ref.state_dict().items()}, path)
    raw = load_file(path)
    assert raw["gain"].dtype == np.float32
    ours = Net()
    ours.load_state_dict(str(path))
    np.testing.assert_array_equal(
        ours.state_dict()["embed.weight"], ref.embed.weight.bfloat16().float().detach().numpy()
    )


def test_assignment_rules():
    m = Net()
    with pytest.raises(TypeError, match="parameter 'gain'"):
        m.gain = np.zeros(2)
    m.layers[0].scale = np.full(4, 2.0)  # assigning an array to a buffer copies into it
    np.testing.assert_array_equal(m.state_dict()["layers.0.scale"], np.full(4, 2.0, np.float32))
    m.head[0].bias = None
    assert "head.0.bias" not in m.state_dict()
    with pytest.raises(AttributeError, match=r"super\(\)\.__init__"):

        class Bad(Module):
            def __init__(self):
                self.x = 1

        Bad()


def test_train_eval_and_requires_grad():
    m = Net()
    assert all(x.training for x in m.modules())
    m.eval()
    assert not any(x.training for x in m.modules())
    m.train()
    m.layers[0].requires_grad_(False)
    frozen = {n for n, p in m.named_parameters() if not p.requires_grad}
    assert frozen == {"layers.0.fc.weight", "layers.0.fc.bias"}


def test_shared_parameter_listed_once_and_state_dict_has_each_name():
    tied = Module()
    tied.a = mn.nn.Linear(2, 2, bias=False)
    tied.b = mn.nn.Linear(2, 2, bias=False)
    tied.b.weight = tied.a.weight
    assert [n for n, _ in tied.named_parameters()] == ["a.weight"]
    assert list(tied.state_dict()) == ["a.weight", "b.weight"]


def test_empty_weights_must_be_loaded():
    with mn.nn.init.empty_weights():
        m = Net()
    assert not m.embed.weight.is_initialized
    with pytest.raises(UninitializedParameterError):
        m.state_dict()
    m.load_state_dict({k: v.numpy() for k, v in TorchNet().state_dict().items()})
    assert m.embed.weight.is_initialized


def test_sequential_with_ordered_dict_and_indexing():
    s = mn.nn.Sequential(OrderedDict(first=mn.nn.Linear(2, 3), act=mn.nn.Identity()))
    assert list(s.state_dict()) == ["first.weight", "first.bias"]
    assert isinstance(s[-1], mn.nn.Identity) and len(s[:1]) == 1
    with pytest.raises(IndexError):
        s[2]


def test_buffer_host_only_keeps_int64():
    m = Module()
    m.register_buffer("num_batches_tracked", Buffer(np.array(0, np.int64), host_only=True))
    assert m.state_dict()["num_batches_tracked"].dtype == np.int64
    m.load_state_dict({"num_batches_tracked": np.array(7)})
    assert int(m.state_dict()["num_batches_tracked"]) == 7


def test_sequential_setitem_and_delitem_renumber_as_torch():
    ours = mn.nn.Sequential(mn.nn.Linear(2, 2), mn.nn.ReLU(), mn.nn.Linear(2, 3))
    ref = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.ReLU(), torch.nn.Linear(2, 3))
    ours[2] = mn.nn.Linear(2, 5)
    ref[2] = torch.nn.Linear(2, 5)
    del ours[1]
    del ref[1]
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert {k: v.shape for k, v in ours.state_dict().items()} == {
        k: tuple(v.shape) for k, v in ref.state_dict().items()
    }


def test_state_dict_of_an_uninitialized_model_names_the_tensor():
    with mn.nn.init.empty_weights():
        m = Net()
    with pytest.raises(UninitializedParameterError, match="'embed.weight'"):
        m.state_dict()


def test_replacing_a_submodule_or_parameter_keeps_its_place_as_torch():
    ours = mn.nn.Sequential(mn.nn.Linear(4, 3), mn.nn.ReLU(), mn.nn.Linear(3, 2))
    theirs = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU(), torch.nn.Linear(3, 2))
    setattr(ours, "0", mn.nn.Linear(4, 3, bias=False))
    setattr(theirs, "0", torch.nn.Linear(4, 3, bias=False))
    assert isinstance(ours[0], mn.nn.Linear) and ours[0].bias is None
    assert (
        list(ours.state_dict()) == list(theirs.state_dict()) == ["0.weight", "2.weight", "2.bias"]
    )
    lin = mn.nn.Linear(2, 2)
    lin.weight = Parameter(np.ones((2, 2), np.float32))
    assert list(lin.state_dict()) == ["weight", "bias"]

"""Compile on call: per-signature cache, shared parameters, constants, dropout seeds and the
footguns of tracing (GPU; lavapipe on CI)."""

from __future__ import annotations

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.nn import Module, UninitializedParameterError

pytestmark = pytest.mark.gpu


class MLP(Module):
    def __init__(self, d_in=6, d_hidden=8, d_out=3):
        super().__init__()
        self.fc1 = mn.nn.Linear(d_in, d_hidden)
        self.fc2 = mn.nn.Linear(d_hidden, d_out)

    def forward(self, x, scale=1.0):
        return self.fc2(F.relu(self.fc1(x))) * scale


def _ref(sd, x, scale=1.0):
    h = np.maximum(x @ sd["fc1.weight"].T + sd["fc1.bias"], 0)
    return (h @ sd["fc2.weight"].T + sd["fc2.bias"]) * scale


def test_forward_cache_and_shared_parameters(gpu_device):
    mn.manual_seed(0)
    m = MLP()
    rng = np.random.default_rng(1)
    x2, x5 = rng.standard_normal((2, 6), np.float32), rng.standard_normal((5, 6), np.float32)
    c = mn.compile(m, x2)
    assert (c.cache_info().hits, c.cache_info().misses) == (0, 1)
    np.testing.assert_allclose(c(x2), _ref(m.state_dict(), x2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c(x5), _ref(m.state_dict(), x5), rtol=1e-5, atol=1e-6)
    c(x2)
    info = c.cache_info()
    assert (info.hits, info.misses, info.currsize) == (2, 2, 2)
    assert [e.calls for e in info.entries] == [2, 1]
    assert all(e.trace_seconds > 0 and e.compile_seconds > 0 for e in info.entries)
    # one GPU copy: a write is seen by both programs, and reading back gives what was written
    w = rng.standard_normal((8, 6)).astype(np.float32)
    m.fc1.weight.data = w
    np.testing.assert_array_equal(m.fc1.weight.data, w)
    sd = m.state_dict()
    np.testing.assert_allclose(c(x2), _ref(sd, x2), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(c(x5), _ref(sd, x5), rtol=1e-5, atol=1e-6)
    runners = [e.runner for e in info.entries]
    b0 = runners[0].session._bound["fc1.weight"]
    b1 = runners[1].session._bound["fc1.weight"]
    assert b0.buffer is b1.buffer and b0.at == b1.at


def test_static_arguments_and_input_conversion(gpu_device):
    m = MLP()
    x = np.random.default_rng(2).standard_normal((3, 6))  # float64: fed as float32
    sd = m.state_dict()
    np.testing.assert_allclose(m(x), _ref(sd, x.astype(np.float32)), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(m(x, scale=2.0), _ref(sd, x, 2.0), rtol=1e-5, atol=1e-6)
    assert m._compiled.cache_info().misses == 2  # the static scale is part of the signature
    with pytest.raises(mn.nn.SignatureError, match="object"):
        m(x, scale=object())


def test_outputs_in_the_structure_forward_returned(gpu_device):
    class Two(Module):
        def __init__(self):
            super().__init__()
            self.lin = mn.nn.Linear(4, 4)

        def forward(self, x):
            y = self.lin(x)
            return {"y": y, "pair": (y * 2.0, F.sum(y)), "tag": "static"}

    m = Two()
    x = np.ones((2, 4), np.float32)
    out = m(x)
    assert set(out) == {"y", "pair", "tag"} and out["tag"] == "static"
    np.testing.assert_allclose(out["pair"][0], 2 * out["y"], rtol=1e-6)
    np.testing.assert_allclose(out["pair"][1], out["y"].sum(), rtol=1e-5)


def test_numpy_constants_inside_forward(gpu_device):
    table = np.random.default_rng(3).standard_normal((4, 5)).astype(np.float32)
    offset = np.arange(5, dtype=np.float64)  # stored as float32

    class WithConstants(Module):
        def forward(self, x):
            return F.matmul(x, table) + offset

    x = np.random.default_rng(4).standard_normal((3, 4)).astype(np.float32)
    np.testing.assert_allclose(WithConstants()(x), x @ table + offset, rtol=1e-5, atol=1e-6)


def test_dropout_seeds_fresh_per_call_reproducible_by_manual_seed(gpu_device):
    class Drop(Module):
        def forward(self, x):
            return F.dropout(x, 0.5, self.training)

    m = Drop()
    x = np.ones((64,), np.float32)
    mn.manual_seed(7)
    a, b = m(x), m(x)
    assert set(np.unique(a)) <= {0.0, 2.0} and not np.array_equal(a, b)
    assert 10 < (a == 0).sum() < 54
    mn.manual_seed(7)
    np.testing.assert_array_equal(m(x), a)
    m.eval()
    np.testing.assert_array_equal(m(x), x)


def test_bool_of_traced_tensor_raises(gpu_device):
    class Branchy(Module):
        def forward(self, x):
            if F.sum(x) > 0:
                return x
            return -x

    with pytest.raises(TypeError, match="only when the compiled program runs"):
        Branchy()(np.ones(3, np.float32))


@pytest.mark.parametrize("what", ["float", "numpy", "index"])
def test_host_values_of_traced_tensor_raise(gpu_device, what):
    class Host(Module):
        def forward(self, x):
            if what == "float":
                return x * float(F.sum(x))
            if what == "numpy":
                return np.exp(x)
            return x[: F.sum(x)]

    with pytest.raises(TypeError, match="no value until the program runs"):
        Host()(np.ones(3, np.float32))


def test_uninitialized_model_raises_naming_the_parameter(gpu_device):
    with mn.nn.init.empty_weights():
        m = MLP()
    with pytest.raises(UninitializedParameterError, match="fc1.weight"):
        m(np.ones((1, 6), np.float32))


def test_unregistered_parameter_raises(gpu_device):
    stray = mn.nn.Parameter(np.ones(3, np.float32))

    class Stray(Module):
        def forward(self, x):
            return x * stray

    with pytest.raises(mn.nn.TraceError, match=r"a Parameter of shape \(3,\).*not registered"):
        Stray()(np.ones(3, np.float32))


def test_changes_after_the_first_call_are_traced_again(gpu_device):
    class M(Module):
        def __init__(self):
            super().__init__()
            self.fc = mn.nn.Linear(4, 4)
            self.act = mn.nn.ReLU()
            self.out = mn.nn.Linear(4, 2)
            self.scale = 1.0

        def forward(self, x):
            return self.out(self.act(self.fc(x))) * self.scale

    m = M()
    x = np.random.default_rng(5).standard_normal((3, 4)).astype(np.float32)
    a = m(x)
    m.scale = 3.0  # a plain attribute read by forward
    np.testing.assert_allclose(m(x), 3 * a, rtol=1e-6)
    m.act = mn.nn.Tanh()  # a replaced submodule
    sd = m.state_dict()
    h = np.tanh(x @ sd["fc.weight"].T + sd["fc.bias"])
    np.testing.assert_allclose(m(x), 3 * (h @ sd["out.weight"].T + sd["out.bias"]), rtol=1e-5)
    m.out.weight = mn.nn.Parameter(np.ones((2, 4), np.float32))  # a replaced parameter
    np.testing.assert_allclose(m(x), 3 * (h.sum(1, keepdims=True) + sd["out.bias"]), rtol=1e-5)
    m.out = mn.nn.Linear(4, 5)
    assert m(x).shape == (3, 5)
    misses = m._compiled.cache_info().misses
    m(x)
    assert m._compiled.cache_info().misses == misses  # nothing changed: a hit


def test_torch_tensors_are_accepted_as_inputs(gpu_device):
    import torch

    m = MLP()
    x = torch.randn(2, 6)
    np.testing.assert_allclose(m(x), _ref(m.state_dict(), x.numpy()), rtol=1e-5, atol=1e-6)


def test_in_place_edit_of_data_raises_instead_of_editing_a_copy():
    lin = mn.nn.Linear(2, 2)
    with pytest.raises(ValueError, match="read-only"):
        lin.weight.data[...] = 0
    lin.weight.data = np.zeros((2, 2))
    assert not lin.weight.data.any()
    w = lin.weight.numpy()
    w[...] = 1  # a writable copy
    assert not lin.weight.data.any()


def test_plain_list_of_layers_names_the_fix(gpu_device):
    class Listy(Module):
        def __init__(self):
            super().__init__()
            self.blocks = [mn.nn.Linear(3, 3)]

        def forward(self, x):
            return self.blocks[0](x)

    with pytest.raises(mn.nn.TraceError, match="parameter 'weight' of a Linear.*ModuleList"):
        Listy()(np.ones((1, 3), np.float32))

"""Bundles (``mn.export``) run by the wgpu+NumPy runtime (``meganeura.runtime.bundle``) give the
compiling Session's outputs bit for bit on the same adapter, although the bundle runtime creates
its shader modules with bounds checks on (as browsers do) and the Session without them (its
Vulkan default): the MNIST MLP (also against a float64 NumPy forward), the MNIST conv net and a
tiny Llama causal LM; the manifest holds what docs/export.md says."""

from __future__ import annotations

import hashlib
import json

import numpy as np
import pytest

import meganeura as mn
from meganeura.export import SCHEMA, trace_program, write_bundle
from meganeura.models.convnet import ConvNet
from meganeura.models.llama import LlamaConfig, LlamaForCausalLM
from meganeura.models.mlp import MLP
from meganeura.runtime import Session
from meganeura.runtime.bundle import BundleSession

pytestmark = pytest.mark.gpu


def _roundtrip(model, inputs, tmp_path, device, **kw):
    """(Session outputs, bundle outputs, manifest, program) for ``model.forward(*inputs)``."""
    program, weights = trace_program(model, inputs, device=device, **kw)
    path = write_bundle(program, tmp_path / "bundle", weights)
    feeds = dict(zip(program.inputs, inputs, strict=True))
    with Session(program, device) as s:
        s.load_state_dict(weights, strict=False)
        ref = s.run(feeds, tuple(program.outputs))
    out = BundleSession(path, device.gpu).run(feeds)
    return ref, out, json.loads((path / "manifest.json").read_text()), program


def _same_bits(ref: dict, out: dict) -> None:
    assert set(ref) == set(out)
    for name in ref:
        assert out[name].dtype == ref[name].dtype and out[name].shape == ref[name].shape
        assert out[name].tobytes() == ref[name].tobytes(), name


def test_mlp_bits_and_manifest(tmp_path, gpu_device):
    mn.manual_seed(0)
    model = MLP((784, 32, 10)).eval()
    x = np.random.default_rng(0).standard_normal((4, 784)).astype(np.float32)
    ref, out, man, program = _roundtrip(model, (x,), tmp_path, gpu_device)
    _same_bits(ref, out)
    sd = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    h = np.maximum(x @ sd["fc1.weight"].T + sd["fc1.bias"], 0)
    want = h @ sd["fc2.weight"].T + sd["fc2.bias"]
    np.testing.assert_allclose(out["output"], want, rtol=1e-5, atol=1e-5)
    assert man["schema"] == SCHEMA == "meganeura-bundle/1"
    assert man["inputs"] == [
        {"name": "x", "dtype": "float32", "storage": "float32", "shape": [4, 784]}
        | {k: man["inputs"][0][k] for k in ("buffer", "offset")}
    ]
    assert [o["name"] for o in man["outputs"]] == ["output"]
    assert man["outputs"][0]["shape"] == [4, 10]
    assert man["requires"]["features"] == []
    assert man["requires"]["limits"]["max-storage-buffers-per-shader-stage"] == max(
        len(d.bindings) for d in program.dispatches
    )
    assert {b["role"] for b in man["buffers"]} <= {
        "input",
        "output",
        "parameter",
        "state",
        "scratch",
    }
    assert len(man["dispatches"]) == len(program.dispatches)
    root = tmp_path / "bundle"
    assert sorted(p.name for p in (root / "kernels").iterdir()) == sorted(
        f"{h}.wgsl" for h in man["kernels"]
    )
    for name, digest in man["files"].items():
        assert hashlib.sha256((root / name).read_bytes()).hexdigest() == digest
    d0 = man["dispatches"][0]
    assert set(d0) >= {"name", "kernel", "grid", "bindings"}
    assert set(d0["bindings"][0]) == {"buffer", "offset", "size", "access"}
    assert not list(tmp_path.glob(".bundle.*"))  # no temporary left behind


def test_convnet_bits(tmp_path, gpu_device):
    mn.manual_seed(1)
    model = ConvNet()
    rng = np.random.default_rng(1)
    for bn in (model.bn1, model.bn2):  # non-trivial running statistics
        n = bn.running_mean.shape[0]
        bn.running_mean.data = rng.standard_normal(n).astype(np.float32) * 0.1
        bn.running_var.data = rng.uniform(0.5, 1.5, n).astype(np.float32)
    model.eval()
    x = rng.standard_normal((2, 1, 28, 28)).astype(np.float32)
    ref, out, man, _ = _roundtrip(model, (x,), tmp_path, gpu_device)
    _same_bits(ref, out)
    assert man["outputs"][0]["shape"] == [2, 10]


def test_tiny_llama_bits_with_f16(tmp_path, gpu_device):
    if "shader-f16" not in gpu_device.features:
        pytest.skip("the adapter lacks shader-f16")
    mn.manual_seed(0)
    cfg = LlamaConfig(
        vocab_size=64,
        hidden_size=32,
        intermediate_size=48,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = LlamaForCausalLM(cfg).eval()
    ids = np.random.default_rng(2).integers(0, 64, (1, 8)).astype(np.int32)
    ref, out, man, program = _roundtrip(model, (ids,), tmp_path, gpu_device, precision="fast")
    _same_bits(ref, out)
    assert man["precision"] == "fast"
    f16 = any(s.dtype is mn.f16 for s in program.parameters.values())
    assert f16 and "shader-f16" in man["requires"]["features"]
    st = [t for t in man["weights"]["tensors"] if t["storage"] == "float16"]
    assert st  # weights stored as the program stores them
    assert man["inputs"][0]["dtype"] == "int32" and man["label_checks"]

"""What export refuses (training programs, kernels over the target's storage-buffer limit or
needing a feature it lacks, an existing folder) and what the bundle runtime refuses (a tampered
file, a missing feature or limit, mismatched feeds), each with a message naming the culprit;
the runtime's imports (no graph, compiler, codegen, scheduler or torch) and ``meganeura
export`` on a ``train mnist`` checkpoint."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.compile import CompileOptions
from meganeura.compile import compile as compile_graph
from meganeura.export import ExportError, trace_program, write_bundle
from meganeura.io.checkpoint import save_checkpoint
from meganeura.models.mlp import MLP
from meganeura.nn.compiled import trace
from meganeura.runtime.bundle import BundleError, BundleSession

pytestmark = pytest.mark.gpu

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def mlp():
    mn.manual_seed(0)
    return MLP((16, 8, 4)).eval()


@pytest.fixture
def bundle(tmp_path, mlp, gpu_device):
    x = np.zeros((2, 16), np.float32)
    program, weights = trace_program(mlp, (x,), device=gpu_device)
    return write_bundle(program, tmp_path / "b", weights)


def test_training_program_refused(mlp, tmp_path):
    x, y = np.zeros((2, 16), np.float32), np.zeros(2, np.int32)
    graph = trace(mlp, x, y, fn=lambda x, y: {"loss": F.cross_entropy(mlp(x), y)})
    program = compile_graph(graph, CompileOptions(loss="loss", optimizer=mn.optim.AdamW()))
    with pytest.raises(ExportError, match="only inference programs.*optimizer"):
        mn.export(program, tmp_path / "t", weights=mlp.state_dict())
    assert not (tmp_path / "t").exists()


def test_target_limits_and_features_refused(mlp, tmp_path, gpu_device):
    x = np.zeros((2, 16), np.float32)
    program, weights = trace_program(mlp, (x,), device=gpu_device)
    most = max(len(d.bindings) for d in program.dispatches)
    with pytest.raises(ExportError, match=rf"kernel '.+' binds {most} storage buffers.*allows 2"):
        write_bundle(program, tmp_path / "a", weights, max_storage_buffers=2)
    if "shader-f16" in gpu_device.features:
        fast, w = trace_program(mlp, (x,), precision="fast", device=gpu_device)
        with pytest.raises(
            ExportError, match=r"kernel '.+' needs the feature\(s\) \['shader-f16'\]"
        ):
            write_bundle(fast, tmp_path / "f", w, target_features={"subgroup"})
        # strict f32 for targets without shader-f16: the same request exports without it
        path = mn.export(mlp, tmp_path / "s", (x,), precision="fast", strict=True)
        man = json.loads((path / "manifest.json").read_text())
        assert man["precision"] == "strict" and "shader-f16" not in man["requires"]["features"]
    assert not (tmp_path / "a").exists() and not (tmp_path / "f").exists()


def test_existing_folder_and_overwrite(bundle, mlp):
    x = np.zeros((2, 16), np.float32)
    with pytest.raises(ExportError, match="exists"):
        mn.export(mlp, bundle, (x,))
    mn.export(mlp, bundle, (x,), overwrite=True)
    assert (bundle / "manifest.json").is_file()
    assert [p.name for p in bundle.parent.iterdir()] == ["b"]


def test_tampered_file_refused(bundle, gpu_device):
    w = bundle / "weights.safetensors"
    data = bytearray(w.read_bytes())
    data[-1] ^= 1
    w.write_bytes(bytes(data))
    with pytest.raises(BundleError, match=r"weights.safetensors has sha256 .* the manifest says"):
        BundleSession(bundle, gpu_device.gpu)


def test_missing_feature_and_limit_refused(bundle, gpu_device):
    m = json.loads((bundle / "manifest.json").read_text())
    m["requires"]["features"].append("texture-compression-astc-sliced-3d")
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(BundleError, match="feature 'texture-compression-astc-sliced-3d'"):
        BundleSession(bundle, gpu_device.gpu)
    m["requires"]["features"].pop()
    m["requires"]["limits"]["max-storage-buffers-per-shader-stage"] = 10**6
    (bundle / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(
        BundleError, match="needs max-storage-buffers-per-shader-stage >= 1,000,000"
    ):
        BundleSession(bundle, gpu_device.gpu)


def test_feeds_checked(bundle, gpu_device):
    s = BundleSession(bundle, gpu_device.gpu)
    x = np.ones((2, 16), np.float32)
    with pytest.raises(BundleError, match=r"missing \['x'\], unknown \['y'\]"):
        s.run({"y": x})
    with pytest.raises(BundleError, match=r"input 'x': expected shape \(2, 16\), got \(3, 16\)"):
        s.run({"x": np.ones((3, 16), np.float32)})
    with pytest.raises(BundleError, match="input 'x': expected dtype float32, got float64"):
        s.run({"x": x.astype(np.float64)})
    assert s.run({"x": x})["output"].shape == (2, 4)


_ISOLATED = """
import importlib.abc, importlib.util, sys, time
BLOCKED = ("meganeura", "torch", "transformers")
class Block(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            raise ImportError("blocked: " + name)
sys.meta_path.insert(0, Block())
t0 = time.perf_counter()
spec = importlib.util.spec_from_file_location("bundle_runtime", sys.argv[1])
rt = importlib.util.module_from_spec(spec)
spec.loader.exec_module(rt)
t1 = time.perf_counter()
import numpy as np
out = rt.BundleSession(sys.argv[2]).run({"x": np.load(sys.argv[3])})["output"]
np.save(sys.argv[4], out)
bad = sorted(m for m in sys.modules if m.split(".")[0] in BLOCKED)
print("import_seconds", t1 - t0, "blocked_loaded", bad)
"""


def test_runtime_needs_only_wgpu_and_numpy(bundle, mlp, tmp_path, gpu_device):
    from meganeura.runtime import bundle as runtime

    x = np.random.default_rng(0).standard_normal((2, 16)).astype(np.float32)
    np.save(tmp_path / "x.npy", x)
    r = subprocess.run(
        [
            sys.executable,
            "-c",
            _ISOLATED,
            runtime.__file__,
            str(bundle),
            str(tmp_path / "x.npy"),
            str(tmp_path / "y.npy"),
        ],
        capture_output=True,
        text=True,
        timeout=60,
        cwd=tmp_path,
    )
    assert r.returncode == 0, r.stderr
    assert "blocked_loaded []" in r.stdout, r.stdout
    want = BundleSession(bundle, gpu_device.gpu).run({"x": x})["output"]
    assert np.load(tmp_path / "y.npy").tobytes() == want.tobytes()


def test_cli_export_mnist_checkpoint(tmp_path, capsys, gpu_device):
    from meganeura.cli import main

    mn.manual_seed(0)
    model = MLP((784, 16, 10))
    ckpt = tmp_path / "checkpoint.safetensors"
    meta = {"sizes": [784, 16, 10], "mean": 0.1307, "std": 0.3081, "model": "mlp", "config": {}}
    save_checkpoint(ckpt, model.state_dict(), meta)
    assert main(["export", str(ckpt), "--strict"]) == 0
    out = capsys.readouterr().out
    assert f"bundle: {tmp_path / 'bundle'}" in out and "weights.safetensors" in out
    assert "required features: none" in out and "kernels: " in out
    man = json.loads((tmp_path / "bundle" / "manifest.json").read_text())
    assert man["meta"]["mean"] == 0.1307 and man["inputs"][0]["shape"] == [1, 784]
    x = np.random.default_rng(3).standard_normal((1, 784)).astype(np.float32)
    got = BundleSession(tmp_path / "bundle", gpu_device.gpu).run({"x": x})["output"]
    sd = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
    want = np.maximum(x @ sd["fc1.weight"].T + sd["fc1.bias"], 0) @ sd["fc2.weight"].T
    np.testing.assert_allclose(got, want + sd["fc2.bias"], rtol=1e-5, atol=1e-5)
    assert main(["export", str(tmp_path / "nope.safetensors")]) == 2
    assert (
        main(["export", str(ckpt), "--out", str(tmp_path / "n"), "--max-storage-buffers", "1"]) == 2
    )
    assert "storage buffers" in capsys.readouterr().err

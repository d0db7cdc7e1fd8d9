"""``target="web"`` exports (docs/web.md): what every browser's WebGPU runs without asking for
more. On lavapipe (subgroups, shader-f16, 32 storage buffers, 32 KiB workgroup memory, 1024
invocations) a web export compiles within WebGPU's default limits and without optional
features, and still computes the model (vs float64 NumPy); a Program whose kernel exceeds a
default limit is refused naming the kernel and the limit."""

from __future__ import annotations

import dataclasses
import json
import re

import numpy as np
import pytest

import meganeura as mn
from meganeura.export import ExportError, trace_program, write_bundle
from meganeura.export.manifest import WEB_LIMITS
from meganeura.models.mlp import MLP
from meganeura.runtime.bundle import BundleSession

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def mlp():
    mn.manual_seed(0)
    return MLP((784, 48, 10)).eval()


def test_web_target_fits_webgpu_defaults(mlp, tmp_path, gpu_device):
    x = np.random.default_rng(0).standard_normal((64, 784)).astype(np.float32)
    web = mn.export(mlp, tmp_path / "web", (x,), target="web", device=gpu_device)
    man = json.loads((web / "manifest.json").read_text())
    assert man["target"] == "web" and man["precision"] == "strict"
    assert man["requires"]["features"] == []
    for k, v in man["requires"]["limits"].items():
        if k in WEB_LIMITS:
            assert v <= WEB_LIMITS[k], k
    assert all("subgroup" not in open(web / k["file"]).read() for k in man["kernels"].values())
    if "subgroup" in gpu_device.features:  # what the same export gets where nothing narrows it
        anyt = mn.export(mlp, tmp_path / "any", (x,), device=gpu_device)
        assert (
            "subgroup" in json.loads((anyt / "manifest.json").read_text())["requires"]["features"]
        )
    got = BundleSession(web, gpu_device.gpu).run({"x": x})["output"]
    sd = {k: v.astype(np.float64) for k, v in mlp.state_dict().items()}
    want = np.maximum(x @ sd["fc1.weight"].T + sd["fc1.bias"], 0) @ sd["fc2.weight"].T
    np.testing.assert_allclose(got, want + sd["fc2.bias"], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize(
    "edit, limit",
    [
        (lambda s: s.replace("@workgroup_size(", "@workgroup_size(512, "), "invocations"),
        (lambda s: "var<workgroup> big: array<f32, 8192>;\n" + s, "workgroup-storage-size"),
    ],
    ids=["invocations", "workgroup-memory"],
)
def test_web_limits_refused_by_kernel(mlp, tmp_path, gpu_device, edit, limit):
    x = np.zeros((1, 784), np.float32)
    program, weights = trace_program(mlp, (x,), device=gpu_device)
    d = program.dispatches[0]
    changed = (dataclasses.replace(d, wgsl=edit(d.wgsl)), *program.dispatches[1:])
    program = dataclasses.replace(program, dispatches=changed)
    with pytest.raises(
        ExportError, match=rf"kernel '{re.escape(d.name)}' needs max-compute-.*{limit}"
    ):
        write_bundle(program, tmp_path / "b", weights, target_limits=WEB_LIMITS)
    assert not (tmp_path / "b").exists()
    with pytest.raises(ExportError, match="target must be 'any' or 'web'"):
        mn.export(mlp, tmp_path / "c", (x,), target="browser")

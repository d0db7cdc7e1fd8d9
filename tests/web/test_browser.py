"""Bundles run in a real browser: headless Chromium (Debian's ``chromium``) with its SwiftShader
WebGPU adapter, driven over the DevTools pipe (``meganeura.web.chromium``), against pages
served on 127.0.0.1 (``meganeura.web.server``).

* The digit demo (``digit.html``) classifies a stroke drawn on its canvas with the MNIST MLP of
  a ``train mnist`` checkpoint exported by ``meganeura export`` (the CLI, ``--target web``);
  its logits, and those of a batch fed from Python, equal the Python session's within 1e-5
  relative (and a float64 NumPy forward's); a screenshot after classifying is a rendered page.
* The transformer demo (``text.html``) runs a byte-level Llama of the model zoo; its logits
  equal the Python session's, and its greedy text is Python's greedy text.
* meganeura.js refuses a damaged bundle and a missing feature, naming them.

Chromium missing: the tests skip saying how to install it (scripts/setup_debian_packages.sh
installs it on CI). Chromium present but without a WebGPU adapter: they fail, saying why.
SwiftShader is slow (the transformer's 14 pipelines take ~10 s to compile), so shapes are
small and nothing is timed.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np
import pytest

from meganeura.web.chromium import FLAGS, INSTALL_HINT, Chromium, find_chromium
from meganeura.web.server import serve_in_thread, url_of
from tests.web.png import decode_png

pytestmark = pytest.mark.gpu

REPO = Path(__file__).resolve().parents[2]
DEMO_CHECKPOINT = REPO / "runs" / "mnist" / "checkpoint.safetensors"
# Where a run may keep the digit demo's screenshot (docs/web_demo.png is one).
SCREENSHOT_DIR = os.environ.get("MEGANEURA_SCREENSHOT_DIR")


def _close(got, want, what):
    """Within 1e-5 relative to the output's scale (``atol`` keeps entries near 0 fair)."""
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    assert got.shape == want.shape, f"{what}: shape {got.shape} != {want.shape}"
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5 * np.abs(want).max(), err_msg=what)


@pytest.fixture(scope="module")
def browser():
    if find_chromium() is None:
        pytest.skip(f"chromium is not installed ({INSTALL_HINT}; scripts/setup_debian_packages.sh)")
    with Chromium() as c:
        yield c


def _open(browser, bundle, page=None):
    """Serve ``bundle``, open its page, and wait for it to load the bundle; fails loudly (with
    the page's console and the browser's flags) when WebGPU has no adapter."""
    server = serve_in_thread(bundle)
    browser.goto(url_of(server, page))
    adapter = browser.evaluate(
        "navigator.gpu ? navigator.gpu.requestAdapter()"
        ".then(a => a && (a.info.architecture || a.info.vendor || 'unnamed'))"
        " : 'no navigator.gpu'"
    )
    if not adapter or adapter == "no navigator.gpu":
        pytest.fail(
            f"Chromium has no WebGPU adapter ({adapter or 'requestAdapter() returned null'}). "
            f"Flags: {' '.join(FLAGS)}. It needs --enable-unsafe-webgpu and no VK_ICD_FILENAMES "
            f"/ VK_DRIVER_FILES in its environment (meganeura.web.chromium drops them).\n"
            f"chromium stderr:\n{browser.stderr()}"
        )
    ready = browser.evaluate("demo.ready")
    return server, ready


def _bundle_run(browser, feeds: dict) -> dict:
    """``demo.bundle.run(feeds)`` in the page, outputs as lists."""
    js = {k: (v.dtype.name, v.reshape(-1).tolist()) for k, v in feeds.items()}
    types = {"float32": "Float32Array", "int32": "Int32Array"}
    args = ", ".join(
        f"{json.dumps(k)}: {types[t]}.from({json.dumps(v)})" for k, (t, v) in js.items()
    )
    return browser.evaluate(
        f"demo.bundle.run({{{args}}}).then(o => Object.fromEntries("
        "Object.entries(o).map(([k, v]) => [k, Array.from(v)])))"
    )


@pytest.fixture(scope="module", params=["trained-here", "make-demo"])
def mnist(request, tmp_path_factory):
    """(checkpoint, bundle) of an MNIST MLP exported by the ``meganeura export`` CLI: one
    epoch trained here, or ``make demo``'s ``runs/mnist/checkpoint.safetensors`` when present."""
    from meganeura.cli import main

    tmp = tmp_path_factory.mktemp(f"mnist-{request.param}")
    if request.param == "make-demo":
        if not DEMO_CHECKPOINT.is_file():
            pytest.skip(f"no {DEMO_CHECKPOINT.relative_to(REPO)} (run `make demo` first)")
        ckpt = tmp / "checkpoint.safetensors"
        shutil.copy(DEMO_CHECKPOINT, ckpt)
    else:
        from meganeura.recipes.mnist import MnistConfig, train

        train(MnistConfig(epochs=1, out=str(tmp)), progress=False)
        ckpt = tmp / "checkpoint.safetensors"
    assert main(["export", str(ckpt)]) == 0
    return ckpt, tmp / "bundle"


def test_digit_demo_classifies_as_python(browser, mnist, tmp_path):
    from meganeura.recipes.mnist import inference, load_model

    ckpt, bundle = mnist
    server, ready = _open(browser, bundle)
    try:
        assert ready["adapter"]  # e.g. "swiftshader"
        browser.evaluate("demo.clear(), demo.stroke([[70, 60], [210, 60], [120, 235]])")  # a 7
        r = browser.evaluate("demo.classify()")
        shown = browser.evaluate("document.getElementById('prediction').textContent")
        rect = browser.evaluate(
            "(r => ({x: r.x, y: r.y, w: r.width, h: r.height}))("
            "document.getElementById('prediction').getBoundingClientRect())"
        )
        pad = browser.evaluate(
            "(r => ({x: r.x, y: r.y, w: r.width, h: r.height}))("
            "document.getElementById('pad').getBoundingClientRect())"
        )
        png = browser.screenshot()
        rng = np.random.default_rng(0)
        x = rng.standard_normal((1, 784)).astype(np.float32)
        fed = _bundle_run(browser, {"x": x})["output"]
    finally:
        server.shutdown()
    model, _ = load_model(str(ckpt))
    run = inference(model)
    page_x = np.asarray(r["input"], np.float32)[None]
    assert page_x.std() > 0.1  # the stroke reached the model's input
    for xs, got, what in ((page_x, r["logits"], "drawn digit"), (x, fed, "fed from Python")):
        want = run(xs)
        _close(np.asarray(got).reshape(want.shape), want, f"{what}: browser vs Session")
        sd = {k: v.astype(np.float64) for k, v in model.state_dict().items()}
        h = np.maximum(xs @ sd["fc1.weight"].T + sd["fc1.bias"], 0)
        _close(np.asarray(got).reshape(want.shape), h @ sd["fc2.weight"].T + sd["fc2.bias"], what)
    assert shown == str(r["digit"]) == str(int(np.argmax(r["logits"])))
    # The screenshot is the rendered page: the viewport's size, many colours, the predicted
    # digit drawn in its blue where the page laid it out, the white stroke on the black pad.
    (tmp_path / "digit.png").write_bytes(png)
    if SCREENSHOT_DIR:
        Path(SCREENSHOT_DIR, "web_demo.png").write_bytes(png)
    img = decode_png(png)[..., :3].astype(np.int32)
    assert img.shape[:2] == (640, 840)
    assert len(np.unique(img.reshape(-1, 3), axis=0)) > 50
    box = img[int(rect["y"]) : int(rect["y"] + rect["h"]), int(rect["x"]) : int(rect["x"] + 80)]
    blue = (np.abs(box - [11, 95, 255]).sum(-1) < 60).sum()
    assert blue > 300, f"{blue} pixels of the digit's blue where the prediction is drawn"
    inner = img[int(pad["y"]) + 4 : int(pad["y"] + pad["h"]) - 4, int(pad["x"]) + 4 :][:, :272]
    white = (inner.min(-1) > 240).mean()
    assert 0.02 < white < 0.5, f"{white:.3f} of the pad is the stroke"


def test_transformer_demo_matches_python(browser, tmp_path):
    from meganeura.web.demos import byte_lm, export_byte_lm

    bundle = export_byte_lm(tmp_path / "lm", seq_len=16)
    ids = (np.arange(16, dtype=np.int32)[None] * 37 + 5) % 256
    server, _ = _open(browser, bundle)
    try:
        out = _bundle_run(browser, {"input_ids": ids})["output"]
        gen = browser.evaluate("demo.generate('Hello')")
    finally:
        server.shutdown()
    model = byte_lm()
    want = model(ids)
    _close(np.asarray(out).reshape(want.shape), want, "logits: browser vs Session")
    # Greedy continuation at the bundle's fixed length, as the page does it.
    tokens = list(b"Hello")
    while len(tokens) < 16:
        x = np.zeros((1, 16), np.int32)
        x[0, : len(tokens)] = tokens
        tokens.append(int(np.argmax(model(x)[0, len(tokens) - 1])))
    assert gen["ids"] == tokens


def test_meganeura_js_names_what_is_wrong(browser, mnist, tmp_path):
    """A kernel file changed after export, and a bundle needing a feature the adapter lacks
    (SwiftShader has no shader-f16): loadBundle rejects both with a BundleError naming it."""
    _, bundle = mnist
    damaged = shutil.copytree(bundle, tmp_path / "damaged")
    kernel = next((damaged / "kernels").iterdir())
    kernel.write_text(kernel.read_text() + "\n// changed\n")
    f16 = shutil.copytree(bundle, tmp_path / "f16")
    man = json.loads((f16 / "manifest.json").read_text())
    man["requires"]["features"] = ["shader-f16"]
    (f16 / "manifest.json").write_text(json.dumps(man))
    server = serve_in_thread(bundle, page="demo.css")  # a page without a bundle of its own
    try:
        browser.goto(url_of(server))
        errors = {}
        for name, folder in (("damaged", damaged), ("f16", f16)):
            server.RequestHandlerClass.bundle = folder
            errors[name] = browser.evaluate(
                "import('/meganeura.js').then(m => m.loadBundle('/bundle/'))"
                ".then(() => 'loaded', e => `${e.name}: ${e.message}`)"
            )
    finally:
        server.shutdown()
    assert errors["damaged"].startswith("BundleError: ") and kernel.name in errors["damaged"]
    assert "sha256" in errors["damaged"]
    assert errors["f16"].startswith("BundleError: ") and "'shader-f16'" in errors["f16"]


def test_subgroup_bundle_runs_in_browser(browser, tmp_path, gpu_device):
    """A bundle whose kernels use subgroups (``target="any"`` where the exporting adapter has
    them: lavapipe's MLP at batch 64): meganeura.js requests ``subgroups`` and prepends
    ``enable subgroups;`` (Tint requires it, naga rejects it), and the outputs equal the Python
    runtime's."""
    import meganeura as mn
    from meganeura.models.mlp import MLP
    from meganeura.runtime.bundle import BundleSession

    mn.manual_seed(0)
    x = np.random.default_rng(1).standard_normal((64, 784)).astype(np.float32)
    path = mn.export(MLP((784, 64, 10)).eval(), tmp_path / "sg", (x,), device=gpu_device)
    if "subgroup" not in json.loads((path / "manifest.json").read_text())["requires"]["features"]:
        pytest.skip(f"{gpu_device.name} compiles this MLP without subgroups")
    want = BundleSession(path, gpu_device.gpu).run({"x": x})["output"]
    server = serve_in_thread(path, page="run.html")
    try:
        browser.goto(url_of(server))
        if not browser.evaluate(
            "navigator.gpu.requestAdapter().then(a => a.features.has('subgroups'))"
        ):
            pytest.skip("this browser's adapter has no subgroups")
        browser.evaluate("demo.ready")
        got = _bundle_run(browser, {"x": x})["output"]
    finally:
        server.shutdown()
    _close(np.asarray(got).reshape(want.shape), want, "subgroup bundle: browser vs Python runtime")

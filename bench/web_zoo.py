"""Zoo models exported with ``target="web"`` in headless Chromium's WebGPU (SwiftShader):
does every kernel compile under Tint, and do the outputs match the Python runtime's on this
machine's adapter? Prints one row per model: bundle bytes, kernels, load and run time in the
browser, and the largest error relative to the output's scale.

    python bench/web_zoo.py [MODEL ...]      # default: all of ZOO

Needs Debian's chromium (meganeura.web.chromium). Not a test: SwiftShader compiles a
model's pipelines in seconds each.
"""

from __future__ import annotations

import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

import meganeura as mn
from meganeura.runtime.bundle import BundleSession
from meganeura.web.chromium import Chromium
from meganeura.web.server import serve_in_thread, url_of


def _zoo():
    from meganeura.models.bert import BertConfig, BertModel
    from meganeura.models.convnet import ConvNet
    from meganeura.models.mlp import MLP
    from meganeura.models.resnet import ResNet, ResNetConfig
    from meganeura.models.unet import TINY, UNet
    from meganeura.web.demos import byte_lm

    rng = np.random.default_rng(0)

    def f32(*shape):
        return rng.standard_normal(shape).astype(np.float32)

    bert = BertConfig(
        vocab_size=128,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    return {
        "mlp-784-128-10 b64": (lambda: MLP((784, 128, 10)), (f32(64, 784),)),
        "convnet b2": (ConvNet, (f32(2, 1, 28, 28),)),
        "resnet18 w8 32px b1": (
            lambda: ResNet(ResNetConfig("basic", (2, 2, 2, 2), num_classes=10, width=8)),
            (f32(1, 3, 32, 32),),
        ),
        "unet tiny 16px": (lambda: UNet(TINY), (f32(1, 4, 16, 16),)),
        "bert 2x32 s16": (
            lambda: BertModel(bert, add_pooling_layer=False),
            (rng.integers(0, 128, (1, 16)).astype(np.int32),),
        ),
        "byte-lm llama 2x64 s16": (byte_lm, (rng.integers(0, 256, (1, 16)).astype(np.int32),)),
    }


def main(names: list[str]) -> None:
    zoo = _zoo()
    names = names or list(zoo)
    browser = Chromium()
    with tempfile.TemporaryDirectory() as tmp:
        print("| model | bundle bytes | kernels | load ms | run ms | max rel err |")
        print("|---|---|---|---|---|---|")
        for name in names:
            build, inputs = zoo[name]
            mn.manual_seed(0)
            model = build().eval()
            path = Path(tmp) / name.replace(" ", "_")
            try:
                mn.export(model, path, inputs, target="web")
            except Exception as e:  # a model the web target refuses: the message is the row
                print(f"| {name} | export refused: {e} |")
                continue
            man = json.loads((path / "manifest.json").read_text())
            feeds = dict(zip([s["name"] for s in man["inputs"]], inputs, strict=True))
            want = BundleSession(path).run(feeds)
            server = serve_in_thread(path, page="demo.css")
            try:
                browser.goto(url_of(server))
                args = ", ".join(
                    f"{json.dumps(k)}: {'Int32Array' if v.dtype == np.int32 else 'Float32Array'}"
                    f".from({json.dumps(v.reshape(-1).tolist())})"
                    for k, v in feeds.items()
                )
                r = browser.evaluate(
                    "import('/meganeura.js').then(async m => {"
                    " let t = performance.now(); const b = await m.loadBundle('/bundle/');"
                    " const load = performance.now() - t; await b.run({" + args + "});"
                    " t = performance.now(); const o = await b.run({" + args + "});"
                    " const run = performance.now() - t;"
                    " return {load, run, out: Object.fromEntries(Object.entries(o)"
                    ".map(([k, v]) => [k, Array.from(v)]))}; })",
                    timeout=600,
                )
            except Exception as e:
                killed = [x for x in browser.console if x.startswith("killed")]
                why = killed[-1] if killed else str(e).splitlines()[0][:300]
                print(f"| {name} | browser failed: {why} |", flush=True)
                browser.close()
                browser = Chromium()  # a fresh one: the GPU process may be gone
                continue
            finally:
                server.shutdown()
            err = max(
                float(np.abs(np.asarray(r["out"][k]).reshape(v.shape) - v).max())
                / max(float(np.abs(v).max()), 1e-30)
                for k, v in want.items()
            )
            size = sum(p.stat().st_size for p in path.rglob("*") if p.is_file())
            print(
                f"| {name} | {size:,} | {len(man['kernels'])} | {r['load']:,.0f} | "
                f"{r['run']:,.1f} | {err:.1e} |",
                flush=True,
            )
    browser.close()


if __name__ == "__main__":
    t0 = time.time()
    main(sys.argv[1:])
    print(f"({time.time() - t0:.0f} s)")

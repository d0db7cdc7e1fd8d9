"""``meganeura serve-web``: the URL layout of the local server (the page for the bundle's
model, meganeura.js as JavaScript, the bundle's files, nothing else of the package or the
disk), and the command, which prints the page's URL and serves it. No browser, no GPU."""

from __future__ import annotations

import http.client
import json
import os
import re
import subprocess
import sys
import urllib.request
from pathlib import Path

from meganeura.cli import main
from meganeura.web.server import page_for, serve_in_thread

REPO = Path(__file__).resolve().parents[2]


def _bundle(folder: Path, model: str | None) -> Path:
    """A folder with just a manifest: all the server reads."""
    folder.mkdir()
    meta = {"model": model} if model else {}
    (folder / "manifest.json").write_text(
        json.dumps({"schema": "meganeura-bundle/1", "meta": meta})
    )
    (folder / "weights.safetensors").write_bytes(b"\x08" + bytes(15))
    return folder


def _get(port: int, path: str):
    c = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    c.request("GET", path)  # sent as written: no client-side normalization of ".."
    r = c.getresponse()
    out = r.status, r.headers, r.read()  # headers: case-insensitive lookup
    c.close()
    return out


def test_server_url_layout(tmp_path):
    bundle = _bundle(tmp_path / "b", "mnist-mlp")
    assert page_for(bundle) == "digit.html"
    assert page_for(_bundle(tmp_path / "lm", "byte-lm")) == "text.html"
    assert page_for(_bundle(tmp_path / "other", None)) == "run.html"
    (tmp_path / "secret.txt").write_text("secret")
    server = serve_in_thread(bundle)
    port = server.server_port
    try:
        status, head, _ = _get(port, "/")
        assert (status, head["Location"]) == (302, "/digit.html")
        status, head, body = _get(port, "/meganeura.js")
        assert status == 200 and head["Content-Type"] == "text/javascript"
        assert b"export async function loadBundle" in body and head["Cache-Control"] == "no-store"
        status, _, body = _get(port, "/digit.html")
        assert status == 200 and b"import { loadBundle" in body
        status, _, body = _get(port, "/bundle/manifest.json")
        assert status == 200 and json.loads(body)["meta"]["model"] == "mnist-mlp"
        status, head, body = _get(port, "/bundle/weights.safetensors")
        assert status == 200 and head["Content-Type"] == "application/octet-stream"
        for path in (
            "/server.py",
            "/bundle/../secret.txt",
            "/bundle/%2e%2e/secret.txt",
            "/../../etc/passwd",
            "/bundle/",
        ):
            status, _, body = _get(port, path)
            assert status == 404 and b"secret" not in body, path
    finally:
        server.shutdown()
        server.server_close()


def test_serve_web_prints_url_and_serves(tmp_path, capsys):
    bundle = _bundle(tmp_path / "b", "mnist-mlp")
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    cmd = [sys.executable, "-m", "meganeura", "serve-web", str(bundle), "--port", "0"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True, env=env, cwd=tmp_path)
    try:
        line = proc.stdout.readline()
        m = re.search(r"at (http://127\.0\.0\.1:\d+/digit\.html) ", line)
        assert m, line
        with urllib.request.urlopen(m.group(1), timeout=10) as r:
            assert r.status == 200 and b"Draw a digit" in r.read()
    finally:
        proc.terminate()
        proc.wait(10)
    assert main(["serve-web", str(tmp_path / "nope")]) == 2
    assert "no manifest.json" in capsys.readouterr().err
    assert main(["serve-web"]) == 2
    assert "BUNDLE folder or --demo-lm" in capsys.readouterr().err

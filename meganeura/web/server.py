"""``meganeura serve-web BUNDLE``: serve a bundle, ``meganeura.js`` and the demo pages on
127.0.0.1 with the standard library's ``http.server``.

URL layout::

    /                 redirects to the page for the bundle (page_for: by the manifest's meta)
    /<page>.html, /meganeura.js     the package's static files (meganeura/web/)
    /bundle/...       the bundle folder (manifest.json, kernels/*.wgsl, weights.safetensors)

WebGPU needs a secure context: ``http://127.0.0.1`` and ``http://localhost`` are one, other
plain-http hosts are not, so the default host is 127.0.0.1. Responses carry
``Cache-Control: no-store`` so a re-exported bundle is never mixed with a cached one.
"""

from __future__ import annotations

import http.server
import json
import posixpath
import signal
import threading
import urllib.parse
from pathlib import Path

from . import STATIC

# Static files a page may fetch (the package folder also holds this module's .py files).
STATIC_SUFFIXES = {".html", ".js", ".css", ".png", ".ico"}
PAGES = {"mnist-mlp": "digit.html", "byte-lm": "text.html"}
TYPES = {
    ".js": "text/javascript",
    ".html": "text/html; charset=utf-8",
    ".css": "text/css",
    ".json": "application/json",
    ".wgsl": "text/plain; charset=utf-8",
    ".safetensors": "application/octet-stream",
    ".png": "image/png",
}


def page_for(bundle: str | Path) -> str:
    """The demo page for a bundle: ``digit.html`` for an MNIST MLP (``meganeura export``),
    ``text.html`` for a byte-level LM (``export_byte_lm``), else ``run.html`` (runs any bundle
    on zeros and shows its outputs).

    Raises:
        FileNotFoundError: no ``manifest.json`` in ``bundle``.
    """
    manifest = json.loads((Path(bundle) / "manifest.json").read_bytes())
    return PAGES.get(manifest.get("meta", {}).get("model"), "run.html")


class _Handler(http.server.SimpleHTTPRequestHandler):
    bundle: Path
    page: str
    quiet: bool

    def translate_path(self, path: str) -> str:
        path = urllib.parse.unquote(urllib.parse.urlsplit(path).path)
        parts = [p for p in posixpath.normpath(path).split("/") if p not in ("", ".", "..")]
        if parts[:1] == ["bundle"]:
            return str(self.bundle.joinpath(*parts[1:]))
        if len(parts) == 1 and Path(parts[0]).suffix in STATIC_SUFFIXES:
            return str(STATIC / parts[0])
        return str(STATIC / "__nothing__")  # 404

    def do_GET(self) -> None:
        if urllib.parse.urlsplit(self.path).path == "/":
            self.send_response(302)
            self.send_header("Location", f"/{self.page}")
            self.end_headers()
            return
        super().do_GET()

    def guess_type(self, path) -> str:
        return TYPES.get(Path(path).suffix, "application/octet-stream")

    def end_headers(self) -> None:
        self.send_header("Cache-Control", "no-store")
        super().end_headers()

    def list_directory(self, path):
        self.send_error(404, "No directory listings")
        return None

    def log_message(self, format, *args) -> None:
        if not self.quiet:
            super().log_message(format, *args)


def make_server(
    bundle: str | Path,
    host: str = "127.0.0.1",
    port: int = 8000,
    page: str | None = None,
    quiet: bool = False,
) -> http.server.ThreadingHTTPServer:
    """A server (not yet serving) for ``bundle``; ``port=0`` picks a free port
    (``server.server_port``).

    Raises:
        FileNotFoundError: ``bundle`` has no ``manifest.json``.
        OSError: the address is in use.
    """
    bundle = Path(bundle).resolve()
    if not (bundle / "manifest.json").is_file():
        raise FileNotFoundError(f"{bundle}: no manifest.json (not a bundle folder)")
    attrs = {"bundle": bundle, "page": page or page_for(bundle), "quiet": quiet}
    handler = type("Handler", (_Handler,), attrs)
    server = http.server.ThreadingHTTPServer((host, port), handler)
    server.page = attrs["page"]
    return server


def url_of(server: http.server.ThreadingHTTPServer, page: str | None = None) -> str:
    """The URL a browser opens for ``server`` (its page by default)."""
    host, port = server.server_address[:2]
    host = f"[{host}]" if ":" in host else host
    return f"http://{host}:{port}/{page or server.page}"


def serve_in_thread(bundle: str | Path, **kw) -> http.server.ThreadingHTTPServer:
    """Start :func:`make_server` (port 0 by default) on a daemon thread; ``shutdown()`` stops
    it. For tests and scripts."""
    kw.setdefault("port", 0)
    kw.setdefault("quiet", True)
    server = make_server(bundle, **kw)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def serve_web(
    bundle: str | Path | None,
    host: str = "127.0.0.1",
    port: int = 8000,
    demo_lm: bool = False,
    out=print,
) -> None:
    """Serve ``bundle`` (or, with ``demo_lm``, a freshly exported :func:`demos.byte_lm`) until
    interrupted; print the page's URL first (through ``out``), then one line per request.

    Raises:
        FileNotFoundError: ``bundle`` is not a bundle folder.
        OSError: the address is in use.
        ValueError: neither or both of ``bundle`` and ``demo_lm``.
    """
    import tempfile

    if (bundle is None) == (not demo_lm):
        raise ValueError("give a BUNDLE folder or --demo-lm (one of them)")
    with tempfile.TemporaryDirectory(prefix="meganeura-web-") as tmp:
        if demo_lm:
            from .demos import export_byte_lm

            bundle = export_byte_lm(Path(tmp) / "byte-lm")
        server = make_server(bundle, host, port)
        if host not in ("127.0.0.1", "localhost", "::1"):
            out(
                f"note: browsers give WebGPU only to secure contexts; http://{host} is not one "
                "(use 127.0.0.1, an SSH tunnel, or https)"
            )
        out(f"serving {Path(bundle).resolve()} at {url_of(server)} (Ctrl-C stops)", flush=True)
        previous = _stop_on_sigterm()
        try:
            server.serve_forever()
        except KeyboardInterrupt:
            pass
        finally:
            server.server_close()
            if previous is not None:
                signal.signal(signal.SIGTERM, previous)


def _stop_on_sigterm():
    """Make SIGTERM (``kill``, ``timeout``) stop the server as Ctrl-C does, so the temporary
    folder is removed; returns the previous handler (None off the main thread, where Python
    cannot set one)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def stop(_signum, _frame):
        raise KeyboardInterrupt

    return signal.signal(signal.SIGTERM, stop)

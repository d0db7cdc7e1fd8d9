"""The browser side of bundles (docs/web.md): ``meganeura.js`` (an ES module that runs a bundle
through ``navigator.gpu``), the demo pages, and the local server of ``meganeura serve-web``.

The ``.js``/``.html`` files ship as package data; :data:`STATIC` is their folder.
"""

from pathlib import Path

STATIC = Path(__file__).parent

__all__ = ["STATIC"]

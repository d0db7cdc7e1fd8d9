"""Lazy imports of the optional packages behind the ``llm`` extra (gguf, tokenizers, jinja2).

meganeura's core needs none of them, so the loaders import them only when called, and a missing
one becomes an ImportError that names the package and the extra that installs it.
"""

from __future__ import annotations

import importlib
from types import ModuleType


def require(module: str, package: str | None = None) -> ModuleType:
    """Import ``module``, or raise an ImportError that says how to install it.

    Args:
        module: the module to import, e.g. ``"gguf"`` or ``"tokenizers.pre_tokenizers"``.
        package: the PyPI name when it differs from the module's top-level name.

    Raises:
        ImportError: the package is not installed; the message says ``pip install meganeura[llm]``.
    """
    try:
        return importlib.import_module(module)
    except ImportError as e:
        name = package or module.split(".")[0]
        raise ImportError(
            f"this loader needs the {name!r} package, which is not installed: "
            f"pip install meganeura[llm]  (or pip install {name})"
        ) from e

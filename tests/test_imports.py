"""Only the runtime may import wgpu: everything before it must be testable without a GPU."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "meganeura"


def _imports_wgpu(tree: ast.AST) -> list[int]:
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0:
            names = [node.module or ""]
        else:
            continue
        if any(n == "wgpu" or n.startswith("wgpu.") for n in names):
            lines.append(node.lineno)
    return lines


def test_only_runtime_imports_wgpu():
    files = sorted(PACKAGE.rglob("*.py"))
    assert PACKAGE / "runtime" / "session.py" in files
    offenders = []
    for path in files:
        rel = path.relative_to(PACKAGE)
        if rel.parts[0] == "runtime":
            continue
        lines = _imports_wgpu(ast.parse(path.read_text(encoding="utf-8"), filename=str(path)))
        offenders += [f"meganeura/{rel.as_posix()}:{n}" for n in lines]
    assert not offenders, f"wgpu imported outside meganeura/runtime/: {offenders}"


def test_the_scan_sees_runtime_imports():
    # Guards against a scan that silently finds nothing.
    tree = ast.parse((PACKAGE / "runtime" / "session.py").read_text(encoding="utf-8"))
    assert _imports_wgpu(tree)
    assert _imports_wgpu(ast.parse("import wgpu.utils as u\nfrom wgpu import gpu\n")) == [1, 2]

"""Export: inference programs as self-contained bundles (docs/export.md).

``mn.export(model, "bundle/", example_inputs=(x,))`` writes a folder with a JSON manifest, the
WGSL of every kernel and the weights; ``meganeura.runtime.bundle.BundleSession`` runs it with
only wgpu and NumPy.
"""

from .bundle import export, trace_program, write_bundle
from .manifest import SCHEMA, ExportError, requirements

__all__ = ["SCHEMA", "ExportError", "export", "requirements", "trace_program", "write_bundle"]

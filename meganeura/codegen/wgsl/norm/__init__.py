"""Normalizations: the lowering (``lowering``) asks the team archetype first (``team``) and
falls back to general kernels over the index maps of ``layout``."""

"""Shared by every emitter: the kernel builder, literals, index math, the WGSL math library."""

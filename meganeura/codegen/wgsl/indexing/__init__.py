"""Copies (slice, pad, cat: ``copies``) and integer-index gathers with their deterministic
scatter-add backward (``gather``)."""

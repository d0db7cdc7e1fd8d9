"""The property-based fuzzer (issue 11): random small programs over the op set, run on the
GPU fused and unfused, strict and fast, and through the NumPy interpreter, against torch
float64, forward and gradients. ``programs.py`` draws them, ``check.py`` runs and compares
them; ``test_fuzz.py`` holds the hypothesis tests and ``test_found.py``
the counterexamples found so far. docs/testing.md says how to run it longer.
"""

"""Reductions over any set of dims (``reductions``) and prefix sums (``scan``)."""

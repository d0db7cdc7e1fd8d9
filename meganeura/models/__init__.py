"""Model definitions used by the CLI, tests and benchmarks."""

"""The paper's five-workload evaluation (issue 14, ``docs/workloads.md``): workload definitions,
deterministic weights, correctness gates, one-configuration child processes and the parent that
collects them. ``bench/workloads.py`` is the command line."""

"""Row kernels: the general row-parallel scaffolding (``rows``), the team-per-row archetype
(``team``), and softmax, log_softmax and cross-entropy (``softmax``)."""

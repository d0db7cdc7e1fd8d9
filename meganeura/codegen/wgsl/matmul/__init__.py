"""Matmul kernels: plan choice (``plan``, ``tuned``), operand layout (``problem``), the
lowering with split-K (``lowering``), and the two kernels (``tiled``, ``gemv``)."""

"""Convolution as implicit GEMM (``lowering`` describes the operands, ``gemm`` emits the
kernel) and pooling (``pool``)."""

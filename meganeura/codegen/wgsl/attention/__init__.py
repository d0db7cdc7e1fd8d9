"""Flash-attention kernels: work plans (``plan``), the lane kernel (``lane``), the
register-tiled block kernel (``block``), the lowering (``lowering``) and rotary embedding
(``rope``)."""

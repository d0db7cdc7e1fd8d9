"""Flash-attention kernels: work plans (``plan``), the lane kernel (``lane``, its stream loop
and lane merge ``lane_stream``), the register-tiled block kernel (``block``), helpers they share
(``common``), the lowering (``lowering``) and rotary embedding (``rope``)."""

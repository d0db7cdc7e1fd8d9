"""0-d parameters and buffers keep shape () on the host, through ``copy_`` and once shared on
the GPU (a scalar Buffer holds the trainer's loss accumulator; a 0-d Parameter a learned scale)."""

from __future__ import annotations

import numpy as np
import pytest

from meganeura.nn import Buffer, Module, Parameter


def test_host_values_keep_shape_scalar():
    p = Parameter(np.float32(0.5))
    b = Buffer(np.zeros((), np.float32))
    assert p.shape == p.data.shape == () and b.shape == b.data.shape == ()
    p.copy_(np.float64(2.0))
    assert p.data.shape == () and p.data == np.float32(2.0)


class Scale(Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = Parameter(np.float32(3.0))

    def forward(self, x):
        return x * self.scale


@pytest.mark.gpu
def test_a_scalar_parameter_is_shared_on_the_gpu(gpu_device):
    m = Scale()
    out = m(np.ones(4, np.float32))
    np.testing.assert_array_equal(out, np.full(4, 3.0, np.float32))
    assert m.scale.data.shape == ()
    m.scale.data = np.float32(-1.0)  # written on the GPU now
    np.testing.assert_array_equal(m(np.ones(4, np.float32)), np.full(4, -1.0, np.float32))

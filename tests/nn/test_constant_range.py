"""Float constants beyond float32's range (issue 11, item 10a), as PyTorch treats them: in
arithmetic and in ``tensor`` they become inf (``x * 1e39``, ``torch.tensor(1e39)``); as the fill
value of ``full``, ``masked_fill``, ``clamp`` and ``pad`` they are refused ("cannot be converted
to type float without overflow" in PyTorch), here with the call and the user's line."""

from __future__ import annotations

import warnings

import numpy as np
import pytest
import torch

import meganeura as mn
import meganeura.nn.functional as F
from meganeura.nn import Module

X = np.array([[1.0, -2.0, 3.0], [0.5, 4.0, -1.0]], np.float32)

REFUSED = {
    "full": (lambda x: x + mn.full((2, 3), 1e39), lambda t: torch.full((2, 3), 1e39)),
    "masked_fill": (
        lambda x: x.masked_fill(x > 2, -1e39),
        lambda t: t.masked_fill(t > 2, -1e39),
    ),
    "clamp": (lambda x: x.clamp(max=1e39), lambda t: t.clamp(max=1e39)),
    "pad": (
        lambda x: F.pad(x, (1, 1), value=1e39),
        lambda t: torch.nn.functional.pad(t, (1, 1), value=1e39),
    ),
}

ACCEPTED = {  # the same calls with inf, and arithmetic and tensor() with 1e39
    "full": (
        lambda x: x + mn.full((2, 3), float("inf")),
        lambda t: t + torch.full((2, 3), float("inf")),
    ),
    "masked_fill": (
        lambda x: x.masked_fill(x > 2, -float("inf")),
        lambda t: t.masked_fill(t > 2, -float("inf")),
    ),
    "clamp": (lambda x: x.clamp(max=float("inf")), lambda t: t.clamp(max=float("inf"))),
    # pad(value=-inf/nan) was refused by the pad op's type rule (issue 11, item 2)
    "pad_neginf": (
        lambda x: F.pad(x, (1, 2), value=-float("inf")),
        lambda t: torch.nn.functional.pad(t, (1, 2), value=-float("inf")),
    ),
    "pad_nan": (
        lambda x: F.pad(x, (0, 1, 1, 0), value=float("nan")),
        lambda t: torch.nn.functional.pad(t, (0, 1, 1, 0), value=float("nan")),
    ),
    "mul": (lambda x: x * 1e39, lambda t: t * 1e39),
    "sub": (lambda x: x - 1e39, lambda t: t - 1e39),
    "tensor": (
        lambda x: x + mn.tensor([1e39, 0.0, -1e39]),
        lambda t: t + torch.tensor([1e39, 0.0, -1e39]),
    ),
}


class Fn(Module):
    def __init__(self, fn) -> None:
        super().__init__()
        self.fn = fn

    def forward(self, x):
        return self.fn(x)


@pytest.mark.parametrize("case", list(REFUSED))
def test_an_overflowing_fill_value_is_refused_naming_the_call_and_line(case):
    ours, theirs = REFUSED[case]
    with pytest.raises(RuntimeError, match="without overflow"):
        theirs(torch.from_numpy(X.copy()))
    with pytest.raises(ValueError) as info:
        mn.nn.trace(Fn(ours), X)
    message = str(info.value)
    assert message.startswith(f"{case}(") and "test_constant_range.py:" in message
    assert "1e+39 cannot be converted to f32 without overflow" in message
    assert "largest finite f32 is 3.4028235e+38" in message


@pytest.mark.gpu
@pytest.mark.parametrize("case", list(ACCEPTED))
def test_infinite_constants_match_torch(gpu_device, case):
    ours, theirs = ACCEPTED[case]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # no NumPy overflow warning either
        out = Fn(ours)(X)
    ref = theirs(torch.from_numpy(X.copy())).numpy()
    assert out.dtype == np.float32 and out.shape == ref.shape
    # by bit pattern: inf and -inf where torch has them
    np.testing.assert_array_equal(out.view(np.uint32), ref.astype(np.float32).view(np.uint32))

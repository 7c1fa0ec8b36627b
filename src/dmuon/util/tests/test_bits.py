"""bitwise_equal against an element-by-element comparison of the raw bits; bits_differ, its tensor
form kept on the device, against bitwise_equal."""

from __future__ import annotations

import pytest
import torch

from dmuon.bench.op_count import HostReadCounter
from dmuon.util.bits import any_bits_differ, bits_differ, bitwise_equal


def _bits(t: torch.Tensor) -> list[int]:
    # The reference: every element's bit pattern, one by one (uint8 views tile every dtype).
    return t.contiguous().reshape(-1).view(torch.uint8).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.float64])
@pytest.mark.parametrize("numel", [1, 3, 4, 7, 8, 49152, 49153])
@pytest.mark.parametrize("offset", [0, 1, 3])
def test_agrees_with_the_raw_bits(dtype, numel, offset):
    gen = torch.Generator().manual_seed(numel + offset)
    base = torch.randn(numel + offset, generator=gen).to(dtype)
    a = base[offset:]  # a storage offset that is not word-aligned
    same = a.clone()
    assert bitwise_equal(a, same) and _bits(a) == _bits(same)
    for where in (0, numel // 2, numel - 1):
        other = a.clone()
        other[where] = -other[where] if other[where] != 0 else 1.0
        assert not bitwise_equal(a, other) and _bits(a) != _bits(other)
        assert bits_differ(a, other).item() and not bits_differ(a, same).item()


def test_signed_zero_and_nan_follow_the_bits_not_the_values():
    zero, negative_zero = torch.zeros(4, dtype=torch.bfloat16), -torch.zeros(4, dtype=torch.bfloat16)
    assert torch.equal(zero, negative_zero) and not bitwise_equal(zero, negative_zero)
    nan = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    assert not torch.equal(nan, nan.clone()) and bitwise_equal(nan, nan.clone())


def test_shape_dtype_and_layout():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    assert not bitwise_equal(x, x.reshape(4, 3))
    assert not bitwise_equal(x, x.to(torch.float64))
    assert bitwise_equal(x.T, x.T.contiguous())  # non-contiguous compared by value layout
    assert not bitwise_equal(x.T, x.reshape(4, 3))


def test_the_tensor_form_is_the_negation_of_bitwise_equal_and_reads_nothing_to_the_host():
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    nan = torch.full((4,), float("nan"), dtype=torch.bfloat16)
    cases = [(x, x.clone()), (x, x.reshape(4, 3)), (x, x.to(torch.float64)), (x.T, x.T.contiguous()),
             (torch.zeros(4), -torch.zeros(4)), (nan, nan.clone()), (torch.zeros(0), torch.zeros(0)),
             (x[:, 1:], x[:, 1:] + 1)]
    reads = HostReadCounter()
    with reads:
        flags = [bits_differ(a, b) for a, b in cases]
        some = any_bits_differ(cases[:1] + cases[3:4], "cpu"), any_bits_differ(cases, "cpu"), any_bits_differ([], "cpu")
    assert reads.count == 0
    assert all(f.dtype == torch.bool and f.dim() == 0 for f in flags + list(some))
    assert [bool(f) for f in flags] == [not bitwise_equal(a, b) for a, b in cases]
    assert [bool(f) for f in some] == [False, True, False]

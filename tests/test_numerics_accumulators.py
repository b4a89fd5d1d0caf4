"""K-lane accumulators: seed 001's numbers, and every step against an exact-rational reference."""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from ddplab.numerics import float_format, lane_norm, lane_partials, lane_sum, lane_sum_of_squares, running_sum_of_squares
from test_numerics_exact import fraction_round


@pytest.fixture(scope="module")
def seed001_weight():
    torch.manual_seed(42)
    return torch.nn.Linear(512, 512, bias=False, dtype=torch.float16).weight.detach()


def test_seed001_norms_are_reproduced_exactly(seed001_weight):
    norms = [lane_norm(seed001_weight, torch.float16, lanes=k).item() for k in (1, 2, 4, 8, 16, 32)]
    assert norms == [2.0, 2.828125, 4.0, 5.65625, 8.0, 11.3125]
    assert lane_partials(seed001_weight, torch.float16, 8, square=True).tolist() == [4.0] * 8
    true_norm = seed001_weight.double().norm().item()
    assert abs(true_norm - 13.08) < 0.01
    assert abs(lane_norm(seed001_weight, torch.float64, lanes=8).item() - true_norm) < 1e-12
    # float32 accumulation does not stall: a few float32 ulps of error at most.
    assert abs(lane_norm(seed001_weight, torch.float32, lanes=8).item() - true_norm) < 1e-5 * true_norm


def test_running_sum_of_squares_shows_the_stall(seed001_weight):
    running = running_sum_of_squares(seed001_weight, torch.float16, lanes=1)
    assert running.shape == (512 * 512, 1) and running.dtype == torch.float16
    lane = running[:, 0].double()
    assert bool((lane[1:] >= lane[:-1]).all())
    first_four = int((lane == 4.0).nonzero()[0])
    assert first_four < 10_000 and bool((lane[first_four:] == 4.0).all())   # stalled for good, early
    eight = running_sum_of_squares(seed001_weight, torch.float16, lanes=8)
    assert eight.shape == (512 * 512 // 8, 8) and eight[-1].tolist() == [4.0] * 8
    odd = running_sum_of_squares(torch.ones(10, dtype=torch.float16), lanes=4)
    assert odd.shape == (3, 4) and odd[-1].tolist() == [3.0, 3.0, 2.0, 2.0]


def reference_lanes(values, dtype, lanes, square):
    fmt = float_format(dtype)
    rn = lambda q: fraction_round(q, fmt)   # noqa: E731
    acc = [0.0] * lanes
    for i, v in enumerate(values):
        if square:
            v = rn(Fraction(v) * Fraction(v))
        acc[i % lanes] = rn(Fraction(acc[i % lanes]) + Fraction(v))
    total = acc[0]
    for a in acc[1:]:
        total = rn(Fraction(total) + Fraction(a))
    return acc, total


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32, torch.float64], ids=str)
def test_lanes_match_an_exact_rational_reference(dtype):
    g = torch.Generator().manual_seed(1)
    # Scales that keep float16 squares finite (the reference is exact rationals, no inf).
    x = (torch.randn(301, generator=g, dtype=torch.float64) * torch.exp2(torch.randint(-8, 3, (301,), generator=g))).to(dtype)
    values = x.to(torch.float64).tolist()
    for lanes in (1, 3, 8):
        for square in (False, True):
            acc, total = reference_lanes(values, dtype, lanes, square)
            assert lane_partials(x, dtype, lanes, square=square).to(torch.float64).tolist() == acc
            got = (lane_sum_of_squares if square else lane_sum)(x, dtype, lanes)
            assert got.dtype == dtype and got.item() == total
    fmt = float_format(dtype)
    _, squares = reference_lanes(values, dtype, 4, True)
    want = fraction_round(Fraction(math.sqrt(squares)), fmt) if dtype != torch.float64 else math.sqrt(squares)
    assert lane_norm(x, dtype, 4).item() == want


def test_input_is_converted_to_the_dtype_first_and_bad_input_is_rejected():
    x = torch.tensor([1.0, 2.0 ** -12, 2.0 ** -12])
    assert lane_sum(x, torch.float16).item() == 1.0            # 1 + 2^-12 rounds back to 1 in float16
    assert lane_sum(x).item() == 1.0 + 2.0 ** -11
    with pytest.raises(ValueError, match="lanes"):
        lane_sum(x, lanes=0)
    with pytest.raises(ValueError, match="at least one"):
        lane_norm(torch.empty(0))
    with pytest.raises(ValueError, match="dtype"):
        lane_sum(x, "int8")

"""The int64 fixed-point reduction: bitwise order independence and its measured precision."""
from __future__ import annotations

import pytest
import torch

from ddplab.numerics import (ORDERS, as_contributions, dequantize, exact_parts, exact_sum, exponents, float_format,
                             lossless_binades, measure, quantize, reduce, reproducible_sum, scale_exponent,
                             world_bits)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
IDS = lambda d: str(d).split(".")[-1]   # noqa: E731
EMULATED = [o for o in ORDERS if o != "exact"]


def data(w, n, dtype, seed, spread=4):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, (w, n), generator=g).to(torch.float64))
    return (torch.randn(w, n, generator=g, dtype=torch.float64) * scale).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_bitwise_identical_across_orders_and_rank_permutations(dtype):
    for w in (2, 3, 5, 8):
        x = data(w, 2000, dtype, seed=w)
        for block_size in (1, 64, None):
            want = reproducible_sum(x, "gloo_ring", block_size=block_size)
            bits = float_format(dtype).int_dtype
            for order in EMULATED:
                assert torch.equal(reproducible_sum(x, order, block_size=block_size).view(bits), want.view(bits))
            for seed in range(3):
                perm = torch.randperm(w, generator=torch.Generator().manual_seed(seed))
                got = reproducible_sum(x[perm], "nccl_ring", block_size=block_size)
                assert torch.equal(got.view(bits), want.view(bits))
        # ... while the plain float orders disagree with each other.
        if w > 2:
            assert not torch.equal(reduce(x, "gloo_ring"), reduce(x, "sequential"))


def test_callable_sources_reduce_the_same_integers():
    x = data(6, 3001, torch.float32, seed=1)
    rows = as_contributions(lambda r: x[r].clone(), world_size=6)
    slices = as_contributions(lambda r, a, b: x[r, a:b].clone(), world_size=6, numel=3001)
    want = reproducible_sum(x)
    assert torch.equal(reproducible_sum(rows, "pairwise"), want)
    assert torch.equal(reproducible_sum(slices, "nccl_tree"), want)
    for source in (rows, slices):
        shuffled = source.permuted([3, 5, 0, 1, 4, 2])
        assert torch.equal(shuffled.row(0), x[3]) and torch.equal(shuffled.columns(7, 9), x[[3, 5, 0, 1, 4, 2], 7:9])
        assert torch.equal(reproducible_sum(shuffled, "gloo_ring"), want)
        assert not torch.equal(reduce(shuffled, "gloo_ring"), reduce(x, "gloo_ring"))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=IDS)
def test_per_element_exponents_give_the_correctly_rounded_sum(dtype):
    # docs/numerics.md: correctly rounded in 100% of elements, where plain gloo is not.
    x = data(8, 20_000, dtype, seed=2)
    fixed = measure(reproducible_sum(x), x)
    assert fixed["frac_correctly_rounded"] == 1.0 and torch.equal(reproducible_sum(x), exact_sum(x))
    assert measure(reduce(x, "gloo_ring"), x)["frac_correctly_rounded"] < 0.95


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_quantization_error_is_within_half_a_grid_step_per_rank(dtype):
    # float64 has 53 of the 62 bits: with W=8 only 6 binades below an element's
    # largest contribution stay exact, so it is not always correctly rounded,
    # but the error never exceeds W half-steps of the grid 2^-k plus the final rounding.
    w = 8
    x = data(w, 5000, dtype, seed=3)
    e = torch.stack([exponents(x[r]) for r in range(w)]).amax(0).to(torch.float64)
    step = torch.exp2(-scale_exponent(e, w).to(torch.float64))
    got = reproducible_sum(x).to(torch.float64)
    fmt = float_format(dtype)
    hi, lo = exact_parts(x)
    err = ((got - hi) - lo).abs()
    assert bool((err <= w * step / 2 + fmt.u * got.abs() + fmt.smallest_subnormal / 2).all())
    if dtype == torch.float64:
        assert measure(reproducible_sum(x), x)["frac_correctly_rounded"] < 1.0


def test_one_exponent_per_tensor_loses_the_small_elements():
    # Elements spanning 2^-40 .. 2^4: with one exponent per tensor the grid is set by the
    # largest, and elements far below it lose bits, well beyond what rounding explains.
    g = torch.Generator().manual_seed(3)
    scale = torch.exp2(torch.linspace(-40, 4, 4000, dtype=torch.float64))
    x = (torch.randn(4, 4000, generator=g, dtype=torch.float64) * scale).float()
    exact = exact_sum(x)
    per_tensor = reproducible_sum(x, block_size=None)
    wrong = (per_tensor != exact).nonzero().flatten()
    assert wrong.numel() > 400 and wrong.max().item() < 2000          # only the small elements
    m = measure(per_tensor, x, "gloo_ring")
    assert m["classification"] == "not rounding" and m["max_bound_ratio"] > 10
    assert torch.equal(reproducible_sum(x, block_size=64), exact)    # small blocks of similar values
    assert torch.equal(reproducible_sum(x, block_size=1), exact)


def test_quantize_and_dequantize():
    x = torch.tensor([3.0, -0.75, 0.0, 2.0 ** -30])
    e = exponents(x)
    assert e.tolist() == [2, 0, float_format(torch.float32).emin - 24 + 2, -29]
    assert world_bits(1) == 0 and world_bits(2) == 1 and world_bits(5) == 3 and world_bits(8) == 3
    k = scale_exponent(e, 8)
    assert k.tolist() == [62 - 3 - 2, 59, 59 - e[2].item(), 59 + 29]
    q = quantize(x, e, 8)
    assert q.dtype == torch.int64 and bool((q.abs() < 2 ** 59).all())
    assert torch.equal(dequantize(q, e, 8, torch.float32), x)
    # Ties to even when a value falls between grid points: 1 + 2^-60 on a grid of 2^-59.
    one = torch.tensor([1.0 + 2.0 ** -52, 1.0], dtype=torch.float64)
    e1 = torch.tensor([1, 1])
    assert quantize(one, e1, 8).tolist() == [2 ** 58 + 2 ** 6, 2 ** 58]
    blocks = exponents(torch.tensor([1.0, 100.0, 0.5, 0.25, 0.0]), block_size=2)
    assert blocks.tolist() == [7, 0, -148]
    assert torch.equal(quantize(torch.tensor([1.0, 100.0, 0.5]), blocks[:2], 4, block_size=2),
                       quantize(torch.tensor([1.0, 100.0, 0.5]), torch.tensor([7, 7, 0]), 4))


def test_lossless_binades_is_where_quantization_stays_exact():
    w, dtype = 8, torch.float32
    span = lossless_binades(dtype, w)
    assert span == 62 - 3 - 24
    big = torch.tensor([1.5])                     # binade 0
    e = exponents(big)
    for binades_below, exact in ((span, True), (span + 1, False)):
        small = torch.tensor([(1.0 + 2.0 ** -23) * 2.0 ** -binades_below])   # all 24 bits used
        q = quantize(small, e, w)
        back = dequantize(q, e, w, torch.float64)
        assert (back.item() == small.item()) is exact


def test_bad_input():
    with pytest.raises(ValueError, match="finite"):
        reproducible_sum(torch.tensor([[1.0, float("inf")], [1.0, 2.0]]))
    with pytest.raises(ValueError, match="exact"):
        reproducible_sum(torch.ones(2, 3), "exact")
    with pytest.raises(ValueError, match="int64"):
        dequantize(torch.ones(3), torch.zeros(3), 2, torch.float32)
    with pytest.raises(ValueError, match="do not match"):
        quantize(torch.ones(5), torch.zeros(2), 2, block_size=2)
    with pytest.raises(ValueError, match="world_size"):
        world_bits(0)

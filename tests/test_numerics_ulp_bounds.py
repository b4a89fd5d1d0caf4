"""ulp distances, the rounding-error bounds, and the measure/verdict built on them."""
from __future__ import annotations

import math

import pytest
import torch

from ddplab.numerics import (METRICS, ORDERS, abs_sum, classify, error_records, exact_parts, exact_sum,
                             float_format, gamma, gloo_ring_segments, measure, order_depth, pair_bound, reduce, rounding_bound,
                             ulp, ulp_distance, unit_roundoff)
from ddplab.records import to_frame

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
IDS = lambda d: str(d).split(".")[-1]   # noqa: E731


# --------------------------------------------------------------------------- ulp distance


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=IDS)
def test_ulp_distance_counts_every_16_bit_float_between(dtype):
    # Every bit pattern, sorted by value: neighbours are 1 ulp apart, anything is
    # its rank difference apart, across zero and signs included.
    values = torch.arange(-(1 << 15), 1 << 15, dtype=torch.int32).to(torch.int16).view(dtype)
    values = values[~torch.isnan(values)]
    ordered = torch.sort(values.to(torch.float64)).values.unique_consecutive()   # -0 and +0 merge
    ordered = ordered.to(dtype)
    steps = ulp_distance(ordered[1:], ordered[:-1])
    assert bool((steps == 1).all())
    idx = torch.randint(0, ordered.numel(), (2, 5000), generator=torch.Generator().manual_seed(0))
    assert torch.equal(ulp_distance(ordered[idx[0]], ordered[idx[1]]), idx[0] - idx[1])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=IDS)
def test_ulp_distance_agrees_with_nextafter_stepping_across_zero(dtype):
    fmt = float_format(dtype)
    starts = torch.tensor([-3 * fmt.smallest_subnormal, -1.0, -fmt.tiny, 1e-30, -fmt.max, 0.0], dtype=dtype)
    x = starts.clone()
    up = torch.full_like(x, math.inf)
    for k in range(1, 8):
        x = torch.nextafter(x, up)
        assert torch.equal(ulp_distance(x, starts), torch.full((6,), k, dtype=torch.int64))
        assert torch.equal(ulp_distance(starts, x), torch.full((6,), -k, dtype=torch.int64))


def test_ulp_distance_signed_zero_sign_changes_and_saturation():
    tiny = torch.tensor([2.0 ** -149])
    assert ulp_distance(tiny, -tiny).item() == 2
    assert ulp_distance(torch.tensor([0.0]), torch.tensor([-0.0])).item() == 0
    big = torch.finfo(torch.float32).max
    assert ulp_distance(torch.tensor([big]), torch.tensor([-big])).item() == 2 * 0x7F7FFFFF
    big64 = torch.tensor([torch.finfo(torch.float64).max], dtype=torch.float64)
    assert ulp_distance(big64, -big64).item() == (1 << 63) - 1
    assert ulp_distance(-big64, big64).item() == -((1 << 63) - 1)
    with pytest.raises(ValueError, match="one dtype"):
        ulp_distance(torch.ones(2), torch.ones(2, dtype=torch.float64))


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_ulp_is_the_gap_to_the_next_float(dtype):
    fmt = float_format(dtype)
    x = torch.tensor([1.0, 1.5, 2.0, -3.0, fmt.tiny, fmt.smallest_subnormal, 0.0, 1000.0, fmt.max / 4], dtype=dtype)
    gap = torch.nextafter(x.abs(), torch.full_like(x, math.inf)).to(torch.float64) - x.abs().to(torch.float64)
    assert torch.equal(ulp(x), gap)
    assert ulp(torch.tensor([1.0]), dtype).item() == 2 * fmt.u
    assert math.isinf(ulp(torch.tensor([math.inf]), dtype).item())


# --------------------------------------------------------------------------- bounds hold


def mixed_data(w, n, dtype, seed, spread=6):
    g = torch.Generator().manual_seed(seed)
    scale = torch.exp2(torch.randint(-spread, spread + 1, (w, n), generator=g).to(torch.float64))
    x = torch.randn(w, n, generator=g, dtype=torch.float64) * scale
    x[-1, : n // 3] = -x[:-1, : n // 3].sum(0) * (1 + 1e-3 * torch.randn(n // 3, generator=g, dtype=torch.float64))
    return x.to(dtype)


def test_gamma():
    u = unit_roundoff(torch.float32)
    assert gamma(1, torch.float32) == u / (1 - u)
    assert gamma(0, "fp16") == 0.0
    assert gamma(5000, torch.bfloat16) == math.inf     # k*u >= 1: no bound
    with pytest.raises(ValueError):
        gamma(-1, torch.float32)


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_every_order_stays_within_its_bound(dtype):
    for w in (2, 3, 5, 8, 16):
        x = mixed_data(w, 3000, dtype, seed=w)
        parts = {"sum": exact_parts(x, "sum"), "avg": exact_parts(x, "avg")}
        for order in ORDERS:
            variants = [dict(op="sum"), dict(op="avg")]
            if order != "exact":
                variants += [dict(op="avg", averaging=a)
                             for a in ("divide_first", "multiply_reciprocal", "multiply_float32_reciprocal")]
                if dtype in (torch.float16, torch.bfloat16):
                    variants += [dict(op="sum", accumulate=torch.float32),
                                 dict(op="avg", averaging="divide_first", accumulate=torch.float32)]
            for kw in variants:
                result = reduce(x, order, **kw)
                # The bound itself, not the bitwise comparison that would decide first.
                m = measure(result, x, order, reference=parts[kw["op"]], bitwise=False, **kw)
                assert m["classification"] == "rounding" and m["evidence"] == "bound", \
                    (order, w, kw, m["max_bound_ratio"])


def test_divide_first_underflow_is_inside_the_bound():
    # float16 gradients near the subnormal range: dividing by W=6 first loses bits
    # to underflow; the bound's W*eta term must cover it (and is needed).
    x = (torch.rand(6, 4000, generator=torch.Generator().manual_seed(3)) * 2e-6).to(torch.float16)
    result = reduce(x, "gloo_ring", op="avg", averaging="divide_first")
    m = measure(result, x, "gloo_ring", op="avg", averaging="divide_first")
    assert m["classification"] == "rounding"
    fmt = float_format(torch.float16)
    hi, lo = exact_parts(x, "avg")
    err = ((result.double() - hi) - lo).abs()
    plain = order_depth("gloo_ring", 6) * fmt.u * abs_sum(x) / 6     # what the bound would be without it
    assert bool((err > plain).any())


@pytest.mark.parametrize("order", ["sequential", "gloo_ring", "nccl_ring"])
def test_the_bound_is_nearly_tight_on_adversarial_data(order):
    # 1 followed by W-1 increments just above half an ulp of 1: every addition
    # rounds up by almost u, so the error approaches (W-1)u ~ gamma_{W-1} * sum|x|.
    w, n = 16, 64
    u = unit_roundoff(torch.float32)
    delta = u * (1 + 2.0 ** -10)
    x = torch.full((w, n), delta)
    owner = [o for a, b, o in gloo_ring_segments(n, w, 4) for _ in range(a, b)]
    chunk = -(-n // w)
    for i in range(n):
        # Put the 1 on the rank each order starts element i's chain with.
        first = {"sequential": 0,
                 "gloo_ring": (owner[i] - 1) % w,        # chunk c starts at rank c-1
                 "nccl_ring": (i // chunk + 1) % w}[order]  # chunk c starts at rank c+1
        x[first, i] = 1.0
    m = measure(reduce(x, order), x, order)
    assert m["classification"] == "rounding" and m["max_bound_ratio"] > 0.95, m["max_bound_ratio"]


def test_pair_bound_covers_two_orders_and_is_not_vacuous():
    w = 12
    u = unit_roundoff(torch.float32)
    x = torch.full((w, 100), u * (1 + 2.0 ** -10))
    x[0] = 1.0
    a, b = reduce(x, "sequential"), reduce(x, "reverse")
    diff = (a.double() - b.double()).abs()
    bound = pair_bound(x, "sequential", "reverse")
    assert bool((diff <= bound).all())
    assert (diff / bound).max().item() > 0.4
    # gloo vs sequential on ordinary data: within the pair bound.
    y = mixed_data(8, 5000, torch.float32, seed=5)
    d = (reduce(y, "gloo_ring").double() - reduce(y, "sequential").double()).abs()
    assert bool((d <= pair_bound(y, "gloo_ring", "sequential")).all())


def test_rounding_bound_matches_the_formula_for_plain_sums():
    x = mixed_data(5, 100, torch.float32, seed=6)
    total = x.double().abs().sum(0)
    assert torch.allclose(rounding_bound(x, "sequential"), gamma(4, torch.float32) * total, rtol=1e-12, atol=0)
    assert torch.allclose(rounding_bound(x, "pairwise"), gamma(3, torch.float32) * total, rtol=1e-12, atol=0)


# --------------------------------------------------------------------------- verdicts


def test_classify():
    assert classify(torch.tensor([1e-7, 0.0]), torch.tensor([2e-7, 0.0])) == ("rounding", 0.5)
    label, ratio = classify(torch.tensor([1.0]), torch.tensor([0.0]))
    assert label == "not rounding" and ratio == math.inf
    assert classify(torch.tensor([math.nan]), torch.tensor([1.0])).label == "not rounding"
    assert classify(torch.tensor([3.0]), torch.tensor([2.0])) == ("not rounding", 1.5)
    # No finite bound: undetermined, never a ratio of 0 (an exact result needs no bound).
    label, ratio = classify(torch.tensor([1e-3, 0.0]), torch.tensor([math.inf, math.inf]))
    assert label == "undetermined" and math.isnan(ratio)
    assert classify(torch.tensor([1e-3]), torch.tensor([math.nan])).label == "undetermined"
    assert classify(torch.tensor([0.0]), torch.tensor([math.inf])) == ("rounding", 0.0)
    # A finite bound that is exceeded decides, whatever other elements lack a bound.
    assert classify(torch.tensor([3.0, 1.0]), torch.tensor([2.0, math.inf])) == ("not rounding", 1.5)


def test_a_real_bug_is_not_rounding():
    # Seed 004's shape: a sum off by ~1e-3 relative is orders of magnitude beyond the bound.
    x = mixed_data(4, 2000, torch.float32, seed=7)
    result = reduce(x, "nccl_ring")
    broken = result.clone()
    broken[1500] *= 1 + 1e-3          # an element without cancellation
    m = measure(broken, x, "nccl_ring")
    assert m["classification"] == "not rounding" and m["max_bound_ratio"] > 100
    assert measure(result, x, "nccl_ring")["classification"] == "rounding"


def test_errors_are_measured_against_sum_abs_not_the_tiny_sum():
    # Cancellation: a legal result can be far from S relative to |S| (NUMERICS.md's 15%).
    x = torch.tensor([[1.0], [1e-7], [-1.0], [3e-8]])
    result = reduce(x, "sequential")
    exact = exact_parts(x)[0]
    assert abs(result.double() - exact).item() / abs(exact).item() > 0.1
    m = measure(result, x, "sequential")
    assert m["classification"] == "rounding" and m["max_rel_error"] < 1e-7


def test_measure_keys_exact_results_and_records():
    x = mixed_data(6, 500, torch.float64, seed=8)
    m = measure(exact_sum(x), x, "exact")
    assert m["max_ulp"] == 0 and m["frac_correctly_rounded"] == 1.0 and m["classification"] == "rounding"
    m2 = measure(reduce(x, "gloo_ring"), x)
    assert set(METRICS) - {"max_bound_ratio", "within_bound"} <= set(m2) and math.isnan(m2["max_bound_ratio"])
    parts = exact_parts(x)
    assert measure(reduce(x, "gloo_ring"), x, "gloo_ring", reference=parts) == measure(reduce(x, "gloo_ring"), x, "gloo_ring")
    recs = error_records(reduce(x, "nccl_tree"), x, "nccl_tree", step=3, bucket=1, case="unit")
    frame = to_frame(recs)
    assert list(frame["metric"]) == list(METRICS)
    assert set(frame["order"]) == {"nccl_tree"} and set(frame["dtype"]) == {"float64"}
    assert set(frame["world_size"]) == {6} and set(frame["step"]) == {3} and set(frame["case"]) == {"unit"}
    with pytest.raises(ValueError, match="elements"):
        measure(torch.zeros(3, dtype=torch.float64), x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=IDS)
def test_no_function_writes_into_its_inputs(dtype):
    # .to(dtype) hands back the caller's own tensor when the dtype already matches,
    # so an in-place op after it would silently change the user's data.
    x = mixed_data(4, 1000, dtype, seed=9)
    keep = x.clone()
    for order in ORDERS:
        measure(reduce(x, order, op="avg"), x, order, op="avg")
    rounding_bound(x, "gloo_ring", op="avg", averaging="divide_first")
    pair_bound(x, "sequential", "nccl_tree")
    abs_sum(x), exact_parts(x), ulp(x[0]), ulp_distance(x[0], x[1])
    assert torch.equal(x, keep)

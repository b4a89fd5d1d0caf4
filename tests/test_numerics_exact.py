"""The exact reference against exact rational arithmetic (fractions.Fraction).

Each case builds W contributions that are exactly representable in the dtype,
sums them as Fractions, rounds with an independent round-to-nearest-even
written here, and demands bitwise equality (signed zeros included) in 100%
of elements, for all four dtypes, for the sum and the mean.
"""
from __future__ import annotations

import math
import random
from fractions import Fraction

import pytest
import torch

from ddplab.numerics import (as_contributions, exact_mean, exact_parts, exact_sum, float_format,
                             reduce, round_to_dtype)

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
WORLD_SIZES = [1, 2, 3, 5, 8]


# --------------------------------------------------------------------------- reference


def fraction_round(value: Fraction, fmt) -> float:
    """Round an exact rational to the format: nearest, ties to even, subnormals, overflow to inf."""
    if value == 0:
        return 0.0
    sign = -1.0 if value < 0 else 1.0
    a = abs(value)
    e = a.numerator.bit_length() - a.denominator.bit_length()
    if a < Fraction(2) ** e:
        e -= 1
    elif a >= Fraction(2) ** (e + 1):
        e += 1
    q = max(e, fmt.emin) - fmt.p + 1
    scaled = a / Fraction(2) ** q
    n, rem = divmod(scaled.numerator, scaled.denominator)
    if 2 * rem > scaled.denominator or (2 * rem == scaled.denominator and n % 2 == 1):
        n += 1
    rounded = Fraction(n) * Fraction(2) ** q
    if rounded > Fraction(fmt.max):
        return sign * math.inf
    return sign * float(rounded)


def expected(columns: list[list[float]], fmt, mean: bool) -> list[float]:
    out = []
    for col in columns:
        if any(math.isnan(v) for v in col) or (math.inf in col and -math.inf in col):
            out.append(math.nan)
        elif math.inf in col or -math.inf in col:
            out.append(math.inf if math.inf in col else -math.inf)
        else:
            total = sum(Fraction(v) for v in col)
            if total == 0:
                all_neg_zero = all(v == 0 and math.copysign(1, v) < 0 for v in col)
                out.append(-0.0 if all_neg_zero else 0.0)
            else:
                out.append(fraction_round(total / len(col) if mean else total, fmt))
    return out


def assert_bitwise(result: torch.Tensor, want: list[float], label: str) -> None:
    want_t = torch.tensor(want, dtype=torch.float64).to(result.dtype)   # exact: representable values
    nan = torch.isnan(want_t)
    assert torch.equal(torch.isnan(result), nan), f"{label}: NaN positions differ"
    bits = float_format(result.dtype).int_dtype
    bad = (result[~nan].view(bits) != want_t[~nan].view(bits)).nonzero().flatten()
    assert bad.numel() == 0, (f"{label}: {bad.numel()} of {result.numel()} not correctly rounded, e.g. "
                              f"got {result[~nan][bad[:3]].tolist()} want {want_t[~nan][bad[:3]].tolist()}")


# --------------------------------------------------------------------------- data


def rand_value(fmt, rng: random.Random, lo_exp=None, hi_exp=None, normal=False) -> float:
    """A random value of the format: up to p significant bits at a random scale in [lo_exp, hi_exp].

    ``normal=True`` gives a full p-bit significand, so the value lies in its scale's binade.
    """
    q_min = fmt.emin - fmt.p + 1
    q_max = fmt.emax - fmt.p + 1
    lo = q_min if lo_exp is None else max(q_min, lo_exp - fmt.p + 1)
    hi = q_max if hi_exp is None else min(q_max, hi_exp - fmt.p + 1)
    m = rng.randrange(1 << (fmt.p - 1) if normal else 1, 1 << fmt.p)
    return rng.choice((-1.0, 1.0)) * math.ldexp(m, rng.randint(lo, hi))


def ulp_of(v: float, fmt) -> float:
    e = math.frexp(abs(v))[1] - 1 if v else fmt.emin
    return math.ldexp(1.0, max(e, fmt.emin) - fmt.p + 1)


def case_wide(fmt, w, n, rng):
    """Exponents anywhere in the format's range: 30+ decades apart, subnormals and near-overflow."""
    return [[rand_value(fmt, rng) for _ in range(w)] for _ in range(n)]


def case_cancel(fmt, w, n, rng):
    """The last value cancels the others up to rounding: the sum is tiny against Σ|x|."""
    cols = []
    for _ in range(n):
        col = [rand_value(fmt, rng, -8, 8) for _ in range(w - 1)] if w > 1 else []
        partial = sum(Fraction(v) for v in col)
        last = -fraction_round(partial, fmt) if partial else rand_value(fmt, rng, -8, 8)
        cols.append(col + [last])
    return cols


def case_ties(fmt, w, n, rng):
    """v + ulp(v)/2 is a midpoint; a tiny third value pushes it just above or below."""
    cols = []
    tiny = math.ldexp(1.0, fmt.emin - fmt.p + 1)
    for _ in range(n):
        v = rand_value(fmt, rng, fmt.emin + 2, fmt.emax - 2, normal=True)
        half = math.copysign(ulp_of(v, fmt) / 2, rng.choice((-1.0, 1.0)))
        extra = rng.choice((0.0, -0.0, tiny, -tiny, 0.0))
        col = ([v, half, extra] + [0.0] * w)[:w]
        rng.shuffle(col)
        cols.append(col)
    return cols


def case_mean_ties(fmt, w, n, rng):
    """W values whose mean is exactly a midpoint (or a hair off it)."""
    cols = []
    tiny = math.ldexp(1.0, fmt.emin - fmt.p + 1)
    while len(cols) < n:
        a = rand_value(fmt, rng, -6, 6, normal=True)
        mid = Fraction(a) + Fraction(ulp_of(a, fmt)) / 2
        total = mid * w
        first = fraction_round(total, fmt)
        rest = total - Fraction(first)
        second = float(rest)
        if not math.isfinite(first) or Fraction(second) != rest or fraction_round(rest, fmt) != second:
            continue
        col = ([first, second, rng.choice((0.0, tiny, -tiny))] + [0.0] * w)[:w]
        if sum(Fraction(v) for v in col) == 0:
            continue
        rng.shuffle(col)
        cols.append(col)
    return cols


def case_specials(fmt, w, n, rng):
    """Signed zeros, infinities, NaN, the overflow threshold and intermediate overflow."""
    big = fmt.max
    half_top = ulp_of(big, fmt) / 2
    tiny = math.ldexp(1.0, fmt.emin - fmt.p + 1)
    patterns = [
        [-0.0] * w, [0.0, -0.0] * w, [1.0, -1.0] * w, [big, half_top], [big, half_top, -tiny],
        [big, big, -big], [-big, -big, big, half_top], [math.inf, 1.0], [math.inf, -math.inf],
        [math.nan, 1.0], [tiny, tiny, -tiny], [-tiny, 0.0], [big, -big, tiny],
    ]
    cols = []
    for _ in range(n):
        col = list(rng.choice(patterns))
        col = (col + [rng.choice((0.0, -0.0))] * w)[:w]
        rng.shuffle(col)
        cols.append(col)
    return cols


def case_small(fmt, w, n, rng):
    """Subnormals and the smallest normals only."""
    return [[rand_value(fmt, rng, fmt.emin - fmt.p, fmt.emin + 2) for _ in range(w)] for _ in range(n)]


CASES = {"wide": case_wide, "cancel": case_cancel, "ties": case_ties, "mean_ties": case_mean_ties,
         "specials": case_specials, "small": case_small}


def contributions_tensor(columns, dtype) -> torch.Tensor:
    return torch.tensor(columns, dtype=torch.float64).T.contiguous().to(dtype)   # exact conversions


# --------------------------------------------------------------------------- tests


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
@pytest.mark.parametrize("case", sorted(CASES))
def test_exact_sum_and_mean_are_correctly_rounded(dtype, case):
    fmt = float_format(dtype)
    rng = random.Random(f"{case}-{dtype}")
    for w in WORLD_SIZES:
        columns = CASES[case](fmt, w, 150, rng)
        x = contributions_tensor(columns, dtype)
        assert torch.equal(x.to(torch.float64).T, torch.tensor(columns, dtype=torch.float64)) or case == "specials"
        assert_bitwise(exact_sum(x), expected(columns, fmt, mean=False), f"sum {case} W={w}")
        assert_bitwise(exact_mean(x), expected(columns, fmt, mean=True), f"mean {case} W={w}")


def test_the_cases_really_contain_ties():
    # Guard against generators that silently stopped producing exact midpoints:
    # a value is a midpoint when nudging it either way changes the rounding.
    fmt = float_format(torch.float32)
    rng = random.Random(0)
    eps = Fraction(1, 2 ** 400)

    def is_tie(v):
        return fraction_round(v - eps, fmt) != fraction_round(v + eps, fmt)

    ties = sum(is_tie(sum(map(Fraction, col))) for col in case_ties(fmt, 3, 200, rng))
    mean_ties = sum(is_tie(sum(map(Fraction, col)) / 3) for col in case_mean_ties(fmt, 3, 200, rng))
    assert ties > 40 and mean_ties > 40, (ties, mean_ties)


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).split(".")[-1])
def test_callable_sources_give_the_same_bits(dtype):
    # Row callables take the streaming path (partials, then gathering the elements
    # whose partials overflow); slice callables the blocked path.
    fmt = float_format(dtype)
    rng = random.Random(1)
    columns = case_wide(fmt, 8, 300, rng) + case_cancel(fmt, 8, 100, rng) + case_specials(fmt, 8, 50, rng)
    x = contributions_tensor(columns, dtype)
    rows = as_contributions(lambda r: x[r].clone(), world_size=8)
    slices = as_contributions(lambda r, a, b: x[r, a:b].clone(), world_size=8, numel=x.shape[1])
    for fn in (exact_sum, exact_mean):
        want = fn(x)
        for src in (rows, slices):
            got = fn(src)
            same = torch.isnan(want) == torch.isnan(got)
            bits = fmt.int_dtype
            assert same.all() and torch.equal(got[~torch.isnan(want)].view(bits), want[~torch.isnan(want)].view(bits))


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_exact_parts_hi_is_rn64_and_lo_has_the_remainders_sign(op):
    fmt64 = float_format(torch.float64)
    rng = random.Random(2)
    columns = case_wide(fmt64, 5, 200, rng) + case_cancel(fmt64, 5, 200, rng)
    x = contributions_tensor(columns, torch.float64)
    hi, lo = exact_parts(x, op)
    for i, col in enumerate(columns):
        exact = sum(Fraction(v) for v in col) / (5 if op == "avg" else 1)
        assert hi[i].item() == fraction_round(exact, fmt64)
        remainder = exact - Fraction(hi[i].item())
        assert (remainder > 0) == (lo[i].item() > 0) and (remainder < 0) == (lo[i].item() < 0)
        if remainder:
            assert abs(Fraction(lo[i].item()) - remainder) <= abs(remainder) * Fraction(1, 2 ** 50)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=str)
def test_round_to_dtype_rounds_hi_plus_lo_once(dtype):
    fmt = float_format(dtype)
    rng = random.Random(3)
    his, los = [], []
    for _ in range(2000):
        v = rand_value(fmt, rng, normal=True)
        mid = v + math.copysign(ulp_of(v, fmt) / 2, v)
        hi = rng.choice((mid, v, rand_value(float_format(torch.float64), rng, fmt.emin - 30, fmt.emax)))
        lo = rng.choice((0.0, math.ldexp(1.0, -1070), -math.ldexp(1.0, -1070), hi * 2.0 ** -60, -hi * 2.0 ** -60))
        his.append(hi)
        los.append(lo)
    got = round_to_dtype(torch.tensor(his, dtype=torch.float64), torch.tensor(los, dtype=torch.float64), dtype)
    want = [fraction_round(Fraction(h) + Fraction(l), fmt) if (h or l) else h for h, l in zip(his, los)]
    assert_bitwise(got, want, f"round_to_dtype {dtype}")


def test_torch_conversion_double_rounds_where_round_to_dtype_does_not():
    # 1 + 2^-11 + 2^-40 must round up in float16; torch goes float64 -> float32
    # (giving the tie 1 + 2^-11) -> float16 (ties to even: 1.0).
    v = 1.0 + 2.0 ** -11 + 2.0 ** -40
    assert torch.tensor([v], dtype=torch.float64).to(torch.float16).item() == 1.0
    assert round_to_dtype(torch.tensor([v], dtype=torch.float64), torch.zeros(1, dtype=torch.float64),
                          torch.float16).item() == 1.0 + 2.0 ** -10


def test_exact_is_an_order_too_and_beats_every_other_order():
    x = torch.randn(6, 4000, generator=torch.Generator().manual_seed(4))
    ref = exact_sum(x)
    assert torch.equal(reduce(x, "exact"), ref)
    assert torch.equal(reduce(x, "exact", op="avg"), exact_mean(x))
    err = {o: (reduce(x, o).double() - exact_parts(x)[0]).abs().sum().item()
           for o in ("sequential", "pairwise", "gloo_ring")}
    assert (ref.double() - exact_parts(x)[0]).abs().sum().item() <= min(err.values())


def test_bad_input_is_rejected_before_work():
    with pytest.raises(ValueError, match="dtype"):
        exact_sum(torch.ones(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[W, N\]"):
        exact_sum(torch.ones(3))
    with pytest.raises(ValueError, match="world_size"):
        exact_sum(lambda r: torch.ones(3), )
    with pytest.raises(ValueError, match="world_size"):
        as_contributions(lambda r: torch.ones(3), world_size=0)
    with pytest.raises(ValueError, match="float16"):
        exact_sum(torch.ones(2, 3), dtype="float8")
    with pytest.raises(ValueError, match="op"):
        exact_parts(torch.ones(2, 3), op="max")


def test_numba_kernels_leave_torchs_thread_count_alone():
    # numba's OpenMP layer shares torch's runtime and would reset its thread count,
    # changing how torch's later reductions split (and so their bits).
    from ddplab.numerics import measure, reproducible_sum

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        x = torch.randn(4, 5000, generator=torch.Generator().manual_seed(5))
        exact_sum(x), exact_mean(x), exact_parts(x, "avg"), reproducible_sum(x)
        exact_sum(as_contributions(lambda r: x[r], world_size=4))
        round_to_dtype(x[0].double(), x[1].double() * 1e-9, torch.float16)
        measure(reduce(x, "gloo_ring"), x, "gloo_ring")
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)


def test_views_of_the_same_elements_are_identical_without_reading_them():
    """A rank's tensor read back as rank 0's (a reference in its capture) is the same memory: equal bits."""
    from ddplab.numerics.accuracy import identical, same_memory

    x = torch.randn(1000)
    x[3] = float("nan")
    assert same_memory(x, x) and same_memory(x[10:20], x[10:20]) and identical(x, x)
    assert not same_memory(x, x.clone()) and identical(x, x.clone())
    assert not same_memory(x[:500], x[500:]) and not same_memory(x[::2], x[:500])
    assert not same_memory(x.view(torch.int32), x) and not same_memory(x.view(10, 100), x)
    y = x.clone()
    y.view(torch.int32)[7] += 1
    assert not identical(x, y)

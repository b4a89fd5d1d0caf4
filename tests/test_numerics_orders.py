"""Emulated reduction orders against an independent per-element reference.

The reference walks each element in Python and performs every addition as
exact rational arithmetic followed by one round-to-nearest-even into the
dtype (``fraction_round``), following the orders as NUMERICS.md and the
gloo/NCCL sources describe them. The emulation under test evaluates postfix
programs with blocked in-place torch adds; the two share no code.
"""
from __future__ import annotations

import math
from fractions import Fraction

import pytest
import torch

from ddplab.numerics import (ORDERS, as_contributions, float_format, gloo_ring_segments, nccl_ring_chunks,
                             order_depth, reduce, reduction_pieces)
from ddplab.numerics._programs import check_program
from test_numerics_exact import fraction_round

DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
IDS = lambda d: str(d).split(".")[-1]   # noqa: E731


# --------------------------------------------------------------------------- reference


class Rounded:
    """Arithmetic in one dtype: each operation exact in Q, then rounded once."""

    def __init__(self, dtype):
        self.fmt = float_format(dtype)

    def add(self, a, b):
        return fraction_round(Fraction(a) + Fraction(b), self.fmt)

    def div(self, a, w):
        return fraction_round(Fraction(a) / w, self.fmt)

    def mul(self, a, b):
        return fraction_round(Fraction(a) * Fraction(b), self.fmt)

    def to(self, a):
        return fraction_round(Fraction(a), self.fmt)


def chain(values, ranks, ar):
    acc = values[ranks[0]]
    for r in ranks[1:]:
        acc = ar.add(acc, values[r])
    return acc


def pairwise(values, ar):
    level = list(values)
    while len(level) > 1:
        nxt = [ar.add(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


def notes_gloo_owner(numel, w, element_size, max_bytes=1 << 20):
    """NUMERICS.md: numSegments = roundUp(max(ceil(bytes / 1 MiB), 2W), W); segment = ceil(N / numSegments)."""
    if w == 1:
        return [0] * numel
    segments = max(-(-numel * element_size // max_bytes), 2 * w)
    segments = -(-segments // w) * w
    seg = -(-numel // segments)
    return [(i // seg) // (segments // w) for i in range(numel)]


def reference(x: torch.Tensor, order: str, *, averaging=None, accumulate=None) -> list[float]:
    w, n = x.shape
    data = Rounded(x.dtype)
    ar = Rounded(accumulate) if accumulate is not None else data
    cols = x.to(torch.float64).T.tolist()
    owner = notes_gloo_owner(n, w, x.element_size())
    chunk = -(-n // w)
    out = []
    for i, col in enumerate(cols):
        vals = [ar.to(v) for v in col]
        if averaging == "divide_first":
            vals = [ar.div(v, w) for v in vals]
        elif averaging == "multiply_reciprocal":
            recip = ar.to(1.0 / w)
            vals = [ar.mul(v, recip) for v in vals]
        if order == "sequential":
            s = chain(vals, list(range(w)), ar)
        elif order == "reverse":
            s = chain(vals, list(range(w - 1, -1, -1)), ar)
        elif order == "pairwise":
            s = pairwise(vals, ar)
        elif order == "gloo_ring":
            c = owner[i]
            s = chain(vals, [(c - 1 - k) % w for k in range(w)], ar)      # descending, ending with c
        elif order == "nccl_ring":
            c = i // chunk
            s = chain(vals, [(c + 1 + k) % w for k in range(w)], ar)      # ascending from c+1, ending with c
        else:
            raise AssertionError(order)
        if averaging == "sum_then_divide":
            s = ar.div(s, w)
        out.append(data.to(s))
    return out


def assert_same_bits(got: torch.Tensor, want: list[float], label: str) -> None:
    want_t = torch.tensor(want, dtype=torch.float64).to(got.dtype)
    bits = float_format(got.dtype).int_dtype
    bad = (got.view(bits) != want_t.view(bits)).nonzero().flatten()
    assert bad.numel() == 0, f"{label}: {bad.numel()}/{got.numel()} differ, e.g. at {bad[:5].tolist()}"


def sample(w, n, dtype, seed) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # Mixed magnitudes and signs so that orders really differ, within every dtype's range.
    scale = torch.exp2(torch.randint(-6, 7, (w, n), generator=g).to(torch.float64))
    return (torch.randn(w, n, generator=g, dtype=torch.float64) * scale).to(dtype)


# --------------------------------------------------------------------------- orders vs reference


EMULATED = ["sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring"]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_every_order_matches_the_per_element_reference(dtype):
    for w in (1, 2, 3, 4, 5, 6):
        for n in (1, 7, 61):
            x = sample(w, n, dtype, seed=100 * w + n)
            for order in EMULATED:
                assert_same_bits(reduce(x, order), reference(x, order), f"{order} W={w} N={n}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
@pytest.mark.parametrize("averaging", ["divide_first", "sum_then_divide", "multiply_reciprocal"])
def test_averaging_variants_match_the_reference(dtype, averaging):
    for w in (3, 5, 6):
        x = sample(w, 41, dtype, seed=w)
        for order in ("sequential", "gloo_ring", "nccl_ring", "pairwise"):
            got = reduce(x, order, op="avg", averaging=averaging)
            assert_same_bits(got, reference(x, order, averaging=averaging), f"{order} {averaging} W={w}")


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_float32_reciprocal_is_what_torch_mul_does(dtype):
    # DDP's reducer without a hook scales each gradient with grad.mul_(1/W).
    for w in (3, 5, 6):
        x = sample(w, 999, dtype, seed=w)
        scaled = torch.stack([x[r].clone().mul_(1.0 / w) for r in range(w)])
        for order in ("sequential", "gloo_ring", "nccl_ring"):
            got = reduce(x, order, op="avg", averaging="multiply_float32_reciprocal")
            assert torch.equal(got, reduce(scaled, order)), (order, w)
        ncclish = reduce(x, "sequential", op="avg", averaging="multiply_reciprocal")
        same = torch.equal(ncclish, reduce(x, "sequential", op="avg", averaging="multiply_float32_reciprocal"))
        # For half types torch multiplies by float32's 1/W, NCCL by the dtype's.
        assert same == (dtype in (torch.float32, torch.float64))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=IDS)
def test_accumulate_in_float32_rounds_once(dtype):
    for w in (3, 8):
        x = sample(w, 53, dtype, seed=7 * w)
        for order in ("sequential", "gloo_ring", "pairwise"):
            got = reduce(x, order, accumulate=torch.float32)
            assert_same_bits(got, reference(x, order, accumulate=torch.float32), f"{order} acc32 W={w}")
            got = reduce(x, order, op="avg", averaging="divide_first", accumulate="fp32")
            want = reference(x, order, averaging="divide_first", accumulate=torch.float32)
            assert_same_bits(got, want, f"{order} acc32 divide_first W={w}")
        # Rounding once is what makes it differ from rounding every hop.
        assert not torch.equal(reduce(x, "sequential", accumulate=torch.float32), reduce(x, "sequential"))


def test_default_averaging_is_what_each_backend_does():
    x = sample(3, 99, torch.float16, seed=1)
    assert torch.equal(reduce(x, "gloo_ring", op="avg"), reduce(x, "gloo_ring", op="avg", averaging="sum_then_divide"))
    assert torch.equal(reduce(x, "nccl_ring", op="avg"),
                       reduce(x, "nccl_ring", op="avg", averaging="multiply_reciprocal"))


# --------------------------------------------------------------------------- gloo segmentation


@pytest.mark.parametrize("element_size", [2, 4, 8])
def test_gloo_segments_follow_the_notes_formula(element_size):
    for numel in (1, 2, 5, 997, 1000, 1001, 262_145, 300_001, 3_000_001):
        for w in range(1, 9):
            segs = gloo_ring_segments(numel, w, element_size)
            assert segs[0][0] == 0 and segs[-1][1] == numel
            assert all(a[1] == b[0] for a, b in zip(segs, segs[1:])), "segments tile the buffer"
            owners = notes_gloo_owner(numel, w, element_size) if numel < 5000 else None
            if owners is not None:
                got = [o for a, b, o in segs for _ in range(a, b)]
                assert got == owners, (numel, w)
            else:   # check the boundaries only
                segments = -(-max(-(-numel * element_size // (1 << 20)), 2 * w) // w) * w
                seg = -(-numel // segments)
                for a, b, o in segs:
                    assert o == (a // seg) // (segments // w) == ((b - 1) // seg) // (segments // w)


def test_gloo_ring_on_a_buffer_over_1_mib_uses_the_1_mib_rule():
    # 3,000,001 float32 = 12 MB: 12 segments for W=3 (not 2W = 6), so chunk
    # boundaries sit at 4 segments of 250,001 elements.
    w, n = 3, 3_000_001
    segs = gloo_ring_segments(n, w, 4)
    assert len(segs) == 12 and segs[0] == (0, 250_001, 0) and segs[4] == (1_000_004, 1_250_005, 1)
    x = sample(w, n, torch.float32, seed=5)
    got = reduce(x, "gloo_ring")
    owner = torch.div(torch.arange(n), 250_001, rounding_mode="floor") // 4
    want = torch.empty(n)
    for c in range(w):
        m = owner == c
        acc = x[(c - 1) % w][m].clone()
        for k in range(1, w):
            acc += x[(c - 1 - k) % w][m]
        want[m] = acc
    assert torch.equal(got, want)


def test_max_segment_bytes_gives_many_segments_per_rank():
    x = sample(3, 100, torch.float32, seed=9)
    segs = gloo_ring_segments(100, 3, 4, max_segment_bytes=16)   # 4 elements per segment at most
    assert len(segs) == 25 and max(b - a for a, b, _ in segs) == 4
    owners = notes_gloo_owner(100, 3, 4, max_bytes=16)
    got = reduce(x, "gloo_ring", max_segment_bytes=16)
    cols = x.T.tolist()
    ar = Rounded(torch.float32)
    want = [chain(col, [(owners[i] - 1 - k) % 3 for k in range(3)], ar) for i, col in enumerate(cols)]
    assert_same_bits(got, want, "small segments")


# --------------------------------------------------------------------------- NCCL


def test_nccl_ring_chunks_channels_and_ring_order():
    w, n = 4, 203
    x = sample(w, n, torch.float32, seed=11)
    ring = [2, 0, 3, 1]
    got = reduce(x, "nccl_ring", channels=2, chunk_elements=10, ring=ring)
    # Independent walk of the model: channel halves, loops of W chunks, last loop shrunk.
    position = [None] * n
    per_channel = -(-n // 2)
    for b in range(2):
        g0, g1 = b * per_channel, min(n, (b + 1) * per_channel)
        off = 0
        while off < g1 - g0:
            real = min(10, -(-(g1 - g0 - off) // w))
            for i in range(g0 + off, min(g1, g0 + off + w * real)):
                position[i] = (i - g0 - off) // real
            off += w * real
    ar = Rounded(torch.float32)
    want = [chain(col, [ring[(position[i] + 1 + k) % w] for k in range(w)], ar)
            for i, col in enumerate(x.T.tolist())]
    assert_same_bits(got, want, "nccl ring with channels and ring order")
    assert sum(b - a for a, b, _ in nccl_ring_chunks(n, w, 2, 10)) == n


def test_nccl_tree_matches_the_trees_drawn_in_trees_cc():
    # W=4, one rank per node. ncclGetBtree: 0 -> 2 -> (1, 3); the mirror tree:
    # 3 -> 1 -> (2, 0). Each rank adds its own value, then its children's sums.
    w, n = 4, 64
    x = sample(w, n, torch.float32, seed=12)
    ar = Rounded(torch.float32)
    got = reduce(x, "nccl_tree")
    want = []
    for i, v in enumerate(x.T.tolist()):
        if i < n // 2:
            want.append(ar.add(v[0], ar.add(ar.add(v[2], v[1]), v[3])))
        else:
            want.append(ar.add(v[3], ar.add(ar.add(v[1], v[2]), v[0])))
    assert_same_bits(got, want, "double binary tree, W=4")


def test_nccl_tree_within_one_node_is_a_chain():
    x = sample(8, 300, torch.float16, seed=13)
    assert torch.equal(reduce(x, "nccl_tree", ranks_per_node=8), reduce(x, "reverse"))
    assert order_depth("nccl_tree", 8, ranks_per_node=8) == 7


# --------------------------------------------------------------------------- structure


def test_order_depths():
    for w in range(1, 18):
        assert order_depth("sequential", w) == order_depth("reverse", w) == w - 1
        assert order_depth("gloo_ring", w) == order_depth("nccl_ring", w) == w - 1
        assert order_depth("pairwise", w) == math.ceil(math.log2(w))
        assert math.ceil(math.log2(w)) <= order_depth("nccl_tree", w) <= w - 1 or w == 1
        assert order_depth("exact", w) == 0


def test_every_program_reads_every_rank_once():
    for w in range(1, 13):
        for order in ORDERS:
            if order == "exact":
                continue
            opts = {"ranks_per_node": 2} if order == "nccl_tree" and w % 2 == 0 else {}
            pieces = reduction_pieces(order, 1000, w, 4, **opts)
            assert pieces[0].start == 0 and pieces[-1].stop == 1000
            for p in pieces:
                check_program(p.program, w)


def test_two_ranks_make_every_order_identical():
    # a + b == b + a: with W=2 there is nothing for the order to change.
    x = sample(2, 5000, torch.bfloat16, seed=14)
    results = [reduce(x, o) for o in ORDERS]
    assert all(torch.equal(results[0], r) for r in results)


def test_orders_differ_from_each_other_with_more_ranks():
    x = sample(5, 5000, torch.float32, seed=15)
    results = {o: reduce(x, o) for o in ORDERS}
    for a in ORDERS:
        for b in ORDERS:
            if a < b:
                assert not torch.equal(results[a], results[b]), (a, b)


# --------------------------------------------------------------------------- sources and edges


@pytest.mark.parametrize("dtype", [torch.float16, torch.float64], ids=IDS)
def test_callable_sources_give_the_same_bits(dtype):
    x = sample(5, 1001, dtype, seed=16)
    rows = as_contributions(lambda r: x[r].clone(), world_size=5)
    slices = as_contributions(lambda r, a, b: x[r, a:b].clone(), world_size=5, numel=1001)
    for order in ORDERS:
        for kw in ({}, {"op": "avg", "averaging": "divide_first"}, {"op": "avg"}):
            want = reduce(x, order, **kw)
            assert torch.equal(reduce(rows, order, **kw), want), (order, kw)
            assert torch.equal(reduce(slices, order, **kw), want), (order, kw)


def test_row_callables_are_generated_few_times():
    w, n = 16, 1000
    calls = []

    def row(r):
        calls.append(r)
        return torch.randn(n, generator=torch.Generator().manual_seed(r))

    c = as_contributions(row, world_size=w, numel=n, dtype=torch.float32)
    for order, most in (("sequential", w), ("reverse", w), ("pairwise", w), ("gloo_ring", 2 * w),
                        ("nccl_ring", 2 * w), ("exact", w)):
        calls.clear()
        reduce(c, order)
        assert len(calls) <= most, (order, len(calls))


def test_edges_empty_buffers_single_rank_and_non_multiples():
    for order in ORDERS:
        assert reduce(torch.empty(3, 0), order).shape == (0,)
        x = sample(1, 10, torch.float32, seed=17)
        assert torch.equal(reduce(x, order), x[0])
        assert torch.equal(reduce(x, order, op="avg"), x[0])
    for n in (1, 2, 3, 999, 1001):
        x = sample(6, n, torch.float32, seed=n)
        assert torch.equal(reduce(x, "gloo_ring"),
                           torch.tensor(reference(x, "gloo_ring"), dtype=torch.float64).float())


def test_bad_input_raises_value_error_before_work():
    x = torch.randn(3, 10)
    for kwargs, match in (
        (dict(order="ring"), "unknown order"),
        (dict(order="gloo_ring", channels=2), "takes no option"),
        (dict(order="nccl_ring", channels=0), "positive"),
        (dict(order="nccl_ring", ring=[0, 0, 1]), "ring"),
        (dict(order="nccl_tree", ranks_per_node=2), "divide"),
        (dict(order="gloo_ring", op="max"), "op"),
        (dict(order="gloo_ring", averaging="divide_first"), "avg"),
        (dict(order="gloo_ring", op="avg", averaging="halve"), "averaging"),
        (dict(order="gloo_ring", accumulate=torch.float16), "less precise"),
        (dict(order="gloo_ring", accumulate="int8"), "dtype"),
    ):
        with pytest.raises(ValueError, match=match):
            reduce(x, **kwargs)
    with pytest.raises(ValueError, match="dtype"):
        reduce(torch.ones(3, 10, dtype=torch.int64), "sequential")
    with pytest.raises(ValueError, match=r"\[W, N\]"):
        reduce(torch.ones(3, 4, 5), "sequential")
    with pytest.raises(ValueError, match="same numel"):
        reduce([torch.ones(3), torch.ones(4)], "sequential")
    with pytest.raises(ValueError, match="rank 1: expected 3 elements"):
        reduce(as_contributions(lambda r: torch.ones(3 + r), world_size=2), "sequential")
    with pytest.raises(ValueError, match="world_size"):
        order_depth("sequential", 0)


# --------------------------------------------------------------------------- compiled engine vs torch ops
# run() evaluates programs with numba kernels; run_torch() with one in-place torch op per
# step, the engine the reference tests above validated first. Both must give the same bits.

from ddplab.numerics._programs import ADD, Arithmetic, Piece, chain_program, run, run_torch, tree_program  # noqa: E402
from ddplab.numerics.orders import _arithmetic  # noqa: E402


def assert_same_results(got: torch.Tensor, want: torch.Tensor, label: str) -> None:
    """Bitwise equal, except that a NaN only has to be a NaN (torch's own NaN bits depend on the code path)."""
    assert got.dtype == want.dtype and got.shape == want.shape, label
    if got.dtype.is_floating_point:
        bits = float_format(got.dtype).int_dtype
        same = (got.view(bits) == want.view(bits)) | (got.isnan() & want.isnan())
    else:
        same = got == want
    bad = (~same).nonzero().flatten()
    assert bad.numel() == 0, f"{label}: {bad.numel()}/{got.numel()} differ, e.g. at {bad[:5].tolist()}"


def sources(x: torch.Tensor) -> dict:
    w, n = x.shape
    return {"tensor": as_contributions(x),
            "rows": as_contributions(lambda r: x[r].clone(), world_size=w),
            "slices": as_contributions(lambda r, a, b: x[r, a:b].clone(), world_size=w, numel=n)}


ARITHMETIC = [dict(op="sum"), dict(op="avg", averaging="sum_then_divide"), dict(op="avg", averaging="divide_first"),
              dict(op="avg", averaging="multiply_reciprocal"),
              dict(op="avg", averaging="multiply_float32_reciprocal"),
              dict(op="sum", accumulate=torch.float32),
              dict(op="avg", averaging="divide_first", accumulate=torch.float64)]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_compiled_engine_equals_torch_ops_for_every_order_and_averaging(dtype):
    # Sizes that are not multiples of W, W=1, and one that spans several tiles and gloo segments.
    for w, n in ((1, 33), (3, 1001), (8, 40_003)):
        x = sample(w, n, dtype, seed=1000 + w)
        for order in ("sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring", "nccl_tree"):
            opts = {"max_segment_bytes": 4096} if order == "gloo_ring" and n > 1000 else {}
            pieces = reduction_pieces(order, n, w, x.element_size(), **opts)
            for kw in ARITHMETIC:
                if "accumulate" in kw and float_format(kw["accumulate"]).p < float_format(dtype).p:
                    continue
                arith = _arithmetic(dtype, order, kw["op"], kw.get("averaging"), kw.get("accumulate"), w)
                want = run_torch(as_contributions(x), pieces, arith)
                for kind, c in sources(x).items():
                    if kind != "tensor" and n > 1001:
                        continue   # callables at the small sizes only: they cost a call per rank and block
                    assert_same_results(run(c, pieces, arith), want, f"{order} {kw} W={w} N={n} {kind}")


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32], ids=IDS)
def test_compiled_engine_rounds_edges_like_torch(dtype):
    # Overflow to inf, inf - inf, NaN, subnormal results, signed zeros, and exact ties of the format.
    fmt = float_format(dtype)
    big, tiny = fmt.max, 2.0 ** (fmt.emin - fmt.p + 1)
    one_ulp = 2.0 ** (1 - fmt.p)
    rows = [[big, -big, 0.0, -0.0, tiny, 1.0, 1.0, float("inf"), float("nan"), 3 * tiny, 2.0 ** fmt.emin],
            [big, big, -0.0, -0.0, tiny, one_ulp / 2, -one_ulp / 4, float("-inf"), 1.0, -tiny, -tiny],
            [-big, big, 0.0, -0.0, -tiny, one_ulp / 2, one_ulp / 2, 1.0, 2.0, tiny / 1, tiny]]
    g = torch.Generator().manual_seed(5)
    x = torch.tensor(rows, dtype=torch.float64).to(dtype)
    x = torch.cat([x, (torch.randn(3, 5000, generator=g, dtype=torch.float64) * 2.0 ** fmt.emin).to(dtype)], 1)
    for order in ("sequential", "pairwise", "gloo_ring"):
        pieces = reduction_pieces(order, x.shape[1], 3, x.element_size())
        for kw in ARITHMETIC:
            if "accumulate" in kw and float_format(kw["accumulate"]).p < fmt.p:
                continue
            arith = _arithmetic(dtype, order, kw["op"], kw.get("averaging"), kw.get("accumulate"), 3)
            assert_same_results(run(as_contributions(x), pieces, arith), run_torch(as_contributions(x), pieces, arith),
                                f"{order} {kw}")


def test_float64_results_reach_half_precision_through_float32_as_torch_converts():
    # 1 + 2^-11 + 2^-24 is a hair above the float16 tie 1 + 2^-11, and exactly halfway between two
    # float32s: float32 rounds it (to even) onto the tie, which float16 then rounds to even, 1.0.
    # Rounding float64 directly to float16 would give 1 + 2^-10. torch's copy_ goes through float32.
    x = torch.tensor([[1.0, 1.0], [2.0 ** -11, 2.0 ** -11], [2.0 ** -24, 0.0]], dtype=torch.float16)
    arith = _arithmetic(torch.float16, "sequential", "sum", None, torch.float64, 3)
    pieces = reduction_pieces("sequential", 2, 3, 2)
    got = run(as_contributions(x), pieces, arith)
    assert_same_results(got, run_torch(as_contributions(x), pieces, arith), "compiled vs torch")
    assert got.tolist() == [1.0, 1.0]               # the tie 1 + 2^-11 alone also goes to even
    assert torch.tensor(1 + 2.0 ** -11 + 2.0 ** -24, dtype=torch.float64).to(torch.float16).item() == 1.0


def random_pieces(n: int, w: int, g: torch.Generator) -> list:
    """Pieces over [0, n) with random lengths (some empty) and random chains and trees, shuffled."""
    cuts = sorted(torch.randint(0, n + 1, (12,), generator=g).tolist())
    bounds = [0] + cuts + [n]
    pieces = []
    for a, b in zip(bounds[:-1], bounds[1:]):
        perm = torch.randperm(w, generator=g).tolist()
        if torch.rand((), generator=g) < 0.5:
            program = chain_program(perm)
        else:
            tree = perm[0]
            for r in perm[1:]:
                tree = (tree, r) if torch.rand((), generator=g) < 0.5 else (r, tree)
            program = tree_program(tree)
        pieces.append(Piece(a, b, program))
    order = torch.randperm(len(pieces), generator=g).tolist()
    return [pieces[i] for i in order]


@pytest.mark.parametrize("dtype", DTYPES, ids=IDS)
def test_compiled_engine_runs_any_pieces_list(dtype):
    # What other orders (a reduce-scatter, say) hand the engine: any ranges, any programs, any order.
    g = torch.Generator().manual_seed(21)
    for w, n in ((1, 50), (4, 999), (7, 20_011)):
        x = sample(w, n, dtype, seed=w * n)
        for _ in range(3):
            pieces = random_pieces(n, w, g)
            arith = Arithmetic(dtype, dtype)
            want = run_torch(as_contributions(x), pieces, arith)
            for kind, c in sources(x).items():
                assert_same_results(run(c, pieces, arith), want, f"W={w} N={n} {kind}")
    # A pieces list may cover only part of the buffer: the covered part is still right.
    x = sample(3, 100, dtype, seed=3)
    pieces = [Piece(10, 40, chain_program([2, 0, 1])), Piece(60, 61, (1, 0, ADD, 2, ADD))]
    c, arith = as_contributions(x), Arithmetic(dtype, dtype)
    got, want = run(c, pieces, arith), run_torch(c, pieces, arith)
    assert_same_results(got[10:40], want[10:40], "partial")
    assert_same_results(got[60:61], want[60:61], "partial")


def test_compiled_engine_sums_int64_like_torch_and_other_dtypes_fall_back():
    g = torch.Generator().manual_seed(8)
    x = torch.randint(-2 ** 58, 2 ** 58, (6, 30_001), generator=g)
    pieces = reduction_pieces("gloo_ring", x.shape[1], 6, 8)
    for c in sources(x).values():
        assert torch.equal(run(c, pieces, Arithmetic(torch.int64, torch.int64)), x.sum(0))
    small = torch.randint(-1000, 1000, (4, 777), generator=g, dtype=torch.int32)
    got = run(as_contributions(small), reduction_pieces("nccl_ring", 777, 4, 4), Arithmetic(torch.int32, torch.int32))
    assert torch.equal(got, small.sum(0, dtype=torch.int32))


def test_engine_rejects_pieces_and_programs_it_cannot_run():
    x = as_contributions(torch.randn(3, 10))
    arith = Arithmetic(torch.float32, torch.float32)
    for pieces, match in (([Piece(0, 11, chain_program([0, 1, 2]))], "outside"),
                          ([Piece(-1, 5, chain_program([0, 1, 2]))], "outside"),
                          ([Piece(0, 6, chain_program([0, 1, 2])), Piece(5, 10, chain_program([1, 2, 0]))], "overlap"),
                          ([Piece(0, 10, chain_program([0, 1, 3]))], "rank outside"),
                          ([Piece(0, 10, (0, 1, ADD, ADD))], "malformed"),
                          ([Piece(0, 10, (0, 1, 2, ADD))], "malformed")):
        for engine in (run, run_torch):
            with pytest.raises(ValueError, match=match):
                engine(x, pieces, arith)

"""Emulated reduce-scatter orders against independent computations, and FSDP2's divide factors against torch's."""
from __future__ import annotations

import itertools

import pytest
import torch
import torch.distributed as dist

from ddplab.numerics import (AVERAGING, exact_mean, exact_sum, float_format, fsdp_reduction, reduce,
                             reduce_scatter, shard_range)

DTYPES = [torch.float64, torch.float32, torch.float16, torch.bfloat16]


def data(world_size, n, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(world_size, world_size * n, generator=g, dtype=torch.float64)
    return (x * torch.exp2(torch.randint(-6, 7, x.shape, generator=g).to(torch.float64))).to(dtype)


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(float_format(a.dtype).int_dtype),
                                              b.view(float_format(b.dtype).int_dtype))


def chain(x, ranks, dtype):
    """((x_a + x_b) + x_c) + ... with one rounding per addition in ``dtype``, written out."""
    acc = x[ranks[0]].to(dtype).clone()
    for r in ranks[1:]:
        acc = (acc.to(torch.float64) + x[r].to(torch.float64)).to(dtype) if dtype == torch.float32 else acc + x[r]
    return acc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("world_size", [2, 3, 5, 8])
def test_nccl_ring_shard_c_is_the_chain_from_c_plus_1_ending_at_c(dtype, world_size):
    n = 37
    x = data(world_size, n, dtype)
    out = reduce_scatter(x, "nccl_ring")
    for c in range(world_size):
        a, b = shard_range(x.shape[1], world_size, c)
        ranks = [(c + 1 + k) % world_size for k in range(world_size)]
        assert bits_equal(out[a:b], chain(x[:, a:b], ranks, dtype)), c


def test_nccl_ring_follows_the_ring_order():
    x = data(4, 16, torch.float16, seed=3)
    ring = [2, 0, 3, 1]
    out = reduce_scatter(x, "nccl_ring", ring=ring)
    for c in range(4):
        a, b = shard_range(x.shape[1], 4, c)
        p = ring.index(c)
        assert bits_equal(out[a:b], chain(x[:, a:b], [ring[(p + 1 + k) % 4] for k in range(4)], torch.float16))
    assert not bits_equal(out, reduce_scatter(x, "nccl_ring"))


@pytest.mark.parametrize("dtype", DTYPES)
def test_gloo_ring_is_the_all_reduce_of_the_whole_buffer_sliced(dtype):
    # 3 MiB per rank at float32: more than 2W segments, boundaries inside shards.
    n = (3 << 20) // (4 * 3) + 1 if dtype == torch.float32 else 1001
    x = data(3, n, dtype)
    for op in ("sum", "avg"):
        assert bits_equal(reduce_scatter(x, "gloo_ring", op=op), reduce(x, "gloo_ring", op=op))
    per_shard = torch.cat([reduce(x[:, r * n:(r + 1) * n], "gloo_ring") for r in range(3)])
    assert bits_equal(reduce_scatter(x, "gloo_ring", list_input=True), per_shard)
    assert not bits_equal(per_shard, reduce(x, "gloo_ring"))


@pytest.mark.parametrize("order", ["sequential", "pairwise", "gloo_ring", "nccl_ring", "exact"])
def test_one_shard_is_that_slice_of_all_shards(order):
    x = data(5, 203, torch.bfloat16)
    full = reduce_scatter(x, order, op="avg")
    for r in range(5):
        a, b = shard_range(x.shape[1], 5, r)
        assert bits_equal(reduce_scatter(x, order, op="avg", shard=r), full[a:b])


@pytest.mark.parametrize("order", ["gloo_ring", "nccl_ring", "exact"])
def test_shard_only_takes_just_that_shards_columns(order):
    x = data(4, 300_001 // 4 + 1, torch.float32)       # over 1 MiB: gloo segments cross shards
    for r in range(4):
        a, b = shard_range(x.shape[1], 4, r)
        assert bits_equal(reduce_scatter(x[:, a:b], order, op="avg", shard=r, shard_only=True),
                          reduce_scatter(x, order, op="avg", shard=r))


@pytest.mark.parametrize("kind", ["rows", "slices"])
@pytest.mark.parametrize("order", ["gloo_ring", "nccl_ring", "exact"])
def test_callables_give_the_tensor_result(kind, order):
    w, n = 67, 30
    x = data(w, n, torch.bfloat16, seed=5)
    fn = (lambda r: x[r].clone()) if kind == "rows" else (lambda r, a, b: x[r, a:b].clone())
    from ddplab.numerics import as_contributions
    c = as_contributions(fn, world_size=w, numel=w * n, dtype=torch.bfloat16)
    assert bits_equal(reduce_scatter(c, order, op="avg"), reduce_scatter(x, order, op="avg"))
    assert bits_equal(reduce_scatter(c, order, shard=7), reduce_scatter(x, order, shard=7))


@pytest.mark.parametrize("averaging", AVERAGING)
def test_averaging_variants_are_the_all_reduce_ones_for_gloo(averaging):
    x = data(6, 50, torch.float16)
    assert bits_equal(reduce_scatter(x, "gloo_ring", op="avg", averaging=averaging),
                      reduce(x, "gloo_ring", op="avg", averaging=averaging))


def test_ncclavg_multiplies_each_contribution_by_the_rounded_reciprocal():
    x = data(3, 40, torch.bfloat16)
    recip = torch.tensor(1 / 3, dtype=torch.bfloat16)
    scaled = x * recip
    out = reduce_scatter(x, "nccl_ring", op="avg")
    assert bits_equal(out, reduce_scatter(scaled, "nccl_ring"))
    assert bits_equal(reduce_scatter(x, "nccl_ring", op="sum", premul=1 / 3), out)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32])
def test_pre_and_post_divide_round_in_the_data_dtype(dtype):
    x = data(3, 64, dtype, seed=2)
    expected = reduce_scatter(x / 2, "gloo_ring") / 1.5
    assert bits_equal(reduce_scatter(x, "gloo_ring", pre_divide=2, post_divide=1.5), expected)
    # Accumulating wider changes the sum only; the divisions stay in the dtype.
    wide = reduce_scatter(x / 2, "gloo_ring", accumulate=torch.float64) / 1.5
    assert bits_equal(reduce_scatter(x, "gloo_ring", pre_divide=2, post_divide=1.5, accumulate=torch.float64), wide)


def test_float32_accumulation_rounds_once_at_the_end():
    x = data(9, 40, torch.bfloat16, seed=4)
    wide = reduce_scatter(x.float(), "nccl_ring")
    assert bits_equal(reduce_scatter(x, "nccl_ring", accumulate=torch.float32), wide.to(torch.bfloat16))
    assert not bits_equal(reduce_scatter(x, "nccl_ring"), wide.to(torch.bfloat16))


def test_exact_is_the_correctly_rounded_value_of_the_ideal_result():
    x = data(4, 100, torch.bfloat16)
    assert bits_equal(reduce_scatter(x, "exact"), exact_sum(x))
    assert bits_equal(reduce_scatter(x, "exact", op="avg"), exact_mean(x))
    assert bits_equal(reduce_scatter(x, "exact", pre_divide=2, post_divide=2.0), exact_mean(x))
    assert bits_equal(reduce_scatter(x, "exact", post_divide=8), exact_sum(x.double() / 8).to(torch.bfloat16))
    with pytest.raises(ValueError, match="power of two"):
        reduce_scatter(x, "exact", post_divide=3)


@pytest.mark.parametrize("call, message", [
    (lambda x: reduce_scatter(x[:, :-1], "gloo_ring"), "multiple of W"),
    (lambda x: reduce_scatter(x, "nccl_tree"), "unknown reduce-scatter order"),
    (lambda x: reduce_scatter(x, "nccl_ring", channels=2), "takes no option channels"),
    (lambda x: reduce_scatter(x, "gloo_ring", op="avg", post_divide=2), "op='sum'"),
    (lambda x: reduce_scatter(x, "gloo_ring", pre_divide=0), "positive"),
    (lambda x: reduce_scatter(x, "gloo_ring", pre_divide=2, premul=0.5), "give one"),
    (lambda x: reduce_scatter(x, "gloo_ring", shard=4), "outside"),
    (lambda x: reduce_scatter(x, "gloo_ring", shard_only=True), "needs shard"),
    (lambda x: reduce_scatter(x, "nccl_ring", ring=[0, 1, 1, 2]), "ring must list"),
    (lambda x: reduce_scatter(x, "gloo_ring", op="max"), "op must be"),
])
def test_bad_input_is_a_value_error(call, message):
    with pytest.raises(ValueError, match=message):
        call(data(4, 3, torch.float32))


def test_fsdp_reduction_is_torchs_rule():
    """Ours against FSDP2's own ``_get_gradient_divide_factors`` on real ProcessGroup objects."""
    from torch.distributed.fsdp._fully_shard._fsdp_collectives import _get_gradient_divide_factors

    names = {dist.ReduceOp.AVG: "avg", dist.ReduceOp.SUM: "sum"}
    for dtype, w, factor, force in itertools.product(DTYPES, range(1, 10), [None, 2.0, 3.0, 7.5, "W"], [False, True]):
        f = float(w) if factor == "W" else factor
        group = dist.ProcessGroup(dist.HashStore(), 0, w)
        pre, post, rs_op, _ = _get_gradient_divide_factors(group, None, dtype, "cpu", f, force)
        ours = fsdp_reduction(dtype, w, gradient_divide_factor=f, force_sum=force)
        label = (dtype, w, factor, force)
        if getattr(rs_op, "op", rs_op) == dist.ReduceOp.PREMUL_SUM:
            assert (ours.op, ours.premul, ours.gloo_supported) == ("premul_sum", rs_op.factor, False), label
        else:
            assert ours.op == names[rs_op], label
        assert (ours.pre_divide, ours.post_divide) == (pre, post), label


def test_fsdp_float16_divides_by_about_the_square_root_before_and_after():
    assert [(r.pre_divide, r.post_divide) for r in (fsdp_reduction(torch.float16, w) for w in (2, 3, 4, 6, 8, 16))] == \
        [(2, 1.0), (2, 1.5), (2, 2.0), (4, 1.5), (4, 2.0), (4, 4.0)]
    assert fsdp_reduction(torch.bfloat16, 8) == ("avg", None, None, None, True)
    assert fsdp_reduction(torch.float32, 8, force_sum=True)[:3] == ("sum", None, 8.0)

"""Emulated gloo reduce-scatter against live gloo, bit for bit.

One launch per world size (W = 2..6). Inside the ranks a loop over the four
dtypes and shard sizes n (a multiple of W, and 1001, which no W here
divides) runs the collectives FSDP2 and users call on gloo:
``reduce_scatter_single`` with SUM and AVG, ``dist.reduce_scatter`` with a
list, and FSDP2's float16 sequence (divide, SUM, divide). One float32 case is
(at W=4) larger than 2W MiB, so that gloo's 1 MiB segment limit places
segment boundaries inside shards. Here the same data is regenerated and reduced by
:func:`ddplab.numerics.reduce_scatter`: ``gloo_ring`` must equal every
rank's shard in 100% of elements; NCCL's ring must not (for W >= 3).
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from ddplab.numerics import float_format, fsdp_reduction, reduce_scatter

WORLD_SIZES = [2, 3, 4, 5, 6]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
#: Over 2 MiB per rank's shard of float32: 3W segments of at most 1 MiB, not aligned with shards
#: (at W=4; smaller buffers have 2W segments, which shards of 1001 elements also cut).
LARGE_SHARD = (2 << 20) // 4 + 3


def shard_sizes(world_size: int, dtype: torch.dtype) -> list[int]:
    sizes = [250 * world_size, 1001]
    return sizes + [LARGE_SHARD] if dtype == torch.float32 and world_size == 4 else sizes


def contribution(rank: int, dtype: torch.dtype, numel: int) -> torch.Tensor:
    """Rank ``rank``'s input: normal values over a few binades, the same in every process."""
    g = torch.Generator().manual_seed(1_000_003 * rank + 7919 * numel + DTYPES.index(dtype))
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-4, 5, (numel,), generator=g).to(torch.float64))
    return x.to(dtype)


def live_reduce_scatters() -> list:
    """On every rank: this rank's shard from each collective, per (dtype, n)."""
    rank, w = dist.get_rank(), dist.get_world_size()
    out = []
    for dtype in DTYPES:
        for n in shard_sizes(w, dtype):
            x = contribution(rank, dtype, w * n)
            got = {}
            for name, op in (("sum", dist.ReduceOp.SUM), ("avg", dist.ReduceOp.AVG)):
                if name == "avg" and n == LARGE_SHARD:
                    continue
                shard = torch.empty(n, dtype=dtype)
                dist.reduce_scatter_single(shard, x.clone(), op=op)
                got[name] = shard
            if n != LARGE_SHARD:
                shard = torch.empty(n, dtype=dtype)
                dist.reduce_scatter(shard, [t.clone() for t in x.chunk(w)])
                got["list"] = shard
            if dtype == torch.float16:
                # FSDP2's float16 path: pre-divide the input, SUM, post-divide the output.
                how = fsdp_reduction(dtype, w)
                buf, shard = x.clone(), torch.empty(n, dtype=dtype)
                buf.div_(how.pre_divide)
                dist.reduce_scatter_single(shard, buf, op=dist.ReduceOp.SUM)
                if how.post_divide != 1:
                    shard.div_(how.post_divide)
                got["fsdp"] = shard
            out.append(got)
    return out


def bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(float_format(t.dtype).int_dtype)


def match(a: torch.Tensor, b: torch.Tensor) -> float:
    return (bits(a) == bits(b)).double().mean().item()


@pytest.mark.parametrize("world_size", WORLD_SIZES)
def test_emulated_gloo_reduce_scatter_equals_live_gloo_bit_for_bit(warm_launcher, world_size):
    returns = warm_launcher(live_reduce_scatters, world_size=world_size, timeout=240).returns
    k = 0
    other = {"nccl_ring": [], "sequential": []}
    for dtype in DTYPES:
        for n in shard_sizes(world_size, dtype):
            x = torch.stack([contribution(r, dtype, world_size * n) for r in range(world_size)])
            label = f"W={world_size} {dtype} n={n}"
            for name, live_shard in returns[0][k].items():
                live = torch.cat([returns[r][k][name] for r in range(world_size)])
                kwargs = {"sum": dict(op="sum"), "avg": dict(op="avg"), "list": dict(op="sum", list_input=True),
                          "fsdp": fsdp_reduction(dtype, world_size).reduce_scatter_kwargs("gloo_ring")}[name]
                emulated = reduce_scatter(x, "gloo_ring", **kwargs)
                assert match(emulated, live) == 1.0, f"{label} {name}: gloo_ring matches in {match(emulated, live):.4%}"
                if name == "sum":
                    for order in other:
                        other[order].append(match(reduce_scatter(x, order), live))
            k += 1
    if world_size == 2:
        assert all(f == 1.0 for fractions in other.values() for f in fractions)   # a + b == b + a
    else:
        # With W=3 NCCL's shard chain adds the same pair first as gloo's ring where a
        # segment's owner is the shard's, so only some elements differ; never all agree.
        for order, fractions in other.items():
            assert min(fractions) < 1.0, (order, fractions)


def test_gloo_refuses_premul_sum_as_fsdp_reduction_says(warm_launcher):
    """FSDP2's PREMUL_SUM (a divide factor other than W for float32/bfloat16) does not run on gloo."""
    def premul():
        shard = torch.empty(2)
        try:
            dist.reduce_scatter_single(shard, torch.ones(4), op=dist.ReduceOp.PREMUL_SUM(0.5))
        except RuntimeError as exc:
            return str(exc)
        return None

    messages = warm_launcher(premul, world_size=2, timeout=60).returns
    assert fsdp_reduction(torch.float32, 2, gradient_divide_factor=4.0).gloo_supported is False
    assert all(m is not None and "PREMUL_SUM" in m for m in messages), messages

"""The emulator refuses, before any work, what it cannot do in O(N) memory and bounded time."""
from __future__ import annotations

import pytest
import torch

from ddplab.numerics import reduce
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.limits import MAX_ADDITIONS, MAX_PROGRAM_STEPS, check_additions, check_program_steps
from ddplab.numerics.orders import ORDERS
from ddplab.numerics.reduce_scatter import REDUCE_SCATTER_ORDERS, reduce_scatter


class CountingRows:
    """A row callable that counts its calls: a refusal must come before any row is made."""

    def __init__(self, numel: int):
        self.numel, self.calls = numel, 0

    def __call__(self, rank: int) -> torch.Tensor:
        self.calls += 1
        return torch.full((self.numel,), float(rank))


@pytest.mark.parametrize("order", ORDERS)
def test_issue_33s_65536_ranks_of_65536_elements_are_refused_with_the_limit(order):
    rows = CountingRows(65536)
    with pytest.raises(ValueError, match=f"W·N = 4.29e\\+09 additions; the emulator does at most {MAX_ADDITIONS}"):
        reduce(as_contributions(rows, 65536, numel=65536, dtype=torch.float32), order)
    assert rows.calls == 0


@pytest.mark.parametrize("order", REDUCE_SCATTER_ORDERS)
def test_the_reduce_scatter_of_65536_ranks_is_refused_too(order):
    rows = CountingRows(65536)
    with pytest.raises(ValueError, match="additions; the emulator does at most"):
        reduce_scatter(as_contributions(rows, 65536, numel=65536, dtype=torch.float32), order)
    assert rows.calls == 0


@pytest.mark.parametrize("run", [
    lambda c: reduce(c, "gloo_ring"),
    lambda c: reduce(c, "nccl_ring"),
    lambda c: reduce_scatter(c, "nccl_ring", shard=0),          # W programs, even for one shard
    lambda c: reduce_scatter(c, "gloo_ring", list_input=True, shard=0),
], ids=["gloo_ring", "nccl_ring", "rs_nccl_ring", "rs_gloo_list"])
def test_a_ring_over_too_many_ranks_is_refused_before_its_programs_are_built(run):
    # 2048 ranks of 4096 elements: few additions, but 2048 programs of 4095 steps (O(W^2)).
    rows = CountingRows(4096)
    with pytest.raises(ValueError, match=f"needs 2048 summation programs of 4095 steps .*at most {MAX_PROGRAM_STEPS}"):
        run(as_contributions(rows, 2048, numel=4096, dtype=torch.float32))
    assert rows.calls == 0


def test_orders_with_few_programs_run_past_the_rings_limit():
    # One or two programs: O(W) memory, so 8192 ranks are fine where a ring is refused.
    x = torch.randn(8192, 64, generator=torch.Generator().manual_seed(0))
    for order in ("sequential", "pairwise", "nccl_tree"):
        assert reduce(x, order).shape == (64,)
    # A ring over many ranks of few elements has as many programs as owned segments: allowed.
    assert reduce(x[:, :8], "gloo_ring").shape == (8,)


def test_the_limits_are_inclusive_and_name_the_largest_ring():
    check_additions(1024, 1 << 20, "reduce")
    with pytest.raises(ValueError):
        check_additions(1024, (1 << 20) + 1, "reduce")
    check_program_steps(1448, 1448, "gloo_ring")
    with pytest.raises(ValueError, match="a ring of at most 1448 ranks"):
        check_program_steps(1449, 1449, "gloo_ring")

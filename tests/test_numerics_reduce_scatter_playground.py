"""The numerics playground's reduce-scatter mode (no processes)."""
from __future__ import annotations

import pytest
import torch

from ddplab.explore import PLAYGROUND_OPERATIONS, NumericsPlayground, playground_contributions, playground_numel
from ddplab.numerics import reduce_scatter


def test_playground_switches_to_reduce_scatter_and_back():
    pg = NumericsPlayground(world_size=4, numel=2001, orders=("pairwise", "nccl_tree", "nccl_ring"))
    assert set(pg.results) == {"pairwise", "nccl_tree", "nccl_ring"}
    pg.operation.value = "reduce-scatter"
    # NCCL has no tree reduce-scatter: it is no longer offered, the others stay chosen.
    assert tuple(pg.orders.options) == PLAYGROUND_OPERATIONS["reduce-scatter"]
    assert set(pg.results) == {"pairwise", "nccl_ring"}
    assert "reduce-scatter" in pg.status.value and "2004 elements" in pg.status.value
    assert all(m["classification"] == "rounding" and m["numel"] == 2004 for m in pg.results.values())
    c = playground_contributions("normal", 4, 2004, torch.float32)
    errors = pg.results["nccl_ring"]["ulp_errors"]
    # The playground's numbers are those of the emulated reduce-scatter (its own errors, not the all-reduce's).
    from ddplab.numerics import exact_sum, ulp_distance
    assert torch.equal(errors, ulp_distance(reduce_scatter(c, "nccl_ring"), exact_sum(c)))
    pg.world_size.value = 64
    assert all(m["numel"] == 2048 for m in pg.results.values())
    pg.operation.value = "all-reduce"
    assert set(pg.results) == {"pairwise", "nccl_ring"} and pg.results["pairwise"]["numel"] == 2001


def test_playground_numel_and_bad_operation():
    assert playground_numel("reduce-scatter", 10, 4) == 12 and playground_numel("all-reduce", 10, 4) == 10
    with pytest.raises(ValueError, match="unknown operation"):
        NumericsPlayground(operation="all-gather")

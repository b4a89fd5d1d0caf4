"""Accumulation without no_sync: every micro-batch all-reduces, and the replay follows each all-reduce.

Correct code reads exact with every reduction replayed; a fault of one ulp on one rank is a bug at
its step, rank and phase, as with no_sync.
"""
from __future__ import annotations

import sys

import cloudpickle
import pytest

from ddplab import compare
from ddplab.compare import examples, faults

from test_compare_compiled import readme_example

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def test_the_readme_accumulation_without_no_sync_reads_exact_reduction_by_reduction(warm_launcher):
    namespace = readme_example("no_sync=False")
    result = namespace["result"]
    label = "accumulate W=2 k=2 sync every micro-batch"
    assert namespace["printed"].strip() == str({label: "exact"})
    v = result.verdict(label)
    assert (v.kind, v.evidence) == ("exact", "replay"), v.headline
    rows = result.records[(result.records["metric"] == "replay_differing") & (result.records["config"] == label)]
    assert rows["value"].sum() == 0
    # k = 2 all-reduces per step, each parameter's local gradient and reduced gradient on every rank.
    params = set(result.records[result.records["metric"] == "band"]["param"]) - {"(model)"}
    for phase in ("local_gradient", "reduction"):
        grads = rows[(rows["phase"] == phase) & (rows["quantity"] == "grad")]
        assert grads.groupby(["step", "rank"]).size().tolist() == [2 * len(params)] * (2 * result.steps)


@pytest.mark.parametrize("kind", ["local_gradient", pytest.param("skipped_micro_batch", marks=pytest.mark.slow)])
def test_a_one_ulp_fault_is_a_bug_at_its_step_rank_and_phase(kind, warm_launcher):
    fault = faults.plant(kind, "ulp")
    config = compare.Accumulate(2, k=2, no_sync=False)
    v = compare.run(fault.setup, config, progress=False).verdict(config)
    assert fault.placed(v), (fault.phase, v.evidence, v.headline)


def _rank_one_scales_its_first_micro_batch(ctx):
    """Accumulation without no_sync in a Custom step, rank 1's first micro-batch loss one part in 10^6 off."""
    ctx.optimizer.zero_grad(set_to_none=True)
    for m, micro in enumerate(ctx.micro_batches):
        loss = ctx.forward_loss(micro) / ctx.k
        if ctx.rank == 1 and m == 0:
            loss = loss * (1 + 1e-6)
        loss.backward()
    ctx.optimizer.step()


@pytest.mark.slow
def test_the_twin_compares_every_reduction_of_a_custom_accumulation(warm_launcher):
    """The fault enters the first all-reduce only; the last one's inputs agree again across ranks."""
    config = compare.Custom(2, k=2, train_step=_rank_one_scales_its_first_micro_batch)
    v = compare.run(examples.digits_setup(0, steps=2), config, progress=False).verdict(config)
    assert (v.kind, v.evidence, v.difference) == ("bug", "twin", "asymmetry"), v.headline
    assert (v.values["twin_step"], v.values["twin_rank"], v.values["twin_quantity"], v.values["twin_param"]) == \
        (0, 1, "collective", "#0 allreduce (bucket 0)")

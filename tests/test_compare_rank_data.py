"""Per-rank data under compare: each rank's own batches (a real DistributedSampler) beside the global ones.

A sampler's padding trains a sample twice at the last step: a bug at that step, the sample named;
with drop_last the same loaders read exact; uneven shares that hold every sample once are weighted
as DDP weighs them and read exact; a sample no rank trains is a missing contribution.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import cloudpickle
import pytest
import torch

from ddplab import compare
from ddplab.compare import data, examples
from ddplab.compare.setup import SetupError

from test_compare_compiled import readme_example

cloudpickle.register_pickle_by_value(sys.modules[__name__])


def _global_batches(sizes=(32, 32, 6)) -> list[tuple]:
    images, labels = examples.digits_setup(0, steps=3, batch_size=sum(sizes)).batches()[0]
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    return [(images[s:s + n], labels[s:s + n]) for s, n in zip(starts, sizes)]


def _uneven(rank: int, world: int, step: int, *, drop: int = 0) -> tuple:
    """Each global batch cut into W contiguous shares as equal as they come (for two ranks, the last
    step 4 and 2 samples); ``drop`` samples fewer for the last rank at step 1."""
    batch = _global_batches()[step]
    size = batch[0].shape[0]
    cut = [4, 2] if (step, world) == (2, 2) else [size // world + (r < size % world) for r in range(world)]
    share = tuple(t.split(cut)[rank] for t in batch)
    return tuple(t[:len(t) - drop] for t in share) if (drop and step == 1 and rank == world - 1) else share


def _setup(rank_batches) -> compare.Setup:
    return dataclasses.replace(examples.digits_setup(0, steps=3), batches=_global_batches(), rank_batches=rank_batches)


# --------------------------------------------------------------------------- without ranks


def test_samples_are_counted_by_their_bytes_and_named_where_they_first_appear():
    setup = _setup(functools.partial(_uneven, drop=2))
    recs = data.sample_records(setup, compare.DDP(2), _global_batches())
    checked = [r for r in recs if r["metric"] == "data_checked"]
    assert [(r["step"], r["shares"], r["uneven"]) for r in checked] == [(0, "16,16", False), (1, "16,14", True),
                                                                         (2, "4,2", True)]
    missing = [(r["step"], r["sample"], r["value"], r["kind"]) for r in recs if r["metric"] == "data_difference"]
    assert missing == [(1, "step 1 sample 30", -1, "missing_contribution"),
                       (1, "step 1 sample 31", -1, "missing_contribution")]
    assert data.sample_records(examples.digits_setup(0, steps=1), compare.DDP(2), _global_batches()) == []


def test_one_process_weighs_uneven_complete_shares_as_ddp_does():
    setup, batches = _setup(_uneven), _global_batches()
    assert data.reference_parts(setup, batches[0], 0, 2) == [batches[0]]      # even: one mean
    parts = data.reference_parts(setup, batches[2], 2, 2)
    assert [p[0].shape[0] for p in parts] == [4, 2]                            # uneven: the shares' means
    broken = _setup(functools.partial(_uneven, drop=2))
    assert data.reference_parts(broken, batches[1], 1, 2) == [batches[1]]     # not the batch's samples


def test_per_rank_batches_that_do_not_fit_are_refused_before_any_rank_starts():
    setup = _setup(_uneven)
    with pytest.raises(SetupError, match=r"rank_batches\(1, 2, 2\) has 2 samples.*4 equal micro-batches"):
        data.check_rank_batches(setup, 3, [compare.Accumulate(2, k=4)])
    with pytest.raises(SetupError, match="one world size at a time"):
        data.check_rank_batches(setup, 3, [compare.DDP(2), compare.DDP(3)])
    with pytest.raises(SetupError, match="per-sample shapes"):
        data.check_rank_batches(_setup(lambda r, w, s: (torch.zeros(2, 3), torch.zeros(2))), 1, [compare.DDP(2)])


# --------------------------------------------------------------------------- on real ranks


def test_the_readme_distributed_sampler_pads_a_duplicate_and_drop_last_reads_exact(warm_launcher):
    namespace = readme_example("DistributedSampler(dataset")
    padded, dropped = namespace["verdicts"][False], namespace["verdicts"][True]
    assert (padded.kind, padded.evidence, padded.difference, padded.first_divergence) == \
        ("bug", "data", "duplicated_contribution", 2)
    assert padded.values["data_samples"] == ["step 0 sample 0"] and padded.values["data_rank"] == 1
    assert (dropped.kind, dropped.evidence) == ("exact", "replay"), dropped.headline
    assert dropped.finding("data").holds


@pytest.fixture(scope="module")
def uneven_runs(warm_launcher):
    return (compare.run(_setup(_uneven), compare.DDP(2), progress=False),
            compare.run(_setup(functools.partial(_uneven, drop=2)), compare.DDP(2), progress=False))


def test_uneven_shares_with_every_sample_once_read_exact(uneven_runs):
    v = uneven_runs[0].verdict("ddp W=2")
    assert (v.kind, v.evidence) == ("exact", "replay"), v.headline
    assert v.finding_values("data")["uneven_steps"] == [2]


@pytest.mark.slow
def test_every_configuration_trains_the_ranks_own_batches(warm_launcher):
    configs = [compare.Accumulate(2, k=2), compare.FSDP2(2), compare.Custom(2, train_step=examples.plain_step)]
    result = compare.run(_setup(_uneven), configs, progress=False)
    assert result.verdict(configs[0]).kind == "exact", result.verdict(configs[0]).headline
    for config in configs[1:]:
        v = result.verdict(config)
        assert (v.kind, v.evidence) == ("rounding", "float64"), (config.label, v.headline)
        assert v.finding("twin").holds and v.finding("data").holds
    broken = compare.run(_setup(functools.partial(_uneven, drop=2)), configs, progress=False)
    for config in configs:
        v = broken.verdict(config)
        assert (v.kind, v.evidence, v.first_divergence) == ("bug", "data", 1), (config.label, v.headline)


def test_a_sample_no_rank_trains_is_a_missing_contribution_at_its_step(uneven_runs):
    v = uneven_runs[1].verdict("ddp W=2")
    assert (v.kind, v.evidence, v.difference, v.first_divergence) == ("bug", "data", "missing_contribution", 1)
    assert v.values["data_samples"] == ["step 1 sample 30", "step 1 sample 31"]

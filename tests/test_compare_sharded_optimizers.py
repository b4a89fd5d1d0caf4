"""Sharded optimizers under compare: a real ZeroRedundancyOptimizer on real gloo ranks.

Each rank's own shard of the state is captured (never the collective state_dict), the replay
steps each shard bit for bit and checks the broadcast of every shard against its owner; a Custom
step may step an optimizer it built itself; a learning rate changed on one rank's shard is a bug.
"""
from __future__ import annotations

import dataclasses
import functools
import sys

import cloudpickle
import pytest
import torch
import torch.distributed as dist
from torch.distributed.optim import ZeroRedundancyOptimizer

from ddplab import compare
from ddplab.compare import examples, sharded_optimizers, stand_in

from test_compare_compiled import readme_example

cloudpickle.register_pickle_by_value(sys.modules[__name__])

STEPS = 2


def _zero(params, inner=torch.optim.SGD, **kwargs):
    return ZeroRedundancyOptimizer(params, optimizer_class=inner, **kwargs)


class _RankOneLearningRate(ZeroRedundancyOptimizer):
    """Rank 1 builds its shard's optimizer with a learning rate one part in 10^6 off."""

    def __init__(self, params, **kwargs):
        if dist.get_rank() == 1:
            kwargs["lr"] = kwargs["lr"] * (1 + 1e-6)
        super().__init__(params, **kwargs)


def _own_zero_adam(ctx):
    """A Custom step that builds and steps its own ZeRO over Adam, kept in ctx.state."""
    if "optimizer" not in ctx.state:
        ctx.state["optimizer"] = _zero(ctx.model.parameters(), torch.optim.Adam, lr=0.01)
    optimizer = ctx.state["optimizer"]
    optimizer.zero_grad(set_to_none=True)
    loss = ctx.forward_loss(ctx.shard)
    loss.backward()
    optimizer.step()
    return loss


def _no_step(ctx):
    ctx.forward_loss(ctx.shard).backward()


# --------------------------------------------------------------------------- without ranks


def test_a_shard_is_captured_and_restored_per_rank_without_a_collective():
    model = examples._build("mlp", 0)
    named = compare.setup.named_trainable(model)
    with stand_in.process_group(1, 2):
        zero = _zero(model.parameters(), torch.optim.Adam, lr=0.01)
        model(torch.randn(4, 64)).sum().backward()
        zero.step()
        captured = sharded_optimizers.capture_state(zero, named)
        again = _zero(model.parameters(), torch.optim.Adam, lr=0.01)
        assert sharded_optimizers.restore_state(again, named, captured)
    mine = [n for n, _ in named if n in captured["owned"]]
    assert mine and len(mine) < len(named)  # rank 1 of 2 owns some, not all
    assert set(captured["state"]) == set(mine)
    assert all(torch.equal(captured["state"][n]["exp_avg"], again.optim.state[p]["exp_avg"])
               for n, p in named if n in mine)
    assert sharded_optimizers.capture_state(torch.optim.SGD(model.parameters(), lr=0.1), named) is None
    assert not dist.is_initialized()


# --------------------------------------------------------------------------- on real ranks


@pytest.fixture(scope="module")
def zero_runs(warm_launcher):
    """ZeRO over SGD with momentum (README: over Adam), in DDP and accumulation; a Custom step that
    builds its own ZeRO over Adam."""
    sgd = dataclasses.replace(examples.digits_setup(0, steps=STEPS),
                              optimizer=functools.partial(_zero, lr=0.1, momentum=0.9))
    adam = dataclasses.replace(examples.digits_setup(0, steps=STEPS),
                               optimizer=functools.partial(_zero, inner=torch.optim.Adam, lr=0.01))
    return (compare.run(sgd, [compare.DDP(2), compare.Accumulate(2, k=2)], progress=False),
            compare.run(adam, compare.Custom(2, train_step=_own_zero_adam), progress=False))


def _every_shard_replayed(result, label: str) -> None:
    v = result.verdict(label)
    assert (v.kind, v.evidence) == ("exact", "replay"), (label, v.headline)
    rows = result.records[(result.records["metric"] == "replay_differing") & (result.records["config"] == label)]
    assert rows["value"].sum() == 0
    # Every parameter on every rank and step: the owner's update against the replay of its shard, the
    # others' copy against the owner's (the broadcast).
    update = rows[(rows["phase"] == "update") & (rows["quantity"] == "param")]
    params = set(result.records[result.records["metric"] == "band"]["param"]) - {"(model)"}
    assert update.groupby(["step", "rank"])["param"].apply(set).tolist() == [params] * (2 * STEPS)


def test_zero_over_sgd_reads_exact_shard_by_shard(zero_runs):
    for label in ("ddp W=2", "accumulate W=2 k=2"):
        _every_shard_replayed(zero_runs[0], label)


def test_the_readme_zero_over_adam_reads_exact_shard_by_shard(warm_launcher):
    namespace = readme_example("ZeroRedundancyOptimizer(params")
    assert "{'ddp W=2': 'exact'}" in namespace["printed"]
    _every_shard_replayed(namespace["result"], "ddp W=2")


def test_a_custom_step_may_step_its_own_sharded_optimizer(zero_runs):
    v = zero_runs[1].verdict("_own_zero_adam W=2")
    assert (v.kind, v.evidence) == ("rounding", "float64"), v.headline
    assert v.finding("twin").holds and v.finding("ranks_agree").holds


def test_a_learning_rate_off_on_one_ranks_shard_is_a_bug_in_its_update(warm_launcher):
    setup = dataclasses.replace(examples.digits_setup(0, steps=STEPS),
                                optimizer=functools.partial(_RankOneLearningRate, optimizer_class=torch.optim.SGD,
                                                            lr=0.1))
    v = compare.run(setup, compare.DDP(2), progress=False).verdict("ddp W=2")
    assert (v.kind, v.evidence) == ("bug", "replay"), v.headline
    assert (v.values["replay_step"], v.values["replay_rank"], v.values["replay_phase"]) == (0, 1, "update")


def test_a_custom_step_that_steps_no_optimizer_is_told_about_ctx_optimizer(warm_launcher):
    config = compare.Custom(2, train_step=_no_step)
    result = compare.run(examples.digits_setup(0, steps=1), config, progress=False)
    assert result.verdict(config).kind == "crashed"
    assert "ctx.optimizer.step()" in str(result.errors[config.label])


"""Non-finite values are a finding, not a crash: the steps before them are judged, the first one is named."""
from __future__ import annotations

import dataclasses

import pytest

from ddplab import compare
from ddplab.compare import comparison, examples
from ddplab.compare.setup import global_batches


def nan_on_rank_1_at_step_1(ctx):
    """Planted: rank 1's loss turns NaN at step 1 (one process never sees it)."""
    ctx.optimizer.zero_grad()
    loss = ctx.forward_loss(ctx.shard)
    if ctx.rank == 1 and ctx.step == 1:
        loss = loss * float("nan")
    loss.backward()
    ctx.optimizer.step()
    return loss.item()


@pytest.mark.parametrize("judged", ["in the parent", "where the references train"])
def test_a_nan_in_the_data_is_named_and_the_steps_before_it_judged(warm_launcher, monkeypatch, judged):
    if judged == "where the references train":   # as for a large model: the reference process finds its NaN
        monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)
    setup = examples.digits_setup(0, steps=3)
    batches = [tuple(t.clone() for t in b) for b in global_batches(setup)]
    batches[2][0].view(-1)[77] = float("nan")               # one NaN pixel in the third batch
    setup = dataclasses.replace(setup, batches=batches)
    result = compare.run(setup, [compare.DDP(2), compare.Custom(2, train_step=nan_on_rank_1_at_step_1)],
                         progress=False)
    ddp = result.verdict("ddp W=2")
    assert ddp.kind == "exact"                              # steps 0 and 1, bit for bit
    finite = ddp.finding_values("finite")
    assert (finite["nonfinite_step"], finite["reference_step"]) == (2, 2)
    assert ddp.finding_values("within_band")["steps_compared"] == 2
    planted = result.verdict("nan_on_rank_1_at_step_1 W=2")
    assert (planted.kind, planted.evidence, planted.difference) == ("bug", "finite", "nonfinite")
    # the data's NaN at step 2 comes later: the planted one at step 1 is first; the reference, trained on
    # past that cut, still says where it turns non-finite
    assert planted.values["nonfinite_step"] == 1 and planted.values["reference_step"] == 2
    judged_steps = result.records[result.records["metric"] == "deviation"].groupby("config")["step"].max()
    assert judged_steps.to_dict() == {"ddp W=2": 1, "nan_on_rank_1_at_step_1 W=2": 0, "reference": 1}


def test_a_tensor_another_rank_shares_is_looked_at_once_and_a_rank_s_own_nan_is_still_found():
    import torch

    from ddplab.compare.finite import nonfinite_at

    shared, own = torch.randn(1000), torch.randn(1000)
    finite: dict = {}
    assert nonfinite_at(dict(params={"w": shared}), finite) is None and len(finite) == 1
    own[3] = float("inf")
    rank_1 = dict(params={"w": shared[:], "b": own})          # rank 0's tensor (a view of the same elements)
    assert nonfinite_at(rank_1, finite) == dict(quantity="param", param="b", count=1)
    shared[5] = float("nan")                                  # already looked at in this step: not again
    assert nonfinite_at(dict(params={"w": shared}), finite) is None
    assert nonfinite_at(dict(params={"w": shared})) == dict(quantity="param", param="w", count=1)

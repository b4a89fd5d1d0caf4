"""The specification replay referee on real gloo ranks: correct runs are exact, every planted
quiet fault of any size -- down to one ulp in one element on one rank -- is a bug placed at the
right step, rank and phase; the float64 promise names semantic bugs; dropout is compared too."""
from __future__ import annotations

import dataclasses
import functools

import pytest
import torch
import torch.nn as nn

from ddplab import compare
from ddplab.compare import examples, faults, replay


def _verdict(setup, config):
    result = compare.run(setup, [config], progress=False)
    return result, result.verdict(config.label)


@pytest.mark.parametrize("config", [compare.DDP(2), compare.Accumulate(2, k=2), compare.DDP(3, bucket_cap_mb=0.001),
                                    compare.DDP(4)], ids=["ddp2", "accumulate", "ddp3-small-buckets", "ddp4"])
def test_correct_runs_equal_the_replay_bit_for_bit(config, warm_launcher):
    # W=4 rebuilds its buckets after the first backward: the replay follows the live layout.
    setup = examples.digits_setup(0, steps=3, batch_size=48)
    result, v = _verdict(setup, config)
    assert v.kind == "exact" and v.referee == "replay"
    rows = result.records[result.records["metric"] == "replay_differing"]
    assert set(rows["phase"]) == set(replay.PHASES)
    assert set(rows["rank"]) == set(range(config.world_size)) and rows["value"].sum() == 0
    assert result.verdict(config.label).finding_values("semantic")["max_semantic_distance"] < 1e-13
    # The bucket audit: every reduction is gloo's ring bit for bit, judged by its bits alone.
    audit = result.records[result.records["metric"] == "frac_matches_order"]
    assert not audit.empty and (audit["value"] == 1).all() and set(audit["evidence"]) == {"bitwise"}
    assert v.finding("reduction").holds


@pytest.mark.parametrize("kind", faults.KINDS)
@pytest.mark.parametrize("magnitude", [1e-3, "ulp"])
def test_every_planted_fault_is_a_bug_at_its_step_rank_and_phase(kind, magnitude, warm_launcher):
    if kind in ("skipped_micro_batch", "duplicated_micro_batch", "low_precision_bucket") and magnitude != "ulp":
        pytest.skip("this fault has one size")
    fault = faults.plant(kind, magnitude)
    result, v = _verdict(fault.setup, fault.config)
    assert v.kind == "bug"
    assert fault.placed(v), (fault.phase, v.evidence, v.headline)
    if kind == "low_precision_bucket":   # bits that differ from the order are measured whole
        audit = result.records[result.records["collective"] == "allreduce"]
        assert not v.finding("reduction").holds and (audit["metric"] == "max_bound_ratio").any()
    if magnitude == "ulp" and kind == "local_gradient":
        assert v.values["replay_differing"] == 1 and v.values["replay_max_ulp"] == 1.0
        assert v.values["replay_module"] == faults.LAYER


def test_ranks_that_disagree_are_a_bug_whatever_the_band(warm_launcher):
    fault = faults.plant("reduced_gradient", 1e-7)
    _, v = _verdict(fault.setup, fault.config)
    assert (v.kind, v.referee, v.difference) == ("bug", "replicas", "desync")
    assert v.values["desync_step"] == 0 and v.values["desync_rank"] == 1
    assert v.finding_values("ranks_agree")["rank"] == 1


def test_a_forward_fault_names_its_module(warm_launcher):
    fault = faults.plant("local_gradient", 1e-3)
    setup = dataclasses.replace(fault.setup, model=functools.partial(faults._model_with_forward_fault, 0, 1e-3, 1))
    _, v = _verdict(setup, fault.config)
    assert v.values["replay_phase"] == "local_gradient" and v.values["replay_rank"] == 1
    assert v.values["replay_module"] == faults.LAYER
    assert v.finding_values("replay")["found_by"] == "forward_output"


def test_a_summed_loss_is_semantic_with_factor_one_over_w(warm_launcher):
    setup = examples.digits_setup(0, steps=2, reduction="sum")
    _, v = _verdict(setup, compare.DDP(2))
    assert (v.kind, v.referee, v.difference) == ("bug", "semantic", "factor")
    sem = v.finding_values("semantic")
    assert sem["kind"] == "factor" and sem["factor"] == pytest.approx(0.5, rel=1e-6)
    assert v.finding_values("replay")["complete"]  # DDP did exactly what it promises


def _batchnorm_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 10))


def test_per_rank_batchnorm_is_semantic_other(warm_launcher):
    setup = dataclasses.replace(examples.digits_setup(0, steps=2), model=_batchnorm_model)
    _, v = _verdict(setup, compare.DDP(2))
    assert (v.kind, v.referee) == ("bug", "semantic")
    assert v.finding_values("semantic")["kind"] == "other"


def _dropout_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 32), nn.Dropout(0.3), nn.Tanh(), nn.Linear(32, 10))


def test_dropout_is_replayed_from_each_ranks_rng_state(warm_launcher):
    setup = dataclasses.replace(examples.digits_setup(0, steps=2), model=_dropout_model)
    result, v = _verdict(setup, compare.DDP(2))
    assert v.kind == "exact"
    assert "semantic" not in [f.key for f in v.findings]  # one process draws other masks: not asked


def test_a_custom_step_has_no_replay_and_says_why(warm_launcher):
    config = compare.Custom(2, k=2, train_step=examples.accumulate_correctly)
    _, v = _verdict(examples.digits_setup(0, steps=2), config)
    # No replay: rounding is earned by the user's own code in float64 and the symmetric twin instead.
    assert (v.evidence, v.kind) == ("float64", "rounding")
    assert v.finding("twin").holds and v.finding("float64").holds
    assert v.finding_values("float64")["max_float64_distance"] < 1e-13
    assert v.finding_values("replay")["reason"] == replay.unavailable(examples.digits_setup(0), config)


def test_before_step_runs_in_the_reference_and_the_replay(warm_launcher):
    clip = functools.partial(_clip, max_norm=0.05)
    setup = dataclasses.replace(examples.digits_setup(0, steps=3), before_step=clip)
    _, v = _verdict(setup, compare.DDP(2))
    assert v.kind == "exact"


def _clip(model, max_norm):
    nn.utils.clip_grad_norm_(model.parameters(), max_norm)


@pytest.mark.parametrize("kind", faults.FSDP_KINDS)
def test_fsdp2_bfloat16_faults_are_placed(kind, warm_launcher):
    fault = faults.plant(kind, "ulp" if kind == "optimizer" else 1e-2, fsdp=True)
    _, v = _verdict(fault.setup, fault.config)
    assert fault.placed(v), (fault.phase, v.evidence, v.headline)


def test_bad_faults_are_refused():
    with pytest.raises(ValueError, match="unknown fault"):
        faults.plant("cosmic_ray")
    with pytest.raises(ValueError, match="magnitude"):
        faults.plant("optimizer", -1)


def test_the_update_phase_borrows_the_reduced_buckets_and_never_writes_them():
    """With no before_step and a torch optimizer the replay's gradients are the rank's reduced bucket
    itself: a rank whose gradients differ from it is still stepped with its own, and neither is written."""
    from ddplab.compare.replay import _Emitter, _replay_update
    from ddplab.compare.setup import named_trainable

    setup = examples.digits_setup(0, steps=1)
    model = setup.build_model()
    named = named_trainable(model)
    result = torch.randn(sum(p.numel() for _, p in named))
    views, offset = {}, 0
    for name, p in named:
        views[name] = result[offset:offset + p.numel()].view_as(p)
        offset += p.numel()
    grads = dict(views)
    first = named[0][0]
    grads[first] = views[first].clone()
    grads[first].view(-1).view(torch.int32)[3] += 1                     # one ulp off its bucket on this rank
    kept = result.clone()
    params = {name: p.detach().clone() for name, p in named}
    optimizer = torch.optim.SGD([p for _, p in named], lr=0.1)
    for name, p in named:
        p.grad = grads[name].clone()
    optimizer.step()                                                     # what the rank's step gave
    cap = dict(buckets=[dict(index=0, names=[n for n, _ in named], result=result, round=0)], grads=grads,
               params={name: p.detach().clone() for name, p in named}, threads=None)
    replayed = setup.build_model()
    with torch.no_grad():
        for name, p in named_trainable(replayed):
            p.copy_(params[name])
    em = _Emitter(compare.DDP(2))
    _replay_update(em, setup, compare.DDP(2), 0, 1, cap, replayed, None, {})
    assert torch.equal(result.view(torch.int32), kept.view(torch.int32))          # never written
    differing = {(r["quantity"], r["param"]): r["value"] for r in em.out}
    assert differing[("grad", first)] == 1 and sum(differing.values()) == 1      # the params are the rank's

"""Probes: fingerprints, the cross-rank gradient check, the detached-reducer guard.

Real gloo ranks through ddplab.launch; no mocks of torch.distributed.
"""
from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab import probes
from ddplab.probes import DetachedReducerError, ReducerGuard


def small_net(seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3)).to(dtype)


def backward(model, step=0, seed=0):
    """One backward on data that differs per rank (so unreduced gradients differ)."""
    torch.manual_seed(1000 * seed + 10 * dist.get_rank() + step)
    dtype = next(model.parameters()).dtype
    model.zero_grad()
    model(torch.randn(7, 6, dtype=dtype)).pow(2).sum().backward()


def _raises(fn, *args):
    try:
        fn(*args)
    except DetachedReducerError as err:
        return err
    return None


# ---------------------------------------------------------------- worker functions


def fingerprint_around_wrapping():
    """DDP copies rank 0's weights to the others: rank 0 keeps every bit, rank 1 does not."""
    model = small_net(seed=dist.get_rank())
    before = probes.fingerprint(model)
    ddp = DDP(model)
    return probes.diff_fingerprints(before, probes.fingerprint(ddp))


def planted_gradient_faults():
    out = {}
    ddp = DDP(small_net())
    backward(ddp)
    out["clean"] = probes.grads_in_sync(ddp, step=0)
    # Gradients scaled on one rank after the reduction.
    if dist.get_rank() == 1:
        ddp.module[0].weight.grad.mul_(2)
    out["scaled"] = probes.grads_in_sync(ddp, step=1)
    # A rank that skips the reduction: it keeps the gradient of its own data.
    backward(ddp.module, step=2)  # the bare module: the reducer ignores this backward
    local = [p.grad.clone() for p in ddp.parameters()]
    backward(ddp, step=2)
    if dist.get_rank() == 1:
        for p, g in zip(ddp.parameters(), local):
            p.grad = g  # rank 1 keeps its local gradient, as if it never reduced
    out["skipped"] = probes.grads_in_sync(ddp, step=2)
    return out


def detached_reducer_scenarios():
    out = {}
    # 1. Seed 003 on CPU: a dtype round trip after wrapping, unguarded: silent divergence.
    ddp = DDP(small_net())
    backward(ddp)
    out["before_move_in_sync"] = probes.grads_in_sync(ddp, emit=False).in_sync
    ddp.double()
    ddp.float()
    backward(ddp, step=1)  # no error, no warning
    out["unguarded_mismatched"] = probes.grads_in_sync(ddp, emit=False).mismatched

    # 2. Guard created at wrapping time: caught before the first forward after the move.
    ddp = DDP(small_net())
    guard = ReducerGuard(ddp)
    backward(ddp)
    ddp.double()
    ddp.float()
    out["guarded"] = _raises(backward, ddp, 1)
    guard.close()

    # 3. Guard created after the move: caught after the first backward that fails to reduce.
    ddp = DDP(small_net())
    ddp.double()
    ddp.float()
    ReducerGuard(ddp, sync_checks=1)
    out["late"] = _raises(backward, ddp, 1)

    # 4. A one-way move before the guard: its buckets still hold float32.
    ddp = DDP(small_net())
    ddp.double()
    out["one_way"] = _raises(ReducerGuard, ddp)

    # 5. The fix: move the bare module and wrap it again; the guard stays quiet.
    ddp = DDP(small_net())
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    ddp = probes.move_ddp_model(ddp, dtype=torch.float64)
    guard = ReducerGuard(ddp, sync_checks=3)
    for step in range(3):
        backward(ddp, step)
        opt.step()  # the optimizer still holds the same Parameter objects
    out["rewrapped_dtype"] = str(next(ddp.parameters()).dtype)
    out["rewrapped_in_sync"] = probes.grads_in_sync(ddp, emit=False).in_sync
    out["rewrapped_params_equal"] = probes.fingerprint(ddp)
    guard.close()

    # 6. no_sync() is unreduced on purpose: the guard's sync check skips it.
    ddp = DDP(small_net())
    guard = ReducerGuard(ddp, sync_checks=2)
    with ddp.no_sync():
        backward(ddp)
    torch.manual_seed(dist.get_rank())
    ddp(torch.randn(7, 6)).pow(2).sum().backward()  # accumulates, then reduces
    out["no_sync_in_sync"] = probes.grads_in_sync(ddp, emit=False).in_sync
    out["no_sync_checks_left"] = guard.sync_checks_left
    return out


def clean_training_across_seeds(seeds):
    """Guarded DDP training on every seed: gradients always in sync, no alarm."""
    alarms = []
    for seed in seeds:
        ddp = DDP(small_net(seed))
        guard = ReducerGuard(ddp, sync_checks=2)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
        for step in range(2):
            backward(ddp, step, seed)
            result = probes.grads_in_sync(ddp, step=step, seed=seed)
            if not result.in_sync:
                alarms.append((seed, step, result.mismatched))
            opt.step()
        guard.close()
    detached = DDP(small_net(99))
    ReducerGuard(detached)
    detached.double()
    detached.float()
    err = _raises(backward, detached, 0)
    return alarms, err is not None and err.params


# ---------------------------------------------------------------- tests


def test_fingerprint_diff_shows_ddp_changed_no_bit_on_rank_0(no_leftovers):
    res = no_leftovers(fingerprint_around_wrapping, world_size=2, timeout=60)
    assert res.returns[0] == []
    changed = res.returns[1]
    assert [(c["param"], c["change"]) for c in changed] == [
        ("0.weight", "bytes"), ("0.bias", "bytes"), ("2.weight", "bytes"), ("2.bias", "bytes")]


def test_grads_in_sync_flags_scaled_and_unreduced_gradients(no_leftovers):
    res = no_leftovers(planted_gradient_faults, world_size=2, timeout=60)
    out = res.returns[0]
    assert out["clean"].in_sync and set(out["clean"].max_abs_diff.values()) == {0.0}
    scaled = out["scaled"]
    assert scaled.mismatched == ["0.weight"]
    assert scaled.max_abs_diff["0.weight"] > 0
    assert out["skipped"].mismatched == ["0.weight", "0.bias", "2.weight", "2.bias"]
    assert res.returns[1]["skipped"].mismatched == out["skipped"].mismatched  # same verdict everywhere
    recs = res.records
    equal = recs[(recs["metric"] == "grad_bitwise_equal") & (recs["step"] == 1)]
    # Rank 1 reports its scaled gradient as not equal to rank 0's; rank 0 trivially equal.
    by_rank = equal[equal["param"] == "0.weight"].set_index("rank")["value"]
    assert by_rank.to_dict() == {0: 1.0, 1: 0.0}


def test_detached_reducer_is_detected_with_cause_and_fix(no_leftovers):
    res = no_leftovers(detached_reducer_scenarios, world_size=2, timeout=90)
    out = res.returns[0]
    # The silent failure itself (seed 003, measured: no error, gradients differ).
    assert out["before_move_in_sync"]
    assert out["unguarded_mismatched"] == ["0.weight", "0.bias", "2.weight", "2.bias"]
    for case in ("guarded", "late", "one_way"):
        err = out[case]
        assert err is not None, case
        assert err.params == ["0.weight", "0.bias", "2.weight", "2.bias"], case
        message = str(err)
        assert "dtype or device after the model was wrapped" in message
        assert "move_ddp_model" in message and "wrap the module again" in message
    assert "gradient accumulator was replaced" in str(out["guarded"])
    assert "after backward 0" in str(out["late"])  # at the first backward that failed
    assert "float32 on cpu, parameter is float64" in str(out["one_way"])
    # The fix re-wraps: float64, reducing, replicas identical after three SGD steps.
    assert out["rewrapped_dtype"] == "torch.float64"
    assert out["rewrapped_in_sync"]
    assert out["rewrapped_params_equal"] == res.returns[1]["rewrapped_params_equal"]
    assert out["no_sync_in_sync"] and out["no_sync_checks_left"] == 1
    recs = res.records
    assert (recs[recs["metric"] == "reducer_detached_params"]["value"] == 4).all()


def test_clean_runs_raise_no_alarm_across_20_seeds_on_four_ranks(no_leftovers):
    res = no_leftovers(clean_training_across_seeds, world_size=4, args=(range(20),), timeout=120)
    for alarms, detached in res.returns:
        assert alarms == []
        assert detached == ["0.weight", "0.bias", "2.weight", "2.bias"]
    recs = res.records
    assert len(recs[recs["metric"] == "grad_bitwise_equal"]) == 20 * 2 * 4 * 4


# ---------------------------------------------------------------- in-process


def test_fingerprint_sees_one_flipped_bit_and_metadata_changes():
    model = small_net()
    model.register_buffer("count", torch.zeros(2, dtype=torch.bfloat16))
    a = probes.fingerprint(model)
    assert a == probes.fingerprint(model)
    assert a["count"].kind == "buffer" and a["count"].dtype == "bfloat16"
    with torch.no_grad():
        bits = model[2].bias.view(torch.int32)
        bits[1] ^= 1  # the lowest mantissa bit of one element
    b = probes.fingerprint(model)
    assert [(c["param"], c["change"]) for c in probes.diff_fingerprints(a, b)] == [("2.bias", "bytes")]
    model.half()
    c = probes.fingerprint(model)
    kinds = {(d["param"], d["change"], d["before"], d["after"]) for d in probes.diff_fingerprints(b, c)}
    assert ("0.weight", "dtype", "float32", "float16") in kinds
    del model[2]
    removed = probes.diff_fingerprints(c, probes.fingerprint(model))
    assert {(d["param"], d["change"]) for d in removed} == {("2.weight", "removed"), ("2.bias", "removed")}


def test_bad_input_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        ReducerGuard(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="sync_checks"):
        ReducerGuard(torch.nn.Linear(2, 2), sync_checks=-1)
    with pytest.raises(ValueError, match="give a device, a dtype or both"):
        probes.move_ddp_model(object())
    with pytest.raises(ValueError, match="floating"):
        probes.move_ddp_model(object(), dtype=torch.int32)
    with pytest.raises(ValueError, match="DistributedDataParallel"):
        probes.rewrap(torch.nn.Linear(2, 2))

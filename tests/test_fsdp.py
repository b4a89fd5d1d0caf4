"""FSDP2 reduce-scatter instrumentation on real gloo ranks and real ``fully_shard`` models.

The audit's records are recomputed here, independently, from every rank's
reduce-scatter input and output (gathered by a recording ``live`` callable,
not by the audit's all_to_all), with the all-reduce emulation sliced rather
than the reduce-scatter one. A planted one-ulp fault in one rank's shard must
be "not rounding" with bitwise evidence. The order comms must give what the
emulation says, and gloo's own order must leave training bitwise unchanged.
"""
from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.fsdp._fully_shard._fsdp_api import ReduceScatter

from ddplab import fsdp
from ddplab.launcher import RankFailed
from ddplab.numerics import error_records, float_format, fsdp_reduction, reduce, reduce_scatter, shard_range
from ddplab.records import where

WORLD = 3
STEPS = 2
BF16, FP16, FP32 = torch.bfloat16, torch.float16, torch.float32
#: name -> (parameter dtype, MixedPrecisionPolicy or None, the dtype the reduce-scatter runs in)
CONFIGS = {
    "float32": (FP32, None, FP32),
    "bfloat16_params": (BF16, None, BF16),
    "fp32_params_bf16_reduce": (FP32, MixedPrecisionPolicy(reduce_dtype=BF16), BF16),
    "bf16_compute_fp32_reduce": (FP32, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=FP32), FP32),
    # slow: the same checks for bfloat16 compute and reduction, and float16's SUM between divisions
    "bf16_compute_bf16_reduce": (FP32, MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16), BF16),
    "fp16_compute_fp16_reduce": (FP32, MixedPrecisionPolicy(param_dtype=FP16, reduce_dtype=FP16), FP16),
}
DEFAULT_CONFIGS = list(CONFIGS)[:4]
SLOW_CONFIGS = list(CONFIGS)[4:]


def build(dtype=FP32, mp=None, seed=0):
    """Two parameter groups of different sizes: the first Linear, and the root holding the second."""
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(13, 32), torch.nn.Tanh(), torch.nn.Linear(32, 7)).to(dtype)
    kwargs = {} if mp is None else {"mp_policy": mp}
    fully_shard(model[0], **kwargs)
    fully_shard(model, **kwargs)
    return model


def train(model, steps=STEPS, dtype=FP32):
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for _ in range(steps):
        x = torch.randn(6, 13, generator=g).to(dtype)
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
    return torch.cat([p.detach().to_local().reshape(-1).float() for p in model.parameters()])


def recording_live(calls: list, groups: int, config: str, fault=None):
    """A ``live`` callable: FSDP's own collective, remembering input and output (and planting ``fault``)."""
    def live(output, input, group, op):
        taken = input.clone()
        dist.reduce_scatter_single(output, input, op=op, group=group)
        if fault is not None:
            fault(output)
        calls.append(dict(config=config, step=len([c for c in calls if c["config"] == config]) // groups,
                          input=taken, output=output.clone(), op=fsdp.reduce_op_name(op)))
    return live


def audited_runs(configs):
    calls, params = [], {}
    for name in configs:
        dtype, mp, _ = CONFIGS[name]
        model = build(dtype, mp)
        groups = len(fsdp.fsdp_groups(model))
        fsdp.attach_audit(model, live=recording_live(calls, groups, name), labels={"config": name})
        params[name] = train(model, dtype=dtype)
    params["plain"] = train(build())
    return calls, params


def bits_equal(a, b):
    return a.dtype == b.dtype and torch.equal(a.view(float_format(a.dtype).int_dtype),
                                              b.view(float_format(b.dtype).int_dtype))


def same_value(a, b):
    return a == b or (isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b))


def all_runs(configs):
    """One launch for the default tests: the audited configurations, the planted fault, the order comms."""
    return dict(audit=audited_runs(configs), fault=faulty_run(False), order=order_runs())


@pytest.fixture(scope="module")
def ranks(warm_launcher):
    return warm_launcher(all_runs, world_size=WORLD, args=(DEFAULT_CONFIGS,), timeout=300)


@pytest.fixture(scope="module")
def audited(ranks):
    records = ranks.records
    return [r["audit"] for r in ranks.returns], records[records["config"].isin(DEFAULT_CONFIGS)]


def test_audit_records_equal_an_independent_computation(audited):
    check_against_independent_computation(*audited)


@pytest.mark.slow
def test_audit_records_equal_an_independent_computation_bf16_and_fp16_reductions(warm_launcher):
    res = warm_launcher(audited_runs, world_size=WORLD, args=(SLOW_CONFIGS,), timeout=240)
    check_against_independent_computation(res.returns, res.records)
    test_audit_tags_every_group_and_counts_steps_per_backward((res.returns, res.records), SLOW_CONFIGS)


def check_against_independent_computation(returns, records):
    for k, call in enumerate(returns[0][0]):
        name, step = call["config"], call["step"]
        x = torch.stack([returns[r][0][k]["input"] for r in range(WORLD)])   # [W, N]: every rank's input
        assert x.dtype == CONFIGS[name][2], (name, x.dtype)                   # the dtype it really runs in
        op = call["op"]
        assert op == fsdp_reduction(x.dtype, WORLD).op, (name, op)            # AVG, or SUM for float16
        averaging = "sum_then_divide" if op == "avg" else None
        everything = reduce(x, "gloo_ring", op=op, averaging=averaging)       # the all-reduce, not the reduce-scatter
        measured = 0
        for r in range(WORLD):
            a, b = shard_range(x.shape[1], WORLD, r)
            full = where(records, "numel", config=name, rank=r, step=step)
            full = full[full["value"] == b - a]
            if full.empty:     # not this rank's turn: its bitwise comparison decided
                continue
            measured += 1
            bucket = int(full["bucket"].iloc[0])
            assert (step + bucket) % WORLD == r and full["reason"].iloc[0] == "rotation"
            audit = where(records, list(records["metric"].unique()), config=name, rank=r, step=step)
            audit = audit[audit["bucket"] == bucket]
            ours = error_records(returns[r][0][k]["output"], x[:, a:b], "gloo_ring", op=op, averaging=averaging,
                                 expected=everything[a:b], bitwise=True)
            assert ours[0]["verdict"] == "rounding" and ours[0]["evidence"] == "bitwise"
            for rec in ours:
                row = audit[audit["metric"] == rec["metric"]]
                assert len(row) == 1, (name, step, r, rec["metric"])
                assert same_value(float(row["value"].iloc[0]), rec["value"]), (name, step, r, rec["metric"])
                assert row["verdict"].iloc[0] == rec["verdict"] and row["evidence"].iloc[0] == rec["evidence"]
            matches = audit[audit["metric"] == "matches_order"]
            assert matches["reduce_op"].iloc[0] == op
            assert matches["reduce_dtype"].iloc[0] == float_format(x.dtype).name
        assert measured == 1, (name, step, k)          # one shard of each collective in full
    matches = where(records, "matches_order")
    assert (matches["value"] == 1.0).all() and set(matches["verdict"]) == {"rounding"}
    assert set(matches["evidence"]) == {"bitwise"}


def test_audit_tags_every_group_and_counts_steps_per_backward(audited, configs=DEFAULT_CONFIGS):
    _, records = audited
    matches, numel = where(records, "matches_order"), where(records, "numel")
    for name in configs:
        rows = matches[matches["config"] == name]
        assert sorted(rows["step"].unique()) == list(range(STEPS))
        assert set(rows["group"]) == {"0", "<root>"}
        assert set(rows[rows["group"] == "0"]["params"]) == {"0.weight,0.bias"}
        assert set(rows[rows["group"] == "<root>"]["params"]) == {"2.weight,2.bias"}
        assert len(rows) == STEPS * 2 * WORLD        # each step, each group, each rank: once
        assert len(numel[numel["config"] == name]) == STEPS * 2     # in full: one rank per collective


def test_audit_leaves_training_bitwise_unchanged(audited):
    returns, _ = audited
    for r in range(WORLD):
        assert bits_equal(returns[r][1]["float32"], returns[r][1]["plain"])


def flip_last_bit_on_rank_1(output):
    if dist.get_rank() == 1:
        output.view(torch.int32)[0] ^= 1       # one ulp in one element of rank 1's shard


def faulty_run(raise_on_alarm):
    model = build()
    calls = []
    state = fsdp.attach_audit(model, live=recording_live(calls, 2, "fault", fault=flip_last_bit_on_rank_1),
                              raise_on_alarm=raise_on_alarm, labels={"config": "fault"})
    train(model, steps=1)
    return state.alarms


def test_planted_one_ulp_fault_in_one_shard_is_not_rounding(ranks):
    records = ranks.records[ranks.records["config"] == "fault"]
    alarms = [r["fault"] for r in ranks.returns]
    verdicts = where(records, "numel")
    faulty = verdicts[verdicts["rank"] == 1]
    assert len(faulty) == 2 and set(faulty["reason"]) == {"differs_from_order"}     # both groups' shards
    assert set(faulty["verdict"]) == {"not rounding"} and set(faulty["evidence"]) == {"bitwise"}
    assert set(verdicts[verdicts["rank"] != 1]["verdict"]) == {"rounding"}
    assert set(where(records, "matches_order", rank=0)["verdict"]) == {"rounding"}
    # One element in each of rank 1's shards: bitwise evidence catches what the bound cannot.
    differs = where(records, "differs_count", rank=1)
    assert set(differs["value"]) == {1.0}
    assert set(where(records, "within_bound", rank=1)["value"]) == {1.0}
    assert len(alarms[1]) == 2 and not alarms[0] and not alarms[2]
    assert {a["evidence"] for a in alarms[1]} == {"bitwise"}


@pytest.mark.slow
def test_raise_on_alarm_stops_the_ranks_with_the_finding(warm_launcher):
    with pytest.raises(RankFailed, match="not what rounding gives"):
        warm_launcher(faulty_run, world_size=WORLD, args=(True,), timeout=120)


class Recording(ReduceScatter):
    """Wraps an attached comm, keeping each call's input and output."""

    def __init__(self, inner, calls, config):
        self.inner, self.calls, self.config = inner, calls, config

    def allocate(self, size, *, dtype, device):
        return self.inner.allocate(size, dtype=dtype, device=device)

    def __call__(self, output_tensor, input_tensor, group, op, async_op=False):
        taken = input_tensor.clone()
        self.inner(output_tensor, input_tensor, group, op)
        self.calls.append(dict(config=self.config, input=taken, output=output_tensor.clone(),
                               op=fsdp.reduce_op_name(op)))


def order_runs():
    mp = MixedPrecisionPolicy(param_dtype=BF16, reduce_dtype=BF16)
    calls, params = [], {}
    for name, attach in (("plain", None), ("gloo_ring", lambda m: fsdp.attach_order(m, "gloo_ring")),
                         ("nccl_ring", lambda m: fsdp.attach_order(m, "nccl_ring")),
                         ("float32", fsdp.attach_float32)):
        model = build(FP32, mp)
        if attach is not None:
            state = attach(model)
            for (_, module, _), comm in zip(fsdp.fsdp_groups(model), state.comms):
                module.set_custom_reduce_scatter(Recording(comm, calls, name))
        params[name] = train(model)
    return calls, params


def test_order_and_float32_comms_compute_what_the_emulation_says(ranks):
    returns = [r["order"] for r in ranks.returns]
    for r in range(WORLD):   # gloo's own order, emulated, trains exactly as gloo does
        assert bits_equal(returns[r][1]["gloo_ring"], returns[r][1]["plain"])
    float32_differs = False
    for k, call in enumerate(returns[0][0]):
        x = torch.stack([returns[r][0][k]["input"] for r in range(WORLD)])
        assert call["op"] == "avg" and x.dtype == BF16
        if call["config"] == "float32":
            expected = reduce_scatter(x, "gloo_ring", op="avg", accumulate=FP32)
            float32_differs |= not bits_equal(expected, reduce_scatter(x, "gloo_ring", op="avg"))
        else:   # AVG as the emulated backend averages: ncclAvg multiplies by fl(1/W)
            expected = reduce_scatter(x, call["config"], op="avg")
        got = torch.cat([returns[r][0][k]["output"] for r in range(WORLD)])
        assert bits_equal(got, expected), call["config"]
    assert float32_differs
    assert not bits_equal(returns[0][1]["nccl_ring"], returns[0][1]["plain"])


def test_bad_arguments_are_value_errors_before_anything_changes():
    with pytest.raises(ValueError, match="no fully_shard"):
        fsdp.attach_audit(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="audit_every"):
        fsdp.attach_audit(torch.nn.Linear(2, 2), audit_every=0)
    with pytest.raises(ValueError, match="unknown reduce-scatter order"):
        fsdp.attach_order(torch.nn.Linear(2, 2), "nccl_tree")
    with pytest.raises(ValueError, match="takes no option"):
        fsdp.attach_order(torch.nn.Linear(2, 2), "nccl_ring", channels=2)
    with pytest.raises(ValueError, match="AVG, SUM or PREMUL_SUM"):
        fsdp.reduce_scatter_args(dist.ReduceOp.MAX, "gloo_ring")


def test_step_advances_when_a_group_reduces_again():
    state = fsdp.FSDPState()
    assert [state.advance(g) for g in (1, 0, 1, 0, 0)] == [0, 0, 1, 1, 2]


def test_readme_fsdp_example_runs_verbatim():
    """The README's FSDP2 example: every shard of every group audited, none off gloo's order."""
    from readme import python_block, readme_section

    namespace: dict = {}
    exec(python_block(readme_section("FSDP2: the reduce-scatter, audited")), namespace)
    res = namespace["res"]
    assert res.returns == [0, 0]
    audited = res.records.query("metric == 'matches_order'")
    assert set(audited["params"]) == {"0.weight,0.bias", "2.weight,2.bias"}
    assert (audited["value"] == 1).all() and len(audited) == 3 * 2 * 2   # steps x groups x ranks

"""The referee against live gloo ranks: planted faults, and gradient accumulation under DDP's no_sync.

One launch per world size runs every fault in float32 and bfloat16: one rank
scaled by (1 + k·u) for k = 1, 2, 5, 10, a rank skipped, a rank's values
replaced by another's, SUM on one rank and MAX on the others. Each result is
refereed here against the clean contributions, as DDP's reduction (multiply
by 1/W, then gloo's ring). Every fault that changes a bit must be "not
rounding"; the clean run must be "rounding".
"""
from __future__ import annotations

import inspect

import pytest
import torch

from ddplab.numerics import DDP_AVERAGING, measure, reduce, reduce_accumulated

DDP = dict(op="avg", averaging=DDP_AVERAGING)
DTYPES = ("float32", "bfloat16")
FAULTS = ("clean", "scale1", "scale2", "scale5", "scale10", "skip", "replace", "sum_max")


def contribution(rank: int, dtype_name: str, numel: int = 1000) -> torch.Tensor:
    """Rank ``rank``'s data: normal values over a few binades, reproducible anywhere."""
    g = torch.Generator().manual_seed(7919 * rank + 31 * len(dtype_name))
    x = torch.randn(numel, generator=g, dtype=torch.float64)
    x *= torch.exp2(torch.randint(-3, 4, (numel,), generator=g).to(torch.float64))
    return x.to(getattr(torch, dtype_name))


def run_faults(launch, world_size: int) -> list[dict]:
    """Every rank's live result per (dtype, fault); the fault sits on the last rank."""
    source, dtypes, faults = inspect.getsource(contribution), DTYPES, FAULTS

    def worker():
        import torch
        import torch.distributed as dist

        from ddplab.numerics import unit_roundoff

        namespace = {"torch": torch}
        exec(source, namespace)
        make = namespace["contribution"]
        rank, world = dist.get_rank(), dist.get_world_size()
        faulty = rank == world - 1
        out = {}
        for dtype_name in dtypes:
            u = unit_roundoff(getattr(torch, dtype_name))
            for fault in faults:
                t = make(rank, dtype_name)
                if faulty and fault.startswith("scale"):
                    # x·(1 + k·u) rounded once (a float32 scalar 1 + 2^-24 would round to 1.0).
                    t = (t.double() * (1 + int(fault[5:]) * u)).to(t.dtype)
                elif faulty and fault == "skip":
                    t.zero_()
                elif faulty and fault == "replace":
                    t = make(0, dtype_name)
                t.mul_(1.0 / world)                       # DDP's averaging, as its reducer does it
                op = dist.ReduceOp.MAX if faulty and fault == "sum_max" else dist.ReduceOp.SUM
                dist.all_reduce(t, op=op)
                out[(dtype_name, fault)] = t
        return out

    return launch(worker, world_size=world_size, timeout=180).returns


def referee_faults(returns: list[dict], world_size: int) -> dict:
    """Per (dtype, fault): did any bit change, and the verdicts (bitwise and bound-only) of every distinct result."""
    table = {}
    for dtype_name in DTYPES:
        x = torch.stack([contribution(r, dtype_name) for r in range(world_size)])
        clean = reduce(x, "gloo_ring", **DDP)
        for fault in FAULTS:
            results = {tuple(r[(dtype_name, fault)].view(torch.int16 if dtype_name == "bfloat16" else torch.int32)
                             .tolist()): r[(dtype_name, fault)] for r in returns}
            verdicts = []
            for live in results.values():
                m = measure(live, x, "gloo_ring", expected=clean, **DDP)
                bound_only = measure(live, x, "gloo_ring", bitwise=False, **DDP)
                changed = not torch.equal(live.view(torch.uint8), clean.view(torch.uint8))
                verdicts.append((changed, m["classification"], m["evidence"], bound_only["classification"],
                                 m["frac_matches_order"]))
            table[(dtype_name, fault)] = verdicts
    return table


def check(table: dict, world_size: int) -> None:
    for (dtype_name, fault), verdicts in table.items():
        for changed, label, evidence, _, frac in verdicts:
            assert evidence == "bitwise"
            if fault == "clean":
                assert not changed and label == "rounding" and frac == 1.0, (world_size, dtype_name)
            elif changed:
                assert label == "not rounding", (world_size, dtype_name, fault)
            else:
                assert label == "rounding", (world_size, dtype_name, fault)
    # The faults change bits: a wrong operand anywhere in gloo's ring reaches the result.
    changed_faults = [k for k, v in table.items() if k[1] != "clean" and any(c for c, *_ in v)]
    assert len(changed_faults) == 2 * (len(FAULTS) - 1), sorted(set(table) - set(changed_faults))


@pytest.mark.parametrize("world_size", [3, 8])
def test_every_planted_fault_that_changes_a_bit_is_not_rounding(warm_launcher, world_size):
    table = referee_faults(run_faults(warm_launcher, world_size), world_size)
    check(table, world_size)
    # The rounding bound alone passes the small faults (at W=8 up to k=5, in either dtype):
    # that is what bitwise evidence adds.
    passed_by_bound = [k for k, v in table.items() if k[1] != "clean" and any(b == "rounding" for *_, b, _ in v)]
    assert ("float32", "scale1") in passed_by_bound


@pytest.mark.slow
@pytest.mark.parametrize("world_size", [2, 4, 5, 6, 7])
def test_every_planted_fault_that_changes_a_bit_is_not_rounding_more_ranks(warm_launcher, world_size):
    check(referee_faults(run_faults(warm_launcher, world_size), world_size), world_size)


# --------------------------------------------------------------------------- gradient accumulation


def accumulate_under_no_sync(dtype_name: str, steps: int):
    """DDP with k micro-batches (k-1 under no_sync); returns the reduced grad and every rank's micro-grads."""
    import torch
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel as DDP

    from ddplab.probes import all_gather_flat

    dtype = getattr(torch, dtype_name)
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(24, 10, bias=False).to(dtype)
    ddp = DDP(model)
    batches = [torch.randn(6, 24, generator=torch.Generator().manual_seed(100 * rank + j)).to(dtype)
               for j in range(steps)]
    # Each micro-batch's gradient on its own, as autograd hands it to AccumulateGrad.
    micro = torch.stack([torch.autograd.grad(model(b).square().sum(), model.weight)[0].reshape(-1)
                         for b in batches])
    for j, b in enumerate(batches):
        if j < steps - 1:
            with ddp.no_sync():
                ddp(b).square().sum().backward()
        else:
            ddp(b).square().sum().backward()
    gathered = all_gather_flat(micro.reshape(-1)).reshape(dist.get_world_size(), steps, -1)
    return model.weight.grad.reshape(-1).clone(), gathered


@pytest.mark.parametrize("dtype_name", DTYPES)
def test_reduce_accumulated_is_ddp_under_no_sync_bit_for_bit(warm_launcher, dtype_name):
    steps = 3
    res = warm_launcher(accumulate_under_no_sync, world_size=3, args=(dtype_name, steps), timeout=120)
    grad, micro = res.returns[0]
    assert all(torch.equal(r[0], grad) for r in res.returns)
    assert torch.equal(reduce_accumulated(micro, "gloo_ring"), grad)
    m = measure(grad, micro, "gloo_ring", **DDP)
    assert (m["classification"], m["evidence"], m["frac_matches_order"]) == ("rounding", "bitwise", 1.0)
    assert measure(grad, micro, "gloo_ring", bitwise=False, **DDP)["classification"] == "rounding"
    # One micro-batch left out of one rank's accumulation: not the composed order's rounding.
    lost = micro.clone()
    lost[1, 2] = 0
    assert measure(reduce_accumulated(lost, "gloo_ring"), micro, "gloo_ring", **DDP)["classification"] \
        == "not rounding"

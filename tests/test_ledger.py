"""The collective ledger, with real gloo ranks (no mocks of torch.distributed)."""
from __future__ import annotations

import random

import pytest
import torch
import torch.distributed as dist

from ddplab.ledger import (CollectiveLedger, CollectiveMismatchError, LedgerEntry, find_problems)

# ---------------------------------------------------------------- worker functions


def swapped_and_mixed_ops(swap_ranks):
    """Ranks in ``swap_ranks`` reduce [b, a] instead of [a, b]; rank 1 uses MAX for c."""
    rank = dist.get_rank()
    a = torch.full((3,), 1.0 + rank)
    b = torch.full((3,), 10.0 + 10 * rank)
    c = torch.full((2,), float(rank))
    with CollectiveLedger({"a": a, "b": b}) as ledger:
        for t in ([b, a] if rank in swap_ranks else [a, b]):
            dist.all_reduce(t)
        op = dist.ReduceOp.MAX if rank == 1 else dist.ReduceOp.SUM
        dist.all_reduce(c, op=op, label="c")
        dist.broadcast(a, src=0)  # consistent on every rank
    report = ledger.report
    return dict(a=a.tolist(), problems=[(p.seq, p.kind, p.values) for p in report.problems],
                pairing=report.pairing(), frame=report.frame())


def named_from_module_grads():
    """Labels come from a module's parameters' gradients; rank 1 swaps two same-shaped ones."""
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    torch.manual_seed(rank)
    model(torch.randn(3, 4)).sum().backward()
    grads = [model[0].weight.grad, model[1].weight.grad]
    if rank == 1:
        grads.reverse()
    with CollectiveLedger(model, strict=True) as ledger:
        for g in grads:
            dist.all_reduce(g)
    return "no error"


def strict_mismatch():
    ledger = CollectiveLedger(strict=True)
    t = torch.ones(4)
    try:
        with ledger:
            dist.all_reduce(t, label="x" if dist.get_rank() == 0 else "y")
    except CollectiveMismatchError as err:
        return [(p.kind, p.values) for p in err.problems]
    return "no error"


def clean_sequences(seeds):
    """Random but identical sequences of collectives on every rank: no problem, ever."""
    rank = dist.get_rank()
    found = []
    n_entries = 0
    for seed in seeds:
        rng = random.Random(seed)
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 3), torch.nn.Linear(3, 3))
        torch.manual_seed(seed * 1000 + rank)  # different data on each rank
        model(torch.randn(4, 5)).pow(2).sum().backward()
        names = [n for n, _ in model.named_parameters()]
        with CollectiveLedger(model, emit=False) as ledger:
            for _ in range(6):
                name = rng.choice(names)
                param = model.get_parameter(name)
                kind = rng.randrange(4)
                if kind == 0:
                    dist.all_reduce(param.grad)
                elif kind == 1:
                    dist.all_reduce(param.grad, op=dist.ReduceOp.MAX)
                elif kind == 2:
                    dist.broadcast(param.data, src=rng.randrange(dist.get_world_size()))
                else:
                    out = [torch.empty_like(param.grad) for _ in range(dist.get_world_size())]
                    dist.all_gather(out, param.grad)
            ledger.check()  # a periodic check inside the block, then one on exit
            dist.all_reduce(model[0].bias.grad)
        found.extend(ledger.report.problems)
        n_entries += len(ledger.report.entries)
        labelled = {e.label for e in ledger.report.entries}
        assert None not in labelled, labelled
    return len(found), n_entries


def detail_misses_what_the_ledger_flags():
    """Under TORCH_DISTRIBUTED_DEBUG=DETAIL a swap and SUM/MAX pass; a shape mismatch does not."""
    # torch reads the variable when torch.distributed is imported, which the
    # launcher's forkserver did before the variable was set: read it again and
    # make a new group, which then gets DETAIL's checking wrapper.
    dist.set_debug_level_from_env()
    detail = dist.new_group(backend="gloo")
    rank = dist.get_rank()
    a = torch.full((3,), 1.0 + rank)
    b = torch.full((3,), 10.0 + 10 * rank)
    with CollectiveLedger({"a": a, "b": b}, emit=False) as ledger:
        for t in ([b, a] if rank == 1 else [a, b]):
            dist.all_reduce(t, group=detail)
        op = dist.ReduceOp.MAX if rank else dist.ReduceOp.SUM
        dist.all_reduce(torch.ones(2), op=op, group=detail)
        try:  # positive control: DETAIL does catch a shape mismatch
            dist.all_reduce(torch.ones(2 + rank), group=detail, label="d")
            shape_error = None
        except RuntimeError as err:
            shape_error = str(err)
    kinds = [p.kind for p in ledger.report.problems]
    return str(dist.get_debug_level()), a.tolist(), shape_error, kinds


# ---------------------------------------------------------------- tests


def test_swapped_same_shaped_collectives_and_sum_vs_max_are_flagged(no_leftovers):
    res = no_leftovers(swapped_and_mixed_ops, world_size=2, args=({1},), timeout=60)
    r0 = res.returns[0]
    # The values mixed silently: a on rank 0 got rank 1's b (1 + 20).
    assert r0["a"] == [21.0, 21.0, 21.0]
    assert r0["problems"] == [
        (0, "pairing", {0: "a", 1: "b"}),
        (1, "pairing", {0: "b", 1: "a"}),
        (2, "reduce_op", {0: "SUM", 1: "MAX"}),
    ]
    assert res.returns[1]["problems"] == r0["problems"]  # every rank reaches the same verdict
    pairing = r0["pairing"]
    assert list(pairing[["seq", "label_i", "label_j", "consistent"]].itertuples(index=False, name=None)) == [
        (0, "a", "b", False), (1, "b", "a", False), (2, "c", "c", False), (3, "a", "a", True)]
    frame = r0["frame"]
    assert frame["problem"].fillna("ok").tolist() == ["pairing"] * 4 + ["reduce_op"] * 2 + ["ok"] * 2
    recs = res.records
    flagged = recs[recs["metric"] == "collective_mismatch"]
    assert len(flagged) == 8  # one record per collective and rank
    assert flagged.groupby("rank")["value"].sum().tolist() == [3.0, 3.0]


def test_pairing_table_names_who_was_combined_with_whom_on_four_ranks(no_leftovers):
    res = no_leftovers(swapped_and_mixed_ops, world_size=4, args=({2, 3},), timeout=60)
    r0 = res.returns[0]
    assert r0["problems"][0] == (0, "pairing", {0: "a", 1: "a", 2: "b", 3: "b"})
    pairs = r0["pairing"]
    first = pairs[pairs["seq"] == 0].set_index(["rank_i", "rank_j"])
    assert first.loc[(0, 1), "consistent"]          # ranks 0 and 1 agree with each other
    assert first.loc[(2, 3), "consistent"]          # and 2 and 3 with each other
    assert not first.loc[(1, 2), "consistent"]
    assert (first.loc[(1, 2), "label_i"], first.loc[(1, 2), "label_j"]) == ("a", "b")
    # SUM on ranks 0, 2, 3 against MAX on rank 1.
    assert r0["problems"][2] == (2, "reduce_op", {0: "SUM", 1: "MAX", 2: "SUM", 3: "SUM"})


def test_labels_from_a_module_and_strict_mode(no_leftovers):
    with pytest.raises(Exception) as info:
        no_leftovers(named_from_module_grads, world_size=2, timeout=60)
    assert "0.weight.grad" in str(info.value) and "1.weight.grad" in str(info.value)
    assert "combined different tensors" in str(info.value)
    res = no_leftovers(strict_mismatch, world_size=2, timeout=60)
    assert res.returns[0] == [("pairing", {0: "x", 1: "y"})]


def test_clean_runs_raise_no_alarm_across_20_seeds(no_leftovers):
    res = no_leftovers(clean_sequences, world_size=4, args=(range(20),), timeout=120)
    problems, entries = res.returns[0]
    assert problems == 0
    assert entries == 20 * 7 * 4  # every collective of every rank was seen


def test_detail_debug_mode_misses_the_swap_the_ledger_flags(no_leftovers):
    res = no_leftovers(detail_misses_what_the_ledger_flags, world_size=2, timeout=60,
                       env={"TORCH_DISTRIBUTED_DEBUG": "DETAIL"})
    level, a, shape_error, kinds = res.returns[0]
    assert level.endswith("DETAIL")
    assert "mismatch between collectives" in shape_error  # DETAIL is on and checking
    assert a == [21.0, 21.0, 21.0]  # yet it let the swapped values mix without an error
    assert kinds == ["pairing", "pairing", "reduce_op", "shape"]


# ---------------------------------------------------------------- pure comparison logic


def _entry(rank, seq, **kw):
    base = dict(group=(0, 1), seq=seq, rank=rank, op="all_reduce", reduce_op="SUM", root=None,
                label="a", shape=(3,), dtype="float32")
    base.update(kw)
    return LedgerEntry(**base)


def test_find_problems_names_the_first_differing_field():
    entries = [_entry(0, 0), _entry(1, 0),
               _entry(0, 1, op="broadcast", reduce_op=None, root=0),
               _entry(1, 1, op="broadcast", reduce_op=None, root=1),
               _entry(0, 2, shape=(4,)), _entry(1, 2),
               _entry(0, 3, label=None), _entry(1, 3, label="b"),  # unlabelled pairs with anything
               _entry(0, 4, dtype="float64", label="z"), _entry(1, 4),
               _entry(0, 5)]  # rank 1 never issued #5
    counts = {"0": {0: 6, 1: 5}}
    kinds = [(p.seq, p.kind) for p in find_problems(entries, counts)]
    assert kinds == [(1, "root"), (2, "shape"), (4, "dtype"), (5, "count")]


def test_bad_input_is_rejected_before_any_work():
    with pytest.raises(ValueError, match="names must be"):
        CollectiveLedger(names=[torch.ones(2)])
    with pytest.raises(ValueError, match="label must be"):
        CollectiveLedger().name(torch.ones(2), "")
    with pytest.raises(RuntimeError, match="initialized process group"):
        with CollectiveLedger():
            pass

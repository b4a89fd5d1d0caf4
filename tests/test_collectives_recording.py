"""Every collective recorded in the ranks and verified bit for bit against its emulation.

Two launches on real gloo ranks. At W=2, one recording per scenario: DDP's
C++ reducer with and without comm hooks (Python fp16/bf16 compression, the
built-in C++ fp16 hook, a hook that adds one ulp to one rank's result at one
step), a user's own ``dist.*`` calls, FSDP2, DTensor and functional
collectives, and a spilling recorder. At W=4: a ``new_group`` of two ranks
and HSDP on a 2x2 ``DeviceMesh``, each collective recorded with its
sub-group's global ranks.
"""
from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks

from ddplab import collectives, comm_hooks, launch
from ddplab.collectives import CollectiveRecord, HookResult, verify
from ddplab.sync_batchnorm import SyncBatchNorm

STEPS = 3
FAULT_STEP, FAULT_RANK = 2, 1


def _batch(g: torch.Generator) -> torch.Tensor:
    return torch.randn(6, 8, generator=g)


def _ddp_steps(rec, model, g, state=None) -> None:
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for step in range(STEPS):
        rec.set_step(step)
        if state is not None:
            state["step"] = step
        opt.zero_grad()
        model(_batch(g)).square().mean().backward()
        opt.step()


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def perturbing_hook(state, bucket):
    """All-reduce the mean, then add one ulp to element 0 on rank FAULT_RANK at step FAULT_STEP."""
    tensor = bucket.buffer().div_(dist.get_world_size())
    fut = dist.all_reduce(tensor, async_op=True).get_future()

    def perturb(f):
        out = f.value()[0]
        if dist.get_rank() == FAULT_RANK and state["step"] == FAULT_STEP:
            out[0] = torch.nextafter(out[0], torch.tensor(float("inf")))
        return out

    return fut.then(perturb)


def _ddp(hook=None, builtin=None, step_state=False):
    """A DDP run; ``step_state`` hands the hook a dict holding the step (torch's hooks take a group or None)."""
    def scenario(rec, g):
        model = nn.parallel.DistributedDataParallel(_net())
        state = {"step": 0} if step_state else None
        if hook is not None:
            model.register_comm_hook(state, hook)
        if builtin is not None:
            model._register_builtin_comm_hook(builtin)
        _ddp_steps(rec, model, g, state)
    return scenario


def _user_calls(rec, g):
    rank, w = dist.get_rank(), dist.get_world_size()
    rec.set_step(0)
    x = torch.randn(1000, generator=g)
    dist.all_reduce(x)
    dist.broadcast(x, src=1)
    dist.all_reduce(torch.randn(37, generator=g).to(torch.bfloat16))
    gathered = torch.empty(7 * w)
    dist.all_gather_into_tensor(gathered, torch.randn(7, generator=g))
    dist.reduce_scatter_tensor(torch.empty(5), torch.randn(5 * w, generator=g))
    dist.all_gather([torch.empty(3) for _ in range(w)], torch.randn(3, generator=g))
    dist.reduce_scatter(torch.empty(4), [torch.randn(4, generator=g) for _ in range(w)])
    dist.all_to_all_single(torch.empty(2 * w), torch.randn(2 * w, generator=g))
    dist.all_reduce(torch.randn(5, generator=g), op=dist.ReduceOp.MAX)
    dist.barrier()
    dist.all_reduce(torch.randn(6, generator=g), op=dist.ReduceOp.AVG)
    dist.all_to_all_single(torch.empty(3 if rank == 0 else 5), torch.randn(4, generator=g),
                           output_split_sizes=[1, 2] if rank == 0 else [3, 2],
                           input_split_sizes=[1, 3] if rank == 0 else [2, 2])
    with dist._coalescing_manager():        # one allreduce_coalesced; over 1 MiB: gloo's ring segments
        for n in (3, 300_001):
            dist.all_reduce(torch.randn(n, generator=g))
    dist.gather(torch.randn(3, generator=g), [torch.empty(3) for _ in range(w)] if rank == 0 else None, dst=0)
    dist.reduce(torch.randn(3, generator=g), dst=1)
    if rank == 0:
        dist.send(torch.randn(3, generator=g), dst=1)
    else:
        dist.recv(torch.empty(3), src=0)
    rec.set_step(1)
    bn = SyncBatchNorm(3)
    bn(torch.randn(4, 3, 2, generator=g, requires_grad=True)).square().sum().backward()


def _fsdp2(mp_policy=None):
    def scenario(rec, g):
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        kwargs = {} if mp_policy is None else {"mp_policy": MixedPrecisionPolicy(**mp_policy)}
        model = _net()
        fully_shard(model[0], **kwargs)
        fully_shard(model, **kwargs)
        _ddp_steps(rec, model, g)
    return scenario


def _dtensor(rec, g):
    import torch.distributed._functional_collectives as funcol
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    rec.set_step(0)
    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    full = distribute_tensor(torch.arange(12.0), mesh, [Shard(0)]).redistribute(mesh, [Replicate()])
    assert torch.equal(full.to_local(), torch.arange(12.0))
    funcol.wait_tensor(funcol.all_reduce(torch.randn(9, generator=g), "sum", mesh))


class _Doubled:
    """What a caller holds of an input that is ``base`` times 2, kept by the recording in its place."""

    def __init__(self, base: torch.Tensor):
        self.base = base

    def value(self) -> torch.Tensor:
        return self.base.mul(2)


def _held_as(rec, g):
    rec.set_step(0)
    base = torch.randn(1000, generator=g)
    other = base.mul(2)
    other[3] = other[3].nextafter(torch.tensor(9.0))
    with rec.inputs_held_as(lambda t, record: _Doubled(base) if torch.equal(t, base.mul(2)) else None):
        dist.all_reduce(base.mul(2))
        dist.all_reduce(other)          # one ulp off: copied
    dist.all_reduce(base.mul(2))        # outside the block: copied


SCENARIOS = {
    "ddp": _ddp(),
    "ddp_fp16_hook": _ddp(hook=default_hooks.fp16_compress_hook),
    "ddp_bf16_hook": _ddp(hook=comm_hooks.bf16_compress_hook),     # torch's, under a name DDP allows on CPU
    "ddp_builtin_fp16": _ddp(builtin=dist.BuiltinCommHookType.FP16_COMPRESS),
    "ddp_fault": _ddp(hook=perturbing_hook, step_state=True),
    "user": _user_calls,
    "fsdp2": _fsdp2(),
    "fsdp2_bf16_reduce": _fsdp2({"reduce_dtype": torch.bfloat16}),
    "dtensor": _dtensor,
}


def record_scenarios(spill_dir: str) -> dict:
    """On every rank: each scenario's records, one recording each, plus a spilled DDP run."""
    out = {}
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    for name, scenario in SCENARIOS.items():
        with collectives.recording() as rec:
            scenario(rec, g)
        out[name] = rec.records()
    dist.all_reduce(torch.ones(3))      # outside any recording: not recorded
    out["after"] = len(out[name]) == len(rec.records())
    with collectives.recording(spill_dir=spill_dir) as rec:
        _ddp()(rec, g)
    out["spilled"] = rec.records()
    with collectives.recording(digests=False) as rec:
        _held_as(rec, g)
    out["held as"] = rec.records()
    for keep, digests in ((True, True), (False, True), (True, False)):   # the same run: tensors and/or digests
        with collectives.recording(keep_tensors=keep, digests=digests) as rec:
            _ddp(comm_hooks.fp16_compress_hook)(rec, torch.Generator().manual_seed(7 + dist.get_rank()))
        out[f"kept={keep}" + ("" if digests else " no digests")] = rec.records()
    return out


@pytest.fixture(scope="module")
def w2(tmp_path_factory):
    spill = tmp_path_factory.mktemp("spill")
    return launch(record_scenarios, world_size=2, args=(str(spill),), timeout=240).returns


def _verified(ranks, name):
    return verify([r[name] for r in ranks])


def _collectives(records, op=None):
    return [r for r in records if isinstance(r, CollectiveRecord) and (op is None or r.op == op)]


def test_ddp_reducer_collectives_from_cpp_are_recorded_per_step_and_exact(w2):
    result = _verified(w2, "ddp")
    assert result.exact and not result.unverified and result.checked > 0
    ops = [(r.op, r.step) for r in _collectives(w2[0]["ddp"])]
    # DDP's constructor (shape check, module broadcast), then one bucket all-reduce per step.
    assert ops[0] == ("allgather", None) and ("broadcast", None) in ops
    assert [s for op, s in ops if op == "allreduce"] == list(range(STEPS))
    allreduces = _collectives(w2[1]["ddp"], "allreduce")
    assert {(r.group_ranks, r.reduce_op, r.dtype) for r in allreduces} == {((0, 1), "sum", "float32")}
    assert result.dtypes_by_step == {0: ("float32",), 1: ("float32",), 2: ("float32",)}


@pytest.mark.parametrize("name, dtype", [("ddp_fp16_hook", "float16"), ("ddp_bf16_hook", "bfloat16"),
                                         ("ddp_builtin_fp16", "float16")])
def test_compression_hooks_reduce_in_their_dtype_and_verify_exact(w2, name, dtype):
    result = _verified(w2, name)
    assert result.exact and not result.unverified
    assert result.dtypes_by_step == {s: (dtype,) for s in range(STEPS)}
    hooks = [r for r in w2[0][name] if isinstance(r, HookResult)]
    hook_rows = [r for r in result.records if r["stage"] == "comm_hook_result"
                 and r["metric"] == "collective_elements_differing"]
    if name == "ddp_builtin_fp16":      # torch's C++ hook: its collective is seen, it has no Python result
        assert not hooks and not hook_rows
    else:
        assert [h.step for h in hooks] == list(range(STEPS)) and all(h.dtype == "float32" for h in hooks)
        assert len(hook_rows) == 2 * STEPS and all(r["value"] == 0 for r in hook_rows)


def test_one_ulp_added_by_a_hook_on_one_rank_is_found_at_its_step_rank_and_collective(w2):
    result = _verified(w2, "ddp_fault")
    assert len(result.mismatches) == 1
    m = result.first_mismatch
    faulty = [r for r in _collectives(w2[FAULT_RANK]["ddp_fault"], "allreduce") if r.step == FAULT_STEP]
    assert (m.step, m.rank, m.stage, m.op, m.group, m.dtype) == (
        FAULT_STEP, FAULT_RANK, "comm_hook_result", "allreduce", (0, 1), "float32")
    assert (m.index, m.collective) == (faulty[0].index, faulty[0].sequence)
    assert (m.elements_differing, m.max_ulp) == (1, 1)
    # The all-reduce itself was exact on both ranks.
    outputs = [r for r in result.records if r["stage"] == "output" and r["op"] == "allreduce"
               and r["metric"] == "collective_elements_differing"]
    assert len(outputs) == 2 * STEPS and all(r["value"] == 0 for r in outputs)


def test_a_recorded_output_off_by_one_ulp_is_a_mismatch_of_that_collective(w2):
    ranks = [list(r["ddp"]) for r in w2]
    target = _collectives(ranks[0], "allreduce")[1]
    out = target.outputs()[0].clone()
    out.view(-1)[3] = torch.nextafter(out.view(-1)[3], torch.tensor(-float("inf")))
    ranks[0][ranks[0].index(target)] = dataclasses.replace(target, tensors={**target.tensors, "outputs": [out]})
    result = verify(ranks)
    m = result.first_mismatch
    assert (m.step, m.rank, m.index, m.stage, m.elements_differing, m.max_ulp) == (1, 0, target.index,
                                                                                   "output", 1, 1)
    assert len(result.mismatches) == 1


def test_user_calls_are_recorded_in_issue_order_with_their_dtype_and_verified(w2):
    result = _verified(w2, "user")
    assert result.exact
    assert [r.op for r in _collectives(w2[0]["user"])] == [
        "allreduce", "broadcast", "allreduce", "all_gather_single", "reduce_scatter_single", "allgather",
        "reduce_scatter", "all_to_all_single", "allreduce", "barrier", "allreduce", "all_to_all_single",
        "allreduce_coalesced", "gather", "reduce", "send", "allgather", "allreduce"]   # the last two: SyncBN
    recs = _collectives(w2[1]["user"])
    assert [r.sequence for r in recs if r.op != "recv"] == list(range(len(recs) - 1))
    assert (recs[1].root, recs[2].dtype, recs[8].reduce_op, recs[10].reduce_op) == (1, "bfloat16", "max", "avg")
    assert result.dtypes_by_step == {0: ("bfloat16", "float32"), 1: ("float32",)}
    # gloo's reduce has no emulation here; send/recv are recorded, not verified.
    assert sorted(u.op for u in result.unverified) == ["recv", "reduce", "send"]
    assert w2[0]["after"] and w2[1]["after"]


@pytest.mark.parametrize("name, reduce_dtype", [("fsdp2", "float32"), ("fsdp2_bf16_reduce", "bfloat16")])
def test_fsdp2_all_gathers_and_reduce_scatters_are_verified_in_the_reduce_dtype(w2, name, reduce_dtype):
    result = _verified(w2, name)
    assert result.exact and not result.unverified
    checked = {(r["op"], r["dtype"]) for r in result.records if r["metric"] == "collective_elements_differing"}
    assert {("all_gather_single", "float32"), ("reduce_scatter_single", reduce_dtype)} <= checked
    assert result.dtypes_by_step == {s: (reduce_dtype,) for s in range(STEPS)}


def test_dtensor_and_functional_collectives_issued_from_cpp_are_verified(w2):
    result = _verified(w2, "dtensor")
    assert result.exact and not result.unverified
    assert [r.op for r in _collectives(w2[0]["dtensor"])] == ["scatter", "all_gather_single_coalesced",
                                                             "allreduce"]


def test_spilled_records_hold_digests_in_memory_and_verify_from_files(w2):
    recs = [r["spilled"] for r in w2]
    assert all(r.tensors is None and r.spill is not None for rank in recs for r in rank)
    steps = {r.spill.rsplit("/", 1)[1].split(".")[0] for r in recs[0]}
    assert {"stepnone", "step0", "step1", "step2"} <= steps
    result = verify(recs)
    assert result.exact and not result.unverified and result.checked == _verified(w2, "ddp").checked


def test_a_digest_only_recording_keeps_the_digests_shapes_and_dtypes_and_no_tensor(w2):
    for rank in w2:
        kept, digests = rank["kept=True"], rank["kept=False"]
        assert len(kept) == len(digests) and any(isinstance(r, HookResult) for r in kept)
        assert all(r.tensors is None and r.spill is None for r in digests)
        assert all(r.tensors is not None for r in kept)
        for a, b in zip(kept, digests):
            assert dataclasses.replace(a, tensors=None) == b


def test_a_recording_without_digests_keeps_the_tensors_and_verifies_the_same(w2):
    for rank in w2:
        kept, bare = rank["kept=True"], rank["kept=True no digests"]
        assert len(kept) == len(bare) and all(r.complete and r.tensors is not None for r in bare)
        assert all(r.input_digests == () == r.output_digests for r in _collectives(bare))
        assert all(r.digest == "" for r in bare if isinstance(r, HookResult))
        for a, b in zip(kept, bare):   # everything else as the digested recording's, tensors bit for bit
            strip = dict(input_digests=(), output_digests=()) if isinstance(a, CollectiveRecord) else dict(digest="")
            assert dataclasses.replace(a, tensors=None, **strip) == dataclasses.replace(b, tensors=None)
    with_digests, without = _verified(w2, "kept=True"), _verified(w2, "kept=True no digests")
    assert without.exact and without.checked == with_digests.checked > 0
    assert without.records == with_digests.records


def test_inputs_the_caller_holds_are_kept_as_its_stand_in_and_read_back_as_tensors(w2):
    for rank in w2:
        reduces = _collectives(rank["held as"], "allreduce")
        kept = [r.tensors["inputs"][0] for r in reduces]
        assert len(kept) == 3 and isinstance(kept[0], _Doubled)
        assert all(isinstance(t, torch.Tensor) for t in kept[1:])
        assert all(isinstance(t, torch.Tensor) for r in reduces for t in r.inputs())
        assert torch.equal(reduces[0].inputs()[0], kept[0].value())
    assert _verified(w2, "held as").exact


def test_a_recording_keeps_tensors_or_digests_and_spills_only_with_digests(tmp_path):
    with pytest.raises(ValueError, match="keep_tensors=False needs digests=True"):
        collectives.Recorder(keep_tensors=False, digests=False)
    with pytest.raises(ValueError, match="needs digests=True"):
        collectives.Recorder(spill_dir=tmp_path, digests=False)


def hsdp_and_subgroup() -> list:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    rank = dist.get_rank()
    g = torch.Generator().manual_seed(rank)
    with collectives.recording() as rec:
        rec.set_step(0)
        pair = dist.new_group([1, 3])
        if rank in (1, 3):
            dist.all_reduce(torch.randn(11, generator=g), group=pair)
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        model = _net()
        fully_shard(model, mesh=mesh)
        rec.set_step(1)
        model(_batch(g)).square().mean().backward()
    return rec.records()


def test_subgroups_are_recorded_with_their_global_ranks_and_verified():
    ranks = launch(hsdp_and_subgroup, world_size=4, timeout=240).returns
    result = verify(ranks)
    assert result.exact and not result.unverified
    pair = {r: [c.group_ranks for c in _collectives(ranks[r]) if c.step == 0 and c.op == "allreduce"]
            for r in range(4)}
    assert pair == {0: [], 1: [(1, 3)], 2: [], 3: [(1, 3)]}
    groups = {(c.op, c.group_ranks) for rank in ranks for c in _collectives(rank) if c.step == 1}
    assert {("reduce_scatter_single", (0, 1)), ("reduce_scatter_single", (2, 3)),
            ("allreduce", (0, 2)), ("allreduce", (1, 3))} <= groups


def test_bad_input_is_rejected_before_any_work():
    with pytest.raises(TypeError):
        verify(["not a record"])
    with pytest.raises(RuntimeError):
        collectives.set_step(1)
    with collectives.recording() as rec:
        with pytest.raises(TypeError):
            rec.set_step("1")
        with pytest.raises(RuntimeError):
            with collectives.recording():
                pass
    assert collectives.active_recorder() is None
    duplicate = CollectiveRecord(rank=0, index=0)
    with pytest.raises(ValueError):
        verify([[duplicate], [duplicate]])

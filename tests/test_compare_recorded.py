"""compare.recorded: a DDP bucket's all-reduce is verified against the bucket audit's emulation of it."""
import dataclasses

import pytest
import torch

from ddplab.collectives.emulation import emulate
from ddplab.compare import DDP
from ddplab.compare.captures import Scaled
from ddplab.compare.recorded import collective_records, known_reductions
from ddplab.compare.replay import Reductions, _ddp_default
from ddplab.numerics.contributions import Contributions


def _wide(n: int, generator) -> torch.Tensor:
    """Values over many binades (and some zeros and subnormals), where orders of addition differ."""
    x = torch.randn(n, generator=generator) * torch.exp2(torch.randint(-30, 30, (n,), generator=generator).float())
    x[::97] = 0.0
    x[1::101] = 1e-40
    return x


@pytest.mark.parametrize("world", [2, 3, 4, 5])
def test_the_audits_averaged_ring_is_the_all_reduce_of_the_inputs_times_one_over_w(world):
    """What lets known_reductions stand for the emulation of the recorded inputs."""
    g = torch.Generator().manual_seed(world)
    local = [_wide(200_003, g) for _ in range(world)]
    audit = _ddp_default(torch.stack(local))
    unstacked = _ddp_default(Contributions.unstacked(local))   # the audit's way: a column block at a time
    assert torch.equal(unstacked.view(torch.int32), audit.view(torch.int32))
    inputs = [[Scaled(t, 1.0 / world).value()] for t in local]
    collective = emulate("allreduce", inputs, [[tuple(audit.shape)]] * world, reduce_op="sum", root=None,
                         extra=[{}] * world)
    for out in collective:
        assert torch.equal(out[0].view(torch.int32), audit.view(torch.int32))


class _Unread(Scaled):
    """A Scaled input that must not be computed: the audit's emulation stands for it."""

    def value(self):
        raise AssertionError("the input of a known reduction was computed")


def _captures(world: int, outputs: list[torch.Tensor], local: list[torch.Tensor], scaled=Scaled) -> list[list[dict]]:
    ranks = []
    for rank in range(world):
        state = dict(type="CollectiveRecord", rank=rank, index=0, step=0, op="allreduce", c10d_op="allreduce_",
                     group="0", group_ranks=tuple(range(world)), group_rank=rank, sequence=3, reduce_op="sum",
                     dtype="float32", input_shapes=((local[rank].numel(),),),
                     output_shapes=((local[rank].numel(),),), input_digests=(), output_digests=(), bucket=0,
                     tensors=dict(inputs=[scaled(local[rank], 1.0 / world)], outputs=[outputs[rank]]))
        bucket = dict(index=0, names=["w"], params="w", local=local[rank], result=outputs[rank], round=0)
        ranks.append([dict(buckets=[bucket], collectives=[state])])
    return ranks


def _differing(records) -> dict[int, int]:
    return {r["rank"]: r["value"] for step in records for r in step if r["metric"] == "collective_elements_differing"}


def test_a_bucket_all_reduce_is_checked_against_the_audits_emulation_and_a_one_ulp_output_is_caught():
    g = torch.Generator().manual_seed(0)
    local = [_wide(5000, g) for _ in range(2)]
    shared = Reductions()
    expected = shared.of(0, local, torch.stack(local))
    wrong = expected.clone()
    wrong.view(torch.int32)[17] += 1                        # one ulp on rank 1
    ranks = _captures(2, [expected.clone(), wrong], local, scaled=_Unread)
    assert set(known_reductions([r[0] for r in ranks], 0, shared)) == {("0", 3)}
    assert _differing(collective_records(DDP(2), ranks, torch.float32, shared)) == {0: 0, 1: 1}


def test_without_the_audits_emulation_the_inputs_are_emulated_and_give_the_same_findings():
    g = torch.Generator().manual_seed(1)
    local = [_wide(5000, g) for _ in range(3)]
    expected = _ddp_default(torch.stack(local))
    wrong = expected.clone()
    wrong.view(torch.int32)[4] += 1
    ranks = _captures(3, [expected, expected.clone(), wrong], local)
    assert known_reductions([r[0] for r in ranks], 0, Reductions()) == {}   # nothing emulated yet
    assert _differing(collective_records(DDP(3), ranks, torch.float32, Reductions())) == {0: 0, 1: 0, 2: 1}
    unread = _captures(3, [expected, expected, expected], local, scaled=_Unread)
    with pytest.raises(AssertionError, match="computed"):
        list(collective_records(DDP(3), unread, torch.float32))


def test_an_input_that_is_not_the_contribution_times_one_over_w_is_emulated_from_itself():
    g = torch.Generator().manual_seed(2)
    local = [_wide(5000, g) for _ in range(2)]
    shared = Reductions()
    shared.of(0, local, torch.stack(local))
    ranks = _captures(2, [torch.zeros(5000)] * 2, local)
    ranks[1][0]["collectives"][0]["tensors"]["inputs"][0] = dataclasses.replace(
        ranks[1][0]["collectives"][0]["tensors"]["inputs"][0], factor=0.25)
    assert known_reductions([r[0] for r in ranks], 0, shared) == {}


def _wide_mlp() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 300))


def test_real_ddp_buckets_large_enough_to_be_written_whole_are_verified_against_the_audit(monkeypatch):
    import torch.nn.functional as F

    from ddplab import compare
    from ddplab.compare import recorded

    used = []

    def counted(captures, step, shared):
        known = known_reductions(captures, step, shared)
        used.append((step, len(known)))
        return known

    monkeypatch.setattr(recorded, "known_reductions", counted)
    g = torch.Generator().manual_seed(1)
    setup = compare.Setup(model=_wide_mlp, loss=F.mse_loss, optimizer=lambda p: torch.optim.SGD(p, lr=0.01),
                          batches=[(torch.randn(8, 300, generator=g), torch.randn(8, 300, generator=g))
                                   for _ in range(3)])
    result = compare.run(setup, compare.DDP(2), progress=False)
    assert result.kinds == {"ddp W=2": "exact"}
    assert [step for step, n in used if n] == [0, 1, 2], used
    rows = result.records[(result.records["metric"] == "collective_elements_differing")
                          & (result.records["op"] == "allreduce")]
    assert set(rows["step"]) == {0, 1, 2} and (rows["value"] == 0).all()
    # DDP's broadcast of the weights, written as the initial weights the parent builds, verified on both ranks.
    broadcast = result.records[(result.records["metric"] == "collective_elements_differing")
                               & (result.records["op"] == "broadcast")]
    assert set(broadcast["rank"]) == {0, 1} and (broadcast["value"] == 0).all()


def test_a_broadcast_of_the_initial_weights_is_written_as_a_marker_and_read_back_from_them():
    from ddplab.compare.captures import InitialWeights

    g = torch.Generator().manual_seed(3)
    initial = torch.randn(300_000, generator=g)
    first, second = initial[:200_000].clone(), initial[200_000:].clone()
    other = first.clone()
    other.view(torch.int32)[5] += 1                                       # one ulp off the weights
    states = [dict(tensors=dict(inputs=[first.clone()], outputs=[first.clone()])),   # a bucket, in place
              dict(tensors=dict(inputs=[second.clone()], outputs=[second.clone()])),  # the next bucket
              dict(tensors=dict(inputs=[other], outputs=[initial[:70_000].double()]))]
    InitialWeights.mark(states, initial)
    assert [s["tensors"]["inputs"][0] for s in states[:2]] == [InitialWeights(0, 200_000),
                                                                InitialWeights(200_000, 100_000)]
    assert states[0]["tensors"]["outputs"][0] == InitialWeights(0, 200_000)
    assert states[2]["tensors"]["inputs"][0] is other                    # not the weights' bits: written whole
    assert isinstance(states[2]["tensors"]["outputs"][0], torch.Tensor)   # another dtype
    assert torch.equal(InitialWeights(200_000, 100_000).value(initial), second)


def test_a_broadcast_written_as_the_initial_weights_verifies_and_one_that_differs_is_caught():
    from ddplab.compare.captures import InitialWeights

    g = torch.Generator().manual_seed(4)
    initial = torch.randn(100_000, generator=g)
    wrong = initial.clone()
    wrong.view(torch.int32)[9] += 1

    def ranks(rank_1_output):
        out = []
        for rank, output in enumerate([InitialWeights(0, 100_000), rank_1_output]):
            state = dict(type="CollectiveRecord", rank=rank, index=0, step=None, op="broadcast", c10d_op="broadcast_",
                         group="0", group_ranks=(0, 1), group_rank=rank, sequence=1, root=0, dtype="float32",
                         input_shapes=((100_000,),), output_shapes=((100_000,),), input_digests=(),
                         output_digests=(), tensors=dict(inputs=[InitialWeights(0, 100_000)], outputs=[output]))
            out.append([dict(collectives=[state])])
        return out

    built = []

    def weights():
        built.append(1)
        return initial

    assert _differing(collective_records(DDP(2), ranks(InitialWeights(0, 100_000)), torch.float32,
                                         initial=weights)) == {0: 0, 1: 0}
    assert not built                          # markers of one range on every rank: the same bits, nothing built
    assert _differing(collective_records(DDP(2), ranks(wrong), torch.float32, initial=weights)) == {0: 0, 1: 1}
    assert len(built) == 1                                               # built once for the step
    assert _differing(collective_records(DDP(2), ranks(InitialWeights(1, 99_999)), torch.float32,
                                         initial=weights)) == {0: 0, 1: 99_999}   # another range: other bits
    assert len(built) == 2
    with pytest.raises(ValueError, match="without them"):
        list(collective_records(DDP(2), ranks(wrong), torch.float32))

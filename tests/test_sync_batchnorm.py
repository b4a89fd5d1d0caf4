"""ddplab's SyncBatchNorm on real gloo ranks against torch's BatchNorm over the global batch.

W ranks each normalize their share of one global batch; their outputs, input
gradients (of a loss summed over every rank), summed weight/bias gradients
and running statistics must be one process's ``BatchNorm`` on the whole
batch, up to rounding. The rounding is measured against a float64 truth
(the same one-process BatchNorm in float64): each float32 result's largest
error, in units of u * max|truth| (u = 2^-24), must stay within
:data:`BOUND_ULPS` -- where torch's own one-process float32 BatchNorm lies too.
Measured (torch 2.13 CPU, the cases below and W=4 on quarters of 64x6x5x5): SyncBatchNorm at
most 3.3, torch's one-process BatchNorm at most 3.1; after 3 DDP steps (W=2) the parameters and
running statistics at most 3.1, the one-process run's at most 4.6.
"""
from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel as DDP

from ddplab.sync_batchnorm import SyncBatchNorm, convert_sync_batchnorm

#: The largest error allowed, in u * max|truth| per tensor (u = 2^-24): over twice the largest measured.
BOUND_ULPS = 8
U = 2.0 ** -24
QUANTITIES = ("out", "grad_input", "grad_weight", "grad_bias", "running_mean", "running_var")


def global_batch(shape, seed=0, dtype=torch.float32):
    """Inputs over a few scales and a fixed upstream gradient G (the loss is sum(y * G))."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g, dtype=torch.float64) * 3 + 1.5
    return x.to(dtype), torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)


def affine(bn, seed=1):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        bn.weight.copy_(torch.rand(bn.num_features, generator=g, dtype=torch.float64) + 0.5)
        bn.bias.copy_(torch.rand(bn.num_features, generator=g, dtype=torch.float64) - 0.5)
    return bn


def one_step(bn, x, grad):
    """Forward, backward of sum(y * grad): everything the comparison reads."""
    x = x.clone().requires_grad_()
    y = bn(x)
    (y * grad).sum().backward()
    return dict(out=y.detach(), grad_input=x.grad, grad_weight=bn.weight.grad, grad_bias=bn.bias.grad,
                running_mean=bn.running_mean.clone(), running_var=bn.running_var.clone(),
                batches=int(bn.num_batches_tracked))


def shares_worker(shape, splits, momentum):
    """Rank r normalizes rows splits[r] of the global batch with SyncBatchNorm."""
    rank = dist.get_rank()
    x, grad = global_batch(shape)
    start = sum(splits[:rank])
    rows = slice(start, start + splits[rank])
    bn = affine(SyncBatchNorm(shape[1], momentum=momentum))
    return one_step(bn, x[rows], grad[rows])


def reference(shape, dtype, momentum):
    x, grad = global_batch(shape, dtype=dtype)
    bn = affine(torch.nn.BatchNorm2d(shape[1], momentum=momentum, dtype=dtype) if len(shape) == 4
                else torch.nn.BatchNorm1d(shape[1], momentum=momentum, dtype=dtype))
    return one_step(bn, x, grad)


def gathered(ranks: list[dict]) -> dict:
    """The W ranks' results as one process's: rows concatenated, weight/bias gradients summed
    (each rank's is of its own rows; DDP would average them, the loss here sums)."""
    return dict(out=torch.cat([r["out"] for r in ranks]), grad_input=torch.cat([r["grad_input"] for r in ranks]),
                grad_weight=sum(r["grad_weight"] for r in ranks), grad_bias=sum(r["grad_bias"] for r in ranks),
                running_mean=ranks[0]["running_mean"], running_var=ranks[0]["running_var"])


def error_ulps(got: torch.Tensor, truth: torch.Tensor) -> float:
    return float((got.double() - truth).abs().max() / (U * truth.abs().max()))


@pytest.mark.parametrize("shape, splits", [
    ((16, 6, 3, 3), (8, 8)),          # BatchNorm2d, halves
    ((40, 5), (20, 20)),              # BatchNorm1d, halves
    ((16, 6, 3, 3), (7, 9, 0)),       # unequal shares and an empty one: the counts weight the merge
    ((64, 6, 5, 5), (16, 16, 16, 16)),
], ids=["2d-halves", "1d-halves", "2d-7-9-0", "2d-quarters"])
def test_w_ranks_are_global_batch_batchnorm_within_rounding(warm_launcher, shape, splits):
    momentum = 0.1
    ranks = warm_launcher(shares_worker, world_size=len(splits), args=(shape, list(splits), momentum),
                          timeout=120).returns
    assert all(r["batches"] == 1 for r in ranks)
    for r in ranks[1:]:      # every rank holds the same running statistics
        assert torch.equal(r["running_mean"], ranks[0]["running_mean"])
        assert torch.equal(r["running_var"], ranks[0]["running_var"])
    sync = gathered([r for r, n in zip(ranks, splits) if n])
    torch_bn = reference(shape, torch.float32, momentum)
    truth = reference(shape, torch.float64, momentum)
    for q in QUANTITIES:
        ours, theirs = error_ulps(sync[q], truth[q]), error_ulps(torch_bn[q], truth[q])
        assert ours <= BOUND_ULPS and theirs <= BOUND_ULPS, (q, ours, theirs)
    # Unbiased running variance of the global count: momentum * N/(N-1) * var + (1 - momentum) * 1.
    x = global_batch(shape)[0].double().transpose(0, 1).reshape(shape[1], -1)
    expected = momentum * x.var(dim=1, correction=1) + (1 - momentum)
    assert error_ulps(sync["running_var"], expected) <= BOUND_ULPS


def ddp_worker(steps):
    """A small network with BatchNorm converted to ddplab's SyncBatchNorm, trained under DDP on gloo."""
    net = convert_sync_batchnorm(bn_net())
    ddp = DDP(net)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.1)
    w, r = dist.get_world_size(), dist.get_rank()
    for step in range(steps):
        x, y = data(step)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(ddp(x.chunk(w)[r]), y.chunk(w)[r]).backward()
        opt.step()
    try:
        DDP(torch.nn.SyncBatchNorm.convert_sync_batchnorm(bn_net()))
        refused = None
    except ValueError as exc:
        refused = str(exc)
    return net.state_dict(), refused


def bn_net(dtype=torch.float32):
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(12, 8), torch.nn.BatchNorm1d(8), torch.nn.Tanh(),
                               torch.nn.Linear(8, 4)).to(dtype)


def data(step, dtype=torch.float32):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(32, 12, generator=g).to(dtype), torch.randint(0, 4, (32,), generator=g)


def train_one_process(steps, dtype):
    net = bn_net(dtype)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    for step in range(steps):
        x, y = data(step, dtype)
        opt.zero_grad()
        torch.nn.functional.cross_entropy(net(x), y).backward()
        opt.step()
    return net.state_dict()


def test_inside_ddp_on_gloo_it_trains_like_one_process_over_the_global_batch(warm_launcher):
    steps = 3
    ranks = warm_launcher(ddp_worker, world_size=2, args=(steps,), timeout=120).returns
    (state, refused), (other, _) = ranks
    assert "only work with GPU modules" in refused          # torch's own, on CPU
    assert all(torch.equal(state[k], other[k]) for k in state)
    single, truth = train_one_process(steps, torch.float32), train_one_process(steps, torch.float64)
    assert list(state) == list(single)                      # the same state_dict keys as BatchNorm
    for k in state:
        if k.endswith("num_batches_tracked"):
            assert int(state[k]) == int(single[k]) == steps
            continue
        # Within rounding of the float64 truth, as the one-process float32 run is (up to 4.6 there).
        assert error_ulps(state[k], truth[k]) <= BOUND_ULPS, k


def test_outside_a_process_group_it_is_batchnorm_bit_for_bit():
    x, grad = global_batch((16, 6, 3, 3))
    for momentum in (0.1, None):
        ours = one_step(affine(SyncBatchNorm(6, momentum=momentum)), x, grad)
        theirs = one_step(affine(torch.nn.BatchNorm2d(6, momentum=momentum)), x, grad)
        for q in QUANTITIES:
            assert torch.equal(ours[q], theirs[q]), q
    assert not dist.is_initialized()


def world_of_one(shape):
    x, grad = global_batch(shape)
    return one_step(affine(SyncBatchNorm(shape[1])), x, grad)


def test_a_group_of_one_rank_is_batchnorm_bit_for_bit(warm_launcher):
    shape = (16, 6, 3, 3)
    ours = warm_launcher(world_of_one, world_size=1, args=(shape,)).returns[0]
    theirs = reference(shape, torch.float32, 0.1)
    for q in QUANTITIES:
        assert torch.equal(ours[q], theirs[q]), q


def test_drop_in_for_torchs_syncbatchnorm_and_the_converter():
    ours, theirs = SyncBatchNorm(8, eps=1e-3, momentum=0.2, bias=False), torch.nn.SyncBatchNorm(8, eps=1e-3,
                                                                                                momentum=0.2, bias=False)
    assert list(ours.state_dict()) == list(theirs.state_dict())
    assert ours.load_state_dict(theirs.state_dict()) is not None and ours.bias is None
    assert SyncBatchNorm.collective_in_forward is True
    net = torch.nn.Sequential(torch.nn.Conv2d(1, 4, 3), torch.nn.BatchNorm2d(4),
                              torch.nn.Sequential(torch.nn.SyncBatchNorm(4)), torch.nn.BatchNorm1d(4).eval())
    before = {n: p for n, p in net.named_parameters()}
    converted = convert_sync_batchnorm(net)
    assert converted is net
    assert [type(m).__name__ for m in (net[1], net[2][0], net[3])] == ["SyncBatchNorm"] * 3
    assert all(isinstance(m, SyncBatchNorm) for m in (net[1], net[2][0], net[3]))
    assert not net[3].training and net[1].training
    assert all(p is before[n] for n, p in net.named_parameters())       # the optimizer's stay valid
    root = torch.nn.BatchNorm1d(3)
    new = convert_sync_batchnorm(root)
    assert isinstance(new, SyncBatchNorm) and new.weight is root.weight and new.running_mean is root.running_mean
    assert convert_sync_batchnorm(new) is new
    copy.deepcopy(new)      # picklable as a module (no process group held)
    with pytest.raises(ValueError, match="at least 2D"):
        new(torch.randn(3))


def test_the_readme_syncbatchnorm_example_is_within_rounding_verbatim(warm_launcher):
    import re

    from test_compression_hooks import readme_examples, run_verbatim

    section, blocks = readme_examples()
    printed = [float(v) for v in run_verbatim(blocks[1])]
    shown = [float(v) for v in re.search(r"prints `([\d.]+)` and `([\d.]+)`", section).groups()]
    assert len(printed) == 2 and all(v <= BOUND_ULPS for v in printed + shown)
    assert printed == pytest.approx(shown, abs=1.0)     # the README's figures, up to another kernel's rounding

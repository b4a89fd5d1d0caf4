"""ddplab.fabric: Lightning Fabric adopts ddplab's process group (real gloo ranks, real Fabric)."""
from __future__ import annotations

import pytest
import torch

from ddplab.fabric import ddp_of, fabric_available, make_fabric


def test_fabric_is_installed_here():
    pytest.importorskip("lightning.fabric")
    ok, version = fabric_available()
    assert ok and version[0].isdigit()


def test_make_fabric_outside_a_rank_says_so():
    with pytest.raises(ValueError, match="inside a rank"):
        make_fabric("cpu")


def test_ddp_of_refuses_a_bare_module():
    with pytest.raises(ValueError, match="DDP"):
        ddp_of(torch.nn.Linear(2, 2))


def _fabric_in_ddplab_group():
    import torch.distributed as dist

    fabric = make_fabric("cpu")
    env = fabric.strategy.cluster_environment
    torch.manual_seed(dist.get_rank())                 # different weights per rank ...
    model = torch.nn.Linear(4, 2)
    model, optimizer = fabric.setup(model, torch.optim.SGD(model.parameters(), lr=0.1))
    ddp = ddp_of(model)
    # ... which DDP's constructor replaced by rank 0's, over ddplab's group.
    weights = [torch.empty(8) for _ in range(dist.get_world_size())]
    dist.all_gather(weights, ddp.module.weight.detach().reshape(-1).clone())
    loss = model(torch.full((3, 4), float(dist.get_rank() + 1))).sum()
    fabric.backward(loss)                              # the reducer averages the gradients
    grads = [torch.empty(8) for _ in range(dist.get_world_size())]
    dist.all_gather(grads, ddp.module.weight.grad.reshape(-1).clone())
    return (fabric.global_rank, fabric.world_size, env.creates_processes_externally,
            type(fabric.strategy).__name__,
            dist.get_world_size(ddp.process_group) == dist.get_world_size(),
            all(torch.equal(w, weights[0]) for w in weights),
            all(torch.equal(g, grads[0]) for g in grads))


def test_fabric_adopts_the_existing_group_and_reduces_over_it(no_leftovers):
    pytest.importorskip("lightning.fabric")
    res = no_leftovers(_fabric_in_ddplab_group, world_size=2, timeout=120)
    assert res.returns == [(0, 2, True, "DDPStrategy", True, True, True),
                           (1, 2, True, "DDPStrategy", True, True, True)]

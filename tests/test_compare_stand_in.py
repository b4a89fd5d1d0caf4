"""The stand-in process group: user code that reads torch.distributed, run in the parent as on its rank.

A loss that multiplies by the world size is replayed as the rank ran it (no module is blamed),
and the float64 run of the user's code names the factor W.
"""
from __future__ import annotations

import sys

import torch.distributed as dist
import torch.nn.functional as F

from ddplab.compare import examples, stand_in

from test_compare_compiled import readme_example


def test_stand_ins_answer_the_rank_nest_and_leave_nothing_behind():
    hook = sys.excepthook
    with stand_in.process_group(1, 3) as standing:
        assert standing and (dist.get_rank(), dist.get_world_size()) == (1, 3)
        with stand_in.process_group(0, 1):
            assert (dist.get_rank(), dist.get_world_size()) == (0, 1)
        assert (dist.get_rank(), dist.get_world_size()) == (1, 3)
    assert not dist.is_initialized() and sys.excepthook is hook


def _world_scaled(out, target):
    return F.cross_entropy(out, target) * dist.get_world_size()


def test_a_loss_that_reads_the_process_group_is_noticed():
    import dataclasses

    setup = examples.digits_setup(0, steps=1)
    assert not stand_in.reads_process_group(setup, 2)
    assert stand_in.reads_process_group(dataclasses.replace(setup, loss=_world_scaled), 2)


def test_the_readme_loss_that_reads_the_world_size_is_a_factor_not_a_module(warm_launcher):
    namespace = readme_example("dist.get_world_size()")
    v = namespace["v"]
    assert (v.kind, v.evidence, v.difference) == ("bug", "float64", "factor"), v.headline
    assert v.values["float64_factor_name"] == "W" and abs(v.values["float64_factor"] - 2.0) < 1e-9
    # The replay ran the loss as the rank did: every phase equal, no module named.
    replay = v.finding("replay")
    assert replay.holds and replay.values["complete"], replay.values
    assert "replay_module" not in v.values and v.values["first_param"] == "(model)"
    assert v.finding("twin").holds  # every rank scales alike: not a rank-dependent computation

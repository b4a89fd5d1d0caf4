"""Models compiled with torch.compile under compare: real inductor on the ranks and in the replay.

ddplab's forward hooks stay out of compiled graphs (no AOTAutograd crash, no graph break, no
recompilation), parameters are named without ``_orig_mod.``, and the replay re-executes the rank's
compiled module: compiled DDP reads exact whether compiled before DDP, after it or in place.
"""
from __future__ import annotations

import contextlib
import copy
import io
import sys

import cloudpickle
import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddplab import compare
from ddplab.compare import compiled
from ddplab.compare.runners import ForwardDigests

from readme import python_block_with, readme_section

cloudpickle.register_pickle_by_value(sys.modules[__name__])  # the ranks get this module's functions by value

SECTION = "Your own training"


def readme_example(marker: str) -> dict:
    """Run the README's shared definitions and the example containing ``marker``; its namespace
    (``printed``: what it printed)."""
    section = readme_section(SECTION)
    namespace = {"__name__": "readme_example"}  # functions pickled by value, as in a notebook
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(python_block_with(section, "sgd = lambda"), "README.md", "exec"), namespace)
        exec(compile(python_block_with(section, marker), "README.md", "exec"), namespace)
    namespace["printed"] = out.getvalue()
    return namespace


def _net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


# --------------------------------------------------------------------------- without ranks


def test_names_drop_orig_mod_and_compiled_models_are_recognized():
    net = _net()
    assert compiled.plain_name("_orig_mod.0.weight") == "0.weight"
    assert compiled.plain_name("module._orig_mod.block._orig_mod.w") == "module.block.w"
    assert not compiled.is_compiled(net)
    assert compiled.is_compiled(torch.compile(copy.deepcopy(net)))
    in_place = copy.deepcopy(net)
    in_place.compile()
    assert compiled.is_compiled(in_place)
    names = [n for n, _ in compare.setup.named_trainable(torch.compile(copy.deepcopy(net)))]
    assert names == [n for n, _ in compare.setup.named_trainable(net)] == ["0.weight", "0.bias", "2.weight", "2.bias"]


def test_forward_digests_stay_out_of_compiled_graphs():
    """The digest hooks on a model compiled through AOTAutograd: no crash (ddplab's uint8 view of an
    output, traced, was AOTAutograd's setStorage error), no graph break, one graph for ten steps,
    no digest from inside the compiled region; the same hooks on the eager model digest every module."""
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    net = _net()
    digests = ForwardDigests(net)
    model = torch.compile(net, backend="aot_eager")
    for step in range(10):
        model(torch.randn(6, 8)).sum().backward()
    assert digests.take() == []
    stats = torch._dynamo.utils.counters
    assert not stats["graph_break"], dict(stats["graph_break"])
    assert stats["stats"]["unique_graphs"] == 1
    digests.remove()
    eager = ForwardDigests(net)
    net(torch.randn(6, 8))
    assert [name for name, _ in eager.take()] == ["0", "1", "2", "(model)"]


def test_a_compiled_local_gradient_the_replay_cannot_reproduce_is_unverified_not_a_bug():
    from ddplab.records import record

    labels = dict(config="c")
    recs = [record("replay_differing", 3, step=0, rank=1, phase="local_gradient", quantity="grad", param="w", **labels),
            record("replay_differing", 0, step=0, rank=1, phase="local_gradient", quantity="forward",
                   param="(forward outputs)", **labels),
            record("replay_module", 1, step=0, rank=1, phase="local_gradient", module="0", found_by="x", **labels),
            record("replay_differing", 0, step=0, rank=0, phase="local_gradient", quantity="grad", param="w", **labels),
            record("replay_differing", 0, step=0, rank=1, phase="update", quantity="param", param="w", **labels)]
    out = compiled.unverified_local(recs)
    assert [(r["metric"], r["rank"], r.get("phase")) for r in out] == [
        ("replay_unverified", 1, "local_gradient"), ("replay_differing", 0, "local_gradient"),
        ("replay_differing", 1, "update")]
    assert out[0]["reason"] == compiled.COMPILED_REASON


# --------------------------------------------------------------------------- on real ranks


def test_the_readme_compiled_model_reads_exact_with_the_full_replay(warm_launcher):
    """torch.compile at its defaults in Setup.model, DDP(2): every phase of every rank equals the
    replay of the rank's compiled module bit for bit."""
    namespace = readme_example("torch.compile(copy.deepcopy(net))")
    assert "{'ddp W=2': 'exact'}" in namespace["printed"]
    result = namespace["result"]
    v = result.verdict("ddp W=2")
    assert (v.kind, v.evidence) == ("exact", "replay"), v.headline
    rows = result.records[result.records["metric"] == "replay_differing"]
    assert set(rows["phase"]) == {"local_gradient", "reduction", "update"} and rows["value"].sum() == 0
    assert not (result.records["metric"] == "replay_unverified").any()
    assert not result.records["param"].dropna().astype(str).str.contains("_orig_mod").any()


def _compiled_in_place(seed: int = 0) -> nn.Module:
    from ddplab.compare.examples import _build

    model = _build("mlp", seed)
    model.compile()
    return model


@pytest.mark.slow
def test_compiled_after_ddp_or_in_place_reads_exact_or_rounding(warm_launcher):
    import dataclasses

    from ddplab.compare import examples

    setup = examples.digits_setup(0, steps=2, batch_size=32)
    configs = [compare.DDP(2, compile=True),
               compare.Custom(2, train_step=examples.plain_step, wrap=examples.compiled_ddp, name="custom compiled")]
    result = compare.run(setup, configs, progress=False)
    assert result.verdict(configs[0]).kind == "exact", result.verdict(configs[0]).headline
    custom = result.verdict(configs[1])
    assert (custom.kind, custom.evidence) == ("rounding", "float64"), custom.headline
    assert custom.finding("twin").holds
    in_place = dataclasses.replace(setup, model=_compiled_in_place)
    v = compare.run(in_place, compare.DDP(2), progress=False).verdict("ddp W=2")
    assert (v.kind, v.evidence) == ("exact", "replay"), v.headline


def _launch_compiled_ddp():
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    net = _net()
    model = torch.compile(DistributedDataParallel(net))
    torch.manual_seed(dist.get_rank())
    F.mse_loss(model(torch.randn(6, 8)), torch.zeros(6, 4)).backward()
    grad = torch.cat([p.grad.reshape(-1) for p in net.parameters()])
    both = [torch.zeros_like(grad) for _ in range(dist.get_world_size())]
    dist.all_gather(both, grad)
    return all(torch.equal(both[0], g) for g in both)


@pytest.mark.slow
def test_compiled_ddp_runs_under_plain_launch(warm_launcher):
    result = warm_launcher(_launch_compiled_ddp, world_size=2)
    assert result.returns == [True, True]

"""Bad setups and configurations are refused with a ValueError naming the problem, before any
rank starts; a model that differs from process to process is caught before any configuration runs."""
from __future__ import annotations

import dataclasses
import functools
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from ddplab import compare, launcher
from ddplab.compare import examples
from ddplab.compare.examples import _batches, _build


def _setup(**overrides) -> compare.Setup:
    fields = dict(model=functools.partial(_build, "mlp", 0), batches=_batches(0, 2, 8),
                  loss=F.cross_entropy, optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    fields.update(overrides)
    return compare.Setup(**fields)


def _unseeded():
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def _five_classes():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 5))


def _no_flatten():
    torch.manual_seed(0)
    return nn.Linear(64, 10)


class _PythonNoise(nn.Module):
    """Randomness outside torch's generator: the replay cannot restore it."""

    def forward(self, x):
        import random
        return x * random.random()


def _python_noise():
    torch.manual_seed(0)
    return nn.Sequential(nn.Flatten(), _PythonNoise(), nn.Linear(64, 10))


def _raises():
    raise RuntimeError("cannot find the checkpoint")


def _ragged_batches():
    good = _batches(0, 2, 8)
    return [good[0], (good[1][0][:, :, :4], good[1][1])]


@pytest.mark.parametrize("setup, configs, match", [
    (_setup(model=_raises), None, r"setup\.model\(\) raised RuntimeError: cannot find the checkpoint"),
    (_setup(model=_unseeded), None, r"different weights on each call.*manual_seed"),
    (_setup(model=lambda: 3), None, r"must return a torch\.nn\.Module, got int"),
    (_setup(model=_no_flatten), None, r"forward pass on batch 0 raised RuntimeError"),
    (_setup(model=_five_classes), None, r"setup\.loss\(output, target\) on batch 0 raised"),
    (_setup(loss=functools.partial(F.cross_entropy, reduction="none")), None, r"0-dim tensor.*\(8,\)"),
    (_setup(model=_python_noise), None, r"not deterministic.*same random-number state"),
    (_setup(optimizer=lambda p: list(p)), None, r"must return a torch\.optim\.Optimizer, got list"),
    (_setup(batches=[]), None, r"setup\.batches is empty"),
    (_setup(batches=[(torch.zeros(8, 64),)]), None, r"batch 0 must be a tuple \(inputs\.\.\., target\)"),
    (_setup(batches=[(torch.zeros(8, 64), torch.zeros(6, dtype=torch.long))]), None, r"one batch size"),
    (_setup(batches=_ragged_batches), None, r"batch 1 has per-sample shapes"),
    (_setup(), [compare.Accumulate(2, k=3)], r"'accumulate W=2 k=3' cannot split into 6 equal pieces"),
    (_setup(batches=lambda: 1 / 0), None, r"setup\.batches\(\) raised ZeroDivisionError"),
    ("not a setup", None, r"expected a ddplab\.compare\.Setup"),
])
def test_bad_setups_are_named_before_any_rank_starts(setup, configs, match):
    seen = []
    with launcher.observe(lambda run, rec: seen.append(rec)):
        with pytest.raises(compare.SetupError, match=match):
            compare.run(setup, configs or [compare.DDP(2)], progress=False)
    assert seen == []  # no rank ever ran


@pytest.mark.parametrize("configs, match", [
    ([], r"at least one configuration"),
    ([compare.DDP(0)], r"world_size must be an int >= 1, got 0"),
    ([compare.Accumulate(2, k=1)], r"k >= 2"),
    ([compare.DDP(2), compare.DDP(2)], r"unique.*'ddp W=2'"),
    ([compare.DDP(2, name="reference")], r"clash with the reference"),
    ([compare.DDP(2, bucket_cap_mb=-1)], r"bucket_cap_mb"),
    ([compare.DDP(2, comm_hook="allreduce")], r"comm_hook"),
    ([compare.DDP(2, options={"process_group": None})], r"must not set \['process_group'\]"),
    ([compare.Custom(2)], r"train_step"),
    ([compare.Custom(2, train_step=print, wrap="fsdp")], r"wrap must be"),
    ([compare.FSDP2(2, param_dtype=torch.int32)], r"param_dtype must be a floating"),
    ([compare.DDP(2, timeout=0)], r"timeout must be a positive"),
    (["ddp"], r"expected DDP, Accumulate, Fabric, FSDP2 or Custom, got str"),
    (7, r"a Configuration or a list"),
])
def test_bad_configurations_are_named(configs, match):
    with pytest.raises(ValueError, match=match):
        compare.run(_setup(), configs, progress=False)


def test_bad_run_arguments_are_named():
    with pytest.raises(ValueError, match=r"steps=5 but setup\.batches has only 2"):
        compare.run(_setup(), compare.DDP(2), steps=5)
    with pytest.raises(ValueError, match="steps must be an int >= 1"):
        compare.run(_setup(), compare.DDP(2), steps=0)
    with pytest.raises(ValueError, match="timeout must be a positive"):
        compare.run(_setup(), compare.DDP(2), timeout=-1)
    with pytest.raises(ValueError, match="progress must be"):
        compare.run(_setup(), compare.DDP(2), progress="yes")
    with pytest.raises(ValueError, match="unknown planted example"):
        examples.planted_example("typo")


def _seeded_by_pid():
    torch.manual_seed(os.getpid())
    return nn.Sequential(nn.Flatten(), nn.Linear(64, 10))


def test_a_model_that_differs_between_processes_is_refused_before_any_configuration(no_leftovers):
    seen = []
    with launcher.observe(lambda run, rec: seen.append(rec)):
        with pytest.raises(compare.SetupError, match="different initial weights in another process"):
            compare.run(_setup(model=_seeded_by_pid), [compare.DDP(2)], progress=False)
    assert not [r for r in seen if r.get("config") == "ddp W=2"]  # the configuration never ran


def test_what_a_launch_would_refuse_is_refused_before_anything_runs():
    from ddplab.launcher import world_size_limit

    setup = examples.digits_setup(0, steps=1)
    too_many = world_size_limit()[0] + 1
    for configs, kwargs in (([compare.DDP(2), compare.DDP(too_many)], {}),
                            (compare.DDP(2, timeout=float("nan")), {}),
                            (compare.DDP(2), dict(timeout=float("inf")))):
        with pytest.raises(ValueError):
            compare.run(setup, configs, progress=False, **kwargs)


def model_that_never_returns():
    import time
    time.sleep(3600)


def test_a_model_that_hangs_is_stopped_at_the_timeout_and_named(warm_launcher):
    setup = dataclasses.replace(examples.digits_setup(0, steps=1), model=model_that_never_returns)
    with pytest.raises(compare.SetupError, match="model_that_never_returns") as err:
        compare.run(setup, compare.DDP(2), timeout=4, progress=False)
    assert "within 4 s" in str(err.value)


def test_the_setup_check_builds_twice_and_one_build_answers_every_structure_question():
    """Building a large model takes seconds: the check builds it twice (are the weights reproducible?)
    and no more; the first question about the model's structure builds once and answers them all,
    and the parent's digest build answers them before any is asked (Setup.answer_from)."""
    from ddplab.compare.compiled import is_compiled
    from ddplab.compare.replay import _collective_modules
    from ddplab.compare.setup import check_setup

    builds = []

    def counted():
        builds.append(1)
        return _build("mlp", 0)

    setup = _setup(model=counted)
    facts = check_setup(setup)
    assert len(builds) == 2 and facts["digest"] == compare.setup.model_digest(_build("mlp", 0))
    assert setup.inspect(is_compiled) is False and len(builds) == 3
    assert setup.inspect(_collective_modules) == [] and len(builds) == 3
    other = _setup(model=counted)
    other.answer_from(counted())
    assert other.inspect(is_compiled) is False and other.inspect(_collective_modules) == []
    assert len(builds) == 4


def test_the_parent_judges_on_one_thread_and_gives_the_user_their_threads_back(monkeypatch):
    """While a pass trains its ranks hold the cores; the parent's own thread count is the user's again after."""
    from ddplab.compare import comparison

    seen = []
    original = comparison._Session.configuration

    def configuration(self, index, config):
        seen.append(torch.get_num_threads())
        return original(self, index, config)

    monkeypatch.setattr(comparison._Session, "configuration", configuration)
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        compare.run(_setup(), [compare.DDP(2)], progress=False)
        assert seen == [1] and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)

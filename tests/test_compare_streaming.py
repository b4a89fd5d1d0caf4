"""A comparison judges each configuration as it trains: the ranks wait for the parent, which is no
hang, and a reference run that fails after its first step ends the comparison with the reason."""
from __future__ import annotations

import time

import pytest
import torch
import torch.nn.functional as F

from ddplab import compare
from ddplab.compare import comparison, examples


def test_a_parent_that_judges_slowly_is_not_a_hang(no_leftovers, monkeypatch):
    reductions = comparison._reduction_steps

    def slow(*args, **kwargs):              # the parent takes 2 s to judge each of steps 0 and 1
        for step, records in enumerate(reductions(*args, **kwargs)):
            time.sleep(2 if step < 2 else 0)
            yield records

    monkeypatch.setattr(comparison, "_reduction_steps", slow)
    seen = {}

    def progress(label, step, steps):
        seen.setdefault(label, []).append(time.perf_counter())

    result = compare.run(examples.digits_setup(0, steps=4), compare.DDP(2), timeout=3, progress=progress)
    alive = seen["ddp W=2"][-1] - seen["ddp W=2"][0]
    assert alive > 3          # step 3 waited for step 1 to be judged: beyond the launch's timeout
    assert result.kinds == {"ddp W=2": "exact"}


def _model():
    torch.manual_seed(0)
    return torch.nn.Linear(4, 2)


def _loss_failing_in_float64_on_marked_targets(out, target):
    if out.dtype == torch.float64 and bool((target == 99.0).any()):
        raise ArithmeticError("the float64 loss cannot take the marked batch")
    return F.mse_loss(out, target)


def test_a_reference_run_that_fails_after_its_first_step_is_reference_failed(no_leftovers):
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 4, generator=g), torch.randn(8, 2, generator=g)) for _ in range(3)]
    batches[1][1][0, 0] = 99.0             # the truth fails at step 1: after the first launch tried step 0
    setup = compare.Setup(model=_model, batches=batches, loss=_loss_failing_in_float64_on_marked_targets,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="marked")
    with pytest.raises(compare.ReferenceFailed, match="the float64 loss cannot take the marked batch"):
        compare.run(setup, compare.DDP(2), progress=False)


def _reference_launches(monkeypatch, keep_bytes: int) -> tuple[dict, int]:
    from ddplab import launcher

    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", keep_bytes)
    launches = set()

    def seen(run, rec):
        if run.fn_name == "reference_worker":
            launches.add(id(run))

    with launcher.observe(seen):
        result = compare.run(examples.digits_setup(0, steps=3), [compare.DDP(2), compare.DDP(2, name="again")],
                             progress=False)
    return result.kinds, len(launches)


def test_a_small_models_reference_runs_train_once_and_a_large_ones_beside_each_configuration(no_leftovers,
                                                                                              monkeypatch):
    kept, once = _reference_launches(monkeypatch, comparison.KEEP_REFERENCES_BYTES)
    streamed, each = _reference_launches(monkeypatch, 0)
    assert once == 1 and each == 2
    assert kept == streamed == {"ddp W=2": "exact", "again": "exact"}


def test_the_float64_promise_is_judged_where_it_trains_and_never_written(tmp_path):
    from ddplab import records
    from ddplab.compare.runners import captured_files, reference_runs, train_references

    setup = examples.digits_setup(0, steps=2, reduction="sum")   # a summed loss: the promise is the truth / W
    runs = reference_runs([compare.DDP(2)])
    promise = next(spec for spec in runs if spec.promise)
    with records.collect() as got:
        train_references(setup, runs, 2, str(tmp_path))
    assert captured_files(str(tmp_path), promise.run_id) == []
    assert len(captured_files(str(tmp_path), "truth")) == 2
    distances = [r for r in got if r["metric"] == "semantic_distance"]
    assert {r["step"] for r in distances} == {0, 1} and {r["config"] for r in distances} == {promise.label}
    [difference] = [r for r in got if r["metric"] == "semantic_difference"]
    assert (difference["step"], difference["kind"], difference["factor_name"]) == (0, "factor", "1/W")


def test_a_semantic_bug_is_found_when_the_references_train_beside_each_configuration(no_leftovers, monkeypatch):
    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)
    result = compare.run(examples.digits_setup(0, steps=2, reduction="sum"), compare.DDP(2), progress=False)
    v = result.verdict("ddp W=2")
    assert (v.kind, v.referee, v.difference) == ("bug", "semantic", "factor")
    assert v.finding_values("semantic")["factor"] == pytest.approx(0.5, rel=1e-6)


def _wide_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(300, 300), torch.nn.Tanh(), torch.nn.Linear(300, 4))


def test_ranks_that_train_on_past_a_nonfinite_step_do_not_wait_for_captures_nobody_reads(no_leftovers):
    """A NaN at step 1 of 5 ends the judging there; the run trains on to its end while the parent deletes
    its captures as they appear. Rank 1 of a model with large tensors waits for rank 0's capture of each
    step to share what is equal (runners.SAME_AS_WAIT, 30 s): released, it must not wait at all, or the
    run would count as hung at its 20 s timeout."""
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 300, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]
    batches[1][0][0, 0] = float("nan")
    setup = compare.Setup(model=_wide_model, batches=batches, loss=F.mse_loss,
                          optimizer=lambda p: torch.optim.SGD(p, lr=0.1), name="wide")
    result = compare.run(setup, compare.DDP(2), timeout=20, progress=False)
    v = result.verdict("ddp W=2")
    assert v.kind == "exact", v.headline                       # step 0, bit for bit; then the NaN
    assert v.finding_values("finite")["nonfinite_step"] == 1
    status = result.records[result.records["metric"] == "steps_completed"]
    assert status["status"].tolist() == ["completed"] and status["value"].tolist() == [5]


def test_a_step_is_reported_done_once_every_rank_of_the_run_has_written_it():
    """Progress (and the explorer's Stop after a step) counts a step when every rank sent its gradient
    norm, which a rank does after writing its capture: rank 0 alone is not the step."""
    from ddplab import records

    calls = []
    progress = comparison._Progress(3, False, lambda *call: calls.append(call), {"ddp W=2": 2})
    for rank, step in [(0, 0), (0, 1), (1, 0)]:
        progress(records.record("grad_norm", 1.0, step=step, rank=rank, config="ddp W=2"))
    progress(records.record("grad_norm", 1.0, step=0, rank=0, config="reference"))   # one rank
    progress(records.record("loss", 1.0, step=2, rank=1, config="ddp W=2"))            # not a step's end
    assert calls == [("ddp W=2", 0, 3), ("reference", 0, 3)]


def _wider_model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(600, 600), torch.nn.Tanh(), torch.nn.Linear(600, 600))


class _OneUlpOnRank1AtItsThirdStep(torch.optim.SGD):
    def step(self, closure=None):
        out = super().step(closure)
        self.calls = getattr(self, "calls", 0) + 1
        if self.calls == 3 and torch.distributed.is_initialized() and torch.distributed.get_rank() == 1:
            with torch.no_grad():
                flat = self.param_groups[0]["params"][0].view(-1)
                flat[0] = torch.nextafter(flat[0], torch.tensor(float("inf")))
        return out


def test_captures_written_over_recycled_files_and_read_into_reused_storages_are_judged_bit_for_bit(
        no_leftovers, monkeypatch):
    """Ranks write steps 1.. over the files of steps nobody reads any more, the reference process judges
    them memory-mapped, the parent reads each into storages its earlier captures used (1.4 MB weights:
    beyond ReadBuffers.MIN_BYTES). Correct code stays exact; a one-ulp fault at step 2, after storages
    were reused, is found there."""
    from ddplab.compare.captures import ReadBuffers

    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)
    taken = []
    copy_of = ReadBuffers.copy_of

    def counted(self, storage, location="cpu"):
        before = self.reused
        out = copy_of(self, storage, location)
        taken.append(self.reused > before)
        return out

    monkeypatch.setattr(ReadBuffers, "copy_of", counted)
    g = torch.Generator().manual_seed(0)
    batches = [(torch.randn(8, 600, generator=g), torch.randn(8, 600, generator=g)) for _ in range(4)]

    def run(optimizer):
        setup = compare.Setup(model=_wider_model, batches=batches, loss=F.mse_loss, optimizer=optimizer, name="wider")
        return compare.run(setup, compare.DDP(2), progress=False).verdict("ddp W=2")

    assert run(lambda p: torch.optim.SGD(p, lr=0.1)).kind == "exact"
    assert sum(taken) >= 8, taken
    v = run(lambda p: _OneUlpOnRank1AtItsThirdStep(p, lr=0.1))
    assert v.kind == "bug", v.headline
    replay = v.finding_values("replay")
    assert (replay["step"], replay["rank"], replay["phase"]) == (2, 1, "update")

"""A configuration that crashes or hangs is reported as such (rank, error, the steps it
finished) while the others still publish; stopping keeps the records so far."""
from __future__ import annotations

import time

import pytest

from ddplab import compare, launcher
from ddplab.compare import examples


def crash_on_rank_1_at_step_1(ctx):
    if ctx.rank == 1 and ctx.step == 1:
        raise ValueError("boom: the data loader ran dry")
    return examples.accumulate_correctly(ctx)


def hang_on_rank_1_at_step_1(ctx):
    if ctx.rank == 1 and ctx.step == 1:
        time.sleep(600)          # rank 0 waits for it in the next all-reduce
    return examples.accumulate_correctly(ctx)


def test_crash_and_hang_are_reported_and_the_others_still_publish(no_leftovers):
    setup = examples.digits_setup(0, steps=3)
    configs = [compare.Custom(2, train_step=crash_on_rank_1_at_step_1),
               compare.Custom(2, train_step=hang_on_rank_1_at_step_1, timeout=10),
               compare.DDP(2)]
    result = compare.run(setup, configs, progress=False)
    crashed = result.verdict("crash_on_rank_1_at_step_1 W=2")
    assert crashed.kind == "crashed" and crashed.classification == "rounding"
    assert crashed.steps_completed == 1                   # step 0 finished and was compared
    failure = crashed.finding_values("completed")
    assert failure["failed_rank"] == 1 and "boom: the data loader ran dry" in failure["error"]
    assert "crash_on_rank_1_at_step_1" in crashed.error   # the remote traceback
    assert isinstance(result.errors["crash_on_rank_1_at_step_1 W=2"], launcher.RankFailed)
    hung = result.verdict("hang_on_rank_1_at_step_1 W=2")
    assert hung.kind == "hung"
    assert isinstance(result.errors["hang_on_rank_1_at_step_1 W=2"], launcher.LaunchTimeout)
    assert "did not return" in hung.error
    # The hang names the rank that never entered the collective rank 0 waits in, and each rank's steps.
    assert hung.finding_values("completed")["failed_rank"] == 1
    assert hung.finding_values("completed")["rank_steps"] == "0:1,1:1"
    assert result.verdict("ddp W=2").kind == "exact"
    frame = result.records
    dev = frame[(frame["metric"] == "deviation") & (frame["config"] == "crash_on_rank_1_at_step_1 W=2")]
    assert set(dev["step"]) == {0}
    status = frame[frame["metric"] == "steps_completed"].set_index("config")
    assert status.loc["crash_on_rank_1_at_step_1 W=2", "status"] == "crashed"
    assert status.loc["hang_on_rank_1_at_step_1 W=2", "status"] == "hung"
    assert status.loc["ddp W=2", "value"] == 3
    # The reference runs train again beside each configuration: the crash cut the first pass short, and
    # a later one completes their curves and distances, each record once.
    ref = frame[frame["config"] == "reference"]
    assert sorted(ref[ref["metric"] == "grad_norm"]["step"]) == [0, 1, 2]
    assert sorted(ref[(ref["metric"] == "distance_to_truth") & (ref["param"] == "(model)")]["step"]) == [0, 0, 1, 1, 2, 2]


@pytest.mark.slow  # the default suite stops your_training through the explorer's Stop
def test_stop_ends_the_ranks_and_keeps_the_records_so_far(no_leftovers):
    setup = examples.digits_setup(0, steps=6)
    calls = []

    def progress(config, step, steps):
        calls.append((config, step, steps))
        if config == "second":
            launcher.stop_all()   # what the explorer's Stop button does

    configs = [compare.DDP(2, name="first"), compare.DDP(2, name="second"), compare.DDP(2, name="third")]
    result = compare.run(setup, configs, progress=progress)
    assert result.stopped
    assert result.kinds["first"] == "exact"               # the replay proves DDP bit for bit
    second = result.verdict("second")
    assert second.kind == "stopped" and 1 <= second.steps_completed < 6
    assert second.classification == "exact"              # the steps it finished were compared
    assert result.kinds["third"] == "not run"
    assert ("first", 5, 6) in calls and ("reference", 0, 6) in calls
    frame = result.records
    assert (frame[frame["metric"] == "deviation"]["config"] == "second").any()
    assert not (frame["config"] == "third").loc[frame["metric"] != "steps_completed"].any()


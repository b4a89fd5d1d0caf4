"""What is measured against the reference runs is judged where they train: a large model's truth and
reference never reach the disk, and the verdicts and records are those the parent reaches with the
references on disk (a small model's, kept for every configuration)."""
from __future__ import annotations

import pandas as pd

from ddplab import compare
from ddplab.compare import comparison, examples, faults

#: What the judge in the reference process computes, whose records must not depend on where it runs.
JUDGED = ("distance_to_truth", "band", "deviation", "distance_to_reference", "rank_distance", "first_divergence",
          "localized", "fit_factor", "piece_weight", "desync_deviation", "float64_distance", "float64_difference",
          "nonfinite")


def _judged(result) -> pd.DataFrame:
    frame = result.records[result.records["metric"].isin(JUDGED)]
    keys = [c for c in ("metric", "config", "step", "rank", "quantity", "param", "piece", "run") if c in frame]
    return frame.sort_values(keys).reset_index(drop=True)[keys + ["value"]]


def _both(monkeypatch, setup, configs) -> tuple:
    kept = compare.run(setup, configs, progress=False)
    # As for a large model: the references train beside each configuration, and the twin and the float64
    # run in a pass of their own after the run, beside the truth.
    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)
    monkeypatch.setattr(comparison, "ALONGSIDE_NUMEL", 0)
    there = compare.run(setup, configs, progress=False)
    return kept, there


def test_judged_where_the_references_train_the_records_are_the_parents(no_leftovers, monkeypatch):
    without_division = compare.Custom(2, k=2, train_step=examples.accumulate_without_division)
    autocast = compare.Custom(2, train_step=examples.autocast_bfloat16)   # its band: reference bfloat16, trained there
    every_rank = faults.plant_custom("every_rank_factor", steps=2).config  # only its float64 run sees it
    setup = examples.digits_setup(0, steps=2)
    kept, there = _both(monkeypatch, setup, [compare.DDP(2), without_division, autocast, every_rank])
    assert kept.kinds == there.kinds
    assert there.kinds[without_division.label] == "bug" and there.kinds[autocast.label] == "rounding"
    assert there.verdict(every_rank.label).referee == "float64"
    assert there.verdict(without_division.label).difference == "factor"
    # The same numbers; to 12 digits, as a least-squares fit's last bits may differ between two processes.
    pd.testing.assert_frame_equal(_judged(kept), _judged(there), rtol=1e-12)
    bands = there.records[(there.records["metric"] == "band") & (there.records["config"] == autocast.label)]
    assert set(bands["band_run"]) == {"reference bfloat16"}
    assert any(spec.label == "reference bfloat16" for spec in there.runs)


def _crash_at_step_1(ctx):
    """Rank 1 raises in step 1: the reference process, waiting for that step's captures, must learn that
    they never come (the launch's end, said on disk), or it would wait until its own timeout."""
    if ctx.step == 1 and ctx.rank == 1:
        raise RuntimeError("planted crash")
    return examples.plain_step(ctx)


def test_a_run_that_crashes_ends_its_judge_where_the_references_train(no_leftovers, monkeypatch):
    monkeypatch.setattr(comparison, "KEEP_REFERENCES_BYTES", 0)
    crash = compare.Custom(2, train_step=_crash_at_step_1, name="crash")
    result = compare.run(examples.digits_setup(0, steps=3), [crash, compare.DDP(2)], timeout=60, progress=False)
    assert result.kinds == {"crash": "crashed", "ddp W=2": "exact"}
    judged = result.records[result.records["metric"] == "deviation"].groupby("config")["step"].max().to_dict()
    assert judged["crash"] == 0 and judged["ddp W=2"] == 2      # the step it finished, judged

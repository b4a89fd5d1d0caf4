"""The pure parts of ddplab.compare, no ranks: the pieces fit and how its weights are named,
the referee's distances and margins, and the verdict rule on synthetic records."""
from __future__ import annotations

import math

import pytest
import torch

from ddplab.compare import localization, referee
from ddplab.compare.verdicts import comparison_verdict, judge, pieces_text
from ddplab.records import record, to_frame


# --------------------------------------------------------------------------- the pieces fit


def test_fit_recovers_weights_of_a_combination_of_the_pieces():
    gen = torch.Generator().manual_seed(0)
    basis = torch.randn(500, 6, generator=gen, dtype=torch.float64)
    weights = torch.tensor([0.5, 0.5, 0.0, 0.5, 0.5, 0.5], dtype=torch.float64)
    a, resid = localization.fit_weights(basis, basis @ weights)
    assert torch.allclose(a, weights, atol=1e-12) and resid < 1e-14
    _, resid = localization.fit_weights(basis, torch.randn(500, generator=gen, dtype=torch.float64))
    assert resid > 0.5  # a vector outside the span is not explained


@pytest.mark.parametrize("rho, kind, factor, missing", [
    ([1, 1, 1, 1], "same", 1.0, []),
    ([2, 2, 2, 2], "factor", 2.0, []),
    ([0.25, 0.25, 0.25, 0.25], "factor", 0.25, []),
    ([0, 1, 1, 1], "missing_contribution", 1.0, [0]),
    ([0, 0, 0, 1, 0, 0, 0, 1], "missing_contribution", 1.0, [0, 1, 2, 4, 5, 6]),
    ([0, 2], "missing_contribution", 2.0, [0]),
    ([1, 2, 1, 1], "weights", math.nan, []),
    ([1 + 3e-4, 1 - 2e-4, 1, 1], "same", 1.0, []),       # rounding moves weights by far less
])
def test_weight_ratios_are_named(rho, kind, factor, missing):
    out = localization.classify_weights(torch.tensor(rho, dtype=torch.float64), localization.FIT_TOLERANCE)
    assert out["kind"] == kind and out["missing"] == missing
    if not math.isnan(factor):
        assert out["factor"] == pytest.approx(factor, rel=1e-3)


@pytest.mark.parametrize("c, world, k, name", [
    (0.5, 2, 1, "1/W"), (4.0, 2, 4, "k"), (0.125, 2, 4, "1/(W·k)"), (8.0, 2, 4, "W·k"),
    (3.0, 3, 2, "W"), (1.7, 2, 4, None), (0.50004, 2, 1, "1/W"),
])
def test_factors_are_named_when_they_are_w_or_k(c, world, k, name):
    assert localization.name_factor(c, world, k, 1e-3) == name


def test_pieces_are_said_in_words():
    assert pieces_text([0], 2, 1) == "rank 0's share"
    assert pieces_text([0, 1, 2, 4, 5, 6], 2, 4) == "micro-batches 0, 1, 2 of every rank"
    assert pieces_text([4, 5, 6, 7], 2, 4) == "rank 1 (every micro-batch)"
    assert pieces_text([1, 6], 2, 4) == "rank 0 micro-batch 1, rank 1 micro-batch 2"


# --------------------------------------------------------------------------- the referee


def _tensors(**values):
    return {name: torch.tensor(v, dtype=torch.float64) for name, v in values.items()}


def test_distances_bands_and_deviations():
    truth = _tensors(w=[1.0, 2.0, 2.0], b=[4.0])               # ‖w‖ = 3, ‖b‖ = 4, model 5
    ref = _tensors(w=[1.0, 2.0, 2.0 + 3e-7], b=[4.0])          # only w moved: d_ref(w) = 1e-7
    run = _tensors(w=[1.0, 2.0, 2.0 + 6e-7], b=[4.0 + 4e-7])   # d(w) = 2e-7, d(b) = 1e-7
    rows = referee.distance_records(0, "grad", truth, ref, run, ref, config="c")
    got = {(r["metric"], r["param"]): r["value"] for r in rows}
    assert got[("distance_to_truth", "w")] == pytest.approx(2e-7)
    assert got[("band", "w")] == pytest.approx(1e-7)
    assert got[("deviation", "w")] == pytest.approx(2.0)
    # b: the reference got it exactly; the whole model's distance (3e-7/5) is its band.
    assert got[("band", "b")] == pytest.approx(6e-8)
    assert got[("deviation", "b")] == pytest.approx(1e-7 / 6e-8)
    assert got[("distance_to_reference", "w")] == pytest.approx(1e-7)


def test_missing_gradients_count_as_zero_and_equal_infinities_as_equal():
    truth = _tensors(w=[1.0, math.inf])
    rows = referee.distance_records(0, "grad", truth, _tensors(w=[1.0 + 1e-7, math.inf]), {}, None,
                                    config="c")
    dev = {r["param"]: r["value"] for r in rows if r["metric"] == "deviation"}
    assert math.isinf(dev["w"])                                 # a missing gradient is a difference
    rows = referee.distance_records(0, "grad", truth, truth, truth, None, config="c")
    assert all(r["value"] == 0 for r in rows if r["metric"] == "deviation")


def test_margins_come_from_the_measurement_and_classify():
    assert referee.ROUNDING_MARGIN == 10 * referee.MEASURED_MAX
    assert referee.BUG_MARGIN == 100 * referee.ROUNDING_MARGIN
    assert referee.classify_deviation(1.3) == "rounding"
    assert referee.classify_deviation(referee.ROUNDING_MARGIN * 2) == "undetermined"
    assert referee.classify_deviation(referee.BUG_MARGIN) == "bug"
    assert referee.classify_deviation(math.inf) == "bug"


# --------------------------------------------------------------------------- the verdict rule


def _records(deviations, *, band=1e-7, unit=6e-8, status="completed", done=None, **extra):
    rows = [record("steps_completed", len(deviations) if done is None else done, config="c", status=status,
                   world_size=2, k=1, **extra)]
    for step, value in enumerate(deviations):
        for param in ("w", referee.MODEL):
            rows.append(record("deviation", value, step=step, rank=0, config="c", param=param, quantity="grad"))
            rows.append(record("band", band, step=step, rank=0, config="c", param=param, quantity="grad",
                               unit_roundoff=unit))
    return to_frame(rows)


@pytest.mark.parametrize("deviations, kind", [
    ([1.0, 1.4, 2.1], "rounding"),
    ([1.0, 500.0], "undetermined"),     # beyond every correct run, not by orders of magnitude
    ([1.0, 3e6], "bug"),
])
def test_the_rule_on_deviations(deviations, kind):
    verdict = judge(_records(deviations), "c")
    assert verdict.kind == kind == verdict.classification
    assert verdict.max_deviation == max(deviations)
    assert verdict.finding_values("within_band")["steps_compared"] == len(deviations)


def test_a_reference_that_reproduces_the_truth_gives_no_band():
    verdict = judge(_records([0.0, 3e6], band=0.0), "c")
    assert verdict.kind == "undetermined" and "no band" in verdict.headline


def test_a_crash_before_the_first_step_is_named_with_its_rank():
    frame = to_frame([record("steps_completed", 0, config="c", status="crashed", world_size=2, k=1,
                             failed_rank=1, error="RankFailed: rank 1 of 2 raised ValueError: boom")])
    verdict = judge(frame, "c")
    assert verdict.kind == "crashed" and verdict.classification is None
    assert "rank 1" in verdict.headline and "boom" in verdict.headline
    whole = comparison_verdict(frame)
    assert whole.kind == "undetermined" and whole.finding("c").holds is None   # nothing measured
    assert "c (crashed)" in whole.headline


def test_a_crash_after_a_bug_is_a_bug_for_the_comparison():
    frame = _records([3e6], status="crashed", done=1, failed_rank=0, error="boom")
    assert judge(frame, "c").kind == "crashed" and judge(frame, "c").classification == "bug"
    assert comparison_verdict(frame).kind == "bug"

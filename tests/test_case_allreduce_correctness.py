"""Case 04 (allreduce correctness): the launches, the report's network, autograd's order per tower,
the signature test, the verdict rule on real and planted records, three towers, and the notebook."""
from __future__ import annotations

import json
import math

import matplotlib.pyplot as plt
import pytest
import torch

from ddplab.cases import get_case
from ddplab.cases.allreduce_correctness import worker as w
from ddplab.cases.allreduce_correctness.verdict import REPORT_MAX_DIFF
from ddplab.records import where

case = get_case("allreduce_correctness")
NOTEBOOK = case.notebook_path()
#: Small and fast: a real run of every mode in seconds.
SMALL = {"steps": 3, "width": 1 / 32}


# --------------------------------------------------------------------------- the plan


def test_one_launch_per_mode_labelled_by_mode():
    plans = case.launches(case.check_params({"mode": ["race", "fixed"], "world_size": 3}))
    assert [(p.label, p.kwargs, p.world_size, p.steps) for p in plans] == [
        ("race", {"mode": "race"}, 3, 100), ("fixed", {"mode": "fixed"}, 3, 100)]
    assert case.run_label == "mode" and case.progress_total(case.check_params({})) == 100


# --------------------------------------------------------------------------- the network


def test_full_width_is_the_reports_network():
    assert w.channels(1.0) == (64, 1280)
    assert w.channels(1 / 16) == (4, 80)
    shapes = {name: tuple(p.shape) for name, p in w.Tower(0, width=1.0).named_parameters()}
    assert shapes == {"aaa/W": (64, 3, 3, 3), "bbb/W": (64, 3, 3, 3), "conv1/W": (64, 64, 3, 3),
                      "conv2/W": (64, 64, 3, 3), "conv3/W": (1280, 64, 3, 3),
                      "conv4/W": (1280, 1280, 3, 3), "conv5/W": (10, 1280, 3, 3)}


def test_towers_share_weights_and_differ_in_their_first_variable():
    assert [w.first_variable(t) for t in range(4)] == ["aaa/W", "bbb/W", "bbb/W", "bbb/W"]
    t0, t1 = w.Tower(0, 1 / 16, seed=3), w.Tower(1, 1 / 16, seed=3)
    for (n0, p0), (n1, p1) in zip(t0.named_parameters(), t1.named_parameters()):
        assert n0 == n1 and torch.equal(p0, p1)
    images, labels = w.make_batch(0, 0, 0)
    assert images.shape == (32, 3, 30, 30) and t0(images).shape == (32, 10)
    assert int(labels.min()) >= 0 and int(labels.max()) <= 8  # the report's maxval=9
    assert not torch.equal(t0(images), t1(images))  # aaa/W and bbb/W hold different values


def test_unused_variables_gradient_is_exactly_the_weight_decay():
    """The report's 1e-3: a variable a tower does not use gets the weight-decay gradient alone."""
    for tower, unused in ((0, "bbb/W"), (1, "aaa/W")):
        model = w.Tower(tower, 1 / 16)
        data, decay = w.losses(model, *w.make_batch(0, 0, tower))
        (data + decay).backward()
        grad = model.variable(unused).grad
        assert torch.equal(grad, torch.full_like(grad, w.WEIGHT_DECAY))
        used = model.variable(w.first_variable(tower)).grad
        assert not torch.equal(used, torch.full_like(used, w.WEIGHT_DECAY))


def test_batches_are_deterministic_and_differ_per_tower_and_step():
    a = w.make_batch(0, 5, 1)
    assert all(torch.equal(x, y) for x, y in zip(a, w.make_batch(0, 5, 1)))
    assert not torch.equal(a[0], w.make_batch(0, 5, 0)[0])
    assert not torch.equal(a[0], w.make_batch(0, 6, 1)[0])
    assert not torch.equal(a[0], w.make_batch(1, 5, 1)[0])


def test_autograd_produces_the_towers_gradients_in_different_orders():
    """The mechanism of as_ready: the unused variable's gradient comes first, the used one's last."""
    orders = {}
    for tower in (0, 1, 2):
        model = w.Tower(tower, 1 / 32)
        seen = []
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(lambda _, name=name: seen.append(name))
        data, decay = w.losses(model, *w.make_batch(0, 0, tower))
        (data + decay).backward()
        orders[tower] = seen
    convs = ["conv5/W", "conv4/W", "conv3/W", "conv2/W", "conv1/W"]
    assert orders[0] == ["bbb/W"] + convs + ["aaa/W"]
    assert orders[1] == orders[2] == ["aaa/W"] + convs + ["bbb/W"]


# --------------------------------------------------------------------------- the signature


def test_offset_in_weight_decays_finds_constant_multiples_only():
    g = torch.randn(1000) * 1e-3
    true_sum = g + 2e-3
    assert w.offset_in_weight_decays(true_sum, true_sum) == 0
    assert w.offset_in_weight_decays(true_sum, true_sum - 1e-3) == 1
    assert w.offset_in_weight_decays(true_sum, true_sum - 2e-3) == 2
    assert w.offset_in_weight_decays(true_sum, true_sum + 1e-3) == -1
    # another tower's whole gradient summed in: varies element by element
    assert w.offset_in_weight_decays(true_sum, true_sum + torch.randn(1000) * 1e-3) == 0
    # float32 arithmetic, as the race produces it: (c0 + c1) + wd against (c0 + wd) + (c1 + wd)
    c0, c1 = torch.randn(500) * 1e-3, torch.randn(500) * 1e-3
    assert w.offset_in_weight_decays((c0 + 1e-3) + (c1 + 1e-3), (c0 + c1) + 1e-3) == 1


def test_holders_group_bitwise_equal_results():
    a = torch.tensor([1.0, 0.0])
    b = torch.tensor([1.0, -0.0])  # equal values, different bits
    assert w.holders(torch.stack([a, a, b, a])) == [[0, 1, 3], [2]]


# --------------------------------------------------------------------------- real runs


@pytest.fixture(scope="module")
def small_run(warm_launcher):
    params = case.check_params(SMALL)
    return case.run(params, progress=False), params


def test_real_run_fixed_is_rounding_and_as_ready_is_mispaired(small_run):
    records, params = small_run
    fixed = where(records, "report_check_pass", mode="fixed")
    assert sorted(fixed["step"].unique()) == [0, 1, 2] and (fixed["value"] == 1).all()
    assert (where(records, "max_bound_ratio", mode="fixed")["value"] <= 1).all()
    failing = where(records, "report_check_pass", mode="as_ready")
    failing = failing[failing["value"] == 0]
    assert set(failing["variable"]) == {"aaa/W", "bbb/W"} and set(failing["step"]) == {0, 1, 2}
    flagged = where(records, "collective_mismatch", mode="as_ready")
    assert set(flagged.loc[flagged["value"] == 1, "combined"]) == {"0:bbb/W + 1:aaa/W", "0:aaa/W + 1:bbb/W"}
    assert (where(records, "collective_mismatch", mode="fixed")["value"] == 0).all()
    # every mispaired result is exactly the sum of what the ledger says was combined
    assert (where(records, "paired_bound_ratio", mode="as_ready")["value"] <= 1).all()
    # race: every tower holds the same result, one weight-decay gradient short
    assert (where(records, "constant_offset_wd", mode="race")["value"] == 1).all()
    assert (where(records, "distinct_results", mode="race")["value"] == 1).all()
    # one launch per mode, each rank timing its own
    assert sorted(where(records, "launch_seconds")["launch"]) == ["as_ready", "fixed", "race"]
    assert len(where(records, "mode_seconds")) == 3 * params["world_size"]


def test_verdict_on_a_real_run(small_run):
    records, params = small_run
    v = case.verdict(records, params)
    assert v.kind == "bug" and v.all_hold, v.to_markdown()
    assert [f.key for f in v.findings] == ["fixed_within_bound", "as_ready_not_rounding",
                                          "as_ready_mispaired", "race_not_rounding", "report_signature"]
    results = 3 * len(w.VARIABLES)
    fixed = v.finding("fixed_within_bound").values
    assert fixed["passed"] == results == v.values["fixed_within"] == v.values["fixed_rounding"]
    # "rounding" rests on the strongest evidence: every result is gloo's emulated ring, bit for bit
    assert fixed["evidence"] == v.values["fixed_evidence"] == "bitwise" and fixed["matches_order"] == results
    assert v.values["fixed_max_ratio"] <= 1
    ready = v.finding("as_ready_not_rounding").values
    assert ready["failing_variables"] == ["aaa/W", "bbb/W"] and ready["first_failing_step"] == 0
    assert ready["min_failing_ratio"] >= 10 ** ready["decades"] and ready["classification"] == "not rounding"
    mispaired = v.finding("as_ready_mispaired").values
    assert mispaired["pairs"] == ["rank 0's aaa/W with rank 1's bbb/W", "rank 0's bbb/W with rank 1's aaa/W"]
    assert mispaired["mismatched_collectives"] == 6 and mispaired["explained"] == mispaired["failed"] > 0
    # each mispaired result is bit for bit gloo's ring over exactly the tensors the ledger paired
    assert (mispaired["paired_classification"], mispaired["paired_evidence"]) == ("rounding", "bitwise")
    race = v.finding("race_not_rounding").values
    assert race["triggered"] == race["writes"] == results and race["exact"] == race["failed"] == results
    assert race["offset"] == pytest.approx(1e-3) and race["mismatched_collectives"] == 0
    assert race["classification"] == "not rounding"
    signature = v.finding("report_signature").values
    assert signature["report"] == REPORT_MAX_DIFF and signature["as_ready_constant"] == 0
    assert signature["race_exact"] == signature["race_failed"]
    assert v.scope and len(v.key_table()) >= 3
    summary = case.table("summary", records, params)
    assert summary.loc["fixed", "classification"] == "rounding"
    assert summary.loc["as_ready", "classification"] == "not rounding"
    table = case.table("pairing", records, params)
    assert table.loc[("as_ready", 0), "rank 0"] == "bbb/W" and table.loc[("as_ready", 0), "rank 1"] == "aaa/W"
    assert table.loc["as_ready", "mispaired"].sum() == 2 and not table.loc["fixed", "mispaired"].any()


def test_every_figure_draws_alone_and_in_a_given_axes(small_run):
    records, params = small_run
    figs = case.figures(records, params)
    assert len(figs) == 5 and all(fig.axes for fig in figs)
    for name in case.figures_by_name:
        fig, ax = plt.subplots()
        assert case.figure(name, records, params, ax=ax) is fig and ax.has_data(), name
        plt.close(fig)
    for fig in figs:
        plt.close(fig)


def _only_fixed(records):
    return records[(records["mode"] == "fixed") | records["mode"].isna()]


def test_verdict_rule_on_planted_faults(small_run):
    """The rule reads the records: planted faults change exactly the findings they should."""
    records, params = small_run
    judged = records["metric"].isin(["max_abs_error", "max_bound_ratio", "within_bound",
                                     "frac_matches_order"])
    # A fixed-order result beyond the report's tolerance and the bound: fixed no longer holds.
    bad = records.copy()
    fixed = (bad["mode"] == "fixed") & (bad["step"] == 1) & (bad["variable"] == "conv3/W")
    bad.loc[fixed & (bad["metric"] == "report_check_pass"), "value"] = 0
    bad.loc[fixed & (bad["metric"] == "max_bound_ratio"), "value"] = 5e6
    bad.loc[fixed & judged, "verdict"] = "not rounding"
    v = case.verdict(bad, params)
    assert not v.holds("fixed_within_bound") and v.holds("as_ready_not_rounding")
    assert v.finding("fixed_within_bound").values["outside_bound"] == 1
    assert v.values["not_holding"] == ["fixed_within_bound"]
    # The race did not trigger (every write before gloo ran) and every result passed.
    quiet = records.copy()
    race = quiet["mode"] == "race"
    quiet.loc[race & (quiet["metric"] == "write_after_completion"), "value"] = 0
    quiet.loc[race & (quiet["metric"] == "report_check_pass"), "value"] = 1
    quiet.loc[race & (quiet["metric"] == "max_bound_ratio"), "value"] = 0.5
    quiet.loc[race & judged, "verdict"] = "rounding"
    quiet.loc[race & (quiet["metric"] == "constant_offset_wd"), "value"] = 0
    v = case.verdict(quiet, params)
    assert not v.holds("race_not_rounding") and v.finding("race_not_rounding").values["triggered"] == 0
    assert v.kind == "bug"  # as_ready still is one
    # as_ready's mispaired results no longer the sum of what the ledger paired: the cause is unexplained.
    odd = records.copy()
    paired = (odd["mode"] == "as_ready") & (odd["metric"] == "paired_bound_ratio")
    odd.loc[paired, "value"] = 40.0
    odd.loc[paired, "verdict"] = "not rounding"
    v = case.verdict(odd, params)
    assert v.holds("as_ready_not_rounding") and not v.holds("as_ready_mispaired")
    # Only the fixed order run: rounding, and no finding about the bug modes.
    only_fixed = {**params, "mode": ["fixed"]}
    v = case.verdict(_only_fixed(records), only_fixed)
    assert v.kind == "rounding" and [f.key for f in v.findings] == ["fixed_within_bound"]
    assert v.values["fixed_evidence"] == "bitwise"
    # Only fixed, and it fails: the correct program summing wrongly is a bug, never "rounding".
    assert case.verdict(_only_fixed(bad), only_fixed).kind == "bug"
    # A bit off gloo's ring, far below the bound and the tolerance: bitwise evidence still calls it.
    subtle = records.copy()
    one = (subtle["mode"] == "fixed") & (subtle["step"] == 2) & (subtle["variable"] == "conv5/W") & judged
    subtle.loc[one, "verdict"] = "not rounding"
    subtle.loc[one & (subtle["metric"] == "frac_matches_order"), "value"] = 0.99
    v = case.verdict(_only_fixed(subtle), only_fixed)
    assert v.kind == "bug" and not v.holds("fixed_within_bound")
    assert v.finding("fixed_within_bound").values["outside_bound"] == 0
    assert v.finding("fixed_within_bound").values["matches_order"] == 3 * len(w.VARIABLES) - 1
    # Where no bit-exact model applies the bound is the evidence, and the verdict says so.
    bounded = records.copy()
    bounded.loc[judged, "evidence"] = "bound"
    v = case.verdict(_only_fixed(bounded), only_fixed)
    assert v.kind == "rounding" and v.values["fixed_evidence"] == "bound"
    # Nothing measured: undetermined.
    v = case.verdict(records[records["mode"].isna()], params)
    assert v.kind == "undetermined" and v.finding("fixed_within_bound").holds is None


@pytest.mark.slow
def test_three_towers(no_leftovers):
    """More than two towers: tower 0 uses aaa/W, the others bbb/W; the race misses 2·1e-3."""
    params = case.check_params({**SMALL, "world_size": 3, "steps": 2})
    records = case.run(params, progress=False)
    flagged = where(records, "collective_mismatch", mode="as_ready")
    assert set(flagged.loc[flagged["value"] == 1, "combined"]) == {
        "0:bbb/W + 1:aaa/W + 2:aaa/W", "0:aaa/W + 1:bbb/W + 2:bbb/W"}
    assert (where(records, "constant_offset_wd", mode="race")["value"] == 2).all()
    v = case.verdict(records, params)
    assert v.kind == "bug" and v.all_hold, v.to_markdown()
    assert v.finding("race_not_rounding").values["offset"] == pytest.approx(2e-3)
    assert "rank 0's bbb/W with rank 1's aaa/W and rank 2's aaa/W" in v.finding("as_ready_mispaired").values["pairs"]


# --------------------------------------------------------------------------- the notebook


@pytest.mark.slow
def test_notebook_quick(tmp_path):
    import papermill

    from ddplab.artifacts import load_results

    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), kernel_name="python3", progress_bar=False,
                               parameters={**case.quick, "results_dir": str(tmp_path / "res")})
    results = load_results(tmp_path / "res")
    rec = results.records
    steps = list(range(case.quick["steps"]))
    fixed = where(rec, "report_check_pass", mode="fixed")
    assert sorted(fixed["step"].unique()) == steps and (fixed["value"] == 1).all()
    # as_ready fails the report's check, and those results are classified "not rounding"
    keys = ["step", "rank", "variable"]
    check = where(rec, "report_check_pass", mode="as_ready")
    failing = check[check["value"] == 0].set_index(keys).index
    assert len(failing) > 0
    within = where(rec, "within_bound", mode="as_ready").set_index(keys)["value"]
    assert (within[within.index.isin(failing)] == 0).all()
    v = results.verdict
    assert v.kind == "bug" and v.all_hold
    assert set(v.finding("as_ready_mispaired").values["combined"]) == {"0:bbb/W + 1:aaa/W",
                                                                       "0:aaa/W + 1:bbb/W"}
    assert math.log10(v.values["as_ready_min_ratio"]) >= 3
    nb = json.loads(out.read_text())
    images = [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    printed = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "notebook ran in" in printed

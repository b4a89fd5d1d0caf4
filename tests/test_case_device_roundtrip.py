"""Case 03 (device round trip): its quick values, the report's model and data, what runs where,
the verdict rule on planted records, a real two-rank run, and the notebook under papermill."""
from __future__ import annotations

import json

import pytest
import torch

from ddplab.cases import get_case
from ddplab.cases.device_roundtrip.figures import (alarms_markdown, loss_gap_table, skipped_markdown,
                                                   summary_table)
from ddplab.cases.device_roundtrip.worker import (ToyModel, apply_roundtrip, device_skip_reason,
                                                  plan_backend, plan_configurations, rank_batches)
from ddplab.records import record, to_frame

case = get_case("device_roundtrip")
NOTEBOOK = case.notebook_path()
PARAM_NAMES = ["net1.weight", "net1.bias", "net2.weight", "net2.bias"]


# --------------------------------------------------------------------------- parameters


def test_quick_runs_both_frameworks_and_the_cpu_round_trip():
    quick = case.check_params(case.quick)
    assert "fabric" in quick["framework"] and "dtype" in quick["roundtrip"]


def test_one_progress_bar_per_configuration():
    params = case.check_params({"steps": 7, "roundtrip_step": 3})
    assert case.run_label == "config" and case.progress_total(params) == 7
    (plan,) = case.launches(params)
    assert plan.world_size == 2 and plan.steps is None   # no launch-wide bar: steps restart per run


# --------------------------------------------------------------------------- model and data


def test_toy_model_is_the_reports():
    model = ToyModel()
    assert [(n, tuple(p.shape)) for n, p in model.named_parameters()] == [
        ("net1.weight", (10, 10)), ("net1.bias", (10,)), ("net2.weight", (5, 10)), ("net2.bias", (5,))]
    assert model(torch.randn(20, 10)).shape == (20, 5)
    assert isinstance(model.relu, torch.nn.ReLU)


def test_rank_batches_differ_per_rank_and_repeat_per_configuration():
    r0 = rank_batches(0, 0, 3)
    r1 = rank_batches(0, 1, 3)
    assert len(r0) == 3 and r0[0][0].shape == (20, 10) and r0[0][1].shape == (20, 5)
    assert not torch.equal(r0[0][0], r1[0][0])                  # each rank its own data
    again = rank_batches(0, 0, 3)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(r0, again))
    assert not torch.equal(rank_batches(1, 0, 1)[0][0], r0[0][0])  # the seed matters
    assert not torch.equal(r0[0][0], r0[1][0])                  # a new batch every step


# --------------------------------------------------------------------------- what runs where


def test_device_round_trip_needs_a_gpu_per_rank():
    assert "no CUDA GPU" in device_skip_reason(2, 0)
    assert "only 1 CUDA GPU" in device_skip_reason(2, 1)
    assert device_skip_reason(2, 2) is None
    cpu = case.check_params({})
    assert plan_backend(cpu, gpus=0) == "gloo"
    assert plan_backend(cpu, gpus=1) == "gloo"
    assert plan_backend(cpu, gpus=2) == "nccl"
    assert plan_backend(case.check_params({"roundtrip": ["none", "dtype"]}), gpus=2) == "gloo"


def test_plan_runs_the_fix_only_after_a_round_trip_and_skips_with_a_reason():
    params = case.check_params({})
    configs, skipped = plan_configurations(params, on_cuda=False, gpus=0, fabric=(True, "2.6"))
    assert configs == [("ddp", "none", "as reported"), ("ddp", "dtype", "as reported"),
                       ("ddp", "dtype", "re-wrapped"), ("fabric", "none", "as reported"),
                       ("fabric", "dtype", "as reported"), ("fabric", "dtype", "re-wrapped")]
    assert [(s["framework"], s["roundtrip"], s["cause"]) for s in skipped] == [
        ("ddp", "device", "no cuda"), ("fabric", "device", "no cuda")]
    assert "one CUDA GPU per rank" in skipped[0]["reason"]

    configs, skipped = plan_configurations(params, on_cuda=True, gpus=2,
                                           fabric=(False, "lightning is not importable"))
    assert ("ddp", "device", "re-wrapped") in configs
    assert all(c[0] == "ddp" for c in configs)
    assert {(s["roundtrip"], s["cause"]) for s in skipped} == {
        ("none", "no lightning"), ("dtype", "no lightning"), ("device", "no lightning")}


def test_apply_roundtrip_restores_dtype_and_keeps_the_parameters_and_rejects_unknown():
    model = ToyModel()
    before = [p for p in model.parameters()]
    apply_roundtrip(model, "dtype", torch.device("cpu"))
    assert all(p.dtype == torch.float32 for p in model.parameters())
    assert all(a is b for a, b in zip(before, model.parameters()))  # the same Parameter objects
    with pytest.raises(ValueError, match="CUDA"):
        apply_roundtrip(model, "device", torch.device("cpu"))
    with pytest.raises(ValueError, match="round trip"):
        apply_roundtrip(model, "sideways", torch.device("cpu"))


# --------------------------------------------------------------------------- the verdict rule


def _planted(*, frameworks=("ddp", "fabric"), steps=6, rt=2, broken=("dtype",), fix_works=True,
             alarm_on=None, report_disagrees=False, warning_in_broken=False, skipped=(),
             fired_step=None):
    """Records shaped like the worker's, with faults planted one at a time.

    ``broken``: round trips whose as-reported run loses sync; ``alarm_on``:
    the configurations the guard fires on (default: the broken ones).
    """
    recs = []
    for framework in frameworks:
        for roundtrip, variant in (("none", "as reported"), ("dtype", "as reported"),
                                   ("dtype", "re-wrapped")):
            config = (framework, roundtrip, variant)
            labels = dict(framework=framework, roundtrip=roundtrip, variant=variant,
                          config=" · ".join(config))
            desync = (roundtrip in broken and variant == "as reported") or \
                (variant == "re-wrapped" and not fix_works)
            fires = (desync if alarm_on is None else config in alarm_on)
            for rank in (0, 1):
                for step in range(steps):
                    out = desync and step >= rt and rank == 1
                    for name in PARAM_NAMES:
                        recs.append(record("grad_bitwise_equal", 0 if out else 1, step=step, rank=rank,
                                           param=name, dtype="float32", **labels))
                        recs.append(record("grad_max_abs_diff", 0.2 if out else 0.0, step=step,
                                           rank=rank, param=name, dtype="float32", **labels))
                        flagged = (desync and step >= rt) != (report_disagrees and step == steps - 1)
                        recs.append(record("report_allclose", 0 if flagged else 1, step=step, rank=rank,
                                           param=name, **labels))
                    late = desync and step >= rt
                    recs.append(record("loss", 1.0 + 0.01 * step + (1e-4 * (rank + 1) if late else 0.0),
                                       step=step, rank=rank, **labels))
                    recs.append(record("buckets_reduced", 0 if late else 1, step=step, rank=rank,
                                       **labels))
                    dist = 0.0 if rank == 0 or not late else 1e-4 * (step - rt + 1)
                    recs.append(record("weight_distance", dist, step=step, rank=rank, **labels))
                if roundtrip != "none":
                    recs.append(record("roundtrip_applied", 1, step=rt, rank=rank, dtype_before="float32",
                                       dtype_after="float32", device_before="cpu", device_after="cpu",
                                       **labels))
                if fires:
                    message = ("DDP's reducer is detached from 4 parameter(s) (before forward 2); ...\n"
                               + "".join(f"  {n}: still float32 on cpu, but its gradient accumulator "
                                         f"was replaced (a round trip through another dtype or device)\n"
                                         for n in PARAM_NAMES))
                    recs.append(record("detector_alarm", 4, step=rt if fired_step is None else fired_step,
                                       rank=rank, when="before forward", params=",".join(PARAM_NAMES),
                                       message=message, **labels))
                recs.append(record("detector_alarms", int(fires), rank=rank, **labels))
                recs.append(record("steps_completed", steps, rank=rank, **labels))
                warned = warning_in_broken and desync
                recs.append(record("training_warnings", int(warned), rank=rank,
                                   messages="UserWarning: something" if warned else "", **labels))
    for framework, roundtrip, cause, reason in skipped:
        recs.append(record("configuration_skipped", 1, rank=0, framework=framework, roundtrip=roundtrip,
                           cause=cause, reason=reason))
    return to_frame(recs)



def _params(**over):
    return case.check_params({"steps": 6, "roundtrip_step": 2, "roundtrip": ["none", "dtype"], **over})


def test_verdict_on_the_expected_records_is_a_silent_bug_fixed_by_rewrapping():
    v = case.verdict(_planted(), _params())
    assert v.kind == "bug" and v.all_hold, v.to_markdown()
    assert {f.key for f in v.findings} == {"none_in_sync", "dtype_breaks_sync", "silent",
                                           "ranks_train_alone", "mechanism", "rewrap_fixes",
                                           "detector_exact", "report_check_agrees"}
    assert v.values["buckets_after"] == [0] and v.values["frameworks"] == ["ddp", "fabric"]
    assert v.values["out_of_sync_after"] == v.values["steps_after"] == 4
    assert v.values["rewrap_loss_gap"] == 0.0
    broken = v.finding("dtype_breaks_sync").values
    assert broken["runs"] == ["ddp/dtype", "fabric/dtype"]
    assert broken["buckets_before"] == [1, 1] and broken["buckets_after"] == [0, 0]
    assert broken["in_sync_before"] == [2, 2] and broken["out_of_sync_after"] == [4, 4]
    fix = v.finding("rewrap_fixes").values
    assert fix["loss_gap"] == [0.0, 0.0] and fix["in_sync"] == [6, 6]
    assert v.finding("detector_exact").values["alarm_step"] == [2, 2]
    assert v.finding("mechanism").values["restored"] == [True, True]
    assert "0 buckets per backward" in v.headline and "a DDP behaviour, not Fabric's" in v.headline
    assert "every loss bitwise equal" in v.headline
    assert set(v.key_numbers.values()) <= set(v.values) and v.scope
    assert "not covered" in v.scope and "accuracy of the reduction" in v.scope
    assert v.values["evidence"] == "bitwise"


def test_verdict_when_rewrapping_does_not_fix_it():
    v = case.verdict(_planted(fix_works=False), _params())
    assert not v.holds("rewrap_fixes") and v.finding("rewrap_fixes").values["in_sync"] == [2, 2]
    assert v.holds("dtype_breaks_sync")
    assert "NOT confirmed" in v.headline


def test_verdict_when_the_guard_fires_on_a_healthy_run_or_misses_a_broken_one():
    noisy = case.verdict(_planted(alarm_on={("ddp", "dtype", "as reported"),
                                            ("fabric", "dtype", "as reported"),
                                            ("ddp", "none", "as reported")}), _params())
    assert not noisy.holds("detector_exact")
    assert "ddp/none" in noisy.finding("detector_exact").values["fired_on"]
    deaf = case.verdict(_planted(alarm_on={("ddp", "dtype", "as reported")}), _params())
    assert not deaf.holds("detector_exact")
    assert deaf.finding("detector_exact").values["fired_on"] == ["ddp/dtype"]
    late = case.verdict(_planted(fired_step=3), _params())
    assert not late.holds("detector_exact")
    assert late.finding("detector_exact").values["alarm_step"] == [3, 3]


def test_verdict_when_the_reports_check_disagrees_with_the_bits():
    v = case.verdict(_planted(report_disagrees=True), _params())
    assert not v.holds("report_check_agrees")
    values = v.finding("report_check_agrees").values
    assert values["total"] == 36 and values["agree"] == 30 and len(values["disagree"]) == 6


def test_verdict_when_something_warned():
    v = case.verdict(_planted(warning_in_broken=True), _params())
    assert not v.holds("silent") and v.finding("silent").values["warnings"] == [2, 2]  # one per rank
    assert "with no error or warning" not in v.headline


def test_verdict_when_the_round_trip_keeps_sync():
    v = case.verdict(_planted(broken=()), _params())
    assert v.kind == "undetermined" and "Not reproduced" in v.headline
    assert not v.holds("dtype_breaks_sync")
    assert v.finding("dtype_breaks_sync").values["out_of_sync_after"] == [0, 0]
    assert v.holds("none_in_sync") and v.holds("detector_exact")   # silent everywhere is exact
    assert {"silent", "mechanism", "ranks_train_alone"}.isdisjoint(f.key for f in v.findings)
    assert v.values["buckets_after"] == [1] and v.values["frameworks"] == "none"


def test_verdict_when_only_a_run_without_the_report_s_trigger_loses_sync():
    v = case.verdict(_planted(broken=(), fix_works=False), _params())
    assert v.kind == "unexplained"
    assert v.values["desynced"] == ["ddp/dtype re-wrapped", "fabric/dtype re-wrapped"]


def test_verdict_says_what_was_not_run():
    recs = _planted(frameworks=("ddp",), skipped=[
        ("ddp", "device", "no cuda", "needs one CUDA GPU per rank (no CUDA GPU on this machine)"),
        ("fabric", "none", "no lightning", "lightning is not importable (ImportError: x)")])
    v = case.verdict(recs, _params(roundtrip=["none", "dtype", "device"]))
    assert v.holds("device_roundtrip") is None        # not measured, and said why
    assert "no CUDA GPU" in v.finding("device_roundtrip").values["reason"]
    assert v.holds("fabric_skipped") is None
    assert "not importable" in v.finding("fabric_skipped").values["reason"]
    assert "no CUDA GPU" in v.values["device_skipped"] and "was not run" in v.headline
    assert "Not run here" in skipped_markdown(recs)


def test_tables_and_figures_from_planted_records():
    import matplotlib
    import matplotlib.pyplot as plt

    recs, params = _planted(), _params()
    table = summary_table(recs, params)
    assert table.loc[("ddp", "dtype", "as reported"), "first step out of sync"] == 2
    assert table.loc[("ddp", "dtype", "re-wrapped"), "steps in sync"] == "6/6"
    assert table.loc[("fabric", "dtype", "as reported"), "buckets reduced per backward"] == \
        "1 before, 0 after the round trip"
    gaps = loss_gap_table(recs)
    rewrapped = gaps[gaps["variant"] == "re-wrapped"]
    assert len(rewrapped) and (rewrapped["gap"] == 0).all()
    broken = gaps[(gaps["variant"] == "as reported") & (gaps["step"] >= 2)]
    assert (broken["gap"] != 0).all()
    assert "fired on rank(s) 0, 1 at step 2" in alarms_markdown(recs)
    assert len(case.table("alarm_log", recs, params)) == 4   # 2 configurations x 2 ranks
    figs = case.figures(recs, params)
    assert len(figs) == 5 and all(isinstance(f, matplotlib.figure.Figure) for f in figs)
    for name in case.figures_by_name:                         # one panel into a caller's axes
        fig, ax = plt.subplots()
        assert case.figure(name, recs, params, ax=ax) is fig and ax.has_data()
        figs.append(fig)
    for f in figs:
        plt.close(f)


# --------------------------------------------------------------------------- real ranks


def test_two_ranks_plain_ddp_round_trip_right_after_wrapping(no_leftovers):
    """The report's timing (round trip before the first step), plain DDP, real gloo ranks."""
    params = case.check_params({"framework": ["ddp"], "roundtrip": ["none", "dtype"], "steps": 3,
                                "roundtrip_step": 0})
    records = case.run(params, progress=False)
    v = case.verdict(records, params)
    assert v.kind == "bug" and v.all_hold, v.to_markdown()
    assert v.values["buckets_after"] == [0] and v.values["out_of_sync_after"] == 3
    assert v.finding("rewrap_fixes").values["loss_gap"] == [0.0]
    equal = records[records["metric"] == "grad_bitwise_equal"]
    broken = equal[(equal["roundtrip"] == "dtype") & (equal["variant"] == "as reported")]
    assert (broken[broken["rank"] == 1]["value"] == 0).all()     # out of sync from step 0
    assert (equal[equal["variant"] == "re-wrapped"]["value"] == 1).all()
    buckets = records[records["metric"] == "buckets_reduced"]
    assert set(buckets[buckets["variant"] == "re-wrapped"]["value"]) == {1.0}
    detached = buckets[(buckets["roundtrip"] == "dtype") & (buckets["variant"] == "as reported")]
    assert set(detached["value"]) == {0.0}


def test_explorer_shows_one_progress_bar_per_configuration(no_leftovers):
    from ddplab.explore import CaseExplorer

    explorer = CaseExplorer("device_roundtrip")
    explorer.set_values(framework=["ddp"], roundtrip=["none", "dtype"], steps=3, roundtrip_step=1)
    explorer.run()
    explorer.wait(180)
    assert explorer.error is None, explorer.error
    bars = [(bar.description, bar.value, bar.max) for bar in explorer.bars.children]
    runs = ["ddp · none · as reported", "ddp · dtype · as reported", "ddp · dtype · re-wrapped"]
    assert bars == [(f"W=2 {run}"[:28], 3, 3) for run in runs]   # the explorer cuts at 28 characters
    assert explorer.verdict.kind == "bug"


# --------------------------------------------------------------------------- the notebook


@pytest.mark.slow
def test_notebook_quick_with_fabric(tmp_path):
    pytest.importorskip("lightning.fabric")
    import papermill

    from ddplab.artifacts import load_results

    out = tmp_path / "out.ipynb"
    parameters = {**case.quick, "roundtrip": ["none", "dtype", "device"],
                  "results_dir": str(tmp_path / "res")}
    papermill.execute_notebook(str(NOTEBOOK), str(out), kernel_name="python3", progress_bar=False,
                               parameters=parameters)
    results = load_results(tmp_path / "res")
    rec, rt = results.records, case.quick["roundtrip_step"]
    equal = rec[rec["metric"] == "grad_bitwise_equal"]
    assert set(equal["framework"]) == {"ddp", "fabric"}
    for framework in ("ddp", "fabric"):
        mine = equal[equal["framework"] == framework]
        assert (mine[mine["roundtrip"] == "none"]["value"] == 1).all()
        broken = mine[(mine["roundtrip"] == "dtype") & (mine["variant"] == "as reported")]
        assert (broken[broken["step"] < rt]["value"] == 1).all()
        after = broken[broken["step"] >= rt].groupby("step")["value"].min()
        assert len(after) == case.quick["steps"] - rt and (after == 0).all()
        assert (mine[mine["variant"] == "re-wrapped"]["value"] == 1).all()
    alarms = rec[rec["metric"] == "detector_alarm"]
    assert set(zip(alarms["framework"], alarms["roundtrip"], alarms["variant"])) == {
        ("ddp", "dtype", "as reported"), ("fabric", "dtype", "as reported")}
    assert set(alarms["step"]) == {rt}
    v = results.verdict
    assert v.kind == "bug" and v.values["buckets_after"] == [0]
    assert v.finding("dtype_breaks_sync").values["runs"] == ["ddp/dtype", "fabric/dtype"]
    for key in ("none_in_sync", "dtype_breaks_sync", "rewrap_fixes", "detector_exact", "silent",
                "mechanism", "report_check_agrees"):
        assert v.holds(key), v.finding(key)
    nb = json.loads(out.read_text())
    printed = "".join("".join(o.get("text", "")) + "".join(o.get("data", {}).get("text/markdown", ""))
                      for c in nb["cells"] for o in c.get("outputs", []))
    if not torch.cuda.is_available():  # the report's trigger is skipped, and the notebook says so
        assert v.holds("device_roundtrip") is None
        assert "no CUDA GPU" in v.finding("device_roundtrip").values["reason"]
        assert "Not run here" in printed
    images = [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    assert "notebook ran in" in printed

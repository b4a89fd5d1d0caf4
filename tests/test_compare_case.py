"""Case 05 (your_training) through ddplab's case framework: it refuses torchrun, the
notebook's parameters cell mirrors the case, a quick report under papermill satisfies the case
contract, planted bugs arrive through the parameters, and a stop keeps the records."""
from __future__ import annotations

import pytest

from ddplab import launcher
from ddplab.cases import case_names, get_case

from test_case_contract import _check_parameters_cell, _check_results

CASE = get_case("your_training")


def test_registered_and_its_notebook_mirrors_the_parameters():
    assert "your_training" in case_names() and CASE.reproduces is None
    _check_parameters_cell(CASE)


def test_refuses_to_run_under_torchrun():
    with pytest.raises(ValueError, match="not under torchrun"):
        CASE.worker(CASE.check_params({}))


@pytest.mark.slow  # test_case_contract's quick batch runs this case's report in the default suite
def test_quick_report_meets_the_case_contract(tmp_path, warm_launcher):
    from ddplab.report import plan_batch, run_batch

    lines: list[str] = []
    outcome, = run_batch(plan_batch(["your_training"], quick=True), tmp_path, timeout=400,
                         echo=lines.append)
    assert outcome.status == "ok", "\n".join(lines)
    verdict = _check_results(CASE, tmp_path / "your_training")
    assert verdict.kind == "rounding"
    assert [f.key for f in verdict.findings] == ["ddp W=2", "accumulate W=2 k=4", "fsdp2 W=2 bfloat16"]
    assert all(f.holds for f in verdict.findings)
    html = (tmp_path / "your_training" / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 5


@pytest.mark.slow
def test_planted_bugs_through_the_parameters(warm_launcher):
    params = CASE.check_params({"setup": "ddplab.compare.examples:summed_loss_setup",
                                "configurations": ["ddp", "ddplab.compare.examples:planted_configurations"],
                                "steps": 1})
    records = CASE.run(params, progress=False)
    verdict = CASE.verdict(records, params)
    assert verdict.kind == "bug" and verdict.values["n_bug"] == 5
    assert verdict.finding("ddp W=2").values["finding"] == "factor"
    assert verdict.finding("zero_grad_in_loop W=2 k=4").values["finding"] == "missing_contribution"
    assert verdict.finding("no_allreduce W=2").values["finding"] == "desync"
    assert "0.5 = 1/W" in CASE.table("verdicts", records, params)
    for fig in CASE.figures(records, params):
        assert fig.axes
    assert CASE.figure("finding", records, params).axes[0].get_title().endswith("factor")


def test_the_explorer_runs_it_and_its_stop_keeps_the_records_so_far(no_leftovers):
    """your_training in the explorer like any case: a bar per configuration, and Stop (clicked
    as the first DDP step arrives) ends the ranks; the records so far stay, compared."""
    from ddplab.explore import CaseExplorer

    explorer = CaseExplorer("your_training")
    assert "your_training" in explorer.case_picker.options
    explorer.set_values(configurations=["ddp", "accumulate"], steps=6)

    def stop_at_first_config_step(run, rec):
        # Rank 0's record: the explorer's bars follow rank 0, and a stop on rank 1's first
        # record could land before rank 0's reached the explorer.
        if rec.get("config") == "ddp W=2" and rec.get("metric") == "grad_norm" and rec.get("rank") == 0:
            explorer.stop_button.click()

    with launcher.observe(stop_at_first_config_step):
        explorer.run_button.click()
        explorer.wait(300)
    assert not explorer.running and explorer.status.value.startswith("stopped"), explorer.status.value
    assert isinstance(explorer.error, launcher.LaunchStopped)
    assert {b.description for b in explorer.bars.children} >= {"W=1 reference", "W=2 ddp W=2"}
    frame = explorer.records
    status = frame[frame["metric"] == "steps_completed"].set_index("config")["status"].to_dict()
    assert status == {"ddp W=2": "stopped", "accumulate W=2 k=4": "not run"}
    assert (frame["metric"] == "deviation").any()      # the steps it finished were compared

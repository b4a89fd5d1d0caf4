"""Case 02 (half-precision weights): model, compile step, numerics, verdict rule, tables,
a real two-rank run, and the notebook under papermill."""
from __future__ import annotations

import json
import math

import pytest
import torch

from ddplab.cases import get_case
from ddplab.cases.half_precision.figures import versions_markdown
from ddplab.cases.half_precision.worker import STAGES, build_linear, compile_step, weight_numerics
from ddplab.records import collect, record, to_frame

case = get_case("half_precision")
NOTEBOOK = case.notebook_path()


# --------------------------------------------------------------------------- pieces


def test_build_linear_seeds_alike_or_per_rank():
    same = case.check_params({"same_init": True})
    other = case.check_params({"same_init": False})
    w0 = build_linear(same, "float16", 0).weight
    assert w0.dtype == torch.float16 and w0.shape == (512, 512)
    assert torch.equal(w0, build_linear(same, "float16", 1).weight)
    assert torch.equal(w0, build_linear(other, "float16", 0).weight)  # rank 0 keeps the seed
    assert not torch.equal(w0, build_linear(other, "float16", 1).weight)


def test_compile_step_is_lazy_and_keeps_the_parameters():
    model = torch.nn.Linear(16, 16, bias=False)
    compiled, facts = compile_step(model)
    assert facts == {"ok": True, "error": None, "frames": 0, "same_objects": True}
    assert compiled is not model and compiled.weight is model.weight


def test_compile_failure_is_reported_not_raised(monkeypatch):
    def broken(*args, **kwargs):
        raise RuntimeError("no C++ compiler")

    monkeypatch.setattr(torch, "compile", broken)
    model = torch.nn.Linear(4, 4)
    wrapped, facts = compile_step(model)
    assert wrapped is model
    assert facts["ok"] is False and "no C++ compiler" in facts["error"]


def test_weight_numerics_reproduce_the_report_and_the_stall():
    weight = build_linear(case.check_params({}), "float16", 0).weight.detach()
    with collect() as recs:
        weight_numerics(weight, [1, 8, 32])
    frame = to_frame(recs)
    lanes = frame[(frame["metric"] == "norm") & (frame["method"] == "lanes")]
    assert dict(zip(lanes["lanes"].astype(int), lanes["value"])) == {1: 2.0, 8: 5.65625, 32: 11.3125}
    exact = frame[(frame["metric"] == "norm") & (frame["method"] == "exact")]["value"].item()
    f64 = frame[(frame["metric"] == "norm") & (frame["method"] == "float64 accumulation")]["value"].item()
    assert exact == pytest.approx(f64, rel=1e-14) and 13.0 < exact < 13.1
    # each of the 8 lanes stalls at 4.0
    eight = frame[(frame["metric"] == "lane_sum_of_squares") & (frame["lanes"] == 8)]
    assert len(eight) == 8 and set(eight["value"]) == {4.0}
    trace = frame[frame["metric"] == "running_sum_of_squares"]
    fp16 = trace[trace["accumulator"] == "float16"].sort_values("step")
    fp32 = trace[trace["accumulator"] == "float32"].sort_values("step")
    stall = int(frame[frame["metric"] == "stall_element"]["value"].item())
    assert 1 < stall < weight.numel()
    assert set(fp16[fp16["step"] >= stall]["value"]) == {4.0}
    assert fp16[fp16["step"] == stall - 1]["value"].item() < 4.0
    # float32 does not stall: its error stays within the classical bound gamma_{n-1}·sum
    from ddplab.numerics.bounds import gamma
    bound = gamma(weight.numel() - 1, torch.float32) * exact ** 2
    assert 0 < abs(fp32["value"].iloc[-1] - exact ** 2) <= bound
    assert fp32["value"].is_monotonic_increasing and fp16["value"].is_monotonic_increasing


# --------------------------------------------------------------------------- the verdict rule


TRUE_NORM = 13.07715
LANES = {1: 2.0, 2: 2.828125, 4: 4.0, 8: 5.65625, 16: 8.0, 32: 11.3125}


def _records(*, world_size=2, same_init=True, ddp_changes=(), broadcast_matches=True,
             compile_error=None, torch_norm=13.078125, lanes=LANES, norm_moves_on=(),
             cuda_norm=None):
    """A consistent record set like the worker's, with one fault planted at a time.

    ``ddp_changes``: ranks whose weights DDP changed; ``broadcast_matches``:
    whether those ranks then equal rank 0's initial weights; ``norm_moves_on``:
    ranks whose printed norm moves at the ddp stage.
    """
    recs = []
    for rank in range(world_size):
        base = dict(rank=rank, dtype="float16", param="weight")
        equal_before = same_init or rank == 0
        for stage in STAGES:
            changed = stage == "ddp" and rank in ddp_changes
            if stage == "ddp":
                equal0 = (equal_before and not changed) or (changed and broadcast_matches)
            else:
                equal0 = equal_before
            recs.append(record("fingerprint_changed", int(changed), stage=stage, kind="parameter", **base))
            recs.append(record("matches_rank0_initial", int(equal0), stage=stage, kind="parameter", **base))
            value = torch_norm + (0.0078125 if stage == "ddp" and rank in norm_moves_on else 0.0)
            recs.append(record("norm", value, stage=stage, method="torch.norm", device="cpu",
                               torch_version="2.13.0+cpu", **base))
        recs.append(record("compile_ok", int(compile_error is None), stage="compile",
                           error=compile_error, rank=rank, dtype="float16"))
        recs.append(record("compiled_frames", 0, stage="compile", rank=rank, dtype="float16"))
        recs.append(record("same_parameter_objects", 1, stage="compile", rank=rank, dtype="float16"))
    zero = dict(rank=0, dtype="float16")
    recs.append(record("norm", TRUE_NORM, method="exact", stage="before", **zero))
    if cuda_norm is not None:
        recs.append(record("norm", cuda_norm, stage="before", method="torch.norm", device="cuda",
                           param="weight", torch_version="2.13.0+cpu", **zero))
    for k, v in lanes.items():
        recs.append(record("norm", v, method="lanes", lanes=k, accumulator="float16", stage="before", **zero))
        for lane in range(k):
            recs.append(record("lane_sum_of_squares", 4.0, lanes=k, lane=lane, **zero))
    recs.append(record("stall_element", 6646, accumulator="float16", lanes=1, **zero))
    for step, (s16, s32) in {1: (0.001, 0.001), 6646: (4.0, 4.0), 262144: (4.0, 171.0)}.items():
        recs.append(record("running_sum_of_squares", s16, step=step, accumulator="float16", lanes=1, **zero))
        recs.append(record("running_sum_of_squares", s32, step=step, accumulator="float32", lanes=1, **zero))
    return to_frame(recs)


def _params(**overrides):
    return case.check_params({"dtypes": ["float16"], **overrides})


def test_verdict_clean_run_is_rounding_not_ddp():
    v = case.verdict(_records(), _params())
    assert v.kind == "rounding" and v.all_hold, v.to_markdown()
    assert v.values["k"] == 8 and v.values["report_norm"] == 5.65625 and v.values["tensors"] == 2
    assert v.finding("report_number_reproduced").values["matching"] == [8]
    assert v.finding("installed_torch_no_artifact").values["ulps"] == 0
    assert v.scope and dict(v.key_table())["K-lane float16 model matching the report"] == "8"


def test_verdict_flags_ddp_changing_bits_with_the_same_seed_as_a_bug():
    v = case.verdict(_records(ddp_changes=(1,), broadcast_matches=False, norm_moves_on=(1,)),
                     _params())
    assert v.kind == "bug"
    assert not v.holds("ddp_changed_no_bit") and not v.holds("replicas_equal_after_ddp")
    assert v.finding("ddp_changed_no_bit").values["changed_per_rank"] == [0, 1]
    assert v.holds("norm_moves_only_with_bits")  # the norm moved, but so did the bits


def test_verdict_names_the_broadcast_with_different_seeds():
    v = case.verdict(_records(same_init=False, ddp_changes=(1,)), _params(same_init=False))
    assert v.kind == "by design" and v.holds("ddp_broadcast_rank0") and v.holds("replicas_equal_after_ddp")
    assert v.values["others"] == [1]
    assert v.finding("ddp_broadcast_rank0").values["changed_per_rank"] == [0, 1]
    # no broadcast happened: the ranks still differ after wrapping
    v = case.verdict(_records(same_init=False), _params(same_init=False))
    assert not v.holds("ddp_broadcast_rank0") and not v.holds("replicas_equal_after_ddp")


def test_verdict_reports_a_failed_compile():
    v = case.verdict(_records(compile_error="RuntimeError: no C++ compiler"), _params())
    finding = v.finding("compile_changed_no_bit")
    assert not finding.holds and "no C++ compiler" in finding.values["errors"]


def test_verdict_when_the_installed_kernel_still_stalls():
    v = case.verdict(_records(torch_norm=5.65625), _params())
    assert not v.holds("installed_torch_no_artifact")
    assert v.finding("installed_torch_no_artifact").values["same"] == [8]
    assert v.values["cpu_norm"] == 5.65625


def test_verdict_when_no_lane_count_gives_the_report():
    v = case.verdict(_records(lanes={1: 2.0, 4: 4.0}), _params(lanes=[1, 4]))
    assert not v.holds("report_number_reproduced")
    assert v.values["k"] == "none" and v.values["closest_k"] == 4


def test_verdict_flags_a_norm_that_moves_over_unchanged_bits():
    v = case.verdict(_records(norm_moves_on=(0,)), _params())
    finding = v.finding("norm_moves_only_with_bits")
    assert not finding.holds and finding.values["unexplained"] == ["rank 0 float16 ddp"]
    assert v.holds("ddp_changed_no_bit")


def test_verdict_judges_a_cuda_norm_when_one_was_measured():
    assert "cuda_norm_no_artifact" not in [f.key for f in case.verdict(_records(), _params()).findings]
    assert case.verdict(_records(cuda_norm=13.078125), _params()).holds("cuda_norm_no_artifact")
    assert not case.verdict(_records(cuda_norm=13.0625), _params()).holds("cuda_norm_no_artifact")


def test_versions_table_is_computed_from_the_records():
    table = versions_markdown(_records(cuda_norm=13.078125))
    rows = {line.split("|")[1].strip() + " " + line.split("|")[2].strip(): line
            for line in table.splitlines()[2:]}
    assert "| -1250 |" in rows["2.0 (the report, before wrapping) CPU"]
    assert rows["2.0 (the report, before wrapping) CPU"].rstrip().endswith("| K=8 |")
    assert "| 0 |" in rows["2.13.0+cpu (installed) CPU"]
    assert "| 0 |" in rows["2.13.0+cpu (installed) CUDA"]


# --------------------------------------------------------------------------- real ranks


def test_two_ranks_with_different_seeds_end_with_rank0s_weights(no_leftovers):
    params = case.check_params({"dtypes": ["float16"], "in_features": 64, "out_features": 32,
                                "lanes": [1, 8], "same_init": False})
    records = case.run(params)
    changed = records[(records["metric"] == "fingerprint_changed") & (records["stage"] == "ddp")]
    assert dict(zip(changed["rank"], changed["value"])) == {0: 0.0, 1: 1.0}
    matches = records[(records["metric"] == "matches_rank0_initial")]
    assert set(matches[matches["stage"] == "ddp"]["value"]) == {1.0}
    assert matches[(matches["stage"] == "before") & (matches["rank"] == 1)]["value"].item() == 0.0
    v = case.verdict(records, params)
    assert v.kind == "by design" and v.holds("ddp_broadcast_rank0")
    assert v.holds("compile_changed_no_bit")


# --------------------------------------------------------------------------- the notebook


@pytest.mark.slow
@pytest.mark.parametrize("same_init", [True, False])
def test_notebook_with_the_defaults(tmp_path, same_init):
    import papermill

    from ddplab.artifacts import load_results

    out = tmp_path / "out.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), kernel_name="python3", progress_bar=False,
                               parameters={"same_init": same_init, "results_dir": str(tmp_path / "res")})
    results = load_results(tmp_path / "res")
    rec = results.records
    lanes = rec[(rec["metric"] == "norm") & (rec["method"] == "lanes") & (rec["dtype"] == "float16")]
    assert lanes[lanes["lanes"] == 8]["value"].item() == 5.65625
    ddp = rec[(rec["metric"] == "fingerprint_changed") & (rec["stage"] == "ddp")]
    assert set(ddp["rank"]) == {0, 1} and set(ddp["dtype"]) == {"float16", "float32"}
    if same_init:
        assert (ddp["value"] == 0).all()
        assert results.verdict.kind == "rounding" and results.verdict.all_hold
    else:
        assert (ddp[ddp["rank"] == 0]["value"] == 0).all()
        assert (ddp[ddp["rank"] == 1]["value"] == 1).all()
        assert results.verdict.kind == "by design" and results.verdict.holds("ddp_broadcast_rank0")
    own = rec[(rec["metric"] == "norm") & (rec["method"] == "torch.norm") & (rec["stage"] == "before")
              & (rec["rank"] == 0) & (rec["dtype"] == "float16")]["value"].item()
    assert math.isclose(own, 13.08, abs_tol=0.01)  # torch 2.13's CPU kernel: no artifact
    nb = json.loads(out.read_text())
    images = [o for c in nb["cells"] for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 3
    printed = "".join("".join(o.get("text", "")) for c in nb["cells"] for o in c.get("outputs", []))
    assert "notebook ran in" in printed

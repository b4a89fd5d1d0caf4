"""Case 01, backend divergence: the CIFAR-10 check, the run plan, the verdict rule, and the
notebook (bad parameters and defaults: test_case_contract)."""
from __future__ import annotations

import json

import pytest

from ddplab.cases import get_case
from ddplab.cases.backend_divergence.runs import launch_groups, plan_runs
from ddplab.cases.backend_divergence.verdict import VISIBLE_RELATIVE_GAP, compare, run_table

case = get_case("backend_divergence")
NOTEBOOK = case.notebook_path()


# --------------------------------------------------------------------------- validation


def test_cifar10_root_is_checked_for_its_files(tmp_path):
    with pytest.raises(ValueError, match=r"parameter 'data_root'.*data_batch_1"):
        case.check_params({"data": "cifar10", "data_root": str(tmp_path)})


# --------------------------------------------------------------------------- the plan


def test_default_plan_runs_exact_first_gloo_twice_and_the_reproducible_pair():
    runs = plan_runs(case.check_params({}))
    names = [r.name for r in runs]
    assert names[0] == "exact" and runs[0].hook == "order"
    assert names.count("gloo") == 1 and "gloo (repeat)" in names
    assert {r.hook for r in runs if r.name.startswith("gloo")} == {"ddp"}  # the live backend
    assert [r.placement for r in runs if r.order == "reproducible"] == ["identity", "reversed"]
    assert "gloo (reversed ranks)" in names
    assert {"nccl_ring", "nccl_tree"} <= set(names)
    assert len(names) == len(set(names))


def test_plan_without_reproducible_or_gloo():
    runs = plan_runs(case.check_params({"orders": ["nccl_ring", "exact"], "reproducible": False}))
    assert [r.name for r in runs] == ["exact", "nccl_ring"]


def test_live_nccl_orders_get_a_launch_each_under_their_nccl_algo():
    # Only the plan: running it needs GPUs (check_params refuses nccl here).
    params = case.parameters.validate({"backend": "nccl", "steps": 7, "orders": [
        "gloo", "nccl_live_ring", "nccl_live_tree", "exact"]})
    main, ring, tree = launch_groups(params)
    assert "nccl_live_ring" not in [r.name for r in main[0]]
    assert ring[1]["NCCL_ALGO"] == "Ring" and tree[1]["NCCL_ALGO"] == "Tree"
    for runs, env in (ring, tree):
        assert runs[0].name == "exact" and not runs[0].emit  # a silent reference
        assert env["CUBLAS_WORKSPACE_CONFIG"] == ":4096:8"
    # One launch per world size and group, each with its own environment and run list.
    plans = case.launches(params)
    assert [(p.world_size, p.label) for p in plans] == [
        (2, "W=2"), (2, "W=2 NCCL_ALGO=Ring"), (2, "W=2 NCCL_ALGO=Tree"),
        (4, "W=4"), (4, "W=4 NCCL_ALGO=Ring"), (4, "W=4 NCCL_ALGO=Tree")]
    assert all(p.backend == "nccl" and p.steps == 7 and p.timeout == 600.0 for p in plans)
    assert [r.name for r in plans[4].kwargs["runs"]] == ["exact", "nccl_live_ring"]
    assert plans[1].env is not plans[4].env


def test_default_launches_are_one_per_world_size():
    plans = case.launches(case.check_params({}))
    assert [(p.world_size, p.backend, p.env, p.steps) for p in plans] == [(2, "gloo", {}, 20),
                                                                          (4, "gloo", {}, 20)]
    assert [r.name for r in plans[0].kwargs["runs"]] == [r.name for r in plan_runs(case.check_params({}))]


# --------------------------------------------------------------------------- the verdict rule

RUNS = ["exact", "gloo", "gloo (repeat)", "gloo (reversed ranks)", "nccl_ring", "nccl_tree",
        "reproducible", "reproducible (reversed ranks)"]
STEPS = 4


def _twin(run):
    """The run whose bits ``run`` shares in a clean rounding story at W > 2."""
    if run in ("gloo (repeat)",):
        return "gloo"
    if run.startswith("reproducible"):
        return "exact"  # as measured in float64 at W=4: the fixed-point runs track exact
    return run


def _clean_records(sizes=(2, 4), runs=tuple(RUNS)):
    """Records shaped like a real run in which the rounding story holds.

    The audit's labels as the referee gives them: bitwise evidence where the
    order is emulated bit for bit, the bound for live NCCL and the fixed-point hook.
    """
    from ddplab.records import record, to_frame

    recs = []
    for w in sizes:
        for run in runs:
            twin = _twin(run) if w > 2 else "exact"
            same_as_exact = twin == "exact"
            tag = RUNS.index(twin) if twin in RUNS else len(RUNS)
            for step in range(STEPS):
                labels = dict(world_size=w, run=run, dtype="float64")
                loss = 2.0 - 0.1 * step + (0 if same_as_exact or step == 0 else tag * 1e-16 * step)
                recs.append(record("loss", loss, step=step, rank=0, **labels))
                recs.append(record("param_digest", 1000 * step + (0 if same_as_exact else tag),
                                   step=step, rank=0, **labels))
                recs.append(record("param_distance", 0.0 if same_as_exact else 1e-16 * (1 + 4 * step),
                                   step=step, rank=0, **labels))
                if run != "gloo":
                    gloo_twin = _twin("gloo") if w > 2 else "exact"
                    recs.append(record("gloo_distance", 0.0 if twin == gloo_twin else 2e-16 * (1 + step),
                                       step=step, rank=0, **labels))
                recs.append(record("grad_norm", 3.0 - 0.1 * step, step=step, rank=0, **labels))
                for rank in range(w):
                    shard = w - 1 - rank if "reversed" in run else rank
                    recs.append(record("local_loss", loss + shard, step=step, rank=rank, shard=shard,
                                       **labels))
                evidence = "bound" if run.startswith(("reproducible", "nccl_live")) else "bitwise"
                for bucket in range(0 if run == "exact" else 2):  # the reference is not audited
                    exact_like = same_as_exact or run.startswith("reproducible")
                    audit = dict(max_ulp=0 if exact_like else 512, mean_ulp=0.0 if exact_like else 0.7,
                                 frac_correctly_rounded=1.0 if exact_like else 0.7,
                                 max_bound_ratio=0.0 if exact_like else 0.5,
                                 max_rel_error=0.0 if exact_like else 0.6 * 2.0 ** -53)
                    for rank in range(w):
                        recs.append(record("matches_order", 1.0, step=step, rank=rank, bucket=bucket,
                                           hook="audit", **labels))
                        for metric, value in audit.items():
                            recs.append(record(metric, value, step=step, rank=rank, bucket=bucket,
                                               hook="audit", verdict="rounding", evidence=evidence,
                                               **labels))
    return to_frame(recs)


def _set(frame, metric, value, **where):
    mask = frame["metric"] == metric
    for key, val in where.items():
        mask &= frame[key] == val
    assert mask.any(), (metric, where)
    frame.loc[mask, "value"] = value
    return frame


PARAMS = case.check_params({"steps": STEPS})


def test_scope_says_which_steps_the_audit_measured():
    records = _clean_records()
    assert "The audit measured every one of the 4 steps." in case.verdict(records, PARAMS).scope
    # audit_every=2: the audit's records of steps 1 and 3 are not there.
    audit = records["hook"].eq("audit") & records["step"].isin([1, 3])
    v = case.verdict(records[~audit], PARAMS)
    assert v.all_hold, v.to_markdown()
    assert v.scope.endswith("The audit measured steps 0, 2 of the 4 (audit_every); the parameter "
                            "digests compare every run at every step.")
    only_first = records["hook"].eq("audit") & records["step"].gt(0)
    assert "The audit measured step 0 of the 4 (audit_every)" in case.verdict(records[~only_first], PARAMS).scope


def test_verdict_holds_on_a_clean_rounding_story():
    v = case.verdict(_clean_records(), PARAMS)
    assert v.all_hold, v.to_markdown()
    assert v.kind == "rounding"
    assert [f.key for f in v.findings] == ["two_ranks_bitwise", "more_ranks_differ",
                                            "same_order_reproducible", "no_order_privileged",
                                            "gloo_rounding_facts"]
    assert v.values["w2_max_ulp"] == 0 and v.values["ratio"] == 0.5 and v.values["w"] == 4
    assert v.values["matches_min"] == 1.0 and v.values["evidence"] == "bitwise"
    more = v.finding("more_ranks_differ").values
    assert more["pairs"] == ["W=4 gloo", "W=4 nccl_ring", "W=4 nccl_tree"]
    assert more["first_differ"] == [0, 0, 0] and more["growth"] == pytest.approx([13.0] * 3)
    # The report's pair, measured at the last step: gloo against the emulated NCCL ring.
    assert (v.values["pair_a"], v.values["pair_b"], v.values["last_step"]) == ("gloo", "nccl_ring", 3)
    assert v.values["loss_gap"] == pytest.approx(abs(1 - 4) * 3e-16, rel=0.01)
    assert v.values["pair_distance"] == pytest.approx(8e-16)
    assert v.values["max_rel_loss_gap"] < VISIBLE_RELATIVE_GAP
    assert "cannot explain a significant difference" in v.headline
    assert "measured growth, not a bound" in v.headline
    assert dict(v.key_table())["W>2: largest error / rounding bound"] == "0.5"
    facts = v.finding("gloo_rounding_facts").values
    assert facts["gloo_ratio"] == 0.5 and facts["matches_n"] == 3 * (2 + 4) * 2 * STEPS
    assert facts["gloo_bitwise"] == facts["gloo_buckets"] == facts["matches_n"]
    assert "Live NCCL" not in v.headline


@pytest.mark.parametrize("metric, value, where, broken", [
    # An order that differs at W=2 is not explained by commutativity.
    ("param_digest", 7, dict(world_size=2, run="nccl_ring", step=2), "two_ranks_bitwise"),
    ("loss", 1.0, dict(world_size=2, run="gloo", step=1), "two_ranks_bitwise"),
    # An error beyond the rounding bound is not rounding.
    ("max_bound_ratio", 3.0, dict(world_size=4, run="nccl_tree", step=1), "more_ranks_differ"),
    ("max_bound_ratio", 3.0, dict(world_size=4, run="nccl_tree", step=1), "no_order_privileged"),
    # The same order twice must give the same bits.
    ("loss", 0.5, dict(world_size=4, run="gloo (repeat)", step=2), "same_order_reproducible"),
    ("local_loss", 9.0, dict(world_size=2, run="gloo (repeat)", step=3, shard=1),
     "same_order_reproducible"),
    # The reproducible hook must make the placements agree.
    ("param_digest", 5, dict(world_size=4, run="reproducible (reversed ranks)", step=1),
     "no_order_privileged"),
    # No divergence from the first step: the W=4 story does not hold.
    ("frac_correctly_rounded", 1.0, dict(world_size=4, run="gloo", step=0), "more_ranks_differ"),
    # "A few ulps" on average, not hundreds.
    ("mean_ulp", 40.0, dict(world_size=4, run="nccl_ring", step=0), "more_ranks_differ"),
])
def test_verdict_follows_the_measurements(metric, value, where, broken):
    frame = _set(_clean_records(), metric, value, **where)
    v = case.verdict(frame, PARAMS)
    assert not v.holds(broken), v.finding(broken).evidence
    assert v.kind == "unexplained" and v.values["failed"] and broken in v.values["failed"]


def test_verdict_needs_the_gap_to_grow():
    frame = _clean_records()
    for run in ("gloo", "nccl_ring"):
        frame = _set(frame, "param_distance", 1e-16, world_size=4, run=run)
    v = case.verdict(frame, PARAMS)
    assert not v.holds("more_ranks_differ")
    assert v.finding("more_ranks_differ").values["growth"][:2] == [1.0, 1.0]


def test_verdict_needs_the_placement_control_to_change_gloo():
    frame = _clean_records()
    digests = frame[(frame["metric"] == "param_digest") & (frame["world_size"] == 4)
                    & (frame["run"] == "gloo")].set_index("step")["value"]
    for step, value in digests.items():
        frame = _set(frame, "param_digest", value, world_size=4, run="gloo (reversed ranks)", step=step)
    v = case.verdict(frame, PARAMS)
    assert not v.holds("no_order_privileged")
    assert v.finding("no_order_privileged").values["control_equal"] == [True, True]


def test_live_gloo_off_its_emulated_ring_is_not_rounding_even_within_the_bound():
    # Rounding in gloo's ring gives exactly one answer: a rank whose bits differ from it
    # (here on every rank of one step) is not rounding, however small the error.
    frame = _set(_clean_records(), "matches_order", 0.97, world_size=4, run="gloo", step=2)
    v = case.verdict(frame, PARAMS)
    facts = v.finding("gloo_rounding_facts")
    assert facts.holds is False and facts.values["matches_min"] == 0.97
    assert v.kind == "unexplained" and v.values["failed"] == ["gloo_rounding_facts"]


def test_a_bucket_the_referee_calls_not_rounding_is_not_rounding():
    frame = _clean_records()
    mask = ((frame["metric"] == "max_bound_ratio") & (frame["world_size"] == 4) & (frame["run"] == "gloo")
            & (frame["step"] == 1) & (frame["bucket"] == 0))
    frame.loc[mask, "verdict"] = "not rounding"  # bits differ from the emulated ring, within the bound
    v = case.verdict(frame, PARAMS)
    privileged = v.finding("no_order_privileged").values
    assert v.finding("gloo_rounding_facts").values["evidence"] == "none"
    assert privileged["judged"] - privileged["rounding"] == mask.sum()
    assert v.kind == "unexplained"
    assert set(v.values["failed"]) == {"no_order_privileged", "gloo_rounding_facts"}


def test_live_nccl_rests_on_the_bound_and_the_headline_says_so():
    frame = _clean_records(runs=tuple(RUNS) + ("nccl_live_ring",))
    v = case.verdict(frame, case.parameters.validate({"steps": STEPS, "backend": "nccl", "orders": [
        "gloo", "nccl_ring", "nccl_tree", "exact", "nccl_live_ring"]}))
    assert v.kind == "rounding", v.to_markdown()
    judged = 2 * STEPS * (2 + 4)  # buckets x steps x every rank of W = 2 and 4
    assert (v.values["nccl_buckets"], v.values["nccl_bound"], v.values["nccl_ratio"]) == (judged, judged, 0.5)
    assert v.values["evidence"] == "bitwise"                     # live gloo: bit for bit
    privileged = v.finding("no_order_privileged").values
    assert privileged["bound"] == judged and privileged["bitwise"] + judged == privileged["judged"]
    assert "Live NCCL's is rounding on the bound" in v.headline


def test_verdict_says_when_rounding_alone_grew_to_a_visible_loss_gap():
    frame = _set(_clean_records(), "loss", 1.8 * (1 + 1e-4), world_size=4, run="nccl_ring", step=2)
    v = case.verdict(frame, PARAMS)
    assert v.kind == "rounding" and v.values["max_rel_loss_gap"] == pytest.approx(1e-4, rel=0.01)
    assert "cannot explain" not in v.headline and "visible" in v.headline


def test_verdict_says_what_was_not_measured():
    frame = _clean_records(sizes=(4,))
    v = case.verdict(frame, PARAMS)
    assert v.holds("two_ranks_bitwise") is None
    assert v.finding("two_ranks_bitwise").values == {"sizes": [4]}
    assert v.values["unmeasured"] == ["two_ranks_bitwise"]
    assert v.holds("more_ranks_differ") and v.holds("same_order_reproducible")


def test_logged_loss_of_a_placement_is_not_compared_bitwise():
    # The logged loss is a W-term sum whose order the placement changes: it may
    # differ by an ulp while every shard's own loss and the parameters agree.
    frame = _set(_clean_records(), "loss", 2.0 + 4e-16, world_size=4,
                 run="reproducible (reversed ranks)", step=0)
    assert case.verdict(frame, PARAMS).holds("no_order_privileged")


def test_loss_gaps_are_exact_differences_from_the_exact_run():
    frame = _clean_records()
    gaps = case.table("loss_gaps", frame, PARAMS)
    w2 = gaps[gaps["world_size"] == 2]
    assert (w2["value"] == 0).all() and "exact" not in set(gaps["run"])
    w4 = gaps[(gaps["world_size"] == 4) & (gaps["run"] == "nccl_tree")].set_index("step")["value"]
    assert w4[0] == 0 and w4[3] == pytest.approx(RUNS.index("nccl_tree") * 3e-16, rel=0.5)


@pytest.mark.parametrize("figure", list(case.figures_by_name))
def test_figures_draw_from_the_records(figure):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from ddplab.plots import png_bytes

    records = _clean_records()
    fig = case.figure(figure, records, PARAMS)
    try:
        assert len(fig.axes) >= 2 and png_bytes(fig)[:4] == b"\x89PNG"
    finally:
        plt.close(fig)
    # One panel on a caller's axes: the largest world size.
    fig, ax = plt.subplots()
    try:
        assert case.figure(figure, records, PARAMS, ax=ax) is fig
        assert "W = 4" in ax.get_title() and png_bytes(fig)[:4] == b"\x89PNG"
    finally:
        plt.close(fig)


# --------------------------------------------------------------------------- real ranks


def test_a_real_run_with_four_ranks_in_float32(no_leftovers):
    """Live gloo twice and the exact reference, 4 ranks, 2 steps: the measurements, unmocked.

    float32 here; the notebook test below runs the report's float64.
    """
    params = {"world_sizes": [4], "orders": ["gloo", "exact"], "steps": 2, "reproducible": False,
              "dtype": "float32", "audit_every": 1}
    records = case.run(params, progress=False)
    runs = set(records.loc[records["metric"] == "loss", "run"])
    assert runs == {"exact", "gloo", "gloo (repeat)"}
    same, first, n = compare(records, "gloo", "gloo (repeat)", 4, by=("loss", "param_digest", "local_loss"))
    assert same and n == 2
    audit = records[(records["metric"] == "max_bound_ratio") & (records["run"] == "gloo")]
    assert set(audit["rank"]) == {0, 1, 2, 3} and audit["value"].max() <= 1
    # The reference is not audited: its audit would measure the exact reduction against itself.
    assert not len(records[(records["metric"] == "max_ulp") & (records["run"] == "exact")])
    assert set(records.loc[records["metric"] == "local_loss", "shard"]) == {0, 1, 2, 3}
    assert set(records["dtype"].dropna()) == {"float32"}
    matches = records.loc[(records["metric"] == "matches_order") & (records["run"] == "gloo"), "value"]
    assert len(matches) and matches.min() == 1.0  # live gloo is the emulated gloo ring, bit for bit
    # Distances from live gloo: its repeat is bitwise gloo, the exact run is not.
    gloo_distance = run_table(records, "gloo_distance").loc[4]
    assert (gloo_distance["gloo (repeat)"] == 0).all() and (gloo_distance["exact"] > 0).all()
    seconds = records.loc[records["metric"] == "launch_seconds", "value"]
    print(f"4 ranks, 3 runs, 2 steps: {seconds.iloc[0]:.1f} s")


# --------------------------------------------------------------------------- the notebook


@pytest.mark.slow
def test_notebook_runs_and_its_records_support_every_finding(tmp_path):
    import papermill

    from ddplab.artifacts import load_results

    out = tmp_path / "01.ipynb"
    papermill.execute_notebook(str(NOTEBOOK), str(out), kernel_name="python3", progress_bar=False,
                               parameters={"steps": 4, "world_sizes": [2, 4],
                                           "results_dir": str(tmp_path / "res")})
    results = load_results(tmp_path / "res")
    records = results.records

    # The saved verdict is the one the records give, and every finding holds.
    again = case.verdict(records, results.params)
    assert again.to_dict() == results.verdict.to_dict()
    assert {f.key: f.holds for f in results.verdict.findings} == {
        "two_ranks_bitwise": True, "more_ranks_differ": True, "same_order_reproducible": True,
        "no_order_privileged": True, "gloo_rounding_facts": True}
    v = results.verdict
    assert v.kind == "rounding" and v.values["evidence"] == "bitwise" and v.values["matches_min"] == 1
    assert v.values["w2_max_ulp"] == 0 and 0 < v.values["ratio"] <= 1
    assert v.values["max_rel_loss_gap"] < VISIBLE_RELATIVE_GAP

    # The same conclusions, read from the raw records.
    loss = run_table(records, "loss")
    w2, w4 = loss.loc[2], loss.loc[4]
    for run in ("gloo", "nccl_ring", "nccl_tree"):
        assert (w2[run] == w2["exact"]).all()                      # 1. W=2: the same bits
    digest = run_table(records, "param_digest").loc[4]
    assert (digest["gloo"] != digest["nccl_ring"]).all()           # 2. W=4: differ from step 0
    ratio = records[(records["metric"] == "max_bound_ratio")
                    & ~records["run"].str.startswith("reproducible")]["value"]
    assert len(ratio) and ratio.max() <= 1.0                        # ... within the bound
    distance = run_table(records, "param_distance").loc[4]["gloo"]
    assert distance.iloc[-1] > distance.iloc[0] > 0                # ... and the gap grows
    assert (w4["gloo"] == w4["gloo (repeat)"]).all()               # 3. the same order twice
    assert (digest["reproducible"] == digest["reproducible (reversed ranks)"]).all()  # 4.
    assert (digest["gloo"] != digest["gloo (reversed ranks)"]).any()
    pair = run_table(records, "gloo_distance").loc[4]["nccl_ring"]
    assert v.values["pair_distance"] == pair.iloc[-1] > 0

    # Figures must not vanish (MPLBACKEND=Agg in a kernel gives no image silently).
    nb = json.loads(out.read_text())
    images = [c for c in nb["cells"] if c["cell_type"] == "code"
              for o in c.get("outputs", []) if "image/png" in o.get("data", {})]
    assert len(images) >= 5
    key = [c for c in nb["cells"] if "key-figure" in c.get("metadata", {}).get("tags", [])]
    assert len(key) == 1 and any("image/png" in o.get("data", {}) for o in key[0]["outputs"])

"""ddplab.compare on real gloo ranks: the correct example is rounding under DDP, accumulation,
a custom loop, Fabric and FSDP2 (float32 and bfloat16); every planted bug is a bug of the
right kind; the records are tidy and say the same as the verdicts."""
from __future__ import annotations

import contextlib
import io
import math

import pytest
import torch

from ddplab import compare
from ddplab.compare import examples, referee
from ddplab.compare.verdicts import judge

from readme import python_block, readme_section

STEPS = 3


HOOKED = "ddp W=2 audited"


@pytest.fixture(scope="module")
def correct_run(warm_launcher):
    """The correct example under every built-in configuration, and DDP with a user comm hook."""
    from ddplab.comm_hooks import AuditState, audit_hook

    example = examples.correct(0, steps=STEPS)
    example.configurations.append(compare.DDP(2, comm_hook=audit_hook, hook_state=AuditState,
                                              bucket_cap_mb=0.001, name=HOOKED))
    example.expected[HOOKED] = examples.Expected("rounding")
    return example, compare.run(example.setup, example.configurations, progress=False)


@pytest.fixture(scope="module")
def planted_run(warm_launcher):
    """Every planted bug that shares the correct setup, compared in one run (fewer launches)."""
    names = [n for n in examples.PLANTED if n not in examples.SETUP_BUGS]
    found = [examples.planted_example(n, steps=2) for n in names]
    configs = [c for ex in found for c in ex.configurations]
    expected = {label: e for ex in found for label, e in ex.expected.items()}
    return expected, compare.run(found[0].setup, configs, progress=False)


def test_correct_example_is_rounding_in_every_configuration(correct_run):
    example, result = correct_run
    assert set(result.kinds) == set(example.expected)
    for label, verdict in result.verdicts.items():
        assert verdict.kind == example.expected.get(label, examples.Expected("rounding")).verdict, \
            (label, verdict.headline)
        assert verdict.steps_completed == STEPS
        assert verdict.max_deviation <= referee.ROUNDING_MARGIN
        assert verdict.first_divergence is None and verdict.difference is None
        assert verdict.finding_values("within_band")["steps_compared"] == STEPS
    # DDP and FSDP2 keep every rank bitwise identical.
    assert result.verdict("ddp W=2").finding_values("ranks_agree")["max_rank_distance"] == 0.0


def test_collectives_are_audited_bit_for_bit_where_ddplab_emulates_them(correct_run):
    _, result = correct_run
    for label, collective in (("ddp W=2", "allreduce"), ("accumulate W=2 k=2", "allreduce"),
                              ("fabric W=2", "allreduce"), ("fsdp2 W=2", "reduce_scatter"),
                              ("fsdp2 W=2 bfloat16", "reduce_scatter")):
        reduction = result.verdict(label).finding("reduction")
        assert reduction.holds, (label, reduction.evidence)
        assert reduction.values["evidence"] == ["bitwise"] and reduction.values["collective"] == [collective]
        assert reduction.values["steps"] == STEPS and reduction.values["min_match"] == 1.0
    # A custom step wrapped in DDP (wrap="ddp") reduces through DDP's buckets: audited the same way.
    custom = result.verdict("accumulate_correctly W=2 k=2").finding("reduction")
    assert custom.holds and custom.values["evidence"] == ["bitwise"] and custom.values["steps"] == STEPS


def test_bfloat16_is_judged_against_a_bfloat16_reference(correct_run):
    _, result = correct_run
    frame = result.records
    bands = frame[(frame["metric"] == "band") & (frame["param"] == referee.MODEL) & (frame["quantity"] == "grad")]
    bf16 = bands[bands["config"] == "fsdp2 W=2 bfloat16"]
    fp32 = bands[bands["config"] == "fsdp2 W=2"]
    assert set(bf16["band_run"]) == {"reference bfloat16"} and set(fp32["band_run"]) == {"reference"}
    # bfloat16 rounds ~2^16 times coarser than float32: so does its band.
    assert bf16["value"].min() > 1000 * fp32["value"].max()
    # Judged against the float32 reference's band it would be far beyond the margin.
    dist = frame[(frame["metric"] == "distance_to_truth") & (frame["config"] == "fsdp2 W=2 bfloat16")]
    assert dist["value"].max() / fp32["value"].max() > referee.BUG_MARGIN


def test_records_are_tidy_and_cover_every_step_param_and_quantity(correct_run):
    example, result = correct_run
    frame = result.records
    assert list(frame.columns[:5]) == ["step", "rank", "bucket", "metric", "value"]
    names = [n for n, _ in example.setup.model().named_parameters()] + [referee.MODEL]
    dev = frame[(frame["metric"] == "deviation") & (frame["config"] == "ddp W=2")]
    assert len(dev) == STEPS * len(names) * 2
    assert set(dev["param"]) == set(names) and set(dev["quantity"]) == {"grad", "param"}
    for metric in ("distance_to_truth", "distance_to_reference", "band", "rank_distance", "loss",
                   "grad_norm", "optimizer_steps", "steps_completed"):
        assert (frame["metric"] == metric).any(), metric
    # Losses stream from every rank of every run, the truth and the reference included.
    losses = frame[frame["metric"] == "loss"]
    assert {"reference", "truth", "reference bfloat16"} <= set(losses["config"])
    assert set(losses[losses["config"] == "ddp W=2"]["rank"]) == {0, 1}
    # The verdicts are a function of the records alone.
    for label, verdict in result.verdicts.items():
        again = judge(frame, label)
        assert (again.kind, again.max_deviation) == (verdict.kind, verdict.max_deviation)


def test_reference_and_configuration_losses_agree_to_rounding(correct_run):
    _, result = correct_run
    frame = result.records
    loss = frame[frame["metric"] == "loss"].groupby(["config", "step"])["value"].mean()
    for label in ("ddp W=2", "accumulate W=2 k=2", "fabric W=2", "fsdp2 W=2"):
        for step in range(STEPS):
            assert loss[(label, step)] == pytest.approx(loss[("reference", step)], rel=1e-5)
    for step in range(STEPS):
        assert loss[("truth", step)] == pytest.approx(loss[("reference", step)], rel=1e-5)


@pytest.mark.slow  # the README example, in the default suite, finds the same factor 1/W
def test_summed_loss_is_a_factor_of_one_over_w():
    example = examples.planted_example("summed_loss", steps=2)
    result = compare.run(example.setup, example.configurations, progress=False)
    (label, expected), = example.expected.items()
    verdict = result.verdict(label)
    assert (verdict.kind, verdict.difference) == ("bug", "factor")
    values = verdict.finding_values("factor")
    assert values["factor"] == pytest.approx(expected.factor, rel=1e-4)
    assert values["factor_name"] == "1/W" and values["step"] == 0
    assert verdict.first_divergence == 0
    assert verdict.max_deviation >= referee.BUG_MARGIN
    assert "0.5 = 1/W" in verdict.headline
    # The finding's figure draws the fitted factor.
    import matplotlib.pyplot as plt

    from ddplab.compare import figures
    ax = figures.finding_figure(result.records, label).axes[0]
    (x0, x1), (y0, y1) = ax.lines[0].get_data()
    assert (y1 - y0) / (x1 - x0) == pytest.approx(0.5, rel=1e-4)
    assert "1/W" in ax.get_legend().get_texts()[0].get_text()
    plt.close("all")


def test_planted_bugs_are_named_with_the_right_kind(planted_run):
    expected, result = planted_run
    for label, exp in expected.items():
        verdict = result.verdict(label)
        assert verdict.kind == exp.verdict, (label, verdict.headline)
        assert verdict.difference == exp.finding, (label, verdict.headline)
        assert verdict.first_divergence == 0
        values = verdict.finding_values(exp.finding)
        if exp.factor is not None:
            assert values["factor"] == pytest.approx(exp.factor, rel=1e-4)
        if exp.missing is not None:
            assert tuple(tuple(p) for p in values["missing_pieces"]) == exp.missing


def test_missing_contribution_weights_and_desync_ranks_are_data(planted_run):
    _, result = planted_run
    zero_grad = result.verdict("zero_grad_in_loop W=2 k=4").finding_values("missing_contribution")
    # Only the last micro-batch of each rank survives, with its reference weight.
    assert zero_grad["piece_weights"] == pytest.approx([0, 0, 0, 1, 0, 0, 0, 1], abs=1e-4)
    assert zero_grad["residual_config"] < 1e-5 and zero_grad["residual_truth"] < 1e-12
    desync = result.verdict("no_allreduce W=2")
    assert dict(desync.finding_values("desync")["rank_deviation"])[1] > referee.BUG_MARGIN
    assert desync.finding_values("ranks_agree")["max_rank_distance"] > 0
    assert not any(f.holds for f in desync.findings if f.key == "ranks_agree")
    # Rank 0 trained on its own share alone: rank 1's piece is missing, its own counts W times.
    assert desync.finding_values("desync")["piece_weights"] == pytest.approx([2, 0], abs=1e-4)


def test_a_comm_hook_configuration_is_compared_too(correct_run):
    _, result = correct_run
    verdict = result.verdict(HOOKED)
    assert verdict.kind == "rounding"  # no emulation of the audit hook: its reduction is judged by the band
    # The hook's own records stream back labelled with the configuration, and its audit of
    # every bucket (many small ones here) becomes the reduction finding.
    frame = result.records
    audit = frame[(frame["metric"] == "matches_order") & (frame["config"] == HOOKED)]
    assert set(audit["hook"]) == {"audit"} and audit["bucket"].nunique() > 1
    reduction = verdict.finding("reduction")
    assert reduction.holds and reduction.values["evidence"] == ["bitwise"]


def test_verdicts_render_as_markdown_and_as_a_ddplab_verdict(planted_run):
    _, result = planted_run
    text = result.to_markdown()
    assert "| zero_grad_in_loop W=2 k=4 | **bug** |" in text
    verdict = result.verdict("no_allreduce W=2").to_verdict()
    assert verdict.kind == "bug" and verdict.finding("desync").holds
    assert "rank(s) 1 hold" in verdict.finding("desync").claim_text
    assert not math.isnan(result.verdict("no_allreduce W=2").max_deviation)


def _readme_section() -> str:
    return readme_section("Your own training")


def _run_readme_example(source: str) -> str:
    """Execute ``source`` as a notebook cell would (its functions pickled by value); what it prints."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(source, "README.md", "exec"), {"__name__": "readme_example"})
    return out.getvalue()


def test_the_readme_example_finds_its_planted_bug_verbatim(warm_launcher):
    """The README's complete example, taken verbatim: under 10 lines, and it prints the table the
    README shows -- the same verdict, finding and factor in every row."""
    section = _readme_section()
    source = python_block(section)
    assert len([line for line in source.splitlines() if line.strip()]) < 10
    printed = _run_readme_example(source)
    shown = [line for line in section.splitlines() if line.startswith("| ") and "**" in line
             and " W=" in line]
    assert len(shown) == 2
    for row in shown:
        config, verdict, _, first, finding, summary = [c.strip() for c in row.strip("|").split("|")]
        got = next(line for line in printed.splitlines() if line.startswith(f"| {config} |"))
        cells = [c.strip() for c in got.strip("|").split("|")]
        assert cells[1] == verdict == "**bug**" and cells[3] == first and cells[4] == finding == "factor"
        assert summary.split("…", 1)[1].strip() in cells[5]


@pytest.mark.slow
def test_the_readme_example_with_a_mean_loss_is_rounding(warm_launcher):
    source = python_block(_readme_section())
    assert 'reduction="sum"' in source
    printed = _run_readme_example(source.replace('reduction="sum"', 'reduction="mean"'))
    rows = [line for line in printed.splitlines() if line.startswith("| ") and " W=" in line]
    # A mean loss is what DDP averages: the replay proves each configuration exact, or the band says rounding.
    assert len(rows) == 2 and all("| **rounding** |" in row or "| **exact** |" in row for row in rows), printed


def test_figures_draw_from_the_records_on_a_given_ax(correct_run, planted_run):
    import matplotlib.pyplot as plt

    from ddplab.compare import figures

    _, correct = correct_run
    _, planted = planted_run
    for fn in (figures.loss_curves, figures.grad_norms, figures.deviation_over_steps):
        fig, ax = plt.subplots()
        assert fn(correct.records, ax=ax) is fig and ax.lines
        plt.close(fig)
    legend = [t.get_text() for t in figures.loss_curves(correct.records).axes[0].get_legend().get_texts()]
    assert legend[:3] == ["truth", "reference", "reference bfloat16"] and "fsdp2 W=2 bfloat16" in legend
    heat = figures.deviation_heatmap(planted.records, "zero_grad_in_loop W=2 k=4")
    boxes = [p for p in heat.axes[0].patches if p.get_edgecolor()[:3] == (1.0, 0.0, 0.0)]
    assert len(boxes) == 1 and boxes[0].get_x() == -0.5        # the first divergence, at step 0
    missing = figures.finding_figure(planted.records, "zero_grad_in_loop W=2 k=4").axes[0]
    (x0, x1), (y0, y1) = missing.lines[0].get_data()
    assert (y1 - y0) / (x1 - x0) == pytest.approx(-1.0)       # difference = −(missing gradient)
    assert len(figures.figures(planted.records)) == 3 + 2 * 4   # a heatmap and a finding per bug
    with pytest.raises(ValueError, match="no 'localized' records"):
        figures.finding_figure(correct.records, "ddp W=2")
    plt.close("all")


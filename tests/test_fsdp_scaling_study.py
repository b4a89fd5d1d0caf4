"""The bfloat16-with-more-ranks study: records, the bounds it switches between, and its figure."""
from __future__ import annotations

import matplotlib
import pytest
import torch

from ddplab.numerics import reduce_scatter
from ddplab.records import to_frame, where
from ddplab.scaling_study import STUDY_METRICS, gradient_like, plot_scaling, reduce_scatter_scaling

matplotlib.use("Agg")


@pytest.fixture(scope="module")
def study():
    return to_frame(reduce_scatter_scaling(world_sizes=(2, 16, 260), numel=520))


def test_one_record_per_metric_size_and_accumulation(study):
    assert len(study) == 3 * 2 * len(STUDY_METRICS)
    assert set(study["accumulate"]) == {"bfloat16", "float32"}
    assert set(study["numel"]) == {520, 528}          # N rounded up to a multiple of W
    assert set(study["averaging"]) == {"multiply_reciprocal"} and set(study["order"]) == {"nccl_ring"}


def test_bfloat16_switches_to_the_probabilistic_bound_where_the_rigorous_one_is_infinite(study):
    ratio = where(study, "bound_ratio")
    kind = {(r.world_size, r.accumulate): r.bound for r in ratio.itertuples()}
    assert kind[(260, "bfloat16")] == "probabilistic"     # (W - 1 + 2) * 2^-8 >= 1
    assert kind[(16, "bfloat16")] == "rigorous" and kind[(260, "float32")] == "rigorous"
    assert (ratio["value"] <= 1.0).all()
    rigorous = where(study, "max_bound_ratio", world_size=260, accumulate="bfloat16")
    assert rigorous["value"].isna().all()                  # no finite rigorous bound there


def test_bfloat16_error_grows_with_w_and_float32_accumulation_stops_it(study):
    rms = {(r.world_size, r.accumulate): r.value for r in where(study, "rms_abs_error").itertuples()}
    assert rms[(2, "bfloat16")] < rms[(16, "bfloat16")] < rms[(260, "bfloat16")]
    assert rms[(260, "float32")] < rms[(260, "bfloat16")] / 10


def test_the_study_measures_the_emulated_reduce_scatter():
    c = gradient_like(16, 64)
    assert c.kind == "rows" and c.dtype == torch.bfloat16
    result = reduce_scatter(c, "nccl_ring", op="avg")
    from ddplab.numerics import measure
    m = measure(result, c, "nccl_ring", op="avg", averaging="multiply_reciprocal")
    rec = to_frame(reduce_scatter_scaling(world_sizes=(16,), numel=64, accumulations=(None,)))
    assert where(rec, "max_abs_error")["value"].iloc[0] == m["max_abs_error"]


def test_plot_draws_on_the_given_axes(study):
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots()
    assert plot_scaling(study, ax=ax) is ax
    assert len(ax.lines) >= 3                              # two accumulations and the bound at 1
    assert plot_scaling(study, metric="rms_abs_error").get_ylabel() == "rms abs error"
    plt.close("all")


@pytest.mark.parametrize("kwargs, message", [
    (dict(world_sizes=(1, 4)), "W >= 2"),
    (dict(numel=0), "positive int"),
    (dict(order="nccl_tree"), "unknown reduce-scatter order"),
])
def test_bad_arguments(kwargs, message):
    with pytest.raises(ValueError, match=message):
        reduce_scatter_scaling(**kwargs)

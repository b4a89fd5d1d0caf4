"""The tolerance band's distances: per parameter, and for the whole model from the parameters'
squared distances (the norm of the whole model's difference, without a flat copy of it)."""
from __future__ import annotations

import math

import torch

from ddplab.compare.referee import MODEL, distance_records


def _values(records, metric, rank=0):
    return {r["param"]: r["value"] for r in records if r["metric"] == metric and r["rank"] == rank}


def test_the_model_row_is_the_norm_of_the_whole_difference_over_the_whole_truth():
    g = torch.Generator().manual_seed(0)
    truth = {"a": torch.randn(40, 3, generator=g, dtype=torch.float64), "b": torch.randn(7, generator=g,
                                                                                           dtype=torch.float64)}
    run = {n: (t * (1 + 1e-6 * torch.randn(t.shape, generator=g, dtype=torch.float64))).float()
           for n, t in truth.items()}
    band = {n: t.float() for n, t in truth.items()}
    other = dict(run, b=run["b"] * 2)
    recs = distance_records(0, "grad", truth, band, run, band, config="c", others={1: other})
    flat = lambda d: torch.cat([d[n].reshape(-1).double() for n in truth])  # noqa: E731
    whole = torch.linalg.vector_norm(flat(truth))
    d = _values(recs, "distance_to_truth")
    assert math.isclose(d[MODEL], float(torch.linalg.vector_norm(flat(run) - flat(truth)) / whole), rel_tol=1e-12)
    assert math.isclose(d["b"], float(torch.linalg.vector_norm(run["b"].double() - truth["b"])
                                      / torch.linalg.vector_norm(truth["b"])), rel_tol=1e-12)
    assert math.isclose(_values(recs, "deviation")[MODEL], d[MODEL] / _values(recs, "band")[MODEL], rel_tol=1e-12)
    equal = {r["param"]: r["bitwise_equal"] for r in recs if r["metric"] == "rank_distance"}
    assert equal == {"a": True, "b": False, MODEL: False}
    assert _values(recs, "rank_distance", rank=1)["a"] == 0.0 and _values(recs, "rank_distance", rank=1)["b"] > 0


def test_equal_infinities_count_as_equal_and_any_other_non_finite_difference_is_infinite():
    truth = {"w": torch.tensor([1.0, math.inf, math.nan], dtype=torch.float64)}
    same = {"w": torch.tensor([1.0, math.inf, math.nan])}
    recs = distance_records(0, "param", truth, same, same, None, config="c")
    assert _values(recs, "distance_to_truth") == {"w": 0.0, MODEL: 0.0}
    off = {"w": torch.tensor([1.0, -math.inf, math.nan])}
    recs = distance_records(0, "param", truth, same, off, None, config="c")
    assert _values(recs, "distance_to_truth") == {"w": math.inf, MODEL: math.inf}
    assert _values(recs, "deviation")["w"] == math.inf

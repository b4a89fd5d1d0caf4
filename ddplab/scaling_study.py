"""How a bfloat16 reduce-scatter's error grows with the number of ranks, from 2 to 1024 virtual ones.

Users of FSDP2 with ``MixedPrecisionPolicy(reduce_dtype=torch.bfloat16)``
report accuracy that falls as ranks are added. :func:`reduce_scatter_scaling`
measures it without processes: W virtual ranks (row callables, O(N) memory)
hold gradient-like contributions, the reduce-scatter is emulated in NCCL's
ring order (bfloat16 additions at every hop, ncclAvg's multiplication by
fl(1/W), as FSDP2's ReduceOp.AVG runs on NCCL) and, for comparison, with
float32 accumulation rounded once, and the referee
(:func:`ddplab.numerics.measure`) sets each result against the exact mean.

The error is reported as a multiple of the rigorous bound γ_d·Σ|x_r| where
that bound is finite, and of Higham & Mary's probabilistic bound where it
is not (bfloat16's γ_d is infinite once d·u >= 1, about W >= 255 here; the
probabilistic statement holds with the confidence recorded beside it), and
in absolute and RMS terms.

Example::

    >>> recs = reduce_scatter_scaling(world_sizes=(2, 64, 1024), numel=1 << 14)
    >>> ax = plot_scaling(recs)
"""
from __future__ import annotations

from typing import Sequence

import torch

from ddplab.numerics import as_contributions, float_format, measure, parse_dtype, reduce_scatter
from ddplab.numerics.orders import default_averaging
from ddplab.records import record

__all__ = ["WORLD_SIZES", "STUDY_METRICS", "gradient_like", "reduce_scatter_scaling", "plot_scaling"]

#: The virtual world sizes of the study: powers of two, and both sides of bfloat16's bound limit.
WORLD_SIZES = (2, 4, 8, 16, 32, 64, 128, 254, 255, 256, 512, 1024)
#: What the study records per (W, accumulation), from the referee's measurements.
STUDY_METRICS = ("bound_ratio", "max_bound_ratio", "prob_bound_ratio", "max_abs_error", "rms_abs_error",
                 "max_rel_error", "rms_rel_error", "mean_ulp", "frac_correctly_rounded")


def gradient_like(world_size: int, numel: int, dtype=torch.bfloat16, seed: int = 0):
    """W ranks' gradients of one parameter: a common mean plus per-rank noise, ``x_r = m + z_r``.

    ``m`` and ``z_r`` are standard normal per element (seeded from ``seed``
    and the rank), rounded to ``dtype`` once. A row callable: each rank's
    row is generated when asked, so W=1024 never holds W*N values.
    """
    dtype = parse_dtype(dtype)

    def row(rank: int) -> torch.Tensor:
        mean = torch.randn(numel, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
        noise = torch.randn(numel, generator=torch.Generator().manual_seed(seed * 1_000_003 + 1 + rank),
                            dtype=torch.float64)
        return (mean + noise).to(dtype)

    return as_contributions(row, world_size=world_size, kind="rows", numel=numel, dtype=dtype)


def reduce_scatter_scaling(world_sizes: Sequence[int] = WORLD_SIZES, numel: int = 1 << 14, *,
                           dtype=torch.bfloat16, order: str = "nccl_ring", op: str = "avg",
                           accumulations: Sequence = (None, torch.float32), seed: int = 0) -> list[dict]:
    """Tidy records of a ``dtype`` reduce-scatter's error against the exact result, per W and accumulation.

    For each W (N = ``numel`` rounded up to a multiple of W) and each entry
    of ``accumulations`` (None: every addition in ``dtype``; a dtype: added
    in it and rounded once), the emulated reduce-scatter of
    :func:`gradient_like` contributions is measured by the referee. Records
    (``step`` None, ``rank`` None): the :data:`STUDY_METRICS`, where
    ``bound_ratio`` is ``max_bound_ratio`` when the rigorous bound is finite
    and ``prob_bound_ratio`` otherwise; labels ``world_size``,
    ``accumulate`` (the dtype's name), ``bound`` ("rigorous" or
    "probabilistic"), ``prob_confidence``, ``order``, ``op``, ``averaging``,
    ``dtype``, ``numel``, ``verdict`` and ``evidence``.
    """
    dtype = parse_dtype(dtype)
    sizes = [int(w) for w in world_sizes]
    if not sizes or any(w < 2 for w in sizes):
        raise ValueError(f"world_sizes must be W >= 2, got {list(world_sizes)}")
    if isinstance(numel, bool) or not isinstance(numel, int) or numel < 1:
        raise ValueError(f"numel must be a positive int, got {numel!r}")
    accs = [None if a is None else parse_dtype(a) for a in accumulations]
    averaging = default_averaging(order) if op == "avg" and order != "exact" else None
    reduce_scatter(torch.zeros(2, 2, dtype=dtype), order, op=op, averaging=averaging)   # bad order/op: ValueError now
    out = []
    for w in sizes:
        n = -(-numel // w) * w
        c = gradient_like(w, n, dtype, seed)
        for acc in accs:
            result = reduce_scatter(c, order, op=op, averaging=averaging, accumulate=acc)
            m = measure(result, c, order, op=op, averaging=averaging, accumulate=acc, expected=result,
                        bitwise=True)
            rigorous = bool(m["bound_finite"])
            values = {metric: m[metric] for metric in STUDY_METRICS if metric != "bound_ratio"}
            values["bound_ratio"] = m["max_bound_ratio"] if rigorous else m["prob_bound_ratio"]
            labels = dict(world_size=w, accumulate=float_format(acc or dtype).name,
                          bound="rigorous" if rigorous else "probabilistic",
                          prob_confidence=float(m["prob_confidence"]), order=order, op=op,
                          averaging=averaging, dtype=float_format(dtype).name, numel=n,
                          verdict=m["classification"], evidence=m["evidence"])
            out.extend(record(metric, values[metric], **labels) for metric in STUDY_METRICS)
    return out


def plot_scaling(records, ax=None, *, metric: str = "bound_ratio"):
    """Draw ``metric`` against W, one line per accumulation dtype; return the Axes.

    ``records``: the list or DataFrame :func:`reduce_scatter_scaling`
    returns. For ``bound_ratio``, filled markers are multiples of the
    rigorous bound, hollow ones of the probabilistic bound, and the line at
    1 is the bound itself.
    """
    import matplotlib.pyplot as plt
    import pandas as pd

    from ddplab.plots import select, theme
    from ddplab.records import to_frame

    frame = records if isinstance(records, pd.DataFrame) else to_frame(records)
    data = select(frame, metric)
    with theme():
        if ax is None:
            _, ax = plt.subplots(figsize=(6.4, 3.6))
        for k, (acc, rows) in enumerate(sorted(data.groupby("accumulate"), key=lambda kv: kv[0])):
            rows = rows.sort_values("world_size")
            color = f"C{k}"
            ax.plot([], [], color=color, label=f"{acc} accumulation")
            for kind, fill, style in (("rigorous", color, "-"), ("probabilistic", "none", ":")):
                # Multiples of two different bounds are not one curve: no line across the switch.
                part = rows[rows["bound"] == kind] if metric == "bound_ratio" else rows
                ax.plot(part["world_size"], part["value"], color=color, linestyle=style, marker="o",
                        markerfacecolor=fill)
                if metric != "bound_ratio":
                    break
        if metric == "bound_ratio":
            ax.plot([], [], color="0.3", marker="o", linestyle="-", label="vs the rigorous bound")
            ax.plot([], [], color="0.3", marker="o", markerfacecolor="none", linestyle=":",
                    label="vs the probabilistic bound")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("W (virtual ranks)")
        if metric == "bound_ratio":
            ax.axhline(1.0, color="0.4", linestyle="--", linewidth=1)
            ax.set_ylabel("max |error| / bound")
        else:
            ax.set_ylabel(metric.replace("_", " "))
        dtype = data["dtype"].iloc[0]
        ax.set_title(f"{dtype} reduce-scatter, {data['order'].iloc[0]} order, against the exact mean",
                     fontsize=10)
        ax.legend(fontsize=8)
    return ax

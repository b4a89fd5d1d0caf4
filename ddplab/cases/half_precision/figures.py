"""Case 02's tables and figures, all read from the tidy records."""
from __future__ import annotations

import math

from ddplab.cases.half_precision.verdict import (REPORT_NORM_AFTER, REPORT_NORM_BEFORE,
                                                 REPORT_TORCH_VERSION, lane_norms, reference_norm,
                                                 torch_norm, ulps_from_true)
from ddplab.cases.half_precision.worker import STAGES
from ddplab.plots import facet_axes, own_axes, series_lines
from ddplab.records import label_values, value_of, where

__all__ = ["fingerprint_table", "norm_table", "versions_markdown", "plot_lanes",
           "plot_running_sum", "plot_fingerprints"]

STAGE_NAMES = {"before": "before", "compile": "after compile", "ddp": "after DDP"}


def fingerprint_table(records):
    """Per dtype, rank and stage: tensors whose bits changed, and tensors equal to rank 0's initial."""
    import pandas as pd

    keys = ["rank", "dtype", "stage"]
    table = where(records, "fingerprint_changed").groupby(keys)["value"].agg(changed="sum",
                                                                              tensors="count")
    table["equal to rank 0's initial"] = where(records, "matches_rank0_initial").groupby(keys)["value"].sum()
    table = table.reset_index().astype({"changed": int, "tensors": int,
                                        "equal to rank 0's initial": int})
    table["stage"] = pd.Categorical(table["stage"], categories=list(STAGES), ordered=True)
    return table.sort_values(["dtype", "rank", "stage"]).set_index(["dtype", "rank", "stage"])


def norm_table(records):
    """Every norm rank 0 computed of its initial weights on the CPU: a row per method, a column per dtype.

    Values are float64 copies of what was computed (float16 results are exact in them).
    """
    import pandas as pd

    norms = where(records, "norm", rank=0, stage="before")
    if "device" in norms:
        norms = norms[norms["device"].fillna("cpu") == "cpu"]
    rows = {}
    for method in ("torch.norm", "torch.linalg.vector_norm", "exact", "float64 accumulation",
                   "float32 accumulation"):
        sub = norms[norms["method"] == method]
        if len(sub):
            rows[method] = sub.set_index("dtype")["value"]
    lanes = norms[norms["method"] == "lanes"]
    for k in label_values(lanes, "lanes"):
        rows[f"K={int(k)} lanes"] = lanes[lanes["lanes"] == k].set_index("dtype")["value"]
    table = pd.DataFrame(rows).T
    table.index.name = "norm of rank 0's weights"
    table.columns.name = "dtype"
    return table


def versions_markdown(records) -> str:
    """Which torch kernel computes what: the report's numbers and the installed kernels, per dtype.

    The report's version is known only by what it printed; the installed
    version's kernels are measured. Each value is compared with the true norm
    (ulps of the weights' dtype, and relative) and with the K-lane models of
    the weights' dtype that give the same value.
    """
    lines = ["| torch | device | weights | torch.norm | true norm (weights built here) | error (ulps) | "
             "relative error | K-lane models giving the same |", "|---|---|---|---|---|---|---|---|"]
    true16 = reference_norm(records, "float16")
    rows = [(f"{REPORT_TORCH_VERSION} (the report, before wrapping)", "CPU", "float16",
             REPORT_NORM_BEFORE, true16),
            # The report's "after" norm ran on cuda:rank (the script's .to(rank)).
            (f"{REPORT_TORCH_VERSION} (the report, after .to(rank) and wrapping)", "CUDA", "float16",
             REPORT_NORM_AFTER, true16)]
    for dtype in label_values(records, "dtype", "norm", method="lanes"):
        versions = label_values(records, "torch_version", "norm", method="torch.norm", dtype=dtype)
        for device in ("cpu", "cuda"):
            own = torch_norm(records, dtype, device=device)
            if not math.isnan(own):
                rows.append((f"{versions[0] if versions else '?'} (installed)", device.upper(), dtype,
                             own, reference_norm(records, dtype)))
    for version, device, dtype, value, true_norm in rows:
        same = [k for k, v in lane_norms(records, dtype).items() if v == value]
        lines.append(f"| {version} | {device} | {dtype} | {value!r} | {true_norm:.6f} | "
                     f"{ulps_from_true(value, true_norm, dtype)} | {(value - true_norm) / true_norm:+.2e} | "
                     f"{', '.join(f'K={k}' for k in same) or 'none'} |")
    return "\n".join(lines) + "\n"


def _lanes_panel(ax, records, dtype: str) -> None:
    lanes = lane_norms(records, dtype)
    ks, values = list(lanes), list(lanes.values())
    ax.plot(ks, values, "o-", color="C0", label=f"K-lane {dtype} accumulator model")
    for k, v in lanes.items():
        ax.annotate(repr(v), (k, v), textcoords="offset points", xytext=(4, -12), fontsize=7)
    true_norm = reference_norm(records, dtype)
    own = torch_norm(records, dtype)
    versions = label_values(records, "torch_version", "norm", method="torch.norm", dtype=dtype)
    ax.axhline(true_norm, color="C2", lw=1.2, label=f"true norm {true_norm:.4f}")
    ax.axhline(own, color="C1", lw=1.2, ls="--",
               label=f"torch.norm, CPU, torch {versions[0] if versions else '?'}: {own!r}")
    cuda = torch_norm(records, dtype, device="cuda")
    if not math.isnan(cuda):
        ax.axhline(cuda, color="C4", lw=1.0, ls=":", label=f"torch.norm, CUDA: {cuda!r}")
    if dtype == "float16":
        ax.axhline(REPORT_NORM_BEFORE, color="C3", lw=1.0, ls=":",
                   label=f"report (torch {REPORT_TORCH_VERSION}, CPU): {REPORT_NORM_BEFORE}")
    ax.set_xscale("log", base=2)
    ax.set_xticks(ks, [str(k) for k in ks])
    ax.set_xlabel("partial accumulators K (lanes)")
    ax.set_ylabel("norm")
    ax.set_ylim(0, max(values + [true_norm, own]) * 1.15)
    ax.set_title(f"{dtype} weights")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2, frameon=False)


def plot_lanes(records, params: dict, ax=None):
    """Norm against the number of lanes K (log2 axis), with the true norm and torch's own.

    One panel per weight dtype; with ``ax``, the float16 panel only.
    """
    if ax is not None:
        _lanes_panel(ax, records, "float16")
        return ax.figure
    dtypes = [d for d in params["dtypes"] if len(where(records, "norm", method="lanes", dtype=d))]
    fig, axes = facet_axes(len(dtypes), width=5.2, height=3.6)
    for panel, dtype in zip(axes, dtypes):
        _lanes_panel(panel, records, dtype)
    fig.tight_layout()
    return fig


def plot_running_sum(records, params: dict, ax=None):
    """One accumulator adding the squares in order: float16 stalls, float32 keeps growing (log-log)."""
    fig, ax = own_axes(ax, (6.4, 3.6))
    for accumulator, color in (("float16", "C3"), ("float32", "C0")):
        trace = where(records, "running_sum_of_squares", dtype="float16", accumulator=accumulator,
                      lanes=1).sort_values("step")
        series_lines(ax, trace["step"], trace["value"], color=color, label=f"{accumulator} accumulator")
    ax.set_xscale("log")
    ax.set_yscale("log")
    ax.set_xlabel("elements accumulated")
    ax.set_ylabel("running sum of squares")
    ax.set_title("One accumulator, elements added in order: float16 stops growing")
    stall = value_of(records, "stall_element", dtype="float16")
    trace = where(records, "running_sum_of_squares", dtype="float16", accumulator="float16")
    if not math.isnan(stall) and len(trace):
        level = float(trace.sort_values("step")["value"].iloc[-1])
        ax.axhline(level, color="grey", lw=0.8, ls="--")
        ax.axvline(stall, color="grey", lw=0.8, ls=":")
        ax.annotate(f"stalls at {level!r} after element {int(stall)}:\nlater squares are below "
                    f"half an ulp of {level!r}", xy=(stall, level), xytext=(0.03, 0.8),
                    textcoords="axes fraction", fontsize=8,
                    arrowprops=dict(arrowstyle="->", color="grey"))
    ax.legend(fontsize=8, loc="lower right")
    return fig


def _fingerprint_panel(ax, table, dtype: str, ranks: list) -> None:
    import numpy as np
    from matplotlib.colors import ListedColormap

    sub = table[table["dtype"] == dtype]
    grid = np.zeros((len(ranks), len(STAGES)))
    for i, rank in enumerate(ranks):
        for j, stage in enumerate(STAGES):
            row = sub[(sub["rank"] == rank) & (sub["stage"] == stage)]
            if not len(row):
                ax.text(j, i, "—", ha="center", va="center", fontsize=8)
                continue
            changed, tensors = int(row["changed"].iloc[0]), int(row["tensors"].iloc[0])
            same0 = int(row["equal to rank 0's initial"].iloc[0]) == tensors
            grid[i, j] = 1.0 if changed else 0.0
            ax.text(j, i, (f"{changed}/{tensors} changed" if changed else "no bit changed")
                    + ("\n= rank 0's" if same0 else "\n≠ rank 0's"), ha="center", va="center",
                    fontsize=8)
    ax.imshow(grid, cmap=ListedColormap(["#cfe8cf", "#f4b6b6"]), vmin=0, vmax=1, aspect="auto")
    ax.set_xticks(range(len(STAGES)), [STAGE_NAMES[s] for s in STAGES])
    ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
    ax.grid(False)
    ax.set_title(dtype)


def plot_fingerprints(records, params: dict, ax=None):
    """Rank × stage grid per dtype: did the weights' bits change, and whose weights are they now?

    One panel per dtype; with ``ax``, the float16 panel only.
    """
    table = fingerprint_table(records).reset_index()
    ranks = sorted(table["rank"].unique())
    if ax is not None:
        _fingerprint_panel(ax, table, "float16", ranks)
        return ax.figure
    dtypes = list(dict.fromkeys(table["dtype"]))
    fig, axes = facet_axes(len(dtypes), width=3.4, height=0.9 + 0.55 * len(ranks))
    for panel, dtype in zip(axes, dtypes):
        _fingerprint_panel(panel, table, dtype, ranks)
    init = "same seed on every rank" if params["same_init"] else "seed + rank on each rank"
    fig.suptitle(f"Weight fingerprints (sha256 of the bytes) against each rank's initial weights "
                 f"— {init}", y=1.02, fontsize=10)
    fig.tight_layout()
    return fig

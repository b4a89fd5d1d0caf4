"""Case 04's tables and figures, all read from the tidy records.

Figures with one panel per mode draw only the as_ready panel (the report's
hypothesis) when given ``ax``.
"""
from __future__ import annotations

from ddplab.cases.allreduce_correctness.verdict import REPORT_MAX_DIFF, mode_facts, modes_run
from ddplab.cases.allreduce_correctness.worker import MODES, VARIABLES, WEIGHT_DECAY
from ddplab.formatting import fmt
from ddplab.plots import draw_zero_floor, facet_axes, legend_outside, log_floor, own_axes, series_lines
from ddplab.records import label_values, where

__all__ = ["summary_table", "pairing_table", "plot_errors_vs_bound", "plot_bound_ratio",
           "plot_first_failure", "plot_pairing", "plot_signature"]

#: The panel a one-axes caller gets from a per-mode figure.
REPRESENTATIVE_MODE = "as_ready"


def summary_table(records, params: dict | None = None):
    """One row per mode: the report's check, ddplab's classification, the ledger, the signature."""
    import pandas as pd

    rows = []
    for mode in modes_run(records):
        f = mode_facts(records, mode)
        offsets = ", ".join(f"{k}×1e-3: {n}" if k else f"not constant: {n}"
                            for k, n in f.offsets)
        rows.append({
            "mode": mode,
            "results checked": f.results,
            "failed the report's check": f.failed,
            "first failing step": "never" if f.first_failing_step is None else f.first_failing_step,
            "largest |add_n - reduced|": f"{f.max_diff:.9g}",
            # Seven digits: a ratio of 0.9999996 must not print as 1.
            "largest error / rounding bound": f"{f.max_ratio:.7g}",
            "classification": f.classification,
            "evidence": f.evidence,
            "bit for bit gloo's emulated ring": f"{f.matches_order} of {f.results}",
            "mispaired collectives (ledger)": f.mismatched_collectives,
            "failing errors as multiples of 1e-3": offsets or "—",
            "steps × variables where ranks disagree": f"{f.ranks_disagree} of {f.agree_checks}",
        })
    return pd.DataFrame(rows).set_index("mode")


def pairing_table(records, step: int | None = None):
    """The ledger's pairing: per mode and collective (seq within the step), each rank's variable.

    Read from the ``combined`` label of rank 0's ``collective_mismatch``
    records (the ledger's cross-checked report is the same on every rank).
    ``step`` defaults to the first recorded step; ``same every step`` says
    whether every other step paired the same tensors.
    """
    import pandas as pd

    rows = where(records, "collective_mismatch")
    if rows.empty:
        raise ValueError("the records hold no collective_mismatch rows (no ledger)")
    step = int(rows["step"].min()) if step is None else step
    out = []
    for mode in [m for m in MODES if m in set(rows["mode"])]:
        sub = rows[rows["mode"] == mode].sort_values("seq")
        # Each step's pairing as one tuple of (seq, combined): equal tuples, equal pairings.
        same = sub.groupby("step")["combined"].agg(tuple).nunique() == 1
        for _, rec in sub[sub["step"] == step].iterrows():
            row = {"mode": mode, "collective": int(rec["seq"])}
            row.update({f"rank {r}": v for r, v in (p.split(":", 1) for p in rec["combined"].split(" + "))})
            row.update({"mispaired": bool(rec["value"] == 1), "same every step": bool(same)})
            out.append(row)
    table = pd.DataFrame(out).set_index(["mode", "collective"])
    table.attrs["step"] = step
    return table


# --------------------------------------------------------------------------- per-mode panels


def _panels(records, metric: str, ax):
    """``(figure, {mode: ax}, per-(mode, variable, step) maxima over ranks)`` for a per-mode figure."""
    rows = where(records, metric)
    if rows.empty:
        raise ValueError(f"the records hold no {metric!r} rows")
    data = rows.groupby(["mode", "variable", "step"])["value"].max().reset_index().astype({"step": int})
    modes = [m for m in MODES if m in set(data["mode"])]
    if ax is not None:
        mode = REPRESENTATIVE_MODE if REPRESENTATIVE_MODE in modes else modes[0]
        return ax.figure, {mode: ax}, data
    fig, axes = facet_axes(len(modes), width=4.6, height=3.6, sharey=True)
    return fig, dict(zip(modes, axes)), data


def _variable_lines(ax, data, mode: str, floor: float) -> None:
    import seaborn as sns
    from matplotlib.ticker import MaxNLocator

    colors = dict(zip(VARIABLES, sns.color_palette("tab10", n_colors=len(VARIABLES))))
    part = data[data["mode"] == mode]
    for name in VARIABLES:
        rows = part[part["variable"] == name].sort_values("step")
        if len(rows):
            series_lines(ax, rows["step"], rows["value"], floor=floor, label=name, color=colors[name],
                         marker="o", ms=2.5, lw=1.4)
    ax.set_yscale("log")
    ax.set_title(mode)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def _finish(fig, axes: dict, ax, ylabel: str, title: str):
    next(iter(axes.values())).set_ylabel(ylabel)
    if ax is not None:  # one panel in someone else's figure: its own legend, no title
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0), frameon=False)
        return fig
    legend_outside(fig)
    fig.suptitle(title, y=1.02)
    fig.tight_layout()
    return fig


def plot_errors_vs_bound(records, params: dict, ax=None):
    """Max error per variable per step (log), the rounding bound, the report's tolerance and 1e-3.

    Error: the largest |reduced − exact sum| over elements and ranks. Bound:
    the largest per-element rounding bound of gloo's ring over the
    variables. Exact zeros are drawn on a dashed floor line.
    """
    fig, axes, errors = _panels(records, "max_abs_error", ax)
    bounds = where(records, "rounding_bound").groupby(["mode", "step"])["value"].max()
    floor = log_floor(errors["value"])
    for mode, panel in axes.items():
        _variable_lines(panel, errors, mode, floor)
        b = bounds.loc[mode].sort_index()
        panel.plot(b.index.astype(int), b.values, color="black", ls="--", lw=1.2,
                   label="rounding bound (largest, gloo ring)")
        panel.axhline(params["tolerance"], color="0.45", ls=":", lw=1.2,
                      label=f"the report's tolerance {fmt(params['tolerance'])}")
        panel.axhline(WEIGHT_DECAY, color="tab:red", ls="-.", lw=0.9, alpha=0.6,
                      label="1e-3: one weight-decay gradient")
        draw_zero_floor(panel, floor, "exact zero")
    return _finish(fig, axes, ax, "max |reduced − exact sum|",
                   "Largest error per variable and step, against the rounding bound")


def plot_bound_ratio(records, params: dict, ax=None):
    """Error / rounding bound per variable per step (largest over elements and ranks), log scale."""
    fig, axes, ratios = _panels(records, "max_bound_ratio", ax)
    floor = log_floor(ratios["value"])
    for mode, panel in axes.items():
        _variable_lines(panel, ratios, mode, floor)
        panel.axhline(1.0, color="black", ls="--", lw=1.2, label="1: what rounding can explain")
        panel.axhspan(floor, 1.0, color="tab:green", alpha=0.06)
        draw_zero_floor(panel, floor, "exact zero")
    return _finish(fig, axes, ax, "error / rounding bound",
                   "Error in multiples of the rounding bound (≤ 1: rounding can explain it)")


def _pairing_panel(ax, table, mode: str) -> None:
    import matplotlib.pyplot as plt

    sub = table.loc[mode]
    ranks = [c for c in table.columns if c.startswith("rank ")]
    ax.set_xlim(0, len(ranks))
    ax.set_ylim(len(sub), 0)
    for i, (_, row) in enumerate(sub.iterrows()):
        color = "#f4b6b6" if row["mispaired"] else "#cfe8cf"
        for j, col in enumerate(ranks):
            ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=color, edgecolor="white", lw=2))
            ax.text(j + 0.5, i + 0.5, row[col], ha="center", va="center", fontsize=8.5)
    ax.set_xticks([j + 0.5 for j in range(len(ranks))], ranks)
    ax.set_yticks([i + 0.5 for i in range(len(sub))], [f"#{s}" for s in sub.index])
    ax.tick_params(length=0)
    ax.grid(False)
    same = "same at every step" if sub["same every step"].all() else "differs between steps"
    ax.set_title(f"{mode}\n({same})", fontsize=10)
    ax.set_ylabel("collective (issue order in the step)")


def plot_pairing(records, params: dict, ax=None):
    """The ledger's pairing table: per mode, which variable each rank reduced in each collective."""
    table = pairing_table(records)
    modes = list(dict.fromkeys(table.index.get_level_values("mode")))
    if ax is not None:
        _pairing_panel(ax, table, REPRESENTATIVE_MODE if REPRESENTATIVE_MODE in modes else modes[0])
        return ax.figure
    ranks = sum(c.startswith("rank ") for c in table.columns)
    fig, axes = facet_axes(len(modes), width=1.3 * ranks + 0.9, height=3.4)
    for panel, mode in zip(axes, modes):
        _pairing_panel(panel, table, mode)
    fig.suptitle(f"The ledger: which variable each rank reduced (step {table.attrs['step']}; "
                 f"red: different tensors combined)", y=1.02)
    fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- one-panel figures


def plot_first_failure(records, params: dict, ax=None):
    """Per mode: the first step failing the report's check, and the first beyond the rounding bound."""
    facts = [mode_facts(records, m) for m in modes_run(records)]
    composed = ax is not None
    fig, ax = own_axes(ax, (7.5, 0.9 + 0.75 * len(facts)))
    steps = max([f.steps for f in facts] + [1])
    bars = (("first_failing_step", "failed", -0.18, "the report's check fails", "tab:red"),
            ("first_outside_step", "outside_bound", 0.18, "beyond the rounding bound", "tab:purple"))
    labelled = set()
    for i, f in enumerate(facts):
        for key, count, offset, label, color in bars:
            first, y = getattr(f, key), i + offset
            if first is None:
                ax.barh(y, steps, height=0.32, color="none", edgecolor="0.6", hatch="//",
                        label=None if "never" in labelled else "never")
                labelled.add("never")
                ax.text(steps, y, f"  never in {f.steps} steps", va="center", fontsize=8)
                continue
            width = max(first, 0.01 * steps)  # a failure at step 0 still gets a visible sliver
            ax.barh(y, width, height=0.32, color=color, label=None if label in labelled else label)
            labelled.add(label)
            ax.text(width, y, f"  step {first} ({getattr(f, count)} of {f.results} results)", va="center",
                    fontsize=8)
    ax.set_yticks(range(len(facts)), [f.mode for f in facts])
    ax.invert_yaxis()
    ax.set_xlim(0, steps * 1.55)
    ax.set_xlabel("step")
    ax.legend(loc="lower right", fontsize=8, frameon=False)
    ax.set_title("First failing step per mode")
    if not composed:
        fig.tight_layout()
    return fig


def plot_signature(records, params: dict, ax=None):
    """Failing results' largest |add_n − reduced| per mode, against the report's 0.00100000016.

    Colour: whether the difference is the same multiple of 1e-3 at every
    element (a weight-decay term missing) or varies (another tensor summed in).
    """
    import numpy as np

    keys = ["mode", "step", "rank", "variable"]
    merged = (where(records, "report_max_diff").set_index(keys)["value"].rename("diff").to_frame()
              .join(where(records, "report_check_pass").set_index(keys)["value"].rename("pass"))
              .join(where(records, "constant_offset_wd").set_index(keys)["value"].rename("offset"))
              .reset_index())
    failing = merged[merged["pass"] == 0]
    modes = [m for m in MODES if m in label_values(merged, "mode")]
    tol = params["tolerance"]
    rng = np.random.default_rng(0)  # jitter only: where a dot sits sideways means nothing
    composed = ax is not None
    fig, ax = own_axes(ax, (7.5, 3.8))
    for i, mode in enumerate(modes):
        part = failing[failing["mode"] == mode]
        if part.empty:
            ax.text(i, tol, "no failure", ha="center", va="bottom", fontsize=8, color="0.4")
            continue
        x = i + rng.uniform(-0.25, 0.25, len(part))
        constant = (part["offset"] != 0).values
        for mask, color, label in ((~constant, "tab:blue", "varies by element (another tensor summed in)"),
                                   (constant, "tab:red", "k·1e-3 at every element (a weight-decay term missing)")):
            if mask.any():
                ax.scatter(x[mask], part["diff"].values[mask], s=9, color=color, alpha=0.6, label=label)
    ax.axhline(REPORT_MAX_DIFF, color="black", ls="--", lw=1.1, label=f"the report's {REPORT_MAX_DIFF:.9g}")
    ax.axhline(tol, color="0.45", ls=":", lw=1.1, label=f"the report's tolerance {fmt(tol)}")
    ax.set_yscale("log")
    ax.set_xticks(range(len(modes)), modes)
    ax.set_xlim(-0.6, len(modes) - 0.4)
    ax.set_ylabel("largest |add_n − reduced| (failing results)")
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), loc="upper left", bbox_to_anchor=(1.0, 0.95),
              frameon=False, fontsize=8)
    ax.set_title("Does the error carry the report's signature?")
    if not composed:
        fig.tight_layout()
    return fig


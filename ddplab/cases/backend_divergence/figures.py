"""Case 01's figures, all read from the tidy records: a panel per world size, a series per run.

Twins share a colour (a run, its repeat and its re-placed copy); the line
style says which twin. On log axes exact zeros -- bitwise equality, the most
important value here -- are drawn as open circles on a labelled floor line.
"""
from __future__ import annotations

from ddplab.cases.backend_divergence.runs import REFERENCE, REVERSED_SUFFIX, base_run, kind_of
from ddplab.cases.backend_divergence.verdict import loss_gaps
from ddplab.plots import draw_zero_floor, facet_axes, legend_outside, log_floor, select, series_lines, theme

__all__ = ["plot_param_distance", "plot_loss_gap", "plot_bucket_errors", "plot_loss_curves",
           "plot_grad_norms"]

#: One colour per order in every figure, whichever runs a figure shows.
_COLORED = ("gloo", "nccl_ring", "nccl_tree", "reproducible", "gloo_ring", "sequential", "pairwise",
            "nccl_live_ring", "nccl_live_tree")
#: Line style and marker per kind of run.
_KIND_STYLE = {"order": ("-", "o"), "repeat": ((0, (4, 3)), "x"), "placement": (":", "s"),
               "reproducible": ("-", "D")}


def _style(run: str) -> dict:
    import seaborn as sns

    palette = sns.color_palette("tab10", n_colors=10)
    base = base_run(run)
    color = (0.1, 0.1, 0.1) if base == REFERENCE else (
        palette[_COLORED.index(base)] if base in _COLORED else (0.6, 0.6, 0.6))
    ls, marker = _KIND_STYLE["placement" if run.endswith(REVERSED_SUFFIX) else kind_of(run)]
    return dict(color=color, ls=ls, marker=marker)


def _per_run(records, metric: str, exclude=()):
    rows = select(records, metric)
    rows = rows[((rows["rank"] == 0) | rows["rank"].isna()) & ~rows["run"].isin(list(exclude))]
    return rows[["world_size", "step", "run", "value"]].astype({"value": float})


def _facets(frame, *, ylabel: str, title: str, ax=None, log: bool = False,
            zero_label: str | None = None, dodge: bool = False):
    """One panel per world size (with ``ax``: the largest only), one series per run.

    ``zero_label``: exact zeros go on a floor line below every positive
    value, labelled so. ``dodge``: markers only, shifted a little per run
    (sparse series whose points would hide each other).
    """
    floor = log_floor(frame["value"]) if zero_label is not None else None
    sizes = sorted(int(w) for w in frame["world_size"].unique())
    runs = sorted(frame["run"].unique())
    if ax is None:
        fig, axes = facet_axes(len(sizes), width=5.0, height=3.6, sharey=True)
    else:
        fig, axes, sizes = ax.figure, [ax], sizes[-1:]
    with theme():
        for panel, w in zip(axes, sizes):
            part = frame[frame["world_size"] == w]
            for i, run in enumerate(runs):
                rows = part[part["run"] == run].sort_values("step")
                style = _style(run)
                shift = (i - (len(runs) - 1) / 2) * 0.6 / len(runs) if dodge else 0.0
                if dodge:
                    style.pop("ls")
                series_lines(panel, rows["step"] + shift, rows["value"], floor=floor, label=run,
                             markers_only=dodge, ms=4.5 if dodge else 3, **style)
            if floor is not None:
                draw_zero_floor(panel, floor, zero_label)
            if log:
                panel.set_yscale("log")
            panel.set_title(f"W = {w}")
            panel.set_xlabel("step")
            panel.xaxis.get_major_locator().set_params(integer=True)
        axes[0].set_ylabel(ylabel)
        if ax is None:
            legend_outside(fig, axes)
            fig.suptitle(title, y=1.02)
            fig.tight_layout()
        else:
            ax.legend(fontsize=7)
    return fig


def plot_param_distance(records, params: dict, ax=None):
    """‖θ_run − θ_exact‖₂ after each step's update, log scale; exact zeros on the floor line."""
    return _facets(_per_run(records, "param_distance", exclude=[REFERENCE]), ax=ax, log=True,
                   ylabel="‖θ − θ_exact‖₂ after the update",
                   zero_label="0: bitwise the exact run's parameters",
                   title="Parameter distance from the exact-reduction run")


def plot_loss_gap(records, params: dict, ax=None):
    """|loss − exact-run loss| per step on a log scale; exact zeros on the floor line."""
    return _facets(loss_gaps(records), ax=ax, log=True, dodge=True,
                   ylabel="|loss − loss of the exact run|",
                   zero_label="0: bitwise the exact run's loss",
                   title="How far each run's logged loss is from the exact-reduction run")


def plot_loss_curves(records, params: dict, ax=None):
    """The report's picture: the logged loss per step, one line per run, a panel per W."""
    return _facets(_per_run(records, "loss"), ax=ax, ylabel="loss (all-reduced, /W)",
                   title="Training loss per run: the runs coincide at this scale")


def plot_grad_norms(records, params: dict, ax=None):
    """2-norm of the reduced gradient per step, one line per run, a panel per W."""
    return _facets(_per_run(records, "grad_norm"), ax=ax, ylabel="‖reduced gradient‖₂",
                   title="Gradient norms per run")


#: The audit's panels of the bucket figure: metric, colour-bar label, colour map.
_AUDIT_PANELS = (("mean_ulp", "mean |ulp error| per element", "rocket_r"),
                 ("max_bound_ratio", "largest error / rounding bound", "crest"))


def _audit_heatmap(ax, rows, w: int, run: str, metric: str, label: str, cmap: str) -> None:
    import numpy as np
    import seaborn as sns

    table = rows[(rows["world_size"] == w) & (rows["metric"] == metric)].pivot_table(
        index="bucket", columns="step", values="value", aggfunc="max").astype(float)
    top = float(np.nanmax(table.values)) if table.size else 0.0
    # At least 1 (one ulp; the bound itself) so that all-zero panels read as zero.
    sns.heatmap(table, ax=ax, cmap=cmap, vmin=0, vmax=max(1.0, top), annot=True, fmt=".2f",
                annot_kws={"fontsize": 7}, cbar_kws={"label": label.split(" per")[0]})
    ax.set_title(f"W = {w}, {run}: {label}")
    ax.set_xlabel("step")
    ax.set_ylabel("bucket")


def plot_bucket_errors(records, params: dict, ax=None, run: str = "gloo"):
    """The audit of ``run`` (live gloo): per bucket and step, its mean ulp error and error/bound.

    Two heatmaps per world size (with ``ax``: the error/bound of the largest).
    Step 0 has one bucket: DDP starts with every parameter in one bucket and
    re-buckets after the first backward. The audit measures each bucket on
    one rank in rotation: whichever emitted it is read.
    """
    import matplotlib.pyplot as plt

    rows = select(records, [m for m, *_ in _AUDIT_PANELS], run=run)
    sizes = sorted(int(w) for w in rows["world_size"].unique())
    with theme():
        if ax is not None:
            _audit_heatmap(ax, rows, sizes[-1], run, *_AUDIT_PANELS[1])
            return ax.figure
        n_steps, n_buckets = rows["step"].nunique(), rows["bucket"].nunique()
        fig, axes = plt.subplots(2 * len(sizes), 1, squeeze=False,
                                 figsize=(min(15, 3 + 0.5 * n_steps), (0.42 * n_buckets + 0.9) * 2 * len(sizes)))
        for i, w in enumerate(sizes):
            for j, panel in enumerate(_AUDIT_PANELS):
                _audit_heatmap(axes[2 * i + j, 0], rows, w, run, *panel)
        fig.tight_layout()
    return fig

"""Figures of a comparison, drawn from its records alone.

Every function takes the comparison's tidy records (``Comparison.records``)
and an optional matplotlib ``ax``; it draws there (or on a new figure) and
returns the Figure. Nothing is shown implicitly (:func:`ddplab.plots.show`
displays one).

* :func:`loss_curves` -- the loss per step of every configuration, the reference and the float64 truth;
* :func:`grad_norms` -- the gradient norm per step, same runs;
* :func:`deviation_over_steps` -- each configuration's largest deviation per
  step, in multiples of its rounding band, with the referee's two margins;
* :func:`deviation_heatmap` -- step × parameter deviation of one configuration, first divergence marked;
* :func:`finding_figure` -- what the localization found, shown: the
  configuration's gradient against the reference's with the fitted factor,
  or the difference against the missing pieces' gradient.
"""
from __future__ import annotations

import math

import numpy as np

from ddplab.compare import referee as _referee
from ddplab.plots import own_axes, theme
from ddplab.records import where

__all__ = ["loss_curves", "grad_norms", "deviation_over_steps", "deviation_heatmap", "finding_figure",
           "figures", "REFERENCE_RUNS"]

#: How the single-process runs are drawn: black, the truth dashed.
REFERENCE_RUNS = {"reference": dict(color="black", lw=2.2, ls="-"),
                  "truth": dict(color="0.35", lw=1.6, ls="--")}


def _steps_axis(ax) -> None:
    from matplotlib.ticker import MaxNLocator
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("step")


def _need(frame, metric: str, **labels):
    rows = where(frame, metric, **labels)
    if rows.empty:
        raise ValueError(f"no {metric!r} records" + (f" for {labels}" if labels else "") +
                         f"; metrics present: {sorted(frame['metric'].dropna().unique().tolist())}")
    return rows


def _order(labels) -> list[str]:
    """Reference runs first (truth, reference, matched references), then configurations in order seen."""
    labels = list(dict.fromkeys(labels))
    refs = [l for l in ("truth", "reference") if l in labels]
    matched = [l for l in labels if l.startswith("reference ")]
    return refs + matched + [l for l in labels if l not in refs and l not in matched]


def _style(label: str) -> dict:
    if label in REFERENCE_RUNS:
        return dict(REFERENCE_RUNS[label])
    if label.startswith("reference "):
        return dict(color="0.2", lw=1.4, ls=":")
    return dict(lw=1.4, marker="o", ms=3)


def _per_step(frame, metric: str, agg: str):
    rows = _need(frame, metric)
    return rows.groupby(["config", "step"], sort=False)["value"].agg(agg)


def _run_lines(table, ylabel: str, title: str, ax=None):
    """One line per run of a ``(config, step) -> value`` series, reference runs first."""
    with theme():
        fig, ax = own_axes(ax)
        for label in _order(table.index.get_level_values(0)):
            series = table.loc[label]
            ax.plot(series.index.astype(int), series.values, label=label, **_style(label))
        _steps_axis(ax)
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.legend(fontsize=7, loc="best")
    return fig


def loss_curves(records, ax=None):
    """The loss per step: every configuration, the reference and the truth.

    A configuration's loss is the mean over its ranks of each rank's loss
    on its share (the global batch's loss when the loss averages over its
    batch; a loss that sums shows up here as 1/W of the reference's).
    """
    return _run_lines(_per_step(records, "loss", "mean"), "loss (mean over ranks)", "Loss per step", ax)


def grad_norms(records, ax=None):
    """The norm of the gradient each run held at ``optimizer.step()`` (rank 0), per step."""
    rows = _need(records, "grad_norm")
    table = rows[rows["rank"] == 0].groupby(["config", "step"], sort=False)["value"].first()
    return _run_lines(table, "‖gradient‖₂ (rank 0)", "Gradient norm per step", ax)


def _configs(records) -> list[str]:
    status = where(records, "steps_completed")
    return list(dict.fromkeys(status["config"]))


def deviation_over_steps(records, ax=None):
    """Each configuration's largest deviation per step (× its rounding band), with the margins."""
    rows = _need(records, "deviation")
    rows = rows[(rows["rank"] == 0) & rows["config"].isin(_configs(records))]
    table = rows.groupby(["config", "step"], sort=False)["value"].max()
    with theme():
        fig, ax = own_axes(ax)
        floor = 1e-2
        for label in _order(table.index.get_level_values(0)):
            series = table.loc[label].clip(lower=floor)
            ax.plot(series.index.astype(int), series.values, label=label, **_style(label))
        ax.set_yscale("log")
        ax.axhline(1.0, color="0.5", lw=0.8)
        ax.axhline(_referee.ROUNDING_MARGIN, color="tab:green", ls="--", lw=1,
                   label=f"rounding margin ({_referee.ROUNDING_MARGIN:g})")
        ax.axhline(_referee.BUG_MARGIN, color="tab:red", ls="--", lw=1,
                   label=f"bug margin ({_referee.BUG_MARGIN:g})")
        _steps_axis(ax)
        ax.set_ylabel("max deviation (× rounding band)")
        ax.set_title("Distance from the float64 truth, in reference-rounding units")
        ax.legend(fontsize=7, loc="best")
    return fig


def deviation_heatmap(records, config: str, ax=None, *, quantity: str = "grad"):
    """Step × parameter deviation of ``config`` (``quantity`` "grad" or "param"), log colour,
    the first divergence boxed in red."""
    if quantity not in _referee.QUANTITIES:
        raise ValueError(f"quantity must be one of {_referee.QUANTITIES}, got {quantity!r}")
    rows = _need(records, "deviation", config=config, quantity=quantity)
    rows = rows[rows["rank"] == 0]
    params = list(dict.fromkeys(rows["param"]))
    params = [p for p in params if p != _referee.MODEL] + [_referee.MODEL]
    table = rows.pivot_table(index="param", columns="step", values="value", aggfunc="max").reindex(params)
    values = np.log10(table.to_numpy(dtype=float).clip(1e-2, 1e12))
    with theme():
        fig, ax = own_axes(ax, figsize=(min(12, 3 + 0.5 * table.shape[1]), 1.4 + 0.3 * table.shape[0]))
        vmax = max(math.log10(_referee.BUG_MARGIN) + 1, float(np.nanmax(values)))
        ax.grid(False)
        image = ax.imshow(values, aspect="auto", cmap="magma_r", vmin=-1, vmax=vmax, interpolation="nearest")
        bar = fig.colorbar(image, ax=ax)
        bar.set_label("log10 deviation (× band)")
        for margin, color in ((_referee.ROUNDING_MARGIN, "tab:green"), (_referee.BUG_MARGIN, "tab:red")):
            bar.ax.axhline(math.log10(margin), color=color, lw=2)
        ax.set_xticks(range(table.shape[1]), [str(int(s)) for s in table.columns])
        ax.set_yticks(range(table.shape[0]), table.index.tolist(), fontsize=7)
        ax.set_xlabel("step")
        ax.set_title(f"{config}: {quantity} deviation per parameter")
        first = where(records, "first_divergence", config=config)
        if not first.empty:
            row = first.iloc[0]
            step = int(row["value"])
            param = row["param"] if row["param"] in params else _referee.MODEL
            if step in list(table.columns):
                x, y = list(table.columns).index(step), params.index(param)
                from matplotlib.patches import Rectangle
                ax.add_patch(Rectangle((x - 0.5, y - 0.5), 1, 1, fill=False, ec="red", lw=2.2))
                ax.annotate(f"first divergence ({row['quantity']})", (x, y), xytext=(6, -10),
                            textcoords="offset points", color="red", fontsize=7)
    return fig


def finding_figure(records, config: str, ax=None):
    """The localized finding of ``config``, drawn from the sampled gradient elements.

    Factor: the configuration's gradient against the reference's, with the
    line ``y = c·x`` of the fitted factor. Missing contribution: the
    difference (configuration − reference) against the missing pieces'
    gradient, with ``y = −x``. Otherwise: configuration against reference
    with ``y = x``.
    """
    found = _need(records, "localized", config=config).iloc[0]
    samples = _need(records, "sample_grad", config=config)
    table = samples.pivot_table(index="element", columns="series", values="value", aggfunc="first")
    ref, cfg, missing = table["reference"].to_numpy(), table["config"].to_numpy(), table["missing"].to_numpy()
    factor_rows = where(records, "fit_factor", config=config)
    kind, step = found["finding"], int(found["step"])
    with theme():
        fig, ax = own_axes(ax, figsize=(4.8, 4.2))
        if kind == "missing_contribution":
            x, y = missing, cfg - ref
            ax.scatter(x, y, s=8, alpha=0.7)
            ax.set_xlabel("gradient of the missing pieces (float64, as weighted in the reference)")
            ax.set_ylabel("configuration − reference gradient")
            line, text = -1.0, "y = −x: the difference is exactly the missing gradient"
        else:
            x, y = ref, cfg
            ax.scatter(x, y, s=8, alpha=0.7)
            ax.set_xlabel("reference gradient")
            ax.set_ylabel("configuration gradient")
            if kind == "factor" and not factor_rows.empty:
                c = float(factor_rows.iloc[0]["value"])
                name = factor_rows.iloc[0].get("factor_name")
                name = f" = {name}" if isinstance(name, str) else ""
                line, text = c, f"fitted factor {c:.6g}{name}"
            else:
                line, text = 1.0, "y = x"
        lim = float(np.nanmax(np.abs(x))) if len(x) else 1.0
        grid = np.array([-lim, lim])
        ax.plot(grid, line * grid, color="tab:red", lw=1.2, label=text)
        ax.legend(fontsize=7, loc="best")
        ax.set_title(f"{config}, step {step}: {kind.replace('_', ' ')}", fontsize=9)
    return fig


def figures(records) -> list:
    """The comparison's figures, most telling first: deviation per step, losses, gradient norms,
    then per configuration that leaves the band its heatmap and its finding."""
    out = [deviation_over_steps(records), loss_curves(records), grad_norms(records)]
    for config in _configs(records):
        if not where(records, "first_divergence", config=config).empty:
            out.append(deviation_heatmap(records, config))
            if not where(records, "sample_grad", config=config).empty:
                out.append(finding_figure(records, config))
    return out

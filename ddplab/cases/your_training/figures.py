"""Case 05's figures, each ``fn(records, params, ax=None)`` over :mod:`ddplab.compare.figures`."""
from __future__ import annotations

from ddplab.compare import figures
from ddplab.compare.verdicts import configurations_in
from ddplab.plots import own_axes
from ddplab.records import where

__all__ = ["plot_deviation", "plot_loss", "plot_grad_norm", "plot_heatmap", "plot_finding"]


def _first_diverged(records) -> str | None:
    rows = where(records, "first_divergence")
    return None if rows.empty else str(rows.iloc[0]["config"])


def plot_deviation(records, params, ax=None):
    """Each configuration's largest deviation per step, in multiples of its rounding band."""
    return figures.deviation_over_steps(records, ax=ax)


def plot_loss(records, params, ax=None):
    """The loss per step of every configuration, the reference and the float64 truth."""
    return figures.loss_curves(records, ax=ax)


def plot_grad_norm(records, params, ax=None):
    """The gradient norm at optimizer.step() per step."""
    return figures.grad_norms(records, ax=ax)


def plot_heatmap(records, params, ax=None):
    """Step × parameter deviation of the first configuration that leaves the band (else the first)."""
    config = _first_diverged(records) or configurations_in(records)[0]
    return figures.deviation_heatmap(records, config, ax=ax)


def plot_finding(records, params, ax=None):
    """The finding of the first configuration that leaves the band, shown on its gradient elements."""
    config = _first_diverged(records)
    if config is not None:
        return figures.finding_figure(records, config, ax=ax)
    fig, ax = own_axes(ax)
    ax.text(0.5, 0.5, "no configuration left the rounding band:\nnothing to localize",
            ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig

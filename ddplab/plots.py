"""Figures from the tidy record table (seaborn/matplotlib).

Every function takes the records DataFrame, selects one ``metric`` and
returns a matplotlib Figure; nothing is shown implicitly. Use :func:`show`
to display one: it renders the PNG itself and displays that, because under
``MPLBACKEND=Agg`` (inherited by papermill kernels) ``plt.show()`` silently
produces no image -- and no figure formatter is registered -- while the run
still succeeds.
"""
from __future__ import annotations

import contextlib
import io
import math
from typing import Sequence

import numpy as np

from ddplab.records import where

__all__ = ["show", "png_bytes", "metric_lines", "metric_heatmap", "select", "theme",
           "facet_axes", "own_axes", "legend_outside", "log_floor", "draw_zero_floor", "series_lines"]

#: Resolution of displayed and saved figures: sharp enough, small enough for < 2 MB reports.
DPI = 90


# matplotlib and seaborn are imported on first use, not with this module: every
# case's figures import it, and so does every rank that unpickles a case's worker
# -- about 2 s of seaborn, pandas and scipy per rank for figures it never draws.
def _pyplot():
    import matplotlib.pyplot as plt
    return plt


def _seaborn():
    import seaborn as sns
    return sns


@contextlib.contextmanager
def theme():
    """ddplab's plot style, applied only inside the block."""
    sns = _seaborn()
    with sns.axes_style("whitegrid"), sns.plotting_context("notebook", font_scale=0.9):
        yield


def select(frame, metric: str | Sequence[str], **labels):
    """The rows of ``frame`` for ``metric`` and label values; ValueError when none (nothing to draw)."""
    out = where(frame, metric, **labels)
    if out.empty:
        have = sorted(frame["metric"].dropna().unique().tolist())
        raise ValueError(f"no records for metric {metric!r} with {labels or 'no filter'}; "
                         f"metrics present: {have}")
    return out


def png_bytes(fig, dpi: int = DPI) -> bytes:
    """``fig`` rendered as PNG."""
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi, bbox_inches="tight")
    return buf.getvalue()


def show(fig, dpi: int = DPI) -> None:
    """Display ``fig`` as a PNG in the notebook output, whatever the backend, and close it."""
    try:
        from IPython.display import Image, display
        display(Image(data=png_bytes(fig, dpi), format="png"))
    finally:
        _pyplot().close(fig)


def metric_lines(frame, metric: str, *, x: str = "step", hue: str | None = None,
                 style: str | None = None, col: str | None = None, log: bool = False,
                 title: str | None = None, ylabel: str | None = None, filters: dict | None = None,
                 height: float = 3.2, aspect: float = 1.5):
    """Line plot of ``metric`` against ``x``, one line per ``hue``/``style``, facets by ``col``.

    With ``log=True`` the y axis is logarithmic and non-positive values are
    dropped (an exact zero has no place on a log axis; say so in the caption).
    """
    data = select(frame, metric, **(filters or {})).copy()
    data["value"] = data["value"].astype(float)
    if log:
        data = data[data["value"] > 0]
        if data.empty:
            raise ValueError(f"metric {metric!r} has no positive values to draw on a log axis")
    for key in (hue, style, col):
        if key is not None:
            data[key] = data[key].astype(str)
    with theme():
        grid = _seaborn().relplot(data=data, x=x, y="value", hue=hue, style=style, col=col,
                           kind="line", markers=style is not None, height=height, aspect=aspect,
                           facet_kws={"sharey": True}, errorbar=None)
        if log:
            grid.set(yscale="log")
        grid.set_axis_labels(x, ylabel or metric)
        if title:
            grid.figure.suptitle(title, y=1.03)
    return grid.figure


def metric_heatmap(frame, metric: str, *, index: str = "bucket", columns: str = "step",
                   agg: str = "max", log: bool = True, title: str | None = None,
                   filters: dict | None = None, cbar_label: str | None = None):
    """Heatmap of ``metric`` aggregated (``agg``) over ``index`` × ``columns``.

    With ``log=True`` colours show log10(value); zeros are drawn as the floor
    colour and marked in the colour-bar label.
    """
    data = select(frame, metric, **(filters or {}))
    table = data.pivot_table(index=index, columns=columns, values="value", aggfunc=agg)
    shown = table.astype(float)
    label = cbar_label or metric
    if log:
        positive = shown[shown > 0]
        floor = np.nanmin(positive.values) if positive.notna().any().any() else 1.0
        shown = np.log10(shown.clip(lower=floor))
        label = f"log10({label}) (zeros shown at the floor)"
    with theme():
        fig, ax = _pyplot().subplots(figsize=(min(14, 2 + 0.35 * table.shape[1]), 1.5 + 0.35 * table.shape[0]))
        _seaborn().heatmap(shown, ax=ax, cmap="viridis", cbar_kws={"label": label})
        ax.set_xlabel(columns)
        ax.set_ylabel(index)
        if title:
            ax.set_title(title)
        fig.tight_layout()
    return fig


# --------------------------------------------------------------------------- scaffolding for case figures


def own_axes(ax=None, figsize: tuple[float, float] = (6.0, 3.6)):
    """``(figure, ax)``: ``ax`` and its figure when given, else a new figure with one axes.

    Every single-panel figure function takes ``ax=None`` and starts with this,
    so a caller can compose panels of several cases in one figure.
    """
    if ax is not None:
        return ax.figure, ax
    with theme():
        fig, ax = _pyplot().subplots(figsize=figsize)
    return fig, ax


def facet_axes(n: int, *, ncols: int | None = None, width: float = 4.6, height: float = 3.4,
               sharey: bool = False, sharex: bool = False):
    """``(figure, [axes])``: ``n`` panels in a row (or ``ncols`` per row), under ddplab's theme."""
    if n < 1:
        raise ValueError("a figure needs at least one panel")
    ncols = min(n, ncols or n)
    nrows = math.ceil(n / ncols)
    with theme():
        fig, grid = _pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows),
                                 sharey=sharey, sharex=sharex, squeeze=False)
    axes = list(grid.flat)
    for extra in axes[n:]:
        extra.set_visible(False)
    return fig, axes[:n]


def legend_outside(fig, axes=None, *, title: str | None = None) -> None:
    """One legend for the whole figure, right of the panels, each label once."""
    handles: dict[str, object] = {}
    for ax in (axes if axes is not None else fig.axes):
        for handle, label in zip(*ax.get_legend_handles_labels()):
            if not label.startswith("_"):
                handles.setdefault(label, handle)
    if handles:
        fig.legend(list(handles.values()), list(handles), loc="upper left",
                   bbox_to_anchor=(1.0, 0.92), frameon=False, title=title, fontsize=8)


def log_floor(values, default: float = 1e-20) -> float:
    """Where exact zeros go on a log axis: a decade below the smallest positive value."""
    positive = [float(v) for v in values if float(v) > 0 and math.isfinite(float(v))]
    if not positive:
        return default
    return 10 ** (math.floor(math.log10(min(positive))) - 1)


def draw_zero_floor(ax, floor: float, label: str = "0: exact zero") -> None:
    """The dashed floor line of a log axis, labelled with what its zeros mean."""
    ax.axhline(floor, color="0.4", ls="--", lw=0.8)
    ax.text(0.01, floor * 1.8, label, transform=ax.get_yaxis_transform(), fontsize=8,
            color="0.3", va="bottom")


def series_lines(ax, x, y, *, floor: float | None = None, label: str | None = None,
                 markers_only: bool = False, **style) -> None:
    """Plot one series; with ``floor`` its exact zeros become open circles on the floor line.

    A log axis has no zero, yet an exact zero -- bitwise equality -- is often
    the most important value: it is drawn, not dropped.
    """
    import numpy as np

    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    color = style.pop("color", None)
    if floor is not None:
        zero = y == 0
        if zero.any():
            ax.scatter(x[zero], np.full(int(zero.sum()), floor), s=40, facecolors="none",
                       edgecolors=[color] if color is not None else None, zorder=3)
        y = np.where(zero, np.nan if markers_only else floor, y)
    if markers_only:
        style.setdefault("ms", 4.5)
        ax.plot(x, y, ls="none", color=color, label=label, **style)
    else:
        style.setdefault("lw", 1.6)
        ax.plot(x, y, color=color, label=label, **style)

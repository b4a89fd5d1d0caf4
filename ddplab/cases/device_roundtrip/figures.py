"""Case 03's tables and figures, all read from the tidy records.

Multi-panel figures draw one panel per configuration (a row per framework);
given ``ax`` they draw one representative panel: the first round trip as reported.
"""
from __future__ import annotations

from ddplab.cases.device_roundtrip.verdict import (CONFIG_KEYS, config_labels, configurations,
                                                   gaps_of, loss_gap_table, roundtrip_step,
                                                   run_facts)
from ddplab.cases.device_roundtrip.worker import AS_REPORTED
from ddplab.plots import facet_axes, legend_outside, own_axes
from ddplab.records import label_values, where

__all__ = ["summary_table", "alarms_table", "alarms_markdown", "skipped_markdown", "loss_gap_table",
           "plot_timeline", "plot_grad_diff", "plot_weight_distance", "plot_loss_gap", "plot_loss"]


def _title(config) -> str:
    return " · ".join(config)


# --------------------------------------------------------------------------- tables


def _buckets_text(f) -> str:
    before = "/".join(map(str, f.bucket_counts(f.before))) or "—"
    if f.roundtrip_step is None:
        return before
    return f"{before} before, {'/'.join(map(str, f.bucket_counts(f.after))) or '—'} after the round trip"


def summary_table(records, params: dict | None = None):
    """One row per configuration: steps in sync, first step out of sync, largest gradient
    difference, the report's check, buckets reduced per backward, weight distance at the end,
    detector alarms and warnings."""
    import pandas as pd

    rt = roundtrip_step(records, params)
    rows = []
    for config in configurations(records):
        f = run_facts(records, config, rt)
        rows.append({
            "framework": config.framework, "round trip": config.roundtrip, "variant": config.variant,
            "steps in sync": f"{len(f.steps) - len(f.out_of_sync)}/{len(f.steps)}",
            "first step out of sync": f.out_of_sync[0] if f.out_of_sync else "—",
            "max |g_r − g_0|": f.max_grad_diff,
            "report's check failed (steps)": len(f.report_fails),
            "buckets reduced per backward": _buckets_text(f),
            "weight distance at the end": f.final_distance,
            "detector alarms (step)": ", ".join(map(str, f.alarm_steps)) or "none",
            "warnings": f.warnings,
        })
    return pd.DataFrame(rows).set_index(["framework", "round trip", "variant"]) if rows else pd.DataFrame()


def alarms_table(records):
    """Every detector alarm: configuration, rank, step, when, and what the guard said."""
    import pandas as pd

    columns = [*CONFIG_KEYS, "rank", "step", "when", "message"]
    alarms = where(records, "detector_alarm")
    table = alarms[columns] if len(alarms) else pd.DataFrame(columns=columns)
    return table.rename(columns={"roundtrip": "round trip"}).reset_index(drop=True)


def alarms_markdown(records) -> str:
    """The guard's alarms per configuration (ranks, step, when) and, once each, what it said."""
    lines, silent = [], []
    for config in configurations(records):
        sub = where(records, "detector_alarm", **config_labels(config))
        if not len(sub):
            silent.append(_title(config))
            continue
        ranks = ", ".join(map(str, label_values(sub, "rank")))
        steps = ", ".join(map(str, label_values(sub, "step")))
        first = sub.sort_values("rank")
        lines.append(f"**{_title(config)}**: the guard fired on rank(s) {ranks} at step {steps} "
                     f"({', '.join(label_values(sub, 'when'))}). It said (rank "
                     f"{int(first['rank'].iloc[0])}):\n")
        lines.append("```\n" + first["message"].iloc[0] + "\n```\n")
    if silent:
        lines.append("Silent on: " + ", ".join(silent) + ".")
    return "\n".join(lines) + "\n"


def skipped_markdown(records) -> str:
    """What did not run here and why (the device round trip off CUDA, Fabric without Lightning)."""
    skipped = where(records, "configuration_skipped")
    lines = [f"Lightning Fabric {version} ran inside ddplab's process group (an environment that "
             f"adopts the existing group: no process started, no group initialized by Fabric)."
             for version in label_values(records, "version", "fabric_version")]
    if not len(skipped):
        return "\n\n".join(lines + ["Every requested configuration ran."]) + "\n"
    lines.append("**Not run here:**\n")
    lines += [f"- `{row['framework']}` × `{row['roundtrip']}`: {row['reason']}"
              for _, row in skipped.iterrows()]
    return "\n".join(lines) + "\n"


# --------------------------------------------------------------------------- figures


def _representative(configs):
    """The panel drawn when a caller gives one ``ax``: the first round trip as reported."""
    return next((c for c in configs if c.roundtrip != "none" and c.variant == AS_REPORTED), configs[0])


def _panels(configs, ax=None):
    """``(fig, {config: ax})``: a panel per configuration, a row per framework; or just ``ax``."""
    if not configs:
        fig, ax = own_axes(ax)
        ax.text(0.5, 0.5, "no configuration ran", ha="center", va="center", transform=ax.transAxes)
        return fig, {}
    if ax is not None:
        return ax.figure, {_representative(configs): ax}
    ncols = len(dict.fromkeys((c.roundtrip, c.variant) for c in configs))
    fig, axes = facet_axes(len(configs), ncols=ncols, width=4.2, height=2.6, sharex=True, sharey=True)
    return fig, dict(zip(configs, axes))


def _roundtrip_line(ax, config, rt: int) -> None:
    if config.roundtrip != "none":
        ax.axvline(rt - 0.5, color="black", lw=1, ls="--")


def _finish(fig, panels: dict, title: str) -> None:
    from matplotlib.ticker import MaxNLocator

    for ax in panels.values():
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        ax.set_xlabel("step")
    if len(panels) > 1:
        legend_outside(fig, list(panels.values()))
        fig.suptitle(title, fontsize=10, y=1.01)
        fig.tight_layout()
    else:
        for ax in panels.values():
            ax.legend(fontsize=7, frameon=False)


def plot_timeline(records, params: dict, ax=None):
    """Configuration × step: gradients bitwise equal across ranks (green) or not (red);
    × where the report's check failed, ★ where the guard fired, a dashed line at the round trip."""
    import numpy as np
    from matplotlib.colors import ListedColormap

    configs = configurations(records)
    rt = roundtrip_step(records, params)
    facts = [run_facts(records, c, rt) for c in configs]
    steps = sorted({s for f in facts for s in f.steps})
    fig, ax = own_axes(ax, (min(14, 3.5 + 0.32 * len(steps)), 1.2 + 0.45 * len(configs)))
    grid = np.full((len(configs), len(steps)), np.nan)
    for i, f in enumerate(facts):
        for s in f.steps:
            grid[i, steps.index(s)] = 0.0 if s in f.out_of_sync else 1.0
    ax.imshow(grid, cmap=ListedColormap(["#f4b6b6", "#cfe8cf"]), vmin=0, vmax=1, aspect="auto")
    fails = [(steps.index(s), i) for i, f in enumerate(facts) for s in f.report_fails]
    if fails:
        ax.scatter(*zip(*fails), marker="x", color="#8b0000", s=22, lw=1.2,
                   label="report's allclose check fails")
    # Drawn at the cell's left edge: the guard speaks before that step's forward.
    alarms = [(steps.index(s) - 0.32, i) for i, f in enumerate(facts) for s in f.alarm_steps]
    if alarms:
        ax.scatter(*zip(*alarms), marker="*", color="#1f3b99", s=110, zorder=3,
                   label="detached-reducer guard fired")
    if any(c.roundtrip != "none" for c in configs) and rt in steps:
        ax.axvline(steps.index(rt) - 0.5, color="black", lw=1.2, ls="--", label="round trip")
    for edge in range(1, len(configs)):
        ax.axhline(edge - 0.5, color="white", lw=2)
    ax.set_yticks(range(len(configs)), [_title(c) for c in configs])
    ax.set_xticks(range(len(steps)), [str(s) for s in steps], fontsize=7)
    ax.set_xlabel("step")
    ax.grid(False)
    ax.set_title("Gradients bitwise equal across ranks (green) or not (red)", fontsize=10)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0), frameon=False)
    return fig


def plot_grad_diff(records, params: dict, ax=None):
    """Per parameter and step: the largest cross-rank gradient difference ``max |g_r - g_0|``
    (symlog axis: 0 means bitwise in sync), one panel per configuration."""
    rt = roundtrip_step(records, params)
    fig, panels = _panels(configurations(records), ax)
    for config, panel in panels.items():
        rows = where(records, "grad_max_abs_diff", **config_labels(config))
        for j, (param, grp) in enumerate(rows.groupby("param", sort=False)):
            per_step = grp.groupby("step")["value"].max()
            panel.plot(per_step.index.astype(int), per_step.values, marker="o", ms=2.5, lw=1.1,
                       color=f"C{j}", label=param)
        _roundtrip_line(panel, config, rt)
        panel.set_yscale("symlog", linthresh=1e-6)
        panel.set_title(_title(config), fontsize=9)
        panel.set_ylabel("max |g_r − g_0|")
    _finish(fig, panels, "Cross-rank gradient difference per parameter (0: in sync; dashed: round trip)")
    return fig


def plot_weight_distance(records, params: dict, ax=None):
    """``||w_r - w_0||_2`` after each step, one line per configuration (0 while in sync)."""
    from matplotlib.ticker import MaxNLocator

    configs = configurations(records)
    rt = roundtrip_step(records, params)
    fig, ax = own_axes(ax, (7.5, 3.6))
    for j, config in enumerate(configs):
        per_step = where(records, "weight_distance", **config_labels(config)).groupby("step")["value"].max()
        ax.plot(per_step.index.astype(int), per_step.values, marker="o", ms=3, lw=1.3,
                ls="-" if config.variant == AS_REPORTED else ":", color=f"C{j}", label=_title(config))
    if any(c.roundtrip != "none" for c in configs):
        ax.axvline(rt - 0.5, color="black", lw=1, ls="--", label="round trip")
    ax.set_xlabel("step (after its update)")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylabel("weight distance ‖w_r − w_0‖₂")
    ax.set_title("Replicas drift apart once the gradients are no longer averaged", fontsize=10)
    ax.legend(fontsize=7, loc="upper left", frameon=False)
    return fig


def plot_loss(records, params: dict, ax=None):
    """Each rank's local loss per step, one panel per configuration."""
    rt = roundtrip_step(records, params)
    fig, panels = _panels(configurations(records), ax)
    for config, panel in panels.items():
        rows = where(records, "loss", **config_labels(config))
        for rank, grp in rows.groupby("rank"):
            grp = grp.sort_values("step")
            panel.plot(grp["step"].astype(int), grp["value"], lw=1.2, marker="o", ms=2,
                       label=f"rank {int(rank)}")
        _roundtrip_line(panel, config, rt)
        panel.set_title(_title(config), fontsize=9)
        panel.set_ylabel("local MSE loss")
    _finish(fig, panels, "Per-rank loss (each rank's own data; dashed: round trip)")
    return fig


def plot_loss_gap(records, params: dict, ax=None):
    """Per rank: loss minus the reference run's loss on the same batch (0 while the run is the
    reference bit for bit), one panel per configuration with a round trip."""
    gaps = loss_gap_table(records)
    rt = roundtrip_step(records, params)
    configs = [c for c in configurations(records) if c.roundtrip != "none"]
    fig, panels = _panels(configs, ax)
    for config, panel in panels.items():
        sub = gaps_of(gaps, config)
        for rank, grp in sub.groupby("rank"):
            grp = grp.sort_values("step")
            panel.plot(grp["step"], grp["gap"], lw=1.2, marker="o", ms=2, label=f"rank {int(rank)}")
        _roundtrip_line(panel, config, rt)
        panel.axhline(0, color="grey", lw=0.8)
        reference = sub["reference"].iloc[0] if len(sub) else "no reference run"
        panel.set_title(f"{_title(config)}\nminus {reference}", fontsize=8)
        panel.set_ylabel("loss gap")
    _finish(fig, panels, "Each rank's loss minus the in-sync reference's, same batch (dashed: round trip)")
    return fig

"""A verdict per configuration, computed from the comparison's records alone.

:func:`judge` reads the tidy records of one configuration -- its
``steps_completed`` status row, the referee's ``deviation`` and ``band``
rows, the localization's rows -- and returns a :class:`ConfigVerdict`:
``kind`` ("rounding", "bug", "undetermined", or "crashed", "hung",
"stopped", "not run", "unavailable" when it did not finish), findings with
their numbers in ``values``, and a headline rendered from those numbers.
Because it reads only records, a saved table gives the same verdict again.
"""
from __future__ import annotations

import dataclasses
import math

from ddplab.compare import referee as _referee
from ddplab.verdict import Finding as _BaseFinding
from ddplab.verdict import Verdict

__all__ = ["Finding", "ConfigVerdict", "judge", "FAILED_STATUSES", "DEGENERATE_FRACTION"]

#: Run statuses that mean the configuration did not finish its steps.
FAILED_STATUSES = ("crashed", "hung", "stopped")
#: A band below this fraction of the unit roundoff means the reference reproduced the truth
#: (exact arithmetic): its distance measures no rounding, so there is no band.
DEGENERATE_FRACTION = 1e-3


@dataclasses.dataclass
class Finding(_BaseFinding):
    """A :class:`ddplab.verdict.Finding` whose numbers are kept as data in ``values``."""

    values: dict = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class ConfigVerdict:
    """The conclusion about one configuration.

    ``kind``: "rounding", "bug" or "undetermined" for a configuration that
    ran every step; its run status ("crashed", "hung", "stopped", "not run",
    "unavailable") otherwise, with ``classification`` then saying what the
    referee found on the steps that did finish. ``finding`` is the kind of
    difference localized at the first divergence ("factor",
    "missing_contribution", "desync", "update", "semantic") or None.
    """

    config: str
    kind: str
    classification: str | None
    headline: str
    findings: list[Finding]
    max_deviation: float | None = None
    first_divergence: int | None = None
    finding: str | None = None
    steps_completed: int = 0
    error: str | None = None

    def values(self, key: str) -> dict:
        """The numbers of finding ``key``."""
        for f in self.findings:
            if f.key == key:
                return f.values
        raise KeyError(f"verdict of {self.config!r} has no finding {key!r}; it has {[f.key for f in self.findings]}")

    def to_verdict(self) -> Verdict:
        """The same conclusion as a :class:`ddplab.verdict.Verdict` (reports, notebooks)."""
        return Verdict(case="compare", kind=self.kind, headline=f"{self.config}: {self.headline}",
                       findings=list(self.findings))

    def _repr_markdown_(self) -> str:
        return self.to_verdict().to_markdown()


# --------------------------------------------------------------------------- reading records


def _rows(frame, metric: str, config: str):
    if "config" not in frame.columns:
        return frame.iloc[0:0]
    return frame[(frame["metric"] == metric) & (frame["config"] == config)]


def _label(row, key, default=None):
    value = row.get(key, default) if hasattr(row, "get") else default
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return value


def _fmt(x: float) -> str:
    return "inf" if math.isinf(x) else f"{x:.3g}"


def _pieces_text(missing: list[int], world: int, k: int) -> str:
    pairs = [(j // k, j % k) for j in missing]
    ranks = sorted({r for r, _ in pairs})
    micros = sorted({m for _, m in pairs})
    if k == 1:
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) + \
            ("'s share" if len(ranks) == 1 else "' shares")
    if len(pairs) == len(micros) * world:  # the same micro-batches of every rank
        return ("micro-batch " if len(micros) == 1 else "micro-batches ") + ", ".join(map(str, micros)) + \
            " of every rank"
    if len(pairs) == len(ranks) * k:
        return ("rank " if len(ranks) == 1 else "ranks ") + ", ".join(map(str, ranks)) + " (every micro-batch)"
    return ", ".join(f"rank {r} micro-batch {m}" for r, m in pairs)


def _localization(frame, config: str, world: int, k: int) -> Finding | None:
    rows = _rows(frame, "localized", config)
    if rows.empty:
        return None
    row = rows.iloc[0]
    kind, step = row["finding"], int(row["step"])
    values = dict(step=step, quantity=_label(row, "quantity"), tolerance=float(_label(row, "tolerance", math.nan)))
    factor_rows = _rows(frame, "fit_factor", config)
    if not factor_rows.empty:
        values["factor"] = float(factor_rows.iloc[0]["value"])
        values["factor_name"] = _label(factor_rows.iloc[0], "factor_name")
    resid = _rows(frame, "fit_residual", config)
    for _, r in resid.iterrows():
        values[f"residual_{r['series']}"] = float(r["value"])
    weights = _rows(frame, "piece_weight", config)
    values["piece_weights"] = [float(v) for v in weights.sort_values("piece")["value"]]
    missing = _label(row, "missing")
    values["missing"] = [int(j) for j in str(missing).split(",")] if missing not in (None, "") else []
    values["missing_pieces"] = [(j // k, j % k) for j in values["missing"]]
    desync = _rows(frame, "desync_deviation", config)
    values["rank_deviation"] = {int(r["rank"]): float(r["value"]) for _, r in desync.iterrows()}
    if kind == "factor":
        name = values.get("factor_name")
        claim = (f"at step {step} every gradient is {_fmt(values['factor'])}"
                 + (f" = {name}" if name else "") + " times the reference's (one constant factor)")
    elif kind == "missing_contribution":
        what = _pieces_text(values["missing"], world, k)
        claim = (f"at step {step} the gradient lacks the contribution of {what}: the difference "
                 f"from the reference equals that gradient")
    elif kind == "desync":
        ranks = [r for r, z in values["rank_deviation"].items() if z > _referee.ROUNDING_MARGIN]
        claim = (f"the ranks disagree: rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))} "
                 f"hold{'' if len(ranks) > 1 else 's'} gradients or parameters different from rank 0's "
                 f"(up to {_fmt(max(values['rank_deviation'].values()))}× the band)")
    elif kind == "update":
        claim = (f"at step {step} the gradients agree with the reference within the band but the "
                 f"parameters after optimizer.step() do not: the update differs")
    else:
        claim = (f"at step {step} the gradient is not the reference's up to a factor or a missing "
                 f"contribution: a different computation (residual "
                 f"{_fmt(values.get('residual_config', math.nan))} of the fit on the batch pieces)")
    return Finding(key=kind, claim=claim, holds=True, values=values,
                   evidence=_evidence(values, ("factor", "residual_config", "residual_truth", "tolerance")))


def _evidence(values: dict, keys) -> str:
    parts = [f"{k}={_fmt(values[k]) if isinstance(values[k], float) else values[k]}"
             for k in keys if k in values and values[k] is not None]
    return ", ".join(parts)


# --------------------------------------------------------------------------- the rule


def judge(frame, config: str, *, error: BaseException | None = None) -> ConfigVerdict:
    """The verdict on ``config`` from the comparison's records (see the module docstring)."""
    status_rows = _rows(frame, "steps_completed", config)
    if status_rows.empty:
        raise ValueError(f"no records of configuration {config!r}")
    srow = status_rows.iloc[0]
    status, done = srow["status"], int(srow["value"])
    world, k = int(_label(srow, "world_size", 1)), int(_label(srow, "k", 1))
    error_text = _label(srow, "error")
    if error is not None:
        error_text = str(error)
    findings: list[Finding] = []
    if status != "completed":
        findings.append(Finding(
            key="completed", claim=f"the configuration ran every step ({status} after {done})", holds=False,
            values=dict(status=status, steps_completed=done, failed_rank=_label(srow, "failed_rank"),
                        error=_label(srow, "error")),
            evidence=str(_label(srow, "error", status))))
    dev = _rows(frame, "deviation", config)
    dev = dev[dev["rank"] == 0] if not dev.empty else dev
    if dev.empty:
        kind = status if status != "completed" else "undetermined"
        headline = {"not run": "not run (the comparison was stopped before it)",
                    "unavailable": f"not run: {error_text}"}.get(
            status, f"{status} before its first step was captured" + (f": {error_text.splitlines()[0]}"
                                                                      if error_text else ""))
        return ConfigVerdict(config, kind, None, headline, findings, steps_completed=done, error=error_text)
    bands = _rows(frame, "band", config)
    degenerate_steps = set()
    for _, b in bands[bands["param"] == _referee.MODEL].iterrows():
        unit = _label(b, "unit_roundoff", 0.0)
        if b["value"] < DEGENERATE_FRACTION * unit:
            degenerate_steps.add((int(b["step"]), b["quantity"]))
    keyed = dev.assign(_degenerate=[(int(s), q) in degenerate_steps for s, q in zip(dev["step"], dev["quantity"])])
    sound = keyed[~keyed["_degenerate"]]
    worst = keyed.loc[keyed["value"].idxmax()]
    max_dev = float(worst["value"])
    sound_max = float(sound["value"].max()) if not sound.empty else 0.0
    classification = _referee.classify_deviation(sound_max)
    beyond_only_degenerate = max_dev > _referee.ROUNDING_MARGIN and sound_max <= _referee.ROUNDING_MARGIN
    if beyond_only_degenerate:
        classification = "undetermined"
    within = Finding(
        key="within_band",
        claim=(f"every gradient and parameter stays within {_fmt(_referee.ROUNDING_MARGIN)}× the "
               f"reference's own distance from the float64 truth"),
        holds=max_dev <= _referee.ROUNDING_MARGIN,
        values=dict(max_deviation=max_dev, step=int(worst["step"]), param=worst["param"],
                    quantity=worst["quantity"], rounding_margin=_referee.ROUNDING_MARGIN,
                    bug_margin=_referee.BUG_MARGIN, steps_compared=int(dev["step"].max()) + 1,
                    degenerate_steps=sorted(degenerate_steps)),
        evidence=(f"max deviation {_fmt(max_dev)}× the band at step {int(worst['step'])}, "
                  f"{worst['quantity']} of {worst['param']}"))
    findings.insert(0, within)
    first_rows = _rows(frame, "first_divergence", config)
    first = int(first_rows.iloc[0]["value"]) if not first_rows.empty else None
    local = _localization(frame, config, world, k)
    if local is not None:
        findings.append(local)
    ranks = _rows(frame, "rank_distance", config)
    if not ranks.empty:
        model_rows = ranks[ranks["param"] == _referee.MODEL]
        equal = bool(model_rows["bitwise_equal"].astype(bool).all())
        findings.append(Finding(
            key="ranks_agree", claim="every rank holds bitwise the same gradients and parameters",
            holds=equal, values=dict(max_rank_distance=float(model_rows["value"].max())),
            evidence=f"largest relative distance from rank 0: {_fmt(float(model_rows['value'].max()))}"))
    kind = status if status != "completed" else classification
    headline = _headline(classification, max_dev, first, local, beyond_only_degenerate)
    if status != "completed":
        headline = f"{status} after {done} step{'s' if done != 1 else ''}" + \
            (f" (rank {_label(srow, 'failed_rank')})" if _label(srow, "failed_rank") is not None else "") + \
            f"; on those steps: {headline}"
    return ConfigVerdict(config, kind, classification, headline, findings, max_deviation=max_dev,
                         first_divergence=first, finding=local.key if local else None,
                         steps_completed=done, error=error_text)


def _headline(classification: str, max_dev: float, first: int | None, local: Finding | None,
              degenerate: bool) -> str:
    if classification == "rounding":
        return (f"rounding: at most {_fmt(max_dev)}× the reference's own rounding distance "
                f"(margin {_fmt(_referee.ROUNDING_MARGIN)})")
    if degenerate:
        return ("undetermined: the reference reproduces the float64 truth to within a rounding, "
                "so its distance gives no band to judge by")
    where = f" from step {first}" if first is not None else ""
    what = f"; {local.claim}" if local is not None else ""
    if classification == "bug":
        return f"bug: {_fmt(max_dev)}× the rounding band{where}{what}"
    return (f"undetermined: {_fmt(max_dev)}× the rounding band{where} -- beyond every correct run "
            f"measured, not by orders of magnitude{what}")

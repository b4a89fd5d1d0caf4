"""Case 03's verdict: per configuration, what the records say about gradient sync; then the findings.

:func:`run_facts` condenses one configuration's records (steps in and out of
sync, buckets reduced, alarms, weight distance, warnings) into a
:class:`RunFacts`; :class:`Runs` groups them (the control, the as-reported
round trips, the re-wrapped ones); the findings, one function each, and the
tables read only these facts. Findings keep their numbers in ``values``;
lists in ``values`` follow the order of the ``runs`` they describe.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ddplab.cases.device_roundtrip.worker import AS_REPORTED, FRAMEWORKS, REWRAPPED, ROUNDTRIPS, VARIANTS
from ddplab.records import label_values, where
from ddplab.verdict import Finding, Verdict

__all__ = ["CONFIG_KEYS", "SCOPE", "Config", "RunFacts", "Runs", "configurations", "config_labels",
           "run_name", "run_facts", "roundtrip_step", "loss_gap_table", "gaps_of", "verdict"]

CONFIG_KEYS = ("framework", "roundtrip", "variant")

SCOPE = ("Covers, per configuration and step, whether DDP's reducer reduced the gradients (buckets "
         "handed to its communication hook per backward), whether every gradient is bitwise equal "
         "across ranks after backward (evidence: bit equality, no rounding bound involved), the "
         "report's own all_gather + allclose check, and the replicas' weight distance; not covered: "
         "the numerical accuracy of the reduction itself (how close the averaged gradient is to the "
         "exact mean), which is not the question here.")


class Config(NamedTuple):
    """One configuration: framework × round trip × variant (labels of its records)."""

    framework: str
    roundtrip: str                      # "none": the control
    variant: str                        # AS_REPORTED, or REWRAPPED (the fix)

    @property
    def name(self) -> str:
        """``ddp/dtype`` or ``ddp/dtype re-wrapped``: the configuration in a sentence."""
        return f"{self.framework}/{self.roundtrip}" + ("" if self.variant == AS_REPORTED else " re-wrapped")


def configurations(records) -> list[Config]:
    """The configurations that ran, in the planned order."""
    done = where(records, "steps_completed")
    if not len(done):
        return []
    keys = {Config(*r) for r in done[list(CONFIG_KEYS)].itertuples(index=False)}
    return sorted(keys, key=lambda c: (FRAMEWORKS.index(c.framework), ROUNDTRIPS.index(c.roundtrip),
                                       VARIANTS.index(c.variant)))


def config_labels(config) -> dict:
    return dict(zip(CONFIG_KEYS, config))


def run_name(config) -> str:
    """``ddp/dtype`` or ``ddp/dtype re-wrapped``: a configuration in a sentence."""
    return Config(*config).name


def roundtrip_step(records, params: dict | None) -> int:
    if params is not None and "roundtrip_step" in params:
        return int(params["roundtrip_step"])
    applied = where(records, "roundtrip_applied")
    return int(applied["step"].min()) if len(applied) else 0


def _per_step(rows, how: str) -> dict[int, float]:
    """``value`` per step over ranks and parameters (``min`` or ``max``)."""
    if not len(rows):
        return {}
    return {int(s): float(v) for s, v in rows.groupby("step")["value"].agg(how).items()}


@dataclasses.dataclass
class RunFacts:
    """What one configuration's records say. Steps are those rank 0 and every rank recorded."""

    config: Config
    roundtrip_step: int | None          # None: no round trip (the control)
    steps: list[int]
    out_of_sync: list[int]              # steps where some rank's gradient differs from rank 0's
    max_grad_diff: float
    report_fails: list[int]             # steps where the report's allclose check failed
    distance: dict[int, float]          # step -> largest ||w_r - w_0||_2 after its update
    buckets: dict[int, list[int]]       # step -> the buckets each rank reduced in its backward
    alarm_steps: list[int]
    alarm_ranks: list[int]
    alarm_when: list[str]
    alarm_messages: list[str]
    warnings: int
    warning_messages: list[str]
    completed: int
    restored: bool                      # the round trip left dtype and device as they were

    @property
    def name(self) -> str:
        return self.config.name

    @property
    def before(self) -> list[int]:
        rt = self.roundtrip_step
        return [s for s in self.steps if rt is None or s < rt]

    @property
    def after(self) -> list[int]:
        rt = self.roundtrip_step
        return [s for s in self.steps if rt is not None and s >= rt]

    @property
    def in_sync_before(self) -> int:
        return sum(s not in self.out_of_sync for s in self.before)

    @property
    def out_of_sync_after(self) -> int:
        return sum(s in self.out_of_sync for s in self.after)

    @property
    def final_distance(self) -> float:
        return self.distance[max(self.distance)] if self.distance else math.nan

    @property
    def distance_before(self) -> float:
        return max((self.distance[s] for s in self.before if s in self.distance), default=0.0)

    def bucket_counts(self, steps: list[int]) -> list[int]:
        """The distinct numbers of buckets one backward reduced over ``steps``, any rank."""
        return sorted({n for s in steps for n in self.buckets.get(s, [])})

    def buckets_in(self, steps: list[int], most: bool = False) -> float:
        """Fewest (or most) buckets one backward reduced over ``steps``; NaN without steps."""
        counts = self.bucket_counts(steps)
        return float(counts[-1] if most else counts[0]) if counts else math.nan


#: The metrics :func:`run_facts` reads.
FACT_METRICS = ("grad_bitwise_equal", "grad_max_abs_diff", "report_allclose", "weight_distance",
                "buckets_reduced", "detector_alarm", "training_warnings", "steps_completed",
                "roundtrip_applied")


def run_facts(records, config, rt: int) -> RunFacts:
    """Condense one configuration's records (round trip before step ``rt``)."""
    config = Config(*config)
    mine = where(records, list(FACT_METRICS), **config_labels(config))
    by_metric = dict(tuple(mine.groupby("metric")))

    def rows(metric: str):
        return by_metric.get(metric, mine.iloc[0:0])

    equal = _per_step(rows("grad_bitwise_equal"), "min")
    allclose = _per_step(rows("report_allclose"), "min")
    diff = _per_step(rows("grad_max_abs_diff"), "max")
    alarms, warn, applied = rows("detector_alarm"), rows("training_warnings"), rows("roundtrip_applied")
    completed = rows("steps_completed")
    restored = bool(len(applied)) and all(
        (applied[f"{k}_before"] == applied[f"{k}_after"]).all() for k in ("dtype", "device"))
    return RunFacts(
        config=config, roundtrip_step=None if config.roundtrip == "none" else rt,
        steps=sorted(equal), out_of_sync=[s for s in sorted(equal) if equal[s] < 1],
        max_grad_diff=max(diff.values()) if diff else math.nan,
        report_fails=[s for s in sorted(allclose) if allclose[s] < 1],
        distance=_per_step(rows("weight_distance"), "max"),
        buckets={int(s): sorted(int(v) for v in g["value"])
                 for s, g in rows("buckets_reduced").groupby("step")},
        alarm_steps=[int(s) for s in label_values(alarms, "step")],
        alarm_ranks=[int(r) for r in label_values(alarms, "rank")],
        alarm_when=label_values(alarms, "when"), alarm_messages=label_values(alarms, "message"),
        warnings=int(warn["value"].sum()) if len(warn) else 0,
        warning_messages=[m for m in label_values(warn, "messages") if m],
        completed=int(completed["value"].min()) if len(completed) else 0,
        restored=restored)


@dataclasses.dataclass
class Runs:
    """Every configuration's facts, and the groups the findings read."""

    facts: list[RunFacts]

    def with_roundtrip(self, roundtrip: str, variant: str | None = None) -> list[RunFacts]:
        return [f for f in self.facts if f.config.roundtrip == roundtrip
                and variant in (None, f.config.variant)]

    @property
    def control(self) -> list[RunFacts]:
        """No round trip."""
        return self.with_roundtrip("none")

    @property
    def reported(self) -> list[RunFacts]:
        """A round trip, as reported (not re-wrapped)."""
        return [f for f in self.facts if f.config.roundtrip != "none" and f.config.variant == AS_REPORTED]

    @property
    def fixed(self) -> list[RunFacts]:
        """Re-wrapped after the round trip."""
        return [f for f in self.facts if f.config.variant == REWRAPPED]

    @property
    def desynced(self) -> list[RunFacts]:
        """Any run whose gradients differed across ranks at some step."""
        return [f for f in self.facts if f.out_of_sync]

    @property
    def broke(self) -> list[RunFacts]:
        """The as-reported round trips that lost sync."""
        return [f for f in self.reported if f.out_of_sync]


def loss_gap_table(records):
    """Each rank's loss minus the same rank's loss in the reference run, on the same batch.

    Every configuration starts from the same weights and sees the same
    batches, so the difference is what the round trip changed. The reference
    is the framework's control (``none``), or else its re-wrapped run. Rows:
    ``framework, roundtrip, variant, reference, rank, step, gap`` (configurations
    with a round trip and a reference).
    """
    import pandas as pd

    configs = configurations(records)
    out = []
    for config in configs:
        if config.roundtrip == "none":
            continue
        refs = [r for r in (config._replace(roundtrip="none", variant=AS_REPORTED),
                            config._replace(variant=REWRAPPED)) if r != config and r in configs]
        if not refs:
            continue
        mine = where(records, "loss", **config_labels(config)).set_index(["rank", "step"])["value"]
        theirs = where(records, "loss", **config_labels(refs[0])).set_index(["rank", "step"])["value"]
        for (rank, step), gap in (mine - theirs).dropna().items():
            out.append(dict(zip(CONFIG_KEYS, config), reference=" · ".join(refs[0]), rank=int(rank),
                            step=int(step), gap=float(gap)))
    return pd.DataFrame(out, columns=[*CONFIG_KEYS, "reference", "rank", "step", "gap"])


# --------------------------------------------------------------------------- findings


def _names(runs: list[RunFacts]) -> list[str] | str:
    return [f.name for f in runs] or "none"


def _sync_finding(key: str, claim: str, runs: list[RunFacts], steps: int) -> Finding:
    """Runs that must stay bitwise in sync at every step with equal replicas at the end."""
    return Finding(
        key, claim, all(not f.out_of_sync and f.final_distance == 0 for f in runs),
        "{runs} (in this order): {in_sync} of {steps} steps bitwise in sync; weight distance at "
        "the end {final_distance}",
        {"runs": _names(runs), "in_sync": [len(f.steps) - len(f.out_of_sync) for f in runs],
         "steps": steps, "final_distance": [f.final_distance for f in runs]})


def _broken_finding(key: str, claim: str, runs: list[RunFacts], rt: int, steps: int,
                    fixed: list[RunFacts] | None = None) -> Finding:
    """As-reported round trips: in sync before the round trip, out of sync at every step after it;
    with ``fixed``, also those re-wrapped runs in sync at every step."""
    template = ("{runs} (in this order): in sync at {in_sync_before} of the {steps_before} steps "
                "before step {roundtrip_step}, out of sync at {out_of_sync_after} of the "
                "{steps_after} steps from it on; max |g_r − g_0| {max_grad_diff}; buckets reduced "
                "per backward {buckets_before} before (fewest), {buckets_after} after (most) the "
                "round trip")
    values = {"runs": _names(runs), "roundtrip_step": rt, "steps_before": rt, "steps_after": steps - rt,
              "in_sync_before": [f.in_sync_before for f in runs],
              "out_of_sync_after": [f.out_of_sync_after for f in runs],
              "max_grad_diff": [f.max_grad_diff for f in runs],
              "buckets_before": [f.buckets_in(f.before) for f in runs],
              "buckets_after": [f.buckets_in(f.after, most=True) for f in runs]}
    holds = bool(runs) and all(f.in_sync_before == len(f.before) and f.after
                               and f.out_of_sync_after == len(f.after) for f in runs)
    if fixed is not None:
        template += "; re-wrapped {fixed_runs}: {fixed_in_sync} of {steps} steps bitwise in sync"
        values.update(fixed_runs=_names(fixed), steps=steps,
                      fixed_in_sync=[len(f.steps) - len(f.out_of_sync) for f in fixed])
        holds = holds and all(not f.out_of_sync for f in fixed)
    return Finding(key, claim, holds, template, values)


def _guard_line(message: str) -> str:
    """The guard's line about the first parameter (what it saw), from its message."""
    lines = [ln.strip() for ln in message.splitlines() if ln.startswith("  ")]
    return lines[0] if lines else message.splitlines()[0]


def _desync_findings(desynced: list[RunFacts], steps: int) -> list[Finding]:
    """Silent, each rank alone, and why: for the runs that went out of sync."""
    runs = _names(desynced)
    silent = Finding(
        "silent", "Nothing stopped or warned: the desynchronized runs trained every step without "
        "an exception or a warning (only ddplab's guard spoke)",
        all(f.completed == steps and f.warnings == 0 for f in desynced),
        "{runs} (in this order): {completed} of {steps} steps trained without an exception; "
        "Python warnings (all ranks) {warnings} ({messages})",
        {"runs": runs, "completed": [f.completed for f in desynced], "steps": steps,
         "warnings": [f.warnings for f in desynced],
         "messages": "; ".join(m for f in desynced for m in f.warning_messages)[:300] or "none"})
    alone = Finding(
        "ranks_train_alone", "Each rank then trains alone: the replicas' weights, equal before the "
        "round trip, drift apart",
        all(f.distance_before == 0 and f.final_distance > 0 for f in desynced),
        "{runs} (in this order): weight distance ‖w_r − w_0‖₂ {distance_before} before the round "
        "trip, {final_distance} after the last step",
        {"runs": runs, "distance_before": [f.distance_before for f in desynced],
         "final_distance": [f.final_distance for f in desynced]})
    # With the round trip right after wrapping there is no step before it to compare.
    mechanism = Finding(
        "mechanism", "The round trip restores every parameter's dtype and device, yet the reducer "
        "reduces no bucket any more: its autograd hooks sit on the parameters' old gradient "
        "accumulators (the guard: 'gradient accumulator was replaced'; see ddplab.probes)",
        all(f.restored and f.buckets_in(f.after, most=True) == 0
            and f.buckets_in(f.before) != 0
            and any("accumulator was replaced" in m for m in f.alarm_messages) for f in desynced),
        "{runs} (in this order): dtype and device restored {restored}; buckets reduced per "
        "backward {buckets_before} before (fewest), {buckets_after} after (most); the guard said: "
        "{guard_said}",
        {"runs": runs, "restored": [f.restored for f in desynced],
         "buckets_before": [f.buckets_in(f.before) for f in desynced],
         "buckets_after": [f.buckets_in(f.after, most=True) for f in desynced],
         "guard_said": [f"'{_guard_line(f.alarm_messages[0])}'" if f.alarm_messages else "nothing"
                        for f in desynced]})
    return [silent, alone, mechanism]


def gaps_of(gaps, config):
    """The rows of :func:`loss_gap_table` for one configuration."""
    return gaps[(gaps[list(CONFIG_KEYS)] == list(config)).all(axis=1)]


def _largest_gap(gaps, f: RunFacts) -> float:
    """The largest |loss − reference's loss| of run ``f`` (NaN without a reference run)."""
    sub = gaps_of(gaps, f.config)
    return float(sub["gap"].abs().max()) if len(sub) else math.nan


def _reference_of(gaps, f: RunFacts) -> str:
    sub = gaps_of(gaps, f.config)
    return sub["reference"].iloc[0] if len(sub) else "no reference run"


def _rewrap_finding(fixed: list[RunFacts], gaps, steps: int) -> Finding:
    return Finding(
        "rewrap_fixes", "The fix works: wrapping again after the round trip (probes.rewrap for "
        "DDP, fabric.setup for Fabric) keeps every gradient bitwise equal at every step",
        all(not f.out_of_sync and f.final_distance == 0 and f.buckets_in(f.after) > 0
            for f in fixed),
        "{runs} (in this order): {in_sync} of {steps} steps bitwise in sync; weight distance at "
        "the end {final_distance}; buckets reduced per backward after the round trip {buckets_after} "
        "(fewest); largest |loss − reference's loss| on the same batch {loss_gap} "
        "(0: every loss bitwise equal), reference {reference}",
        {"runs": _names(fixed), "in_sync": [len(f.steps) - len(f.out_of_sync) for f in fixed],
         "steps": steps, "final_distance": [f.final_distance for f in fixed],
         "buckets_after": [f.buckets_in(f.after) for f in fixed],
         "loss_gap": [_largest_gap(gaps, f) for f in fixed],
         "reference": [_reference_of(gaps, f) for f in fixed]})


def _detector_finding(facts: list[RunFacts], desynced: list[RunFacts], rt: int,
                      world_size: int) -> Finding:
    fired = [f for f in facts if f.alarm_steps]
    exact = ({f.config for f in fired} == {f.config for f in desynced}
             and all(f.alarm_steps == [rt] and f.alarm_when == ["before forward"]
                     and len(f.alarm_ranks) == world_size for f in desynced))
    return Finding(
        "detector_exact", "The detached-reducer guard (probes.ReducerGuard) fired exactly on the "
        "configurations that went out of sync, on every rank, at the first forward after the round "
        "trip (before step {roundtrip_step}); it stayed silent on the others",
        exact,
        "fired on: {fired_on}; out of sync: {out_of_sync}; where it fired (in that order): at "
        "step {alarm_step} ({alarm_when}) on {alarm_ranks} of {world_size} ranks",
        {"fired_on": _names(fired), "out_of_sync": _names(desynced), "roundtrip_step": rt,
         "alarm_step": [f.alarm_steps[0] for f in fired] or "nowhere",
         "alarm_when": [" and ".join(f.alarm_when) for f in fired] or "n/a",
         "alarm_ranks": [len(f.alarm_ranks) for f in fired] or 0, "world_size": world_size})


def _report_check_finding(facts: list[RunFacts]) -> Finding:
    disagree = [f"{f.name} step {s}" for f in facts for s in f.steps
                if (s in f.report_fails) != (s in f.out_of_sync)]
    total = sum(len(f.steps) for f in facts)
    return Finding(
        "report_check_agrees", "The report's own check (all_gather the gradients, torch.allclose) "
        "fails exactly at the steps where the gradients differ bitwise",
        total > 0 and not disagree,
        "{agree} of {total} configuration-steps agree; they disagree at: {disagree}",
        {"agree": total - len(disagree), "total": total, "disagree": disagree[:10] or "none"})


def _skip_reasons(records, cause: str) -> list[str]:
    return label_values(records, "reason", "configuration_skipped", cause=cause)


def _control_finding(runs: Runs, steps: int) -> Finding:
    return _sync_finding("none_in_sync", "Without a round trip every gradient is bitwise equal across "
                         "ranks at every step", runs.control, steps)


def _dtype_finding(runs: Runs, rt: int, steps: int) -> Finding:
    return _broken_finding(
        "dtype_breaks_sync", "After .double() then .float() on the wrapped model (before step "
        "{roundtrip_step}) the gradients differ across ranks at every later step, for every "
        "framework run; before it they are equal", runs.with_roundtrip("dtype", AS_REPORTED), rt, steps)


_DEVICE_CLAIM = ("The report's own trigger (.cpu() then .cuda()) breaks sync the same way, and "
                 "re-wrapping fixes it")


def _device_finding(records, runs: Runs, rt: int, steps: int) -> Finding | None:
    """The report's .cpu()/.cuda() round trip where it ran; why not where it could not."""
    if runs.with_roundtrip("device"):
        return _broken_finding("device_roundtrip", _DEVICE_CLAIM, runs.with_roundtrip("device", AS_REPORTED),
                               rt, steps, fixed=runs.with_roundtrip("device", REWRAPPED))
    skipped = _skip_reasons(records, "no cuda")
    if skipped:
        return Finding("device_roundtrip", _DEVICE_CLAIM, None, "not run here: {reason}",
                       {"reason": "; ".join(skipped)})
    return None


def _fabric_finding(records) -> Finding | None:
    skipped = _skip_reasons(records, "no lightning")
    if not skipped:
        return None
    return Finding("fabric_skipped", "Lightning Fabric (the report's framework) loses sync the same way",
                   None, "not run here: {reason}", {"reason": "; ".join(skipped)})


def _findings(records, runs: Runs, fix: Finding | None, rt: int, steps: int, world: int) -> list[Finding]:
    """Every finding the runs allow, in the order a reader follows the story."""
    findings = [_control_finding(runs, steps)] if runs.control else []
    if runs.with_roundtrip("dtype", AS_REPORTED):
        findings.append(_dtype_finding(runs, rt, steps))
    if runs.desynced:
        findings += _desync_findings(runs.desynced, steps)
    if fix is not None:
        findings.append(fix)
    if runs.facts:
        findings += [_detector_finding(runs.facts, runs.desynced, rt, world),
                     _report_check_finding(runs.facts)]
    return findings + [f for f in (_device_finding(records, runs, rt, steps), _fabric_finding(records))
                       if f is not None]


# --------------------------------------------------------------------------- the verdict


KEY_NUMBERS = {"buckets reduced per backward after the round trip": "buckets_after",
               "steps out of sync after the round trip": "out_of_sync_after",
               "steps after the round trip": "steps_after",
               "largest cross-rank gradient difference": "max_grad_diff",
               "replicas' weight distance at the end": "final_distance",
               "re-wrapped: largest loss gap to the in-sync run": "rewrap_loss_gap"}


def _values(records, runs: Runs, fix: Finding | None, rt: int, steps: int, world: int) -> dict:
    """The verdict's numbers; those about a round trip are over the as-reported ones."""
    reported, broke = runs.reported, runs.broke
    gap_values = [g for g in (fix.values["loss_gap"] if fix else []) if not math.isnan(g)]
    return {
        # The referee's evidence kinds (ddplab.numerics.EVIDENCE): every claim about sync here is
        # bit equality of gradients across ranks, and buckets are counted, never bounded.
        "evidence": "bitwise",
        "world_size": world, "steps": steps, "roundtrip_step": rt, "steps_after": steps - rt,
        "frameworks": sorted({f.config.framework for f in broke}, key=FRAMEWORKS.index) or "none",
        "roundtrips": sorted({f.config.roundtrip for f in broke}, key=ROUNDTRIPS.index) or "none",
        "runs": _names(runs.facts), "in_sync": [len(f.steps) - len(f.out_of_sync) for f in runs.facts],
        "desynced": _names(runs.desynced),
        # Over the as-reported round trips (the report's runs), whether they broke or not.
        "buckets_after": sorted({n for f in reported for n in f.bucket_counts(f.after)}) or "none",
        "out_of_sync_after": min((f.out_of_sync_after for f in reported), default=0),
        "max_grad_diff": max((f.max_grad_diff for f in reported), default=math.nan),
        "final_distance": max((f.final_distance for f in reported), default=math.nan),
        "rewrap_loss_gap": max(gap_values) if gap_values else math.nan,
        "device_skipped": "; ".join(_skip_reasons(records, "no cuda")) or "none",
    }


def _kind(runs: Runs) -> str:
    if runs.broke:
        return "bug"
    return "unexplained" if runs.desynced else "undetermined"


def _fix_text(fix: Finding | None, values: dict) -> str:
    if fix is None:
        return "not run here"
    if fix.holds and values["rewrap_loss_gap"] == 0:
        return "it kept every gradient in sync and every loss bitwise equal to the in-sync run's"
    return "it kept every gradient in sync" if fix.holds else "NOT confirmed here"


def _summary(kind: str, runs: Runs, fix: Finding | None, values: dict) -> str:
    if kind == "bug":
        broke = runs.broke
        silent = all(f.completed == values["steps"] and f.warnings == 0 for f in broke)
        summary = ("Silent desynchronization reproduced ({frameworks}; round trip {roundtrips}): after "
                   "the round trip DDP's reducer reduced {buckets_after} buckets per backward, the "
                   "gradients differed across ranks at {out_of_sync_after} of the {steps_after} steps "
                   "after it (by up to {max_grad_diff}) and the replicas drifted to a weight distance "
                   "of {final_distance} after {steps} steps"
                   + (", with no error or warning." if silent else ".")
                   + " Cause: the reducer's hooks stay on the parameters' old gradient accumulators."
                   + (" Plain DDP shows it too: a DDP behaviour, not Fabric's."
                      if any(f.config.framework == "ddp" for f in broke) else "")
                   + f" Fix: wrap again after moving; {_fix_text(fix, values)}.")
    elif kind == "unexplained":
        summary = ("Gradients went out of sync in {desynced}, yet no as-reported round trip lost "
                   "sync: not the report's mechanism.")
    else:
        summary = ("Not reproduced: no configuration lost gradient sync ({runs}, in this order: "
                   "{in_sync} of {steps} steps bitwise in sync).")
    if values["device_skipped"] != "none" and not runs.with_roundtrip("device"):
        summary += " The .cpu()/.cuda() round trip was not run: {device_skipped}."
    return summary


def verdict(records, params: dict) -> Verdict:
    """kind "bug" when an as-reported round trip made the gradients differ across ranks
    (DDP's reducer detached); "unexplained" when only other runs lost sync; "undetermined"
    when every run stayed in sync (the report's failure is not reproduced here)."""
    rt, steps, world = params["roundtrip_step"], params["steps"], params["world_size"]
    runs = Runs([run_facts(records, c, rt) for c in configurations(records)])
    fix = _rewrap_finding(runs.fixed, loss_gap_table(records), steps) if runs.fixed else None
    values = _values(records, runs, fix, rt, steps, world)
    kind = _kind(runs)
    return Verdict(case="device_roundtrip", kind=kind, summary=_summary(kind, runs, fix, values),
                   findings=_findings(records, runs, fix, rt, steps, world), values=values,
                   scope=SCOPE, key_numbers=KEY_NUMBERS)

"""A verdict per configuration, computed from the comparison's records alone.

:func:`judge` reads the tidy records of one configuration -- its
``steps_completed`` status row, the band's ``deviation`` rows, and what every
evidence source of :data:`ddplab.compare.evidence.EVIDENCE` recorded -- and
returns a :class:`ConfigVerdict`: ``kind`` ("exact", "rounding", "bug",
"undetermined", or "crashed", "hung", "stopped", "not run", "unavailable"
when it did not finish), the evidence that decided, :class:`ddplab.verdict.Finding` s
with their numbers in ``values``, and a summary rendered from those numbers.
Because it reads only records, a saved table gives the same verdict again.
"""
from __future__ import annotations

import dataclasses
import math

from ddplab.compare import evidence as _evidence
from ddplab.compare import mesh_evidence as _mesh_evidence
from ddplab.compare import referee as _referee
from ddplab.compare.evidence import EVIDENCE, Context, decide, label, pieces_text, read_band, rows
from ddplab.glossary import RunStatus, VerdictKind
from ddplab.verdict import Finding, Verdict

__all__ = ["ConfigVerdict", "judge", "comparison_verdict", "configurations_in", "verdicts_markdown", "FAILED_STATUSES", "SCOPE",
           "pieces_text"]

#: Run statuses that mean the configuration did not finish its steps.
FAILED_STATUSES = (RunStatus.CRASHED, RunStatus.HUNG, RunStatus.STOPPED)
#: What a comparison's verdict covers.
SCOPE = ("covers every compared step of every rank: finite values; the replicas' gradients and parameters "
         "against each other bit for bit; every collective the ranks issued against its emulation, bit for bit, "
         "and its dtype against the one declared; for DDP, accumulation and Fabric each rank's local gradient, "
         "its reduced buckets and its update against ddplab's specification replay bit for bit (FSDP2: forward "
         "outputs and the sharded update); where no replay covers every phase, the symmetric twin (every rank "
         "on rank 0's data and RNG state, bit for bit) and the configuration's own code in float64 against the "
         "float64 truth; whether the data-parallel promise equals one process, in float64; and each "
         "parameter's distance from a float64 run against the reference's own distance; not steps after the "
         "last one compared or after the first non-finite value, nor effects outside the captured gradients, "
         "parameters, buffers and collectives (data loading, unless Setup.rank_batches gives each rank's "
         "batches: then every sample is counted against the global batch)")


@dataclasses.dataclass
class ConfigVerdict(Verdict):
    """The conclusion about one compared configuration: a :class:`ddplab.verdict.Verdict` whose
    ``case`` is the configuration's label (also :attr:`config`).

    ``kind`` (a :class:`~ddplab.glossary.VerdictKind`): "exact", "rounding", "approximation", "bug" or
    "undetermined" for a configuration that ran every step; its run status ("crashed", "hung",
    "stopped", "not run", "unavailable") otherwise, with ``classification`` then saying what the
    evidence found on the steps that did finish. ``difference`` is the kind of difference found at
    the first divergence ("factor", "missing_contribution", "desync", "asymmetry", "collective",
    "semantic", ...) or None; ``finding(key)`` is, as for every verdict, one of its findings.
    ``evidence`` names the source that decided, one of :data:`ddplab.compare.evidence.EVIDENCE`
    (strongest first).
    """

    classification: str | None = None
    max_deviation: float | None = None
    first_divergence: int | None = None
    difference: str | None = None
    steps_completed: int = 0
    error: str | None = None
    evidence: str = "tolerance"

    @property
    def config(self) -> str:
        """The configuration's label (the verdict's ``case``)."""
        return self.case

    @property
    def referee(self) -> str:
        """The evidence that decided (the name earlier versions used)."""
        return self.evidence

    def finding_values(self, key: str) -> dict:
        """The numbers of finding ``key``."""
        return self.finding(key).values

    def to_verdict(self, case: str = "your_training") -> Verdict:
        """The same conclusion as a case's :class:`ddplab.verdict.Verdict` named ``case`` (reports,
        notebooks): the headline starts with the configuration's label."""
        return Verdict(case=case, kind=self.kind, summary="{config}: " + self.summary,
                       findings=list(self.findings), values={"config": self.config, **self.values},
                       scope=SCOPE)

    def _repr_markdown_(self) -> str:
        return self.to_verdict().to_markdown()


# --------------------------------------------------------------------------- the rule


def judge(frame, config: str, *, error: BaseException | None = None) -> ConfigVerdict:
    """The verdict on ``config`` from the comparison's records: the evidence of
    :data:`ddplab.compare.evidence.EVIDENCE`, strongest first (:func:`~ddplab.compare.evidence.decide`)."""
    status_rows = rows(frame, "steps_completed", config)
    if status_rows.empty:
        raise ValueError(f"no records of configuration {config!r}")
    srow = status_rows.iloc[0]
    status, done = srow["status"], int(srow["value"])
    error_text = str(error) if error is not None else label(srow, "error")
    failed_rank = int(label(srow, "failed_rank", -1))
    failure = dict(status=status, steps_completed=done, failed_rank=failed_rank,
                   failed_where=f"rank {failed_rank}" if failed_rank >= 0 else "no single rank named",
                   rank_steps=str(label(srow, "rank_steps", "") or ""),
                   error=label(srow, "error", ""))
    findings: list[Finding] = []
    if status != RunStatus.COMPLETED:
        findings.append(Finding(key="completed", claim="The configuration ran every step", holds=False,
                                template="{status} after {steps_completed} step(s) on every rank, {failed_where}: {error}",
                                values=failure))
    dev = rows(frame, "deviation", config)
    dev = dev[dev["rank"] == 0] if not dev.empty else dev
    if dev.empty:
        kind = status if status != RunStatus.COMPLETED else VerdictKind.UNDETERMINED
        summary = {"not run": "not run: the comparison was stopped before it",
                   "unavailable": "not run: {error}"}.get(
            status, "{status} before its first step was captured ({failed_where}): {error}")
        return ConfigVerdict(case=config, kind=kind, summary=summary, findings=findings, values=failure,
                             scope=SCOPE, steps_completed=done, error=error_text)
    ctx = Context(frame, config, world=int(label(srow, "world_size", 1)), k=int(label(srow, "k", 1)),
                  status=srow)
    band = read_band(ctx, dev)
    ctx.findings.update(within_band=band, localization=_evidence._read_localization(ctx))
    decision = decide(ctx)
    findings.insert(0, band)
    reduction = _reduction(frame, config)
    if reduction is not None:
        findings.append(reduction)
    findings += [ctx.findings[s.name] for s in EVIDENCE
                 if s.name != "tolerance" and ctx.findings.get(s.name) is not None]
    findings += decision.extra_findings
    local = ctx.findings.get("localization")
    if local is not None and local.key == decision.finding and local not in findings:
        findings.append(local)  # the band's piece fit of the same kind: its weights and residuals
    bv = band.values
    semantic = ctx.findings.get("semantic")
    values = {key: bv[key] for key in ("max_deviation", "step", "param", "quantity", "where", "rounding_margin",
                                       "bug_margin", "steps_compared", "degenerate_steps")}
    values.update(first_divergence=-1, finding="none", finding_text="", first_rank=0, first_param=bv["param"],
                  no_replay=str(ctx.fact("no_replay", "") or ""),
                  compression=str(ctx.fact("compression", "") or ""),
                  max_semantic_distance=semantic.values["max_semantic_distance"] if semantic else math.nan,
                  semantic_tolerance=semantic.values["semantic_tolerance"] if semantic else math.nan)
    values.update(decision.values)
    first = decision.first_divergence
    values.update(referee=decision.evidence, evidence=decision.evidence, finding=decision.finding or "none",
                  first_divergence=-1 if first is None else first)
    summary = decision.summary
    if decision.classification == "bug":  # on a device mesh: the axis, and the coordinate where it starts
        placed = _mesh_evidence.place(values, ctx)
        values.update(placed)
        summary += "{place_text}" if placed else ""
    finite = ctx.findings.get("finite")
    if finite is not None and decision.evidence != "finite" and finite.values["nonfinite_step"] < 0:
        values.update(finite.values)
        summary += ("; the reference turns NaN or Inf from step {reference_step} ({reference_param}) while "
                    "this configuration stays finite: only the {steps_compared} step(s) before are judged")
    elif finite is not None and decision.evidence != "finite":
        values.update(finite.values)
        summary += ("; from step {nonfinite_step} the values turn NaN or Inf (rank {nonfinite_rank}, "
                    "{nonfinite_quantity} of {nonfinite_param}) and the reference's do too (step "
                    "{reference_step}): the data or the model produce them, not distribution, and "
                    "only the {steps_compared} step(s) before are judged")
    if status != "completed":
        values.update(failure)
        summary = "{status} after {steps_completed} step(s) on every rank ({failed_where}); on those steps: " + summary
    return ConfigVerdict(case=config, kind=status if status != "completed" else decision.classification,
                         summary=summary, findings=findings, values=values, scope=SCOPE,
                         classification=decision.classification, max_deviation=bv["max_deviation"],
                         first_divergence=first, difference=decision.finding, steps_completed=done,
                         error=error_text, evidence=decision.evidence)


def _reduction(frame, config: str) -> Finding | None:
    """The reduction audit's rows (DDP buckets measured in the parent, FSDP2's audit in the ranks)."""
    found = rows(frame, "frac_matches_order", config)
    if found.empty or "verdict" not in found.columns:
        return None
    bad = found[found["verdict"] != "rounding"]
    first = bad.sort_values(["step", "bucket"]).iloc[0] if not bad.empty else None
    collectives = sorted({str(c) for c in found.get("collective", found["metric"]).dropna()} - {"frac_matches_order"})
    values = dict(audited=len(found), steps=int(found["step"].nunique()),
                  evidence=sorted({str(e) for e in found["evidence"].dropna()}),
                  collective=collectives or ["allreduce"],
                  order=sorted({str(o) for o in found["order"].dropna()}),
                  min_match=float(found["value"].min()),
                  not_rounding=len(bad),
                  first_not_rounding_step=int(first["step"]) if first is not None else -1,
                  first_not_rounding_params=str(label(first, "params", "")) if first is not None else "")
    return Finding(
        key="reduction",
        claim=("Every {collective} of the ranks' gradients is rounding: what {order} gives for the same "
               "contributions"),
        holds=bad.empty,
        template=("{audited} reductions audited over {steps} steps (evidence: {evidence}); smallest "
                  "fraction of elements equal to the order's bits {min_match}; not rounding: {not_rounding}"),
        values=values)


# --------------------------------------------------------------------------- the whole comparison


def configurations_in(frame) -> list[str]:
    """The compared configurations, in the order they ran (their ``steps_completed`` rows)."""
    found = frame[frame["metric"] == "steps_completed"] if "metric" in frame.columns else frame.iloc[0:0]
    return list(dict.fromkeys(found["config"])) if not found.empty else []


def verdicts_markdown(frame) -> str:
    """One table row per configuration: verdict, largest deviation, first divergence, finding, headline."""
    from ddplab.formatting import fmt

    lines = ["| configuration | verdict | max deviation (× band) | first divergence (step, rank, parameter) | finding | summary |",
            "|---|---|---|---|---|---|"]
    for name in configurations_in(frame):
        v = judge(frame, name)
        first = "" if v.first_divergence is None else f"step {v.first_divergence}"
        dev = "" if v.max_deviation is None else fmt(v.max_deviation)
        if v.first_divergence is not None:
            rank = v.values.get("first_rank", 0)
            first = f"step {v.first_divergence}" + (f", rank {rank}" if rank is not None and rank >= 0 else "") + \
                f", {v.values.get('first_param', '')}"
        lines.append(f"| {name} | **{v.kind}** | {dev} | {first} | {v.difference or ''} | "
                    f"{v.headline.replace('|', '/')} |")
    return "\n".join(lines) + "\n"


def comparison_verdict(frame, *, case: str = "your_training") -> Verdict:
    """One :class:`ddplab.verdict.Verdict` for every configuration of a comparison's records.

    Kind: "bug" when some configuration is a bug (on the steps it finished),
    "rounding" when every configuration ran every step and is rounding,
    "undetermined" otherwise. One finding per configuration (key: its name;
    holds when it is rounding, None when the referee could not say), with
    its verdict's numbers as values.
    """
    labels = configurations_in(frame)
    if not labels:
        raise ValueError("no compared configuration in these records")
    verdicts = [judge(frame, name) for name in labels]
    kinds = [v.kind for v in verdicts]
    classes = [v.classification for v in verdicts]
    if "bug" in classes:
        kind = "bug"
    elif all(k in ("exact", "rounding") for k in kinds):
        kind = "rounding"
    else:
        kind = "undetermined"
    findings = []
    for v in verdicts:
        values = {k: val for k, val in v.values.items() if not isinstance(val, dict)}
        values.update(config=v.config, verdict=v.kind, headline=v.headline,
                      finding=v.difference or "none", steps_completed=v.steps_completed)
        holds = {"exact": True, "rounding": True, "bug": False}.get(v.classification) if v.classification else None
        if v.kind in ("not run", "unavailable"):
            holds = None
        findings.append(Finding(key=v.config, claim="{config} differs from the single-process reference "
                                "by rounding only", holds=holds, template="{headline}",
                                values=values))
    deviations = [v.max_deviation for v in verdicts if v.max_deviation is not None]
    n_fine = kinds.count("rounding") + kinds.count("exact")
    values = dict(total=len(verdicts), n_rounding=n_fine, n_exact=kinds.count("exact"), n_bug=classes.count("bug"),
                  n_other=len(verdicts) - n_fine - classes.count("bug"),
                  bugs=[v.config for v in verdicts if v.classification == "bug"] or ["none"],
                  others=[f"{v.config} ({v.kind})" for v in verdicts
                          if v.kind not in ("exact", "rounding") and v.classification != "bug"] or ["none"],
                  max_deviation=max(deviations) if deviations else math.nan,
                  rounding_margin=_referee.ROUNDING_MARGIN, bug_margin=_referee.BUG_MARGIN)
    summary = ("{n_rounding} of {total} configurations differ from the single-process reference by "
               "rounding only ({n_exact} of them proven bit for bit by the replay); bugs: {bugs}; "
               "neither: {others}")
    return Verdict(case=case, kind=kind, summary=summary, findings=findings, values=values, scope=SCOPE,
                   key_numbers={"configurations": "total", "rounding": "n_rounding", "bugs": "n_bug",
                                "largest deviation (× band)": "max_deviation",
                                "rounding margin": "rounding_margin"})

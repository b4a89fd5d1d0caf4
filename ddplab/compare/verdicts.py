"""A verdict per configuration, computed from the comparison's records alone.

:func:`judge` reads the tidy records of one configuration -- its
``steps_completed`` status row, the referee's ``deviation`` and ``band``
rows, the localization's rows, the reduction audit's rows -- and returns a
:class:`ConfigVerdict`: ``kind`` ("rounding", "bug", "undetermined", or
"crashed", "hung", "stopped", "not run", "unavailable" when it did not
finish), :class:`ddplab.verdict.Finding` s with their numbers in ``values``,
and a summary rendered from those numbers. Because it reads only records, a
saved table gives the same verdict again.
"""
from __future__ import annotations

import dataclasses
import math

from ddplab.compare import referee as _referee
from ddplab.formatting import render
from ddplab.verdict import Finding, Verdict

__all__ = ["ConfigVerdict", "judge", "comparison_verdict", "configurations_in", "verdicts_markdown", "FAILED_STATUSES", "DEGENERATE_FRACTION", "SCOPE"]

#: Run statuses that mean the configuration did not finish its steps.
FAILED_STATUSES = ("crashed", "hung", "stopped")
#: A band below this fraction of the unit roundoff means the reference reproduced the truth
#: (exact arithmetic): its distance measures no rounding, so there is no band.
DEGENERATE_FRACTION = 1e-3
#: What a comparison's verdict covers.
SCOPE = ("covers every compared step of every rank: the replicas' gradients and parameters against "
         "each other bit for bit; for DDP, accumulation and Fabric each rank's local gradient, its "
         "reduced buckets and its update against ddplab's specification replay bit for bit (FSDP2: "
         "forward outputs, the reduce-scatter and the sharded update; the backward by tolerance); "
         "whether the data-parallel promise equals one process, in float64; and, where no replay "
         "exists (Custom steps, models that issue collectives), each parameter's distance from a "
         "float64 run against the reference's own distance; not steps after the last one compared, "
         "nor effects outside the captured gradients, parameters and buffers (data loading)")


@dataclasses.dataclass
class ConfigVerdict:
    """The conclusion about one configuration.

    ``kind``: "exact", "rounding", "bug" or "undetermined" for a
    configuration that ran every step; its run status ("crashed", "hung", "stopped", "not run",
    "unavailable") otherwise, with ``classification`` then saying what the
    referee found on the steps that did finish. ``finding`` is the kind of
    difference localized at the first divergence ("factor",
    "missing_contribution", "desync", "update", "semantic") or None.
    ``summary`` is the headline's template, filled from ``values``.
    ``referee`` names the evidence that decided, strongest first:
    "replicas" (ranks bitwise apart after a synchronized step: bug),
    "replay" (bits against the specification replay: bug on any
    difference, exact on none), "semantic" (the float64 promise against the
    float64 truth) and "tolerance" (the band, where nothing stronger applies).
    """

    config: str
    kind: str
    classification: str | None
    summary: str
    values: dict
    findings: list[Finding]
    max_deviation: float | None = None
    first_divergence: int | None = None
    finding: str | None = None
    steps_completed: int = 0
    error: str | None = None
    referee: str = "tolerance"

    @property
    def headline(self) -> str:
        return render(self.summary, self.values)

    def finding_values(self, key: str) -> dict:
        """The numbers of finding ``key``."""
        return self._finding(key).values

    def _finding(self, key: str) -> Finding:
        for f in self.findings:
            if f.key == key:
                return f
        raise KeyError(f"verdict of {self.config!r} has no finding {key!r}; it has {[f.key for f in self.findings]}")

    def to_verdict(self, case: str = "your_training") -> Verdict:
        """The same conclusion as a :class:`ddplab.verdict.Verdict` (reports, notebooks)."""
        return Verdict(case=case, kind=self.kind, summary="{config}: " + self.summary,
                       findings=list(self.findings), values={"config": self.config, **self.values},
                       scope=SCOPE)

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


def pieces_text(missing: list[int], world: int, k: int) -> str:
    """Pieces ``r*k + m`` in words: "rank 0's share", "micro-batches 0, 1 of every rank", ..."""
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


_CLAIMS = {
    "factor": "At step {step} every gradient is {factor} {factor_named}times the reference's: one constant factor",
    "missing_contribution": ("At step {step} the gradient lacks the contribution of {missing_text}: the "
                             "difference from the reference equals that gradient"),
    "desync": ("The ranks disagree: rank(s) {desync_ranks} hold gradients or parameters other than rank "
               "0's, up to {max_rank_deviation} × the band"),
    "update": ("At step {step} the gradients agree with the reference within the band, the parameters "
               "after optimizer.step() do not: the update differs ({optimizer_steps} optimizer.step() "
               "call(s) on rank 0)"),
    "semantic": ("At step {step} the gradient is not the reference's up to a factor or a missing "
                 "contribution: a different computation"),
}
_TEMPLATE = ("fit on the {pieces} batch pieces at step {step}: weights relative to the truth's "
             "{piece_weights}; residual {residual_config} (truth {residual_truth}), tolerance {tolerance}")


def _localization(frame, config: str, world: int, k: int) -> Finding | None:
    rows = _rows(frame, "localized", config)
    if rows.empty:
        return None
    row = rows.iloc[0]
    kind, step = row["finding"], int(row["step"])
    values = dict(step=step, quantity=_label(row, "quantity"), tolerance=float(_label(row, "tolerance", math.nan)),
                  factor=math.nan, factor_name=None, factor_named="", residual_config=math.nan,
                  residual_truth=math.nan, optimizer_steps=int(_label(row, "optimizer_steps", 1)))
    factor_rows = _rows(frame, "fit_factor", config)
    if not factor_rows.empty:
        values["factor"] = float(factor_rows.iloc[0]["value"])
        values["factor_name"] = _label(factor_rows.iloc[0], "factor_name")
        if values["factor_name"]:
            values["factor_named"] = f"= {values['factor_name']} "
    for _, r in _rows(frame, "fit_residual", config).iterrows():
        values[f"residual_{r['series']}"] = float(r["value"])
    weights = _rows(frame, "piece_weight", config).sort_values("piece")
    values["piece_weights"] = [round(float(v), 6) for v in weights["value"]]
    values["pieces"] = len(values["piece_weights"])
    missing = _label(row, "missing")
    values["missing"] = [int(j) for j in str(missing).split(",")] if missing not in (None, "") else []
    values["missing_pieces"] = [[j // k, j % k] for j in values["missing"]]
    values["missing_text"] = pieces_text(values["missing"], world, k) if values["missing"] else "none"
    desync = _rows(frame, "desync_deviation", config)
    # [rank, deviation] pairs, not a dict: JSON would turn integer keys into strings.
    values["rank_deviation"] = sorted([int(r["rank"]), float(r["value"])] for _, r in desync.iterrows())
    beyond = [r for r, z in values["rank_deviation"] if z > _referee.ROUNDING_MARGIN]
    values["desync_ranks"] = beyond or ["none"]
    values["max_rank_deviation"] = max((z for _, z in values["rank_deviation"]), default=0.0)
    return Finding(key=kind, claim=_CLAIMS[kind], holds=True, template=_TEMPLATE, values=values)


def _reduction(frame, config: str) -> Finding | None:
    """The reduction audit's rows (DDP buckets measured in the parent, FSDP2's audit in the ranks)."""
    rows = _rows(frame, "frac_matches_order", config)
    if rows.empty or "verdict" not in rows.columns:
        return None
    bad = rows[rows["verdict"] != "rounding"]
    first = bad.sort_values(["step", "bucket"]).iloc[0] if not bad.empty else None
    collectives = sorted({str(c) for c in rows.get("collective", rows["metric"]).dropna()} - {"frac_matches_order"})
    values = dict(audited=len(rows), steps=int(rows["step"].nunique()),
                  evidence=sorted({str(e) for e in rows["evidence"].dropna()}),
                  collective=collectives or ["allreduce"],
                  order=sorted({str(o) for o in rows["order"].dropna()}),
                  min_match=float(rows["value"].min()),
                  not_rounding=len(bad),
                  first_not_rounding_step=int(first["step"]) if first is not None else -1,
                  first_not_rounding_params=str(_label(first, "params", "")) if first is not None else "")
    return Finding(
        key="reduction",
        claim=("Every {collective} of the ranks' gradients is rounding: what {order} gives for the same "
               "contributions"),
        holds=bad.empty,
        template=("{audited} reductions audited over {steps} steps (evidence: {evidence}); smallest "
                  "fraction of elements equal to the order's bits {min_match}; not rounding: {not_rounding}"),
        values=values)


# --------------------------------------------------------------------------- the evidence, strongest first


_PHASE_TEXT = {"local_gradient": "local gradient (its bucket input)",
               "reduction": "reduced gradient (its bucket output)", "update": "update"}


def _replicas(frame, config: str) -> Finding | None:
    """Replicas must hold bitwise the same gradients and parameters after a synchronized step."""
    rows = _rows(frame, "rank_distance", config)
    if rows.empty:
        return None
    per_param = rows[rows["param"] != _referee.MODEL]
    bad = per_param[~per_param["bitwise_equal"].astype(bool)]
    values = dict(max_rank_distance=float(rows[rows["param"] == _referee.MODEL]["value"].max()),
                  step=-1, rank=-1, param="", quantity="")
    if not bad.empty:
        first = bad.assign(_q=(bad["quantity"] == "param").astype(int)).sort_values(
            ["step", "_q", "rank"], kind="stable").iloc[0]
        values.update(step=int(first["step"]), rank=int(first["rank"]), param=str(first["param"]),
                      quantity=str(first["quantity"]))
    return Finding(key="ranks_agree", claim="Every rank holds bitwise the same gradients and parameters",
                   holds=bad.empty,
                   template=("first difference: step {step}, rank {rank}, {quantity} of {param}; largest "
                             "relative distance from rank 0: {max_rank_distance}"),
                   values=values)


def _replay(frame, config: str, reason: str | None) -> Finding | None:
    """Bits against the specification replay (:mod:`ddplab.compare.replay`)."""
    from ddplab.compare.replay import first_difference

    rows = _rows(frame, "replay_differing", config)
    if rows.empty:
        return None if not reason else Finding(
            key="replay", claim="Every rank equals the specification replay bit for bit", holds=None,
            template="no replay: {reason}", values=dict(reason=reason))
    unverified = _rows(frame, "replay_unverified", config)
    first = first_difference(frame, config)
    values = dict(compared=int(len(rows)), steps=int(rows["step"].nunique()),
                  phases=sorted({str(p) for p in rows["phase"]}),
                  unverified=sorted({f"{r['phase']}: {r['reason']}" for _, r in unverified.iterrows()}) or ["none"],
                  complete=bool(unverified.empty))
    if first is not None:
        values.update(first)
        values["phase_text"] = _PHASE_TEXT[first["phase"]]
        if first["quantity"] == "forward":  # the forward outputs, compared by digest
            values["phase_text"] = "forward outputs (by digest)"
            values["param"] = first["module"] or first["param"]
        values["module_text"] = (f"; it starts in module {first['module']} "
                                 f"(by its {first['found_by'].replace('_', ' ')})" if first["module"] else "")
    return Finding(key="replay", claim="Every rank equals the specification replay bit for bit",
                   holds=first is None,
                   template=("{compared} comparisons over {steps} step(s), phases {phases}; not replayed: "
                             "{unverified}"),
                   values=values)


def _semantic(frame, config: str) -> Finding | None:
    """Does the float64 promise equal the float64 one-process truth?"""
    rows = _rows(frame, "semantic_distance", config)
    if rows.empty:
        return None
    diff = _rows(frame, "semantic_difference", config)
    values = dict(max_semantic_distance=float(rows["value"].max()),
                  semantic_tolerance=float(rows.iloc[0]["tolerance"]), step=-1, kind="none",
                  factor=math.nan, factor_name="", missing=[])
    if not diff.empty:
        d = diff.iloc[0]
        missing = _label(d, "missing", "")
        values.update(step=int(d["step"]), kind=str(d["kind"]), factor=float(_label(d, "factor", math.nan)),
                      factor_name=str(_label(d, "factor_name", "") or ""),
                      missing=[int(j) for j in str(missing).split(",")] if missing not in (None, "") else [])
    return Finding(key="semantic",
                   claim=("In float64, what the configuration promises (each rank's share, the mean over "
                          "ranks) is one process's computation"),
                   holds=diff.empty,
                   template=("largest distance of the float64 promise from the truth {max_semantic_distance} "
                             "(tolerance {semantic_tolerance})"),
                   values=values)


def _semantic_text(values: dict, world: int, k: int) -> str:
    kind = values["kind"]
    if kind == "factor":
        named = f" = {values['factor_name']}" if values["factor_name"] else ""
        return f"every gradient is {values['factor']:.6g}{named} times one process's: one constant factor"
    if kind == "missing_contribution":
        return f"the gradient lacks the contribution of {pieces_text(values['missing'], world, k)}"
    return ("the gradient is no combination of the pieces' gradients that one process takes: a different "
            "computation (per-rank statistics, local negatives, local clipping, ...)")


# --------------------------------------------------------------------------- the rule


def judge(frame, config: str, *, error: BaseException | None = None) -> ConfigVerdict:
    """The verdict on ``config`` from the comparison's records (see the module docstring)."""
    status_rows = _rows(frame, "steps_completed", config)
    if status_rows.empty:
        raise ValueError(f"no records of configuration {config!r}")
    srow = status_rows.iloc[0]
    status, done = srow["status"], int(srow["value"])
    world, k = int(_label(srow, "world_size", 1)), int(_label(srow, "k", 1))
    error_text = str(error) if error is not None else _label(srow, "error")
    failure = dict(status=status, steps_completed=done, failed_rank=_label(srow, "failed_rank", -1),
                   error=_label(srow, "error", ""))
    findings: list[Finding] = []
    if status != "completed":
        findings.append(Finding(key="completed", claim="The configuration ran every step", holds=False,
                                template="{status} after {steps_completed} step(s), rank {failed_rank}: {error}",
                                values=failure))
    dev = _rows(frame, "deviation", config)
    dev = dev[dev["rank"] == 0] if not dev.empty else dev
    if dev.empty:
        kind = status if status != "completed" else "undetermined"
        summary = {"not run": "not run: the comparison was stopped before it",
                   "unavailable": "not run: {error}"}.get(
            status, "{status} before its first step was captured (rank {failed_rank}): {error}")
        return ConfigVerdict(config, kind, None, summary, failure, findings, steps_completed=done,
                             error=error_text)
    degenerate = set()
    bands = _rows(frame, "band", config)
    for _, b in bands[bands["param"] == _referee.MODEL].iterrows():
        if b["value"] < DEGENERATE_FRACTION * float(_label(b, "unit_roundoff", 0.0)):
            degenerate.add((int(b["step"]), b["quantity"]))
    is_degenerate = [(int(s), q) in degenerate for s, q in zip(dev["step"], dev["quantity"])]
    sound = dev[[not d for d in is_degenerate]]
    worst = dev.loc[dev["value"].idxmax()]
    max_dev = float(worst["value"])
    sound_max = float(sound["value"].max()) if not sound.empty else 0.0
    classification = _referee.classify_deviation(sound_max)
    only_degenerate = max_dev > _referee.ROUNDING_MARGIN >= sound_max
    if only_degenerate:
        classification = "undetermined"
    where = (f"the gradient of {worst['param']}" if worst["quantity"] == "grad"
             else f"{worst['param']} after the update")
    values = dict(max_deviation=max_dev, step=int(worst["step"]), param=str(worst["param"]),
                  quantity=str(worst["quantity"]), where=where, rounding_margin=_referee.ROUNDING_MARGIN,
                  bug_margin=_referee.BUG_MARGIN, steps_compared=int(dev["step"].max()) + 1,
                  degenerate_steps=len(degenerate))
    findings.insert(0, Finding(
        key="within_band",
        claim=("Every gradient and parameter stays within {rounding_margin} × the reference's own "
               "distance from the float64 truth"),
        holds=max_dev <= _referee.ROUNDING_MARGIN,
        template=("largest deviation {max_deviation} × the band at step {step}, {where}, "
                  "over {steps_compared} step(s)"),
        values=values))
    first_rows = _rows(frame, "first_divergence", config)
    first = int(first_rows.iloc[0]["value"]) if not first_rows.empty else None
    local = _localization(frame, config, world, k)
    reduction = _reduction(frame, config)
    if reduction is not None:
        findings.append(reduction)
    no_replay = str(_label(srow, "no_replay", "") or "")
    random = bool(_label(srow, "random", False))
    replicas, replay, semantic = _replicas(frame, config), _replay(frame, config, no_replay), _semantic(frame, config)
    findings += [f for f in (replicas, replay, semantic) if f is not None]
    values.update(first_divergence=-1 if first is None else first, finding="none", finding_text="",
                  first_rank=0, first_param=str(worst["param"]), no_replay=no_replay,
                  compression=str(_label(srow, "compression", "") or ""),
                  max_semantic_distance=semantic.values["max_semantic_distance"] if semantic else math.nan,
                  semantic_tolerance=semantic.values["semantic_tolerance"] if semantic else math.nan)
    replay_complete = replay is not None and replay.holds is True and replay.values["complete"]
    finding = None
    # The evidence, strongest first: replicas' bits, the replay's bits, the float64 semantics,
    # and only where none of them decides, the tolerance.
    if replicas is not None and replicas.holds is False:
        classification, finding, referee = "bug", "desync", "replicas"
        if local is not None and local.key == "desync":
            findings.append(local)  # the band's view of it: each rank's distance, the piece weights
        rv = replicas.values
        values.update({f"desync_{key}": rv[key] for key in ("step", "rank", "param", "quantity")})
        first = rv["step"]
        values.update(first_divergence=first, first_rank=rv["rank"], first_param=rv["param"], replay_text="")
        if replay is not None and replay.holds is False:  # the replay says which rank and phase
            pv = replay.values
            values.update({f"replay_{key}": pv[key] for key in ("step", "rank", "phase", "param")})
            values.update(first_rank=pv["rank"], first_param=pv["param"],
                          replay_text=(f"; the replay places it at step {pv['step']} in rank {pv['rank']}'s "
                                       f"{pv['phase_text']} of {pv['param']}{pv['module_text']}"))
    elif replay is not None and replay.holds is False:
        classification, finding, referee = "bug", "replay", "replay"
        rv = replay.values
        values.update({f"replay_{key}": rv[key] for key in ("step", "rank", "phase", "quantity", "param",
                                                             "differing", "max_ulp", "max_relative", "module")})
        values.update(phase_text=rv["phase_text"], module_text=rv["module_text"])
        first = rv["step"]
        values.update(first_divergence=first, first_rank=rv["rank"], first_param=rv["param"])
    elif semantic is not None and semantic.holds is False:
        classification, referee = "bug", "semantic"
        sv = semantic.values
        # The kind the piece fit names: a factor, a missing contribution, or another computation.
        finding = sv["kind"] if sv["kind"] in ("factor", "missing_contribution") else "semantic"
        values.update(semantic_step=sv["step"], semantic_kind=sv["kind"], semantic_factor=sv["factor"],
                      semantic_missing=sv["missing"], semantic_text=_semantic_text(sv, world, k))
        first = sv["step"]
        values.update(first_divergence=first, first_rank=-1, first_param=_referee.MODEL)
    elif replay_complete and (semantic is not None or random):
        classification, referee, first = "exact", "replay", None
        values.update(first_divergence=-1)
    else:
        referee = "tolerance"
        if local is not None:
            findings.append(local)
            finding = local.key
            values.update(finding_text="; " + local.claim_text[0].lower() + local.claim_text[1:])
    values.update(referee=referee, finding=finding or "none")
    summary = _summary(classification, only_degenerate and referee == "tolerance", first is not None,
                       referee, values)
    if status != "completed":
        values.update(failure)
        summary = "{status} after {steps_completed} step(s) (rank {failed_rank}); on those steps: " + summary
    return ConfigVerdict(config, status if status != "completed" else classification, classification,
                         summary, values, findings, max_deviation=max_dev, first_divergence=first,
                         finding=finding, steps_completed=done, error=error_text, referee=referee)


def _summary(classification: str, degenerate: bool, diverged: bool, referee: str = "tolerance",
             values: dict | None = None) -> str:
    """The headline's template for the evidence that decided (see :func:`judge`)."""
    values = values or {}
    if referee == "replicas":
        return ("bug: the ranks disagree after a synchronized step: at step {desync_step} rank {desync_rank} "
                "holds a {desync_quantity} of {desync_param} bitwise other than rank 0's{replay_text}")
    if referee == "replay" and classification == "bug" and values.get("replay_quantity") == "forward":
        return ("bug: at step {replay_step}, rank {replay_rank}'s forward output of module {replay_param} "
                "differs from the specification replay's on the same input (by digest; {replay_differing} "
                "forward output(s) differ from there on)")
    if referee == "replay" and classification == "bug":
        return ("bug: at step {replay_step}, rank {replay_rank}'s {phase_text} of {replay_param} differs from "
                "the specification replay in {replay_differing} element(s), up to {replay_max_ulp} ulp "
                "({replay_max_relative} relative){module_text}")
    if referee == "semantic":
        return ("bug: what the configuration promises is not one process's computation: from step "
                "{semantic_step} the float64 promise differs from the float64 truth by {max_semantic_distance} "
                "(tolerance {semantic_tolerance}); {semantic_text}")
    if classification == "exact":
        text = ("exact: every rank equals the specification replay bit for bit at every step, so the "
                "difference from one process ({max_deviation} × the reference's own rounding distance) is "
                "the batch split's rounding")
        if values.get("compression"):
            text = ("exact: every rank equals the specification replay of the {compression} compression you "
                    "asked for, bit for bit at every step: rounding of that compression, {max_deviation} × "
                    "the reference's own rounding distance")
        if values.get("max_semantic_distance") == values.get("max_semantic_distance"):
            return text + "; in float64 the promise equals one process within {semantic_tolerance}"
        return text + ("; the model draws random numbers (dropout), so one process draws other ones and "
                       "the semantic question is not asked")
    tail = "; judged by tolerance (no replay: {no_replay})" if values.get("no_replay") else ""
    if classification == "rounding":
        return ("rounding: at most {max_deviation} × the reference's own rounding distance "
                "(margin {rounding_margin})" + tail)
    if degenerate:
        return ("undetermined: the reference reproduces the float64 truth to within a rounding, "
                "so its distance gives no band to judge by" + tail)
    where = " from step {first_divergence}" if diverged else ""
    if classification == "bug":
        return "bug: {max_deviation} × the rounding band" + where + "{finding_text}" + tail
    return ("undetermined: {max_deviation} × the rounding band" + where + ", beyond every correct run "
            "measured but not by orders of magnitude{finding_text}" + tail)


# --------------------------------------------------------------------------- the whole comparison


def configurations_in(frame) -> list[str]:
    """The compared configurations, in the order they ran (their ``steps_completed`` rows)."""
    rows = frame[frame["metric"] == "steps_completed"] if "metric" in frame.columns else frame.iloc[0:0]
    return list(dict.fromkeys(rows["config"])) if not rows.empty else []


def verdicts_markdown(frame) -> str:
    """One table row per configuration: verdict, largest deviation, first divergence, finding, headline."""
    from ddplab.formatting import fmt

    rows = ["| configuration | verdict | max deviation (× band) | first divergence (step, rank, parameter) | finding | summary |",
            "|---|---|---|---|---|---|"]
    for label in configurations_in(frame):
        v = judge(frame, label)
        first = "" if v.first_divergence is None else f"step {v.first_divergence}"
        dev = "" if v.max_deviation is None else fmt(v.max_deviation)
        if v.first_divergence is not None:
            rank = v.values.get("first_rank", 0)
            first = f"step {v.first_divergence}" + (f", rank {rank}" if rank is not None and rank >= 0 else "") + \
                f", {v.values.get('first_param', '')}"
        rows.append(f"| {label} | **{v.kind}** | {dev} | {first} | {v.finding or ''} | "
                    f"{v.headline.replace('|', '/')} |")
    return "\n".join(rows) + "\n"


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
    verdicts = [judge(frame, label) for label in labels]
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
                      finding=v.finding or "none", steps_completed=v.steps_completed)
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

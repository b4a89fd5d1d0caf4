"""Case 04's verdict rule: the agreed order is rounding; as_ready and race are real bugs, and why.

Every number a finding quotes is in its ``values`` (named as the fields of
:class:`ModeFacts`, which :func:`mode_facts` reads from a mode's records, the
one place they are read; the tables and figures use it too); the sentences
are templates (:mod:`ddplab.formatting`). Each finding is one function, and
each mode's part of the summary one :class:`Clause`.
Whether a result is rounding is the referee's call (:func:`ddplab.numerics.measure`,
recorded as the labels ``verdict`` and ``evidence``): bitwise equality with
gloo's emulated ring where it applies, else the rounding bound.
"""
from __future__ import annotations

import dataclasses
import math

from ddplab.cases.allreduce_correctness.worker import MODES, VARIABLES, WEIGHT_DECAY
from ddplab.numerics.accuracy import EVIDENCE
from ddplab.records import label_values, where
from ddplab.verdict import Finding, Verdict

__all__ = ["REPORT_MAX_DIFF", "MANY_DECADES", "SCOPE", "ModeFacts", "modes_run", "mode_facts",
           "describe_pairs", "verdict"]

#: The largest difference the report's failed assertion printed.
REPORT_MAX_DIFF = 0.00100000016
#: "Many orders of magnitude": a failing reduction this far beyond the bound is no rounding.
MANY_DECADES = 3
SCOPE = ("Covers the all-reduce of each variable's tower gradients, measured against the exact sum of "
         "the same contributions, and which tensor each rank passed to each collective (the ledger); "
         "not the towers' forward/backward that computed the gradients, nor the SGD step or drift "
         "along training.")
#: What a mode's "rounding" rests on, per kind of evidence.
GROUNDS = {"bitwise": "{matches_order} of {results} equal gloo's ring emulated on the same contributions "
                      "bit for bit (bitwise evidence)",
           "bound": "the rounding bound is the evidence (no bit-exact model applies)",
           "probabilistic": "only a probabilistic bound applies"}


def modes_run(records) -> list[str]:
    """The modes whose results were checked, in :data:`MODES` order."""
    present = set(label_values(records, "mode", "report_check_pass"))
    return [m for m in MODES if m in present]


def _classification(rows) -> str:
    """Of measured results: "not rounding" if any is, "rounding" if every one is, else "undetermined"."""
    verdicts = set(rows["verdict"].dropna())
    return ("not rounding" if "not rounding" in verdicts else
            "rounding" if verdicts == {"rounding"} else "undetermined")


def _weakest_evidence(rows) -> str:
    """The weakest evidence any measured result rests on ("none" without one)."""
    evidence = set(rows["evidence"].dropna())
    return max(evidence, key=EVIDENCE.index) if evidence else "none"


def _stat(series, how: str) -> float:
    return float(getattr(series, how)()) if len(series) else math.nan


@dataclasses.dataclass
class ModeFacts:
    """Everything the verdict, the summary and the figures say about one mode (JSON-able values).

    A *result* is one variable's reduced gradient at one step, measured by
    one rank (its label ``holders`` names every rank holding it bit for bit).
    """

    mode: str
    steps: int
    results: int
    failed: int                         # results failing the report's check
    passed: int
    first_failing_step: int | None
    failing_variables: list[str]
    max_diff: float                     # largest |add_n − reduced|
    max_ratio: float                    # largest error / rounding bound
    min_failing_ratio: float
    outside_bound: int
    first_outside_step: int | None
    rounding: int                       # results the referee calls rounding
    matches_order: int                  # results equal to gloo's emulated ring bit for bit
    min_failing_diff: float
    max_failing_diff: float
    offsets: list[list[int]]            # failing results per offset k (k·1e-3 at every element; 0: not constant), [k, n]
    constant: int                       # failing results off by a constant multiple of 1e-3
    report_number: int                  # failing results printing the report's number
    max_paired_ratio: float             # against the sum of what the ledger paired
    paired_results: int
    explained: int                      # failing results that are rounding of what the ledger paired
    mismatched_collectives: int
    mismatched_steps: int
    combined: list[str]                 # the ledger's mispairings, '0:bbb/W + 1:aaa/W'
    ranks_disagree: int                 # steps × variables where the ranks hold different results
    agree_checks: int
    classification: str
    evidence: str
    paired_classification: str
    paired_evidence: str
    # With the world size: failing results short by exactly (world_size − 1)·1e-3 at every element.
    exact: int | None = None
    offset: float | None = None
    # Race mode: steps × variables whose every write landed after gloo ran ("triggered"), and failures.
    writes: int | None = None
    triggered: int | None = None
    untriggered: int | None = None
    triggered_failed: int | None = None
    untriggered_failed: int | None = None

    @property
    def pairs(self) -> list[str]:
        return describe_pairs(self.combined)

    @property
    def same_everywhere(self) -> int:
        return self.agree_checks - self.ranks_disagree


def _race_facts(records, mode: str, check) -> dict:
    """Per (step, variable): did every rank's write land after gloo had run, and did it fail?"""
    late = where(records, "write_after_completion", mode=mode).groupby(["step", "variable"])["value"].min()
    passed = check.groupby(["step", "variable"])["value"].min().reindex(late.index)
    return dict(writes=len(late), triggered=int((late == 1).sum()), untriggered=int((late == 0).sum()),
                triggered_failed=int(((late == 1) & (passed == 0)).sum()),
                untriggered_failed=int(((late == 0) & (passed == 0)).sum()))


def mode_facts(records, mode: str, world_size: int | None = None) -> ModeFacts:
    """Read one mode's records into :class:`ModeFacts`; ``world_size`` sets ``exact`` and ``offset``."""
    keys = ["step", "rank", "variable"]
    check, ratio, diff, offset, paired, distinct, mismatch, matches = (
        where(records, metric, mode=mode) for metric in (
            "report_check_pass", "max_bound_ratio", "report_max_diff", "constant_offset_wd",
            "paired_bound_ratio", "distinct_results", "collective_mismatch", "frac_matches_order"))
    failing = check[check["value"] == 0]
    fail_keys = failing.set_index(keys).index

    def at_failing(rows):
        rows = rows.set_index(keys)["value"]
        return rows[rows.index.isin(fail_keys)]

    failing_ratio, failing_offset, failing_diff = at_failing(ratio), at_failing(offset), at_failing(diff)
    outside = ratio[ratio["value"] > 1]
    flagged = mismatch[mismatch["value"] == 1]
    explained = paired[paired["verdict"] == "rounding"].set_index(keys).index
    extra = _race_facts(records, mode, check) if mode == "race" else {}
    if world_size is not None:
        extra.update(exact=int((failing_offset == world_size - 1).sum()), offset=(world_size - 1) * WEIGHT_DECAY)
    return ModeFacts(
        mode=mode, steps=int(check["step"].nunique()), results=len(check), failed=len(failing),
        passed=len(check) - len(failing),
        first_failing_step=None if failing.empty else int(failing["step"].min()),
        failing_variables=sorted(set(failing["variable"])),
        max_diff=_stat(diff["value"], "max"), max_ratio=_stat(ratio["value"], "max"),
        min_failing_ratio=_stat(failing_ratio, "min"),
        outside_bound=len(outside), first_outside_step=None if outside.empty else int(outside["step"].min()),
        rounding=int((ratio["verdict"] == "rounding").sum()), matches_order=int((matches["value"] == 1).sum()),
        min_failing_diff=_stat(failing_diff, "min"), max_failing_diff=_stat(failing_diff, "max"),
        offsets=sorted([int(k), int(n)] for k, n in failing_offset.value_counts().items()),
        constant=int((failing_offset != 0).sum()),
        # The report's number as float32 prints it: nine significant digits.
        report_number=int(failing_diff.map(lambda v: f"{v:.9g}" == f"{REPORT_MAX_DIFF:.9g}").sum()),
        max_paired_ratio=_stat(paired["value"], "max"), paired_results=len(paired),
        explained=int(fail_keys.isin(explained).sum()),
        mismatched_collectives=len(flagged), mismatched_steps=int(flagged["step"].nunique()),
        combined=sorted(set(flagged["combined"].dropna())),
        ranks_disagree=int((distinct["value"] > 1).sum()), agree_checks=len(distinct),
        classification=_classification(ratio), evidence=_weakest_evidence(ratio),
        paired_classification=_classification(paired), paired_evidence=_weakest_evidence(paired),
        **extra)


def describe_pairs(combined: list[str]) -> list[str]:
    """'0:bbb/W + 1:aaa/W' → "rank 0's bbb/W with rank 1's aaa/W" (more ranks joined by 'and')."""
    out = []
    for pair in combined:
        named = [f"rank {r}'s {v}" for r, v in (p.split(":", 1) for p in pair.split(" + "))]
        out.append(named[0] + " with " + " and ".join(named[1:]))
    return out


def _pick(facts: ModeFacts, names: str, **extra) -> dict:
    """The facts called ``names`` (space-separated), as a finding quotes them."""
    return {**{n: getattr(facts, n) for n in names.split()}, **extra}


# --------------------------------------------------------------------------- findings


def _fixed(f: ModeFacts | None, tolerance: float) -> Finding:
    claim = ("fixed (one agreed order): every result passes the report's check and is what rounding "
             "in gloo's ring gives, at every step")
    if f is None:
        return Finding("fixed_within_bound", claim, None, "not run (mode does not include 'fixed')")
    ok = f.failed == 0 and f.classification == "rounding" and f.mismatched_collectives == 0
    return Finding(
        "fixed_within_bound", claim, ok,
        "{passed} of {results} results ({steps} steps × {variables} variables; ranks disagree in "
        "{ranks_disagree} of them) pass |add_n − reduced| < {tolerance} (largest difference {max_diff}); "
        "{rounding} of {results} are rounding: " + GROUNDS.get(f.evidence, "no verdict was recorded")
        + "; largest error / rounding bound {max_ratio:.7g} ({outside_bound} beyond 1); the ledger found "
        "{mismatched_collectives} mispaired collectives",
        _pick(f, "passed results steps ranks_disagree max_diff rounding matches_order evidence "
                 "classification max_ratio outside_bound mismatched_collectives",
              variables=len(VARIABLES), tolerance=tolerance))


def _as_ready(a: ModeFacts) -> list[Finding]:
    decades = math.log10(a.min_failing_ratio) if a.failed and a.min_failing_ratio > 0 else 0
    not_rounding = Finding(
        "as_ready_not_rounding",
        "as_ready (one all_reduce per gradient as autograd produces it): fails the report's check with "
        "errors at least 10^{decades} times the rounding bound — a real bug",
        a.failed > 0 and a.classification == "not rounding" and decades >= MANY_DECADES,
        "{failed} of {results} results fail the report's check, from step {first_failing_step} on, in "
        "{failing_variables}; their error is {min_failing_ratio} to {max_ratio} times the rounding bound; "
        "classified '{classification}' ({evidence} evidence)" if a.failed else
        "no result failed in {steps} steps (largest error / bound {max_ratio:.7g})",
        _pick(a, "failed results steps first_failing_step failing_variables min_failing_ratio max_ratio "
                 "classification evidence", decades=MANY_DECADES))
    named = {v for pair in a.combined for v in (p.split(":", 1)[1] for p in pair.split(" + "))}
    mispaired = Finding(
        "as_ready_mispaired",
        "The cause is mispaired collectives: towers issue in different orders and collectives pair by "
        "issue order, so same-shaped gradients of different variables are summed",
        bool(a.pairs) and a.explained == a.failed and a.paired_classification == "rounding"
        and set(a.failing_variables) <= named,
        "the ledger flags {mismatched_collectives} collectives in {mismatched_steps} of {steps} steps: "
        "{pairs}; measured as the sum of exactly the tensors the ledger paired, the {paired_results} "
        "results of those collectives are '{paired_classification}' ({paired_evidence} evidence; largest "
        "error / bound against that sum {max_paired_ratio:.7g}); {explained} of the {failed} failing "
        "results are explained so; the towers end up holding different results in {ranks_disagree} of "
        "{agree_checks} steps × variables" if a.pairs else "the ledger found no mispaired collective",
        _pick(a, "mismatched_collectives mismatched_steps steps pairs combined paired_results "
                 "paired_classification paired_evidence max_paired_ratio explained failed "
                 "failing_variables ranks_disagree agree_checks"))
    return [not_rounding, mispaired]


def _race(r: ModeFacts) -> Finding:
    return Finding(
        "race_not_rounding",
        "race (buffer written again before wait()): wherever the write lands after the collective read "
        "the buffer, the result lacks the other towers' last write — a real bug the ledger cannot see "
        "(the pairing is right)",
        (r.triggered > 0 and r.triggered_failed == r.triggered and r.exact == r.failed
         and r.classification == "not rounding" and r.mismatched_collectives == 0),
        "every rank's write landed after gloo had run in {triggered} of {writes} steps × variables"
        + (" (the race did not trigger in this run)" if r.triggered == 0 else "")
        + "; {triggered_failed} of those fail the report's check"
        + (" ({untriggered_failed} of the {untriggered} others)" if r.untriggered else "")
        + "; error {min_failing_ratio} to {max_ratio} times the rounding bound ('{classification}', "
        "{evidence} evidence); the ledger found {mismatched_collectives} mispaired collectives; {exact} of "
        "{failed} failing results are short by exactly {offset:.3g} at every element (1e-3 per other "
        "tower: their weight-decay gradients); every tower holds the same wrong value in "
        "{same_everywhere} of {agree_checks} steps × variables, so a cross-rank consistency check cannot "
        "see it",
        _pick(r, "triggered writes triggered_failed untriggered untriggered_failed min_failing_ratio "
                 "max_ratio classification evidence mismatched_collectives exact failed offset "
                 "same_everywhere agree_checks"))


def _signature(a: ModeFacts | None, r: ModeFacts | None) -> Finding:
    """Does the reproduction's error carry the report's 0.00100000016, and what does that say?"""
    values = dict(report=REPORT_MAX_DIFF, in_decays=REPORT_MAX_DIFF / WEIGHT_DECAY)
    parts = ["the report printed {report:.9g} = {in_decays:.8f}×1e-3, one weight-decay gradient (an "
             "unused variable's whole gradient is 1e-3 everywhere)"]
    ok = True
    if a is not None and a.failed:
        ok &= a.constant == 0
        values.update({f"as_ready_{k}": getattr(a, k) for k in ("min_failing_diff", "max_failing_diff",
                                                                 "constant", "failed", "report_number")})
        parts.append("as_ready: largest differences {as_ready_min_failing_diff:.3g} to "
                     "{as_ready_max_failing_diff:.3g}, a constant multiple of 1e-3 in {as_ready_constant} "
                     "of {as_ready_failed} failing results, the report's number in {as_ready_report_number}: "
                     "a mispaired result is off by another tower's whole gradient, which varies from "
                     "element to element")
    if r is not None and r.failed:
        ok &= r.exact == r.failed
        values.update({f"race_{k}": getattr(r, k) for k in ("exact", "failed", "offset", "report_number")})
        parts.append("race: {race_exact} of {race_failed} failing results are off by exactly "
                     "{race_offset:.3g} at every element, {race_report_number} print the report's "
                     "{report:.9g} digit for digit")
    parts.append("so the report's failing result most likely summed the right variable's gradients with "
                 "one weight-decay term (1e-3 at every element) missing or doubled, which is what a buffer "
                 "read before its last write gives; swapped aaa/W and bbb/W would be off by a whole "
                 "gradient of another tower")
    return Finding("report_signature",
                   "The report's 0.00100000016 carries the signature of a gradient read before its last "
                   "write (race), not that of a mispaired collective (as_ready)", ok, "; ".join(parts),
                   values)


# --------------------------------------------------------------------------- the verdict


@dataclasses.dataclass
class Clause:
    """One mode's part of the summary: a template, the values it quotes, the key numbers it adds."""

    text: str
    values: dict
    key_numbers: dict


def _fixed_clause(f: ModeFacts) -> Clause:
    values = {f"fixed_{k}": getattr(f, k) for k in ("results", "passed", "failed", "rounding", "max_ratio",
                                                     "classification", "evidence", "matches_order")}
    values["fixed_within"] = f.results - f.outside_bound
    text = (("with one agreed order (fixed) all {fixed_results} results pass the report's check and are "
             "rounding, " + ("bit for bit what gloo's ring gives" if f.evidence == "bitwise" else
                             "within the rounding bound (the bound is the evidence)"))
            if f.failed == 0 and f.classification == "rounding" else
            "with one agreed order (fixed) {fixed_failed} of {fixed_results} results fail the report's "
            "check and {fixed_rounding} are rounding ('{fixed_classification}', {fixed_evidence} "
            "evidence; largest error / bound {fixed_max_ratio:.7g})")
    return Clause(text, values, {"fixed: results that are rounding": "fixed_rounding",
                                 "fixed: evidence (bitwise: equal to gloo's emulated ring)": "fixed_evidence"})


def _as_ready_clause(a: ModeFacts) -> Clause:
    return Clause(
        "issuing each all_reduce as autograd produces the gradient (as_ready) fails from step "
        "{as_ready_first}: the towers issue in different orders and collectives pair by issue "
        "order, so {pairs} were summed (errors {as_ready_min_ratio} to {as_ready_max_ratio} × the bound)",
        dict(as_ready_first=a.first_failing_step, as_ready_min_ratio=a.min_failing_ratio,
             as_ready_max_ratio=a.max_ratio, pairs=" and ".join(a.pairs) or "different tensors"),
        {"as_ready: smallest failing error / rounding bound": "as_ready_min_ratio",
         "as_ready: what the ledger says was summed": "pairs"})


def _race_clause(r: ModeFacts) -> Clause:
    return Clause(
        "writing the buffer before wait() (race) leaves results short by the other towers' "
        "weight-decay gradients, {race_offset:.3g}"
        + (" — {race_report} results print the report's {report:.9g}" if r.report_number else ""),
        dict(race_offset=r.offset, race_exact=r.exact, race_report=r.report_number),
        {"race: failing results short by exactly the others' weight decay": "race_exact",
         "race: results printing the report's 0.00100000016": "race_report"})


def _clauses(fixed: ModeFacts | None, as_ready: ModeFacts | None, race: ModeFacts | None) -> list[Clause]:
    """The summary's parts: the fixed order if it ran, each bug mode if it failed."""
    clauses = [_fixed_clause(fixed)] if fixed is not None else []
    if as_ready is not None and as_ready.failed:
        clauses.append(_as_ready_clause(as_ready))
    if race is not None and race.failed:
        clauses.append(_race_clause(race))
    return clauses


def _findings(fixed: ModeFacts | None, as_ready: ModeFacts | None, race: ModeFacts | None,
              tolerance: float) -> list[Finding]:
    findings = [_fixed(fixed, tolerance)]
    findings += _as_ready(as_ready) if as_ready is not None else []
    findings += [_race(race)] if race is not None else []
    if as_ready is not None or race is not None:
        findings.append(_signature(as_ready, race))
    return findings


def verdict(records, params: dict) -> Verdict:
    """kind "bug" when a mode's results are "not rounding" (as_ready and race with the defaults),
    "rounding" when every result of every mode run is rounding (on the referee's strongest
    evidence: bitwise equality with gloo's emulated ring, else the bound), else "undetermined"."""
    w = params["world_size"]
    facts = {m: mode_facts(records, m, w) for m in modes_run(records)}
    fixed, as_ready, race = facts.get("fixed"), facts.get("as_ready"), facts.get("race")
    findings = _findings(fixed, as_ready, race, params["tolerance"])
    clauses = _clauses(fixed, as_ready, race)
    values = dict(modes=list(facts), world_size=w, report=REPORT_MAX_DIFF)
    key_numbers = {}
    for clause in clauses:
        values.update(clause.values)
        key_numbers.update(clause.key_numbers)
    kinds = {x.classification for x in facts.values()}
    kind = "bug" if "not rounding" in kinds else "rounding" if kinds == {"rounding"} else "undetermined"
    summary = {"bug": "A real bug, not rounding: ", "rounding": "Rounding only: "}.get(kind, "")
    summary += "; ".join(c.text for c in clauses) + "." if clauses else "Nothing was measured."
    values["not_holding"] = [fi.key for fi in findings if fi.holds is False]
    if values["not_holding"]:
        summary += " Not every expected finding holds: {not_holding} (read their evidence)."
    return Verdict(case="allreduce_correctness", kind=kind, summary=summary, findings=findings,
                   values=values, scope=SCOPE, key_numbers=key_numbers)

"""Case 04's verdict rule: the agreed order is rounding; as_ready and race are real bugs, and why.

Every number a finding quotes is in its ``values`` (named as in
:func:`mode_facts`, the one place a mode's records are read; the tables and
figures use it too); the sentences are templates (:mod:`ddplab.formatting`).
Whether a result is rounding is the referee's call (:func:`ddplab.numerics.measure`,
recorded as the labels ``verdict`` and ``evidence``): bitwise equality with
gloo's emulated ring where it applies, else the rounding bound.
"""
from __future__ import annotations

import math

from ddplab.cases.allreduce_correctness.worker import MODES, VARIABLES, WEIGHT_DECAY
from ddplab.numerics.accuracy import EVIDENCE
from ddplab.records import label_values, where
from ddplab.verdict import Finding, Verdict

__all__ = ["REPORT_MAX_DIFF", "MANY_DECADES", "SCOPE", "modes_run", "mode_facts", "describe_pairs",
           "verdict"]

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


def _judged(rows) -> tuple[str, str]:
    """(classification, evidence) of measured results: "not rounding" if any is, "rounding" if
    every one is, else "undetermined"; the evidence is the weakest any result rests on."""
    verdicts, evidence = set(rows["verdict"].dropna()), set(rows["evidence"].dropna())
    kind = ("not rounding" if "not rounding" in verdicts else
            "rounding" if verdicts == {"rounding"} else "undetermined")
    return kind, max(evidence, key=EVIDENCE.index) if evidence else "none"


def _stat(series, how: str) -> float:
    return float(getattr(series, how)()) if len(series) else math.nan


def mode_facts(records, mode: str, world_size: int | None = None) -> dict:
    """Everything the verdict, the summary and the figures say about one mode (JSON-able values).

    A *result* is one variable's reduced gradient at one step, measured by
    one rank (its label ``holders`` names every rank holding it bit for bit).
    ``world_size`` sets ``exact``: failing results short by exactly
    (world_size − 1)·1e-3 at every element.
    """
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
    facts = dict(
        mode=mode, steps=int(check["step"].nunique()), results=len(check), failed=len(failing),
        passed=len(check) - len(failing),
        first_failing_step=None if failing.empty else int(failing["step"].min()),
        failing_variables=sorted(set(failing["variable"])),
        max_diff=_stat(diff["value"], "max"), max_ratio=_stat(ratio["value"], "max"),
        min_failing_ratio=_stat(failing_ratio, "min"),
        outside_bound=len(outside), first_outside_step=None if outside.empty else int(outside["step"].min()),
        rounding=int((ratio["verdict"] == "rounding").sum()), matches_order=int((matches["value"] == 1).sum()),
        min_failing_diff=_stat(failing_diff, "min"), max_failing_diff=_stat(failing_diff, "max"),
        # Failing results per offset k (k·1e-3 at every element; 0: not constant), as [k, n] pairs.
        offsets=sorted([int(k), int(n)] for k, n in failing_offset.value_counts().items()),
        constant=int((failing_offset != 0).sum()),
        # The report's number as float32 prints it: nine significant digits.
        report_number=int(failing_diff.map(lambda v: f"{v:.9g}" == f"{REPORT_MAX_DIFF:.9g}").sum()),
        max_paired_ratio=_stat(paired["value"], "max"), paired_results=len(paired),
        explained=int(fail_keys.isin(explained).sum()),
        mismatched_collectives=len(flagged), mismatched_steps=int(flagged["step"].nunique()),
        combined=sorted(set(flagged["combined"].dropna())),
        ranks_disagree=int((distinct["value"] > 1).sum()), agree_checks=len(distinct),
    )
    facts["classification"], facts["evidence"] = _judged(ratio)
    facts["paired_classification"], facts["paired_evidence"] = _judged(paired)
    facts["pairs"] = describe_pairs(facts["combined"])
    facts["same_everywhere"] = facts["agree_checks"] - facts["ranks_disagree"]
    if world_size is not None:
        facts["exact"] = int((failing_offset == world_size - 1).sum())
        facts["offset"] = (world_size - 1) * WEIGHT_DECAY
    if mode == "race":
        # Per (step, variable): did every rank's write land after gloo had run?
        late = where(records, "write_after_completion", mode=mode).groupby(["step", "variable"])["value"].min()
        passed = check.groupby(["step", "variable"])["value"].min().reindex(late.index)
        facts.update(writes=len(late), triggered=int((late == 1).sum()),
                     untriggered=int((late == 0).sum()),
                     triggered_failed=int(((late == 1) & (passed == 0)).sum()),
                     untriggered_failed=int(((late == 0) & (passed == 0)).sum()))
    return facts


def describe_pairs(combined: list[str]) -> list[str]:
    """'0:bbb/W + 1:aaa/W' → "rank 0's bbb/W with rank 1's aaa/W" (more ranks joined by 'and')."""
    out = []
    for pair in combined:
        named = [f"rank {r}'s {v}" for r, v in (p.split(":", 1) for p in pair.split(" + "))]
        out.append(named[0] + " with " + " and ".join(named[1:]))
    return out


def _pick(facts: dict, names: str, **extra) -> dict:
    return {**{n: facts[n] for n in names.split()}, **extra}


# --------------------------------------------------------------------------- findings


def _fixed(f: dict | None, tolerance: float) -> Finding:
    claim = ("fixed (one agreed order): every result passes the report's check and is what rounding "
             "in gloo's ring gives, at every step")
    if f is None:
        return Finding("fixed_within_bound", claim, None, "not run (mode does not include 'fixed')")
    ok = f["failed"] == 0 and f["classification"] == "rounding" and f["mismatched_collectives"] == 0
    return Finding(
        "fixed_within_bound", claim, ok,
        "{passed} of {results} results ({steps} steps × {variables} variables; ranks disagree in "
        "{ranks_disagree} of them) pass |add_n − reduced| < {tolerance} (largest difference {max_diff}); "
        "{rounding} of {results} are rounding: " + GROUNDS.get(f["evidence"], "no verdict was recorded")
        + "; largest error / rounding bound {max_ratio:.7g} ({outside_bound} beyond 1); the ledger found "
        "{mismatched_collectives} mispaired collectives",
        _pick(f, "passed results steps ranks_disagree max_diff rounding matches_order evidence "
                 "classification max_ratio outside_bound mismatched_collectives",
              variables=len(VARIABLES), tolerance=tolerance))


def _as_ready(a: dict) -> list[Finding]:
    decades = math.log10(a["min_failing_ratio"]) if a["failed"] and a["min_failing_ratio"] > 0 else 0
    not_rounding = Finding(
        "as_ready_not_rounding",
        "as_ready (one all_reduce per gradient as autograd produces it): fails the report's check with "
        "errors at least 10^{decades} times the rounding bound — a real bug",
        a["failed"] > 0 and a["classification"] == "not rounding" and decades >= MANY_DECADES,
        "{failed} of {results} results fail the report's check, from step {first_failing_step} on, in "
        "{failing_variables}; their error is {min_failing_ratio} to {max_ratio} times the rounding bound; "
        "classified '{classification}' ({evidence} evidence)" if a["failed"] else
        "no result failed in {steps} steps (largest error / bound {max_ratio:.7g})",
        _pick(a, "failed results steps first_failing_step failing_variables min_failing_ratio max_ratio "
                 "classification evidence", decades=MANY_DECADES))
    named = {v for pair in a["combined"] for v in (p.split(":", 1)[1] for p in pair.split(" + "))}
    mispaired = Finding(
        "as_ready_mispaired",
        "The cause is mispaired collectives: towers issue in different orders and collectives pair by "
        "issue order, so same-shaped gradients of different variables are summed",
        bool(a["pairs"]) and a["explained"] == a["failed"] and a["paired_classification"] == "rounding"
        and set(a["failing_variables"]) <= named,
        "the ledger flags {mismatched_collectives} collectives in {mismatched_steps} of {steps} steps: "
        "{pairs}; measured as the sum of exactly the tensors the ledger paired, the {paired_results} "
        "results of those collectives are '{paired_classification}' ({paired_evidence} evidence; largest "
        "error / bound against that sum {max_paired_ratio:.7g}); {explained} of the {failed} failing "
        "results are explained so; the towers end up holding different results in {ranks_disagree} of "
        "{agree_checks} steps × variables" if a["pairs"] else "the ledger found no mispaired collective",
        _pick(a, "mismatched_collectives mismatched_steps steps pairs combined paired_results "
                 "paired_classification paired_evidence max_paired_ratio explained failed "
                 "failing_variables ranks_disagree agree_checks"))
    return [not_rounding, mispaired]


def _race(r: dict) -> Finding:
    return Finding(
        "race_not_rounding",
        "race (buffer written again before wait()): wherever the write lands after the collective read "
        "the buffer, the result lacks the other towers' last write — a real bug the ledger cannot see "
        "(the pairing is right)",
        (r["triggered"] > 0 and r["triggered_failed"] == r["triggered"] and r["exact"] == r["failed"]
         and r["classification"] == "not rounding" and r["mismatched_collectives"] == 0),
        "every rank's write landed after gloo had run in {triggered} of {writes} steps × variables"
        + (" (the race did not trigger in this run)" if r["triggered"] == 0 else "")
        + "; {triggered_failed} of those fail the report's check"
        + (" ({untriggered_failed} of the {untriggered} others)" if r["untriggered"] else "")
        + "; error {min_failing_ratio} to {max_ratio} times the rounding bound ('{classification}', "
        "{evidence} evidence); the ledger found {mismatched_collectives} mispaired collectives; {exact} of "
        "{failed} failing results are short by exactly {offset:.3g} at every element (1e-3 per other "
        "tower: their weight-decay gradients); every tower holds the same wrong value in "
        "{same_everywhere} of {agree_checks} steps × variables, so a cross-rank consistency check cannot "
        "see it",
        _pick(r, "triggered writes triggered_failed untriggered untriggered_failed min_failing_ratio "
                 "max_ratio classification evidence mismatched_collectives exact failed offset "
                 "same_everywhere agree_checks"))


def _signature(a: dict | None, r: dict | None) -> Finding:
    """Does the reproduction's error carry the report's 0.00100000016, and what does that say?"""
    values = dict(report=REPORT_MAX_DIFF, in_decays=REPORT_MAX_DIFF / WEIGHT_DECAY)
    parts = ["the report printed {report:.9g} = {in_decays:.8f}×1e-3, one weight-decay gradient (an "
             "unused variable's whole gradient is 1e-3 everywhere)"]
    ok = True
    if a and a["failed"]:
        ok &= a["constant"] == 0
        values.update({f"as_ready_{k}": a[k] for k in ("min_failing_diff", "max_failing_diff", "constant",
                                                        "failed", "report_number")})
        parts.append("as_ready: largest differences {as_ready_min_failing_diff:.3g} to "
                     "{as_ready_max_failing_diff:.3g}, a constant multiple of 1e-3 in {as_ready_constant} "
                     "of {as_ready_failed} failing results, the report's number in {as_ready_report_number}: "
                     "a mispaired result is off by another tower's whole gradient, which varies from "
                     "element to element")
    if r and r["failed"]:
        ok &= r["exact"] == r["failed"]
        values.update({f"race_{k}": r[k] for k in ("exact", "failed", "offset", "report_number")})
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


def verdict(records, params: dict) -> Verdict:
    """kind "bug" when a mode's results are "not rounding" (as_ready and race with the defaults),
    "rounding" when every result of every mode run is rounding (on the referee's strongest
    evidence: bitwise equality with gloo's emulated ring, else the bound), else "undetermined"."""
    w = params["world_size"]
    facts = {m: mode_facts(records, m, w) for m in modes_run(records)}
    f, a, r = (facts.get(m) for m in MODES)
    findings = [_fixed(f, params["tolerance"])] + (_as_ready(a) if a else []) + ([_race(r)] if r else [])
    if a or r:
        findings.append(_signature(a, r))

    values = dict(modes=list(facts), world_size=w, report=REPORT_MAX_DIFF)
    parts, key_numbers = [], {}
    if f:
        values.update({f"fixed_{k}": f[k] for k in ("results", "passed", "failed", "rounding", "max_ratio",
                                                     "classification", "evidence", "matches_order")})
        values["fixed_within"] = f["results"] - f["outside_bound"]
        parts.append(("with one agreed order (fixed) all {fixed_results} results pass the report's check "
                      "and are rounding, " + ("bit for bit what gloo's ring gives"
                                              if f["evidence"] == "bitwise" else
                                              "within the rounding bound (the bound is the evidence)"))
                     if f["failed"] == 0 and f["classification"] == "rounding" else
                     "with one agreed order (fixed) {fixed_failed} of {fixed_results} results fail the "
                     "report's check and {fixed_rounding} are rounding ('{fixed_classification}', "
                     "{fixed_evidence} evidence; largest error / bound {fixed_max_ratio:.7g})")
        key_numbers.update({"fixed: results that are rounding": "fixed_rounding",
                            "fixed: evidence (bitwise: equal to gloo's emulated ring)": "fixed_evidence"})
    if a and a["failed"]:
        values.update(as_ready_first=a["first_failing_step"], as_ready_min_ratio=a["min_failing_ratio"],
                      as_ready_max_ratio=a["max_ratio"], pairs=" and ".join(a["pairs"]) or "different tensors")
        parts.append("issuing each all_reduce as autograd produces the gradient (as_ready) fails from step "
                     "{as_ready_first}: the towers issue in different orders and collectives pair by issue "
                     "order, so {pairs} were summed (errors {as_ready_min_ratio} to {as_ready_max_ratio} × "
                     "the bound)")
        key_numbers.update({"as_ready: smallest failing error / rounding bound": "as_ready_min_ratio",
                            "as_ready: what the ledger says was summed": "pairs"})
    if r and r["failed"]:
        values.update(race_offset=r["offset"], race_exact=r["exact"], race_report=r["report_number"])
        parts.append("writing the buffer before wait() (race) leaves results short by the other towers' "
                     "weight-decay gradients, {race_offset:.3g}"
                     + (" — {race_report} results print the report's {report:.9g}" if r["report_number"] else ""))
        key_numbers.update({"race: failing results short by exactly the others' weight decay": "race_exact",
                            "race: results printing the report's 0.00100000016": "race_report"})
    kinds = {x["classification"] for x in facts.values()}
    kind = "bug" if "not rounding" in kinds else "rounding" if kinds == {"rounding"} else "undetermined"
    summary = {"bug": "A real bug, not rounding: ", "rounding": "Rounding only: "}.get(kind, "")
    summary += "; ".join(parts) + "." if parts else "Nothing was measured."
    values["not_holding"] = [fi.key for fi in findings if fi.holds is False]
    if values["not_holding"]:
        summary += " Not every expected finding holds: {not_holding} (read their evidence)."
    return Verdict(case="allreduce_correctness", kind=kind, summary=summary, findings=findings,
                   values=values, scope=SCOPE, key_numbers=key_numbers)

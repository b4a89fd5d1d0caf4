"""Case 04's verdict rule: the agreed order is rounding; as_ready and race are real bugs, and why.

Every number a finding quotes is in its ``values``; the sentences are
templates (:mod:`ddplab.formatting`). :func:`mode_facts` is the one place
the records of a mode are read; the tables and figures use it too.
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


def modes_run(records) -> list[str]:
    """The modes whose results were checked, in :data:`MODES` order."""
    present = set(label_values(records, "mode", "report_check_pass"))
    return [m for m in MODES if m in present]


def _first_step(rows) -> int | None:
    return None if rows.empty else int(rows["step"].min())


def _judged(rows) -> tuple[str, str | None]:
    """(classification, evidence) of a set of measured results, from the referee's labels.

    "not rounding" if any result is; "rounding" only if every one is; else
    "undetermined". The evidence is the weakest any result rests on.
    """
    verdicts = set(rows["verdict"].dropna()) if "verdict" in rows else set()
    evidence = set(rows["evidence"].dropna()) if "evidence" in rows else set()
    kind = ("not rounding" if "not rounding" in verdicts else
            "rounding" if verdicts == {"rounding"} else "undetermined")
    return kind, max(evidence, key=EVIDENCE.index) if evidence else None


def _prints_report(value: float) -> bool:
    # The report's number as float32 prints it: nine significant digits.
    return f"{value:.9g}" == f"{REPORT_MAX_DIFF:.9g}"


def mode_facts(records, mode: str) -> dict:
    """Everything the verdict, the summary and the figures say about one mode, from its records.

    A *result* is one variable's reduced gradient at one step, measured by
    one rank (its label ``holders`` names every rank holding it bit for bit).
    """
    keys = ["step", "rank", "variable"]
    check, ratio, diff, offset, paired, distinct, mismatch = (
        where(records, metric, mode=mode) for metric in (
            "report_check_pass", "max_bound_ratio", "report_max_diff", "constant_offset_wd",
            "paired_bound_ratio", "distinct_results", "collective_mismatch"))
    failing = check[check["value"] == 0]
    fail_keys = failing.set_index(keys).index

    def at_failing(rows):
        rows = rows.set_index(keys)["value"]
        return rows[rows.index.isin(fail_keys)]

    failing_ratio, failing_offset, failing_diff = at_failing(ratio), at_failing(offset), at_failing(diff)
    outside = ratio[ratio["value"] > 1]
    flagged = mismatch[mismatch["value"] == 1]
    classification, evidence = _judged(ratio)
    paired_kind, paired_evidence = _judged(paired)
    explained = paired[paired["verdict"] == "rounding"].set_index(keys).index if len(paired) else []
    facts = dict(
        mode=mode, steps=int(check["step"].nunique()), results=len(check), failed=len(failing),
        first_failing_step=_first_step(failing),
        failing_variables=sorted(set(failing["variable"])),
        max_diff=float(diff["value"].max()) if len(diff) else math.nan,
        max_ratio=float(ratio["value"].max()) if len(ratio) else math.nan,
        min_failing_ratio=float(failing_ratio.min()) if len(failing_ratio) else math.nan,
        outside_bound=len(outside), first_outside_step=_first_step(outside),
        classification=classification, evidence=evidence,
        rounding=int((ratio["verdict"] == "rounding").sum()) if len(ratio) else 0,
        matches_order=int((where(records, "frac_matches_order", mode=mode)["value"] == 1).sum()),
        min_failing_diff=float(failing_diff.min()) if len(failing_diff) else math.nan,
        max_failing_diff=float(failing_diff.max()) if len(failing_diff) else math.nan,
        # Failing results per offset k (k·1e-3 at every element; 0: not constant).
        offsets={int(k): int(n) for k, n in failing_offset.value_counts().items()},
        report_number=int(failing_diff.map(_prints_report).sum()),
        max_paired_ratio=float(paired["value"].max()) if len(paired) else math.nan,
        paired_results=len(paired), paired_classification=paired_kind, paired_evidence=paired_evidence,
        failing_unexplained=int((~fail_keys.isin(explained)).sum()),
        mismatched_collectives=len(flagged), mismatched_steps=int(flagged["step"].nunique()),
        combined=sorted(set(flagged["combined"].dropna())),
        ranks_disagree=int((distinct["value"] > 1).sum()), agree_checks=len(distinct),
    )
    if mode == "race":
        # Per (step, variable): did every rank's write land after gloo had run?
        late = where(records, "write_after_completion", mode=mode).groupby(["step", "variable"])["value"].min()
        passed = check.groupby(["step", "variable"])["value"].min().reindex(late.index)
        facts.update(writes=len(late), triggered=int((late == 1).sum()),
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


# --------------------------------------------------------------------------- findings


#: What a "rounding" verdict rests on, per kind of evidence (the referee's strongest first).
GROUNDS = {"bitwise": "{matches} of {results} equal gloo's ring emulated on the same contributions bit "
                      "for bit (bitwise evidence)",
           "bound": "the bound is the evidence (no bit-exact model)",
           "probabilistic": "only a probabilistic bound applies (undetermined)"}


def _fixed(f: dict | None, tolerance: float) -> Finding:
    claim = ("fixed (one agreed order): every result passes the report's check and is what rounding "
             "in gloo's ring gives, at every step")
    if f is None:
        return Finding("fixed_within_bound", claim, None, "not run (mode does not include 'fixed')")
    values = dict(passed=f["results"] - f["failed"], results=f["results"], steps=f["steps"],
                  variables=len(VARIABLES), ranks_disagree=f["ranks_disagree"], tolerance=tolerance,
                  max_diff=f["max_diff"], max_ratio=f["max_ratio"], outside=f["outside_bound"],
                  mismatched=f["mismatched_collectives"], classification=f["classification"],
                  rounding=f["rounding"], evidence=f["evidence"] or "none", matches=f["matches_order"])
    ok = f["failed"] == 0 and f["classification"] == "rounding" and f["mismatched_collectives"] == 0
    return Finding("fixed_within_bound", claim, ok,
                   "{passed} of {results} results ({steps} steps × {variables} variables; ranks "
                   "disagree in {ranks_disagree} of them) pass |add_n − reduced| < {tolerance} (largest "
                   "difference {max_diff}); {rounding} of {results} are rounding: "
                   + GROUNDS.get(f["evidence"], "no verdict was recorded")
                   + "; largest error / rounding bound {max_ratio:.7g} ({outside} beyond 1); the ledger "
                   "found {mismatched} mispaired collectives", values)


def _as_ready(a: dict) -> list[Finding]:
    values = dict(failed=a["failed"], results=a["results"], steps=a["steps"],
                  first_step=a["first_failing_step"] if a["failed"] else "never",
                  failing_variables=a["failing_variables"] or "none", min_ratio=a["min_failing_ratio"],
                  max_ratio=a["max_ratio"], classification=a["classification"], decades=MANY_DECADES,
                  evidence=a["evidence"] or "none")
    decades = math.log10(a["min_failing_ratio"]) if a["failed"] and a["min_failing_ratio"] > 0 else 0
    ok = a["failed"] > 0 and a["classification"] == "not rounding" and decades >= MANY_DECADES
    template = ("{failed} of {results} results fail the report's check, from step {first_step} on, in "
                "{failing_variables}; their error is {min_ratio} to {max_ratio} times the rounding bound; "
                "classified '{classification}' ({evidence} evidence)" if a["failed"] else
                "no result failed in {steps} steps (largest error / bound {max_ratio:.7g})")
    not_rounding = Finding(
        "as_ready_not_rounding",
        "as_ready (one all_reduce per gradient as autograd produces it): fails the report's check with "
        "errors at least 10^{decades} times the rounding bound — a real bug", ok, template, values)

    pairs = describe_pairs(a["combined"])
    named = {v for pair in a["combined"] for v in (p.split(":", 1)[1] for p in pair.split(" + "))}
    explained = a["failing_unexplained"] == 0 and a["paired_classification"] == "rounding"
    values = dict(mismatched=a["mismatched_collectives"], mismatched_steps=a["mismatched_steps"],
                  steps=a["steps"], pairs=pairs or "none", combined=a["combined"],
                  paired_results=a["paired_results"], max_paired_ratio=a["max_paired_ratio"],
                  paired_classification=a["paired_classification"],
                  paired_evidence=a["paired_evidence"] or "none",
                  explained=a["failed"] - a["failing_unexplained"], failed=a["failed"],
                  failing_variables=a["failing_variables"] or "none",
                  ranks_disagree=a["ranks_disagree"], agree_checks=a["agree_checks"])
    template = ("the ledger flags {mismatched} collectives in {mismatched_steps} of {steps} steps: "
                "{pairs}; measured as the sum of exactly the tensors the ledger paired, the "
                "{paired_results} results of those collectives are '{paired_classification}' "
                "({paired_evidence} evidence; largest error / bound against that sum "
                "{max_paired_ratio:.7g}); {explained} of the {failed} failing results "
                "are explained so; failing variables {failing_variables}; the towers end up holding "
                "different results in {ranks_disagree} of {agree_checks} steps × variables"
                if pairs else "the ledger found no mispaired collective")
    mispaired = Finding(
        "as_ready_mispaired",
        "The cause is mispaired collectives: towers issue in different orders and collectives pair by "
        "issue order, so same-shaped gradients of different variables are summed",
        bool(pairs) and explained and set(a["failing_variables"]) <= named, template, values)
    return [not_rounding, mispaired]


def _race(r: dict, world_size: int) -> Finding:
    k = world_size - 1
    exact = r["offsets"].get(k, 0)
    values = dict(triggered=r["triggered"], writes=r["writes"], triggered_failed=r["triggered_failed"],
                  others=r["writes"] - r["triggered"], untriggered_failed=r["untriggered_failed"],
                  min_ratio=r["min_failing_ratio"], max_ratio=r["max_ratio"],
                  classification=r["classification"], evidence=r["evidence"] or "none",
                  mismatched=r["mismatched_collectives"],
                  exact=exact, failed=r["failed"], k=k, offset=k * WEIGHT_DECAY,
                  same_everywhere=r["agree_checks"] - r["ranks_disagree"], agree_checks=r["agree_checks"])
    ok = (r["triggered"] > 0 and r["triggered_failed"] == r["triggered"]
          and r["classification"] == "not rounding" and r["mismatched_collectives"] == 0
          and exact == r["failed"])
    template = ("every rank's write landed after gloo had run in {triggered} of {writes} steps × variables"
                + (" (the race did not trigger in this run)" if r["triggered"] == 0 else "")
                + "; {triggered_failed} of those fail the report's check"
                + (" ({untriggered_failed} of the {others} others)" if values["others"] else "")
                + "; error {min_ratio} to {max_ratio} times the rounding bound ('{classification}', "
                "{evidence} evidence); the "
                "ledger found {mismatched} mispaired collectives; {exact} of {failed} failing results are "
                "short by exactly {offset:.3g} at every element (1e-3 per other tower: their weight-decay "
                "gradients); every tower holds the same wrong value in {same_everywhere} of "
                "{agree_checks} steps × variables, so a cross-rank consistency check cannot see it")
    return Finding(
        "race_not_rounding",
        "race (buffer written again before wait()): wherever the write lands after the collective read "
        "the buffer, the result lacks the other towers' last write — a real bug the ledger cannot see "
        "(the pairing is right)", ok, template, values)


def _signature(a: dict | None, r: dict | None, world_size: int) -> Finding:
    """Does the reproduction's error carry the report's 0.00100000016, and what does that say?"""
    values = dict(report=REPORT_MAX_DIFF, in_decays=REPORT_MAX_DIFF / WEIGHT_DECAY)
    parts = ["the report printed {report:.9g} = {in_decays:.8f}×1e-3, one weight-decay gradient (an "
             "unused variable's whole gradient is 1e-3 everywhere)"]
    ok = True
    if a and a["failed"]:
        constant = sum(n for k, n in a["offsets"].items() if k)
        ok &= constant == 0
        values.update(as_ready_lo=a["min_failing_diff"], as_ready_hi=a["max_failing_diff"],
                      as_ready_constant=constant, as_ready_failed=a["failed"],
                      as_ready_report=a["report_number"])
        parts.append("as_ready: largest differences {as_ready_lo:.3g} to {as_ready_hi:.3g}, a constant "
                     "multiple of 1e-3 in {as_ready_constant} of {as_ready_failed} failing results, the "
                     "report's number in {as_ready_report}: a mispaired result is off by another tower's "
                     "whole gradient, which varies from element to element")
    if r and r["failed"]:
        k = world_size - 1
        values.update(race_exact=r["offsets"].get(k, 0), race_failed=r["failed"],
                      race_offset=k * WEIGHT_DECAY, race_report=r["report_number"])
        ok &= values["race_exact"] == r["failed"]
        parts.append("race: {race_exact} of {race_failed} failing results are off by exactly "
                     "{race_offset:.3g} at every element, {race_report} print the report's {report:.9g} "
                     "digit for digit")
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
    facts = {m: mode_facts(records, m) for m in modes_run(records)}
    f, a, r = (facts.get(m) for m in MODES)
    w = params["world_size"]
    findings = [_fixed(f, params["tolerance"])]
    if a:
        findings += _as_ready(a)
    if r:
        findings.append(_race(r, w))
    if a or r:
        findings.append(_signature(a, r, w))

    values = dict(modes=list(facts), world_size=w, report=REPORT_MAX_DIFF)
    parts = []
    if f:
        values.update(fixed_results=f["results"], fixed_within=f["results"] - f["outside_bound"],
                      fixed_rounding=f["rounding"], fixed_failed=f["failed"],
                      fixed_max_ratio=f["max_ratio"], fixed_classification=f["classification"],
                      fixed_evidence=f["evidence"] or "none", fixed_matches=f["matches_order"])
        if f["failed"] == 0 and f["classification"] == "rounding":
            parts.append("with one agreed order (fixed) all {fixed_results} results pass the report's "
                         "check and are rounding, " + (
                             "bit for bit what gloo's ring gives" if f["evidence"] == "bitwise" else
                             "within the rounding bound (the bound is the evidence)"))
        else:
            parts.append("with one agreed order (fixed) {fixed_failed} of {fixed_results} results fail "
                         "the report's check and {fixed_rounding} are rounding ('{fixed_classification}', "
                         "{fixed_evidence} evidence; largest error / bound {fixed_max_ratio:.7g})")
    if a and a["failed"]:
        values.update(as_ready_first=a["first_failing_step"], as_ready_min_ratio=a["min_failing_ratio"],
                      as_ready_max_ratio=a["max_ratio"],
                      pairs=" and ".join(describe_pairs(a["combined"])) or "different tensors")
        parts.append("issuing each all_reduce as autograd produces the gradient (as_ready) fails from "
                     "step {as_ready_first}: the towers issue in different orders and collectives pair by "
                     "issue order, so {pairs} were summed (errors {as_ready_min_ratio} to "
                     "{as_ready_max_ratio} × the bound)")
    if r and r["failed"]:
        values.update(race_offset=(w - 1) * WEIGHT_DECAY, race_exact=r["offsets"].get(w - 1, 0),
                      race_report=r["report_number"])
        parts.append("writing the buffer before wait() (race) leaves results short by the other towers' "
                     "weight-decay gradients, {race_offset:.3g}"
                     + (" — {race_report} results print the report's {report:.9g}"
                        if r["report_number"] else ""))
    bugs = [m for m, x in facts.items() if x["classification"] == "not rounding"]
    rounding = facts and all(x["classification"] == "rounding" for x in facts.values())
    kind = "bug" if bugs else "rounding" if rounding else "undetermined"
    summary = {"bug": "A real bug, not rounding: ", "rounding": "Rounding only: "}.get(kind, "")
    summary += "; ".join(parts) + "." if parts else "Nothing was measured."
    failed = [fi.key for fi in findings if fi.holds is False]
    if failed:
        values["not_holding"] = failed
        summary += " Not every expected finding holds: {not_holding} (read their evidence)."
    key_numbers = {}
    if f:
        key_numbers.update({"fixed: results that are rounding": "fixed_rounding",
                            "fixed: evidence (bitwise: equal to gloo's emulated ring)": "fixed_evidence"})
    if "pairs" in values:
        key_numbers.update({"as_ready: smallest failing error / rounding bound": "as_ready_min_ratio",
                            "as_ready: what the ledger says was summed": "pairs"})
    if "race_exact" in values:
        key_numbers.update({"race: failing results short by exactly the others' weight decay": "race_exact",
                            "race: results printing the report's 0.00100000016": "race_report"})
    return Verdict(case="allreduce_correctness", kind=kind, summary=summary, findings=findings,
                   values=values, scope=SCOPE, key_numbers=key_numbers)

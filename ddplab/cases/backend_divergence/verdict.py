"""Case 01's verdict: the report's four observations, each computed from the records.

Rules (none assumed): bitwise equality compares logged losses and parameter
digests step by step (rank placements compare every shard's own loss
instead of the logged sum, whose order the placement changes); "within the
rounding bound" is the audit's largest error / bound <= 1; "a few ulps" is
an average ulp error per element of at most W-1 (the roundings an element
passes through; the largest ulp counts sit where cancellation makes the sum
small, which is why the bound is on Σ|x_r|); "grows" is a last-step
parameter distance from the exact run larger than the first non-zero one --
a measurement, not a bound. Findings keep their numbers in ``values``; each
finding is one function, over :class:`Comparison` and :class:`OrderFacts`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import NamedTuple

from ddplab.cases.backend_divergence.runs import REFERENCE, REVERSED_SUFFIX, base_run, kind_of
from ddplab.records import where
from ddplab.verdict import Finding, Verdict

__all__ = ["SCOPE", "VISIBLE_RELATIVE_GAP", "Comparison", "OrderFacts", "run_table", "loss_gaps",
           "compare", "verdict"]

SCOPE = ("The audit's rounding bound covers the all-reduce of the gradient contributions; the "
         "forward/backward and the optimizer are identical across runs by construction (same "
         "batches, same initialization, same kernels), so the only source of divergence measured "
         "is the reduction order; drift along training is measured, not bounded.")


def _audit_coverage(records, steps: int) -> str:
    """The scope's last sentence: which steps the audit measured (``audit_every``)."""
    audited = sorted({int(s) for s in where(records, "max_bound_ratio")["step"].dropna()})
    if not audited:
        return "No step was audited."
    if len(audited) >= steps:
        return f"The audit measured every one of the {steps} steps."
    which = f"step {audited[0]}" if len(audited) == 1 else f"steps {', '.join(map(str, audited))}"
    return (f"The audit measured {which} of the {steps} (audit_every); the parameter digests compare "
            "every run at every step.")


#: A relative gap between two logged losses below which no reader of a training log would
#: call them different: a change in the sixth significant digit.
VISIBLE_RELATIVE_GAP = 1e-6

#: The report's pair: live gloo against NCCL, emulated or live (the first present is used).
NCCL_RUNS = ("nccl_ring", "nccl_tree", "nccl_live_ring", "nccl_live_tree")


# --------------------------------------------------------------------------- tables


def _rank0(records, metric: str):
    rows = where(records, metric)
    return rows[(rows["rank"] == 0) | rows["rank"].isna()]


def run_table(records, metric: str):
    """``metric`` as a (world_size, step) × run table of rank 0's values."""
    return _rank0(records, metric).pivot_table(index=["world_size", "step"], columns="run",
                                               values="value", aggfunc="first", dropna=False)


def loss_gaps(records):
    """|loss − exact-run loss| per world size, run and step (metric ``loss_gap``)."""
    table = run_table(records, "loss")
    if REFERENCE not in table:
        raise ValueError(f"the records hold no loss of the {REFERENCE!r} run")
    gaps = table.sub(table[REFERENCE], axis=0).abs().drop(columns=[REFERENCE])
    long = gaps.stack().rename("value").reset_index()
    long["metric"] = "loss_gap"
    return long[["world_size", "step", "run", "metric", "value"]].astype({"world_size": int, "step": int})


class Comparison(NamedTuple):
    """Two runs' logged metrics, step by step."""

    equal: bool                         # bitwise equal at every step compared
    first_differ: int | None            # the first step where they differ
    steps: int                          # steps compared


def compare(records, a: str, b: str, world_size: int, by=("loss", "param_digest")) -> Comparison:
    """Whether runs ``a`` and ``b`` logged bitwise equal ``by`` metrics at every step.

    ``local_loss`` compares every shard's loss (all ranks). A run without
    records compares unequal.
    """
    first, steps = None, None
    for metric in by:
        rows = where(records, metric, world_size=world_size)
        if metric == "local_loss":
            table = rows.pivot_table(index=["step", "shard"], columns="run", values="value",
                                     aggfunc="first")
        else:
            table = _rank0(rows, metric).pivot_table(index="step", columns="run", values="value",
                                                     aggfunc="first")
        if a not in table or b not in table or table[[a, b]].dropna().empty:
            return Comparison(False, None, 0)
        part = table[[a, b]].dropna()
        step_index = part.index.get_level_values("step")
        steps = min(steps or math.inf, step_index.nunique())
        differ = step_index[(part[a] != part[b]).to_numpy()]
        if len(differ):
            first = min(int(differ.min()), first if first is not None else math.inf)
    return Comparison(first is None, first, int(steps or 0))


def _audit(records, world_size: int, runs, metric: str, step: int | None = None):
    """The audit's ``metric`` values for ``runs`` (every rank that measured a bucket)."""
    rows = where(records, metric, world_size=world_size, run=list(runs))
    return rows["value"] if step is None else rows.loc[rows["step"] == step, "value"]


def _max(values) -> float:
    return float(values.max()) if len(values) else math.nan


def _min(values) -> float:
    return float(values.min()) if len(values) else math.nan


class Growth(NamedTuple):
    """How a per-step series grew: its first positive value, its last, and last / first."""

    first: float
    last: float
    ratio: float


def _growth(values) -> Growth:
    positive = values[values > 0]
    last = float(values.iloc[-1]) if len(values) else 0.0
    if positive.empty:
        return Growth(0.0, last, math.nan)
    return Growth(float(positive.iloc[0]), last, last / float(positive.iloc[0]))


def _not_measured_as_text(values: dict) -> dict:
    """NaN (not measured) as "n/a": a verdict read back from JSON then equals the one computed."""
    def clean(v):
        if isinstance(v, list):
            return [clean(x) for x in v]
        return "n/a" if isinstance(v, float) and math.isnan(v) else v
    return {k: clean(v) for k, v in values.items()}


def _judged(records, runs):
    """The referee's judgements of ``runs``' audited buckets: one ``max_bound_ratio`` row each,
    labelled with its ``verdict`` and ``evidence`` (bitwise, bound, probabilistic)."""
    rows = where(records, "max_bound_ratio", run=list(runs))
    for column in ("verdict", "evidence"):
        if column not in rows:
            rows = rows.assign(**{column: None})
    return rows


def _count(rows, **labels) -> int:
    return len(where(rows, "max_bound_ratio", **labels))


# --------------------------------------------------------------------------- findings


def _two_ranks(records, runs, steps) -> Finding:
    """W=2: every run bitwise the exact run, every audited bucket the correctly rounded mean."""
    claim = "With 2 ranks every reduction order gives bitwise identical losses and parameters at every step"
    unequal = [r for r in runs if not compare(records, r, REFERENCE, 2).equal]
    ulps = _audit(records, 2, runs, "max_ulp")
    return Finding(
        "two_ranks_bitwise", claim, bool(runs) and not unequal and not _max(ulps) > 0,
        "W=2, {steps} steps: {n_equal} of {n_runs} runs ({runs}) logged the exact run's loss and "
        "parameter bits at every step (differing: {differing}); the audit of {buckets} bucket "
        "reductions found a largest error of {max_ulp} ulp from the correctly rounded mean. Why: "
        "DDP scales each gradient by 1/2, which is exact (a power of two), and x0/2 + x1/2 is one "
        "addition, rounded once, with a + b = b + a: every order computes the same correctly "
        "rounded mean",
        {"steps": steps, "n_equal": len(runs) - len(unequal), "n_runs": len(runs), "runs": runs,
         "differing": unequal or "none", "buckets": len(ulps), "max_ulp": _max(ulps)})


def _drift(records, w: int, orders, steps: int) -> dict:
    """How far the report's pair (or, without it, the farthest order) got from each other by the last step."""
    loss = run_table(records, "loss")
    nccl = [r for r in NCCL_RUNS if r in orders]
    a, b = ("gloo", nccl[0]) if "gloo" in orders and nccl else (REFERENCE, None)
    if b is None:  # no pair: the farthest order from the exact run
        dist = run_table(records, "param_distance").loc[w].iloc[-1]
        b = max(orders, key=lambda r: dist.get(r, -1.0))
        distance = float(dist[b])
    else:
        distance = float(run_table(records, "gloo_distance").loc[w].iloc[-1].get(b, math.nan)) \
            if len(where(records, "gloo_distance")) else math.nan
    gaps = (loss.loc[w][a] - loss.loc[w][b]).abs()
    relative = gaps / loss.loc[w][a].abs()
    return {"pair_a": a, "pair_b": b, "last_step": steps - 1, "loss_gap": float(gaps.iloc[-1]),
            "rel_loss_gap": float(relative.iloc[-1]), "max_rel_loss_gap": float(relative.max()),
            "pair_distance": distance}


@dataclasses.dataclass
class OrderFacts:
    """One order at one world size above 2, against the exact run."""

    world_size: int
    run: str
    comparison: Comparison              # parameter digests against the exact run's
    frac_correct0: float                # elements correctly rounded at step 0 (fewest of any bucket)
    mean_ulp0: float                    # average ulp error per element at step 0 (largest bucket)
    max_ulp: float
    bound_ratio: float                  # largest error / rounding bound, every audited step
    distance: Growth                    # parameter distance from the exact run along training

    def holds(self, steps: int) -> bool:
        """Off the exact run from step 0 by a few ulps, within the bound, the gap growing."""
        return (self.comparison.first_differ == 0 and self.frac_correct0 < 1
                and self.mean_ulp0 <= self.world_size - 1 and self.bound_ratio <= 1
                and (steps < 2 or self.distance.ratio > 1))

    def values(self) -> dict:
        c = self.comparison
        return {"pairs": f"W={self.world_size} {self.run}", "first_differ": "never" if c.equal else c.first_differ,
                "frac_correct0": self.frac_correct0, "mean_ulp0": self.mean_ulp0, "max_ulp": self.max_ulp,
                "bound_ratio": self.bound_ratio, "d_first": self.distance.first, "d_last": self.distance.last,
                "growth": self.distance.ratio}


def order_facts(records, w: int, r: str, pdist) -> OrderFacts:
    measured = r in pdist and w in pdist.index.get_level_values("world_size")
    return OrderFacts(
        world_size=w, run=r, comparison=compare(records, r, REFERENCE, w, by=("param_digest",)),
        frac_correct0=_min(_audit(records, w, [r], "frac_correctly_rounded", step=0)),
        mean_ulp0=_max(_audit(records, w, [r], "mean_ulp", step=0)),
        max_ulp=_max(_audit(records, w, [r], "max_ulp")),
        bound_ratio=_max(_audit(records, w, [r], "max_bound_ratio")),
        distance=_growth(pdist.loc[w][r].dropna()) if measured else Growth(math.nan, math.nan, math.nan))


def _columns(rows: list[dict]) -> dict[str, list]:
    """Rows of values as one list per name, in the rows' order."""
    return {key: [row[key] for row in rows] for key in rows[0]} if rows else {}


def _measured_drift(records, big, orders, steps, facts: list[OrderFacts]) -> dict:
    """The drift at the largest world size, and the orders' worst step-0 ulps and bound ratio."""
    return {**_drift(records, max(big), orders, steps), "w": max(big), "steps": steps,
            "mean_ulp": max(f.mean_ulp0 for f in facts), "ratio": max(f.bound_ratio for f in facts)}


def _more_ranks(facts: list[OrderFacts], drift: dict, steps: int) -> Finding:
    """W > 2: each order off the exact run from step 0, a few ulps, within its bound; the drift measured."""
    claim = ("With more than 2 ranks the orders differ from the first step by a few ulps (on average "
             "per element), each within the rounding bound; along training the gap grows "
             "(a measured growth, not a bound)")
    if not facts:
        return Finding("more_ranks_differ", claim, None, "not measured: no world size above 2 "
                       "with an order besides the exact one", {})
    return Finding(
        "more_ranks_differ", claim, all(f.holds(steps) for f in facts),
        "{pairs}: parameters first differ from the exact run's at step {first_differ}; at step 0 "
        "{frac_correct0:.0%} of reduced gradient elements correctly rounded, {mean_ulp0:.2g} ulp on "
        "average (largest {max_ulp} ulp, where the sum cancels); largest error over every audited "
        "step {bound_ratio:.2g} of the rounding bound. Measured drift (not bounded): distance from "
        "the exact run {d_first} at its first non-zero step → {d_last} at step {last_step} "
        "(×{growth:.3g}); {pair_a} vs {pair_b} at W={w} after {steps} steps: logged loss "
        "{loss_gap} apart ({rel_loss_gap} relative), parameters {pair_distance} apart",
        {**_columns([f.values() for f in facts]), **drift})


def _same_order(records, sizes, runs) -> Finding:
    """Each repeated run against its first: losses (every shard's too) and parameters, bit for bit."""
    rows = []
    for w in sizes:
        for rep in [r for r in runs if kind_of(r) == "repeat"]:
            c = compare(records, base_run(rep), rep, w, by=("loss", "param_digest", "local_loss"))
            rows.append({"pairs": f"W={w} {base_run(rep)}", "equal": c.equal,
                         "first_differ": c.first_differ if c.first_differ is not None else "never",
                         "steps": c.steps})
    cols = _columns(rows) or {"pairs": [], "equal": [], "first_differ": [], "steps": []}
    return Finding(
        "same_order_reproducible", "The same order run twice gives bitwise identical losses and "
        "parameters (the report's observation)", all(cols["equal"]) if cols["equal"] else None,
        "{pairs} run twice: bitwise equal losses (every shard's and the logged) and parameters at "
        "every one of {steps} steps: {equal} (first differing step: {first_differ})"
        if cols["equal"] else "not measured: no repeated run", cols)


def _no_order_privileged(records, sizes, runs, orders, steps, params) -> Finding:
    """Every order rounding (by the referee), none the exact run; the fixed-point hook placement-free."""
    from ddplab.numerics.fixed_point import lossless_binades
    from ddplab.numerics.fpformat import unit_roundoff
    from ddplab.cases.backend_divergence.worker import DTYPES

    live_like = [r for r in runs if kind_of(r) in ("order", "repeat", "placement") and r != REFERENCE]
    repro = [r for r in runs if kind_of(r) == "reproducible"]
    control = "gloo" + REVERSED_SUFFIX
    ratios = [_max(_audit(records, w, live_like, "max_bound_ratio")) for w in sizes]
    judged = _judged(records, live_like)
    pdist, big = run_table(records, "param_distance"), [w for w in sizes if w > 2]
    exact_equal = [f"W={w} {r}" for w in big for r in orders if compare(records, r, REFERENCE, w).equal]
    values = {"sizes": sizes, "ratios": ratios, "steps": steps, "big": big, "orders": orders,
              "d_last": [float(pdist.loc[w].iloc[-1].get(r, math.nan)) for w in big for r in orders],
              "equal_to_exact": exact_equal or "none", "judged": len(judged),
              "rounding": _count(judged, verdict="rounding"),
              "bitwise": _count(judged, verdict="rounding", evidence="bitwise"),
              "bound": _count(judged, verdict="rounding", evidence="bound")}
    ok = all(r <= 1 for r in ratios) and not exact_equal and values["rounding"] == len(judged) > 0
    template = ("the referee judged {rounding} of {judged} audited buckets of every order rounding "
                "({bitwise} by bitwise equality with their emulated order, {bound} within the bound); "
                "largest error/rounding bound, W = {sizes}: {ratios:.2g}; distance from the exact run "
                "after {steps} steps, W = {big}, orders {orders}: {d_last} (equal to exact: {equal_to_exact})")
    if len(repro) < 2:
        return Finding("no_order_privileged", _CLAIM4, False,
                       template + "; the reproducible hook was not run (reproducible=False)", values)
    placed, replaced = repro[0], repro[1]    # the same hook, rank r on shard r and on shard W-1-r
    equal = [compare(records, placed, replaced, w, by=("param_digest", "local_loss")).equal for w in sizes]
    ctl = [compare(records, "gloo", control, w, by=("param_digest",)).equal if control in runs else None
           for w in sizes]
    # Above 2 ranks the control must change gloo's bits, or the placement change tested nothing.
    ok &= all(equal) and not any(c for w, c in zip(sizes, ctl) if w > 2)
    w_top = max(sizes)
    dtype = DTYPES[params["dtype"]]
    rel = _max(_audit(records, w_top, repro, "max_rel_error"))
    repro_judged = _judged(records, repro)
    values.update(repro_equal=equal, control_equal=["n/a" if c is None else c for c in ctl],
                  repro_min_correct=_min(_audit(records, w_top, repro, "frac_correctly_rounded")),
                  repro_max_ulp=_max(_audit(records, w_top, repro, "max_ulp")), w_top=w_top,
                  repro_rel_u=rel / unit_roundoff(dtype), dtype=params["dtype"],
                  binades=lossless_binades(dtype, w_top), repro_judged=len(repro_judged),
                  repro_beyond=_count(repro_judged, verdict="not rounding"),
                  repro_ratio=_max(repro_judged["value"]))
    return Finding(
        "no_order_privileged", _CLAIM4, ok, template +
        "; the reproducible hook under both placements, W = {sizes}: bitwise equal parameters and "
        "shard losses at every step: {repro_equal} (control, plain gloo under the same change, "
        "bitwise equal: {control_equal}); its precision at W={w_top}: ≥ {repro_min_correct:.4%} of "
        "elements correctly rounded, largest error {repro_max_ulp} ulp = {repro_rel_u:.2g}·u·Σ|x_r| "
        "(in {dtype} int64 fixed point holds a contribution exactly only within {binades} binades "
        "of its element's largest: order-independent, not correctly rounded; against the bound of "
        "one correct rounding {repro_beyond} of {repro_judged} audited buckets exceed it, by up to "
        "{repro_ratio:.3g}×)", values)


_CLAIM4 = ("Which one is correct? Neither is privileged: every order stays within the rounding bound "
           "of the exact reduction and none reproduces it, and the reproducible hook makes every "
           "order and rank placement agree bitwise")


def _gloo_facts(records, sizes, runs, same_order: Finding) -> Finding:
    """Live gloo's reduction judged as a known floating-point order: bit for bit, then by the bound."""
    live = [r for r in runs if base_run(r) == "gloo"]
    judged = _judged(records, live)
    matches = where(records, "matches_order", run=live)["value"]
    w2 = _audit(records, 2, [r for r in runs if kind_of(r) != "reproducible"], "max_ulp")
    values = {"gloo_buckets": len(judged), "gloo_bitwise": _count(judged, verdict="rounding", evidence="bitwise"),
              "gloo_rounding": _count(judged, verdict="rounding"), "matches_min": _min(matches),
              "matches_n": len(matches), "gloo_ratio": _max(judged["value"]), "sizes": sizes,
              "repeats_equal": "n/a" if same_order.holds is None else same_order.holds,
              "w2_max_ulp": _max(w2)}
    values["evidence"] = ("bitwise" if values["gloo_bitwise"] == len(judged) > 0 else
                          "bound" if values["gloo_rounding"] == len(judged) > 0 else "none")
    holds = (values["evidence"] == "bitwise" and values["matches_min"] == 1 and values["gloo_ratio"] <= 1
             and same_order.holds is not False and not values["w2_max_ulp"] > 0)
    return Finding(
        "gloo_rounding_facts", "Live gloo's reduction is rounding of a known order: it equals the "
        "emulated gloo ring bit for bit, stays within γ_(W−1)·Σ|x_r|, repeats its bits and is the "
        "correctly rounded mean at W=2", holds if len(live) else None,
        "{gloo_bitwise} of {gloo_buckets} audited live gloo buckets are rounding by bitwise evidence "
        "(the referee: equal to the emulated gloo ring in every bit); every rank's result equals "
        "it in {matches_min:.2%} of elements at worst over {matches_n} bucket reductions; the "
        "largest error of live gloo was {gloo_ratio:.2g} of the bound γ_(W−1)·Σ|x_r| (W = {sizes}); "
        "the same order twice gave the same bits: {repeats_equal}; at W=2 every audited reduction "
        "was within {w2_max_ulp} ulp of the correctly rounded mean (DDP's scaling by 1/2 is exact)",
        values)


def _live_nccl(records, runs) -> dict:
    """Live NCCL's audited buckets: rounding rests on the bound there (ddplab's NCCL orders are models)."""
    judged = _judged(records, [r for r in runs if r.startswith("nccl_live")])
    return {"nccl_buckets": len(judged), "nccl_bound": _count(judged, verdict="rounding", evidence="bound"),
            "nccl_ratio": _max(judged["value"])}


# --------------------------------------------------------------------------- the verdict


def _two_ranks_unmeasured(sizes) -> Finding:
    return Finding("two_ranks_bitwise", "With 2 ranks every reduction order gives bitwise identical "
                   "losses and parameters at every step", None,
                   "not measured: world_sizes {sizes} has no 2", {"sizes": sizes})


def _orders_above_two(records, big, orders) -> list[OrderFacts]:
    if not big or not orders:
        return []
    pdist = run_table(records, "param_distance")
    return [order_facts(records, w, r, pdist) for w in big for r in orders]


def _values(params: dict, findings: list[Finding], two: Finding, gloo: Finding, nccl: dict, drift: dict,
            steps: int, big: list[int]) -> dict:
    """The verdict's numbers; the drift's are NaN or "none" where no world size above 2 ran."""
    facts = gloo.values
    return {"steps": steps, "dtype": params["dtype"], "model": params["model"], "data": params["data"],
            "w2_max_ulp": two.values.get("max_ulp", math.nan), "w": max(big) if big else "none",
            "mean_ulp": math.nan, "ratio": math.nan, "loss_gap": math.nan, "rel_loss_gap": math.nan,
            "pair_distance": math.nan, "pair_a": "none", "pair_b": "none",
            "matches_min": facts["matches_min"], "evidence": facts["evidence"],
            "gloo_buckets": facts["gloo_buckets"], "gloo_bitwise": facts["gloo_bitwise"], **nccl,
            "unmeasured": [f.key for f in findings if f.holds is None] or "none",
            "failed": [f.key for f in findings if f.holds is False] or "none", **drift}


def _rounding_summary(two: Finding, drifted: bool, values: dict) -> str:
    summary = "Rounding, not a bug: the backends add the gradients in different orders."
    if two.holds:
        summary += " With 2 ranks every order gives the same bits."
    if drifted:
        summary += (" With {w} ranks the orders differ from the first step (about {mean_ulp:.2g} ulp per "
                    "element on average, at most {ratio:.2g} of the rounding bound).")
    if values["gloo_buckets"]:
        summary += (" Live gloo's reduction is rounding on bitwise evidence: all {gloo_buckets} of "
                    "its audited buckets equal the emulated gloo ring bit for bit.")
    if values["nccl_buckets"]:
        summary += (" Live NCCL's is rounding on the bound ({nccl_bound} of {nccl_buckets} audited "
                    "buckets within it, at most {nccl_ratio:.2g} of it): NCCL's order is modelled, "
                    "not emulated bit for bit.")
    if drifted:
        summary += (" Training then amplified the difference, a measured growth, not a bound: "
                    "after {steps} steps {pair_a} and {pair_b} differ by {loss_gap} in the logged loss "
                    "({rel_loss_gap} relative) and {pair_distance} in parameter distance, in {dtype}.")
        summary += (" Rounding of the reduction alone reached no more than this here (model {model}, data "
                    "{data}): it cannot explain a significant difference in train loss or accuracy within "
                    "{steps} steps; such a difference would need another cause, which this run does not "
                    "reproduce." if values["max_rel_loss_gap"] < VISIBLE_RELATIVE_GAP else
                    " Within {steps} steps rounding alone grew to a visible loss difference here.")
    summary += (" Neither backend is correct and neither is wrong: each is within the rounding "
                "bound of the exact sum. A reproducible (fixed-point) reduction makes every order "
                "agree bit for bit.")
    if values["unmeasured"] != "none":
        summary += " Not measured with these parameters: {unmeasured}."
    return summary


KEY_NUMBERS = {"W=2: largest error of any order (ulp)": "w2_max_ulp",
               "W>2: largest error / rounding bound": "ratio:.2g",
               "live gloo elements equal to the emulated gloo ring": "matches_min:.2%",
               "logged-loss gap of the report's pair at the last step": "loss_gap",
               "parameter distance of the report's pair at the last step": "pair_distance"}


def verdict(records, params: dict) -> Verdict:
    """kind "rounding" when every finding holds (or was not measured), else "unexplained"."""
    sizes = sorted(int(w) for w in records["world_size"].dropna().unique())
    runs = sorted(where(records, "loss")["run"].dropna().unique())
    orders = [r for r in runs if kind_of(r) == "order" and r != REFERENCE]
    steps = int(_rank0(records, "loss")["step"].max()) + 1 if runs else 0
    big = [w for w in sizes if w > 2]
    live_like = [r for r in runs if kind_of(r) in ("order", "repeat", "placement") and r != REFERENCE]

    two = _two_ranks(records, live_like, steps) if 2 in sizes else _two_ranks_unmeasured(sizes)
    above_two = _orders_above_two(records, big, orders)
    drift = _measured_drift(records, big, orders, steps, above_two) if above_two else {}
    same = _same_order(records, sizes, runs)
    gloo = _gloo_facts(records, sizes, runs, same)
    findings = [two, _more_ranks(above_two, drift, steps), same,
                _no_order_privileged(records, sizes, runs, orders, steps, params), gloo]
    kind = "rounding" if all(f.holds is not False for f in findings) else "unexplained"
    values = _values(params, findings, two, gloo, _live_nccl(records, runs), drift, steps, big)
    summary = (_rounding_summary(two, bool(drift), values) if kind == "rounding" else
               "The measurements do not match the rounding explanation in full: {failed} did not "
               "hold; read their evidence.")
    for f in findings:
        f.values = _not_measured_as_text(f.values)
    return Verdict(case="backend_divergence", kind=kind, summary=summary, findings=findings,
                   values=_not_measured_as_text(values),
                   scope=f"{SCOPE} {_audit_coverage(records, steps)}", key_numbers=KEY_NUMBERS)

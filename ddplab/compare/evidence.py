"""The evidence a comparison's verdict rests on: one declaration per source, strongest first.

Each :class:`Evidence` reads the tidy records of one configuration and
returns a typed :class:`~ddplab.verdict.Finding` (``holds`` True, False, or
None when it could not look). :data:`EVIDENCE` orders the sources; the
verdict (:func:`decide`) walks it twice:

1. the first source that **proves a bug** decides -- a bug proven by bits
   (ranks that disagree, a collective or a rank's step that differs from its
   emulation, a computation that depends on the rank, a promise that is not
   one process's) always wins over any tolerance;
2. otherwise the first source that **clears** the configuration decides
   (``exact``: bit for bit against the replay; ``rounding`` earned by the
   float64 run of the user's own code; ``approximation``: a lossy step the
   user declared); the tolerance band, last, always decides.

A new source is one declaration here: its reader, what it proves, what it
clears, and one row per verdict it can give (:func:`verdict_table`, which
the README's verdict table is rendered from).
"""
from __future__ import annotations

import dataclasses
import math
import weakref
from typing import Callable

from ddplab.compare import mesh_evidence as _mesh
from ddplab.compare import referee as _referee
from ddplab.verdict import Finding

__all__ = ["Evidence", "Decision", "Context", "EVIDENCE", "decide", "verdict_table", "rows", "label",
           "pieces_text", "DEGENERATE_FRACTION"]

#: A band below this fraction of the unit roundoff means the reference reproduced the truth
#: (exact arithmetic): its distance measures no rounding, so there is no band.
DEGENERATE_FRACTION = 1e-3


# --------------------------------------------------------------------------- reading records


def rows(frame, metric: str, config: str):
    """The records of ``metric`` for ``config``."""
    if "config" not in frame.columns:
        return frame.iloc[0:0]
    positions = _positions(frame).get((metric, config))
    return frame.iloc[0:0] if positions is None else frame.iloc[positions]


#: The last frame read: a weak reference, its shape, and its rows' positions by (metric, config). A
#: verdict reads some forty metrics of one frame; one grouping instead of a scan of the frame for each.
_grouped: list = [None, None, {}]


def _positions(frame) -> dict:
    ref, shape, positions = _grouped
    if ref is None or ref() is not frame or shape != frame.shape:
        positions = frame.groupby(["metric", "config"], sort=False).indices
        _grouped[:] = [weakref.ref(frame), frame.shape, positions]
    return positions


def label(row, key, default=None):
    """A label of a record row; ``default`` where it is absent or NaN."""
    value = row.get(key, default) if hasattr(row, "get") else default
    if value is None or (isinstance(value, float) and math.isnan(value)):
        return default
    return value


def _pieces(missing) -> list[int]:
    """The piece indices of a ``missing`` label ("0,3"; empty or absent: none)."""
    return [int(j) for j in str(missing).split(",")] if missing not in (None, "") else []


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


@dataclasses.dataclass
class Context:
    """What every source reads: the records, the configuration, and its status row's facts."""

    frame: object
    config: str
    world: int
    k: int
    status: dict                      # the steps_completed row's labels (no_replay, random, compression, ...)
    findings: dict = dataclasses.field(default_factory=dict)   # source name -> Finding | None

    def fact(self, key: str, default=None):
        return label(self.status, key, default)


@dataclasses.dataclass
class Decision:
    """What the deciding source concludes: the classification, the finding kind, where it starts,
    the headline's template and the numbers it adds to the verdict's values."""

    classification: str
    evidence: str
    summary: str
    finding: str | None = None
    first_divergence: int | None = None
    values: dict = dataclasses.field(default_factory=dict)
    extra_findings: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass(frozen=True)
class Evidence:
    """One evidence source.

    ``read(ctx)`` turns the records into a Finding (or None: nothing recorded);
    ``proves(finding, ctx)`` returns the bug Decision it proves, or None;
    ``clears(ctx)`` the positive Decision it earns, or None. ``verdicts`` are
    ``(kind, meaning)`` rows for the verdict table, ``meaning`` in Markdown.
    """

    name: str
    read: Callable[[Context], Finding | None]
    proves: Callable[[Finding, Context], Decision | None] = lambda finding, ctx: None
    clears: Callable[[Context], Decision | None] = lambda ctx: None
    verdicts: tuple = ()


# --------------------------------------------------------------------------- finite values


def _read_finite(ctx: Context) -> Finding | None:
    """Where a gradient or parameter first became NaN or Inf (:mod:`ddplab.compare.finite`)."""
    found = rows(ctx.frame, "nonfinite", ctx.config)
    if found.empty:
        return None
    mine = found[found["run"] == "configuration"].sort_values(["step", "rank"])
    ref = found[found["run"] == "reference"]
    values = dict(nonfinite_step=-1, nonfinite_rank=-1, nonfinite_param="", nonfinite_quantity="",
                  nonfinite_count=0, reference_step=int(ref.iloc[0]["step"]) if not ref.empty else -1,
                  reference_param=str(ref.iloc[0]["param"]) if not ref.empty else "")
    if not mine.empty:
        first = mine.iloc[0]
        values.update(nonfinite_step=int(first["step"]), nonfinite_rank=int(first["rank"]),
                      nonfinite_param=str(first["param"]), nonfinite_quantity=str(first["quantity"]),
                      nonfinite_count=int(first["value"]))
    # It holds (distribution kept the values finite) unless the configuration went non-finite before
    # the reference did; a reference that goes non-finite as well says the data or model produce it.
    ahead = values["nonfinite_step"] >= 0 and (values["reference_step"] < 0 or
                                               values["nonfinite_step"] < values["reference_step"])
    return Finding(key="finite", claim="Every gradient and parameter stays finite wherever the reference's does",
                   holds=not ahead,
                   template=("first non-finite value: step {nonfinite_step}, rank {nonfinite_rank}, "
                             "{nonfinite_quantity} of {nonfinite_param}; the reference: step {reference_step} "
                             "{reference_param} (-1: never); the steps before are judged"),
                   values=values)


def _proves_finite(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    fv = finding.values
    return Decision("bug", "finite", finding="nonfinite", first_divergence=fv["nonfinite_step"],
                    values=dict(fv, first_rank=fv["nonfinite_rank"], first_param=fv["nonfinite_param"]),
                    summary=("bug: at step {nonfinite_step} rank {nonfinite_rank}'s {nonfinite_quantity} of "
                             "{nonfinite_param} holds {nonfinite_count} NaN or Inf value(s) where the "
                             "single-process reference stays finite; the steps before are judged as usual"))


# --------------------------------------------------------------------------- replicas


def _read_replicas(ctx: Context) -> Finding | None:
    """Replicas must hold bitwise the same gradients and parameters after a synchronized step."""
    found = rows(ctx.frame, "rank_distance", ctx.config)
    if found.empty:
        return None
    per_param = found[found["param"] != _referee.MODEL]
    bad = per_param[~per_param["bitwise_equal"].astype(bool)]
    values = dict(max_rank_distance=float(found[found["param"] == _referee.MODEL]["value"].max()),
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


def _proves_replicas(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    rv = finding.values
    values = {f"desync_{key}": rv[key] for key in ("step", "rank", "param", "quantity")}
    values.update(first_rank=rv["rank"], first_param=rv["param"], replay_text="")
    extra = []
    local = ctx.findings.get("localization")
    if local is not None and local.key == "desync":
        extra.append(local)  # the band's view of it: each rank's distance, the piece weights
    replay = ctx.findings.get("replay")
    if replay is not None and replay.holds is False:  # the replay says which rank and phase
        pv = replay.values
        values.update({f"replay_{key}": pv[key] for key in ("step", "rank", "phase", "param")})
        values.update(first_rank=pv["rank"], first_param=pv["param"],
                      replay_text=(f"; the replay places it at step {pv['step']} in rank {pv['rank']}'s "
                                   f"{pv['phase_text']} of {pv['param']}{pv['module_text']}"))
    return Decision("bug", "replicas", finding="desync", first_divergence=rv["step"], values=values,
                    extra_findings=extra,
                    summary=("bug: the ranks disagree after a synchronized step: at step {desync_step} rank "
                             "{desync_rank} holds a {desync_quantity} of {desync_param} bitwise other than "
                             "rank 0's{replay_text}"))


# --------------------------------------------------------------------------- every collective, recorded


def _read_collectives(ctx: Context) -> Finding | None:
    """Every recorded collective against its emulation, and its dtype against the one declared."""
    found = rows(ctx.frame, "collective_elements_differing", ctx.config)
    dtypes = rows(ctx.frame, "collective_dtype", ctx.config)
    if found.empty and dtypes.empty:
        return None
    bad = found[found["value"] > 0].sort_values(["step", "index", "rank"]) if not found.empty else found
    unverified = rows(ctx.frame, "collective_unverified", ctx.config)
    wrong = dtypes[(dtypes["declared"] != "") & (dtypes["declared"] != dtypes["dtype"])] if not dtypes.empty else dtypes
    values = dict(verified=int(len(found)), unverified=int(len(unverified)),
                  dtypes=sorted({str(d) for d in dtypes["dtype"]}) if not dtypes.empty else [],
                  declared=sorted({str(d) for d in dtypes["declared"] if d}) if not dtypes.empty else [],
                  collective_step=-1, collective_rank=-1, collective_op="", collective_group="",
                  collective_dtype="", collective_index=-1, collective_differing=0, collective_ulp=math.nan,
                  collective_stage="", wrong_dtype_step=-1, wrong_dtype_op="", wrong_dtype="", wrong_dtype_declared="")
    if not bad.empty:
        first = bad.iloc[0]
        ulp = rows(ctx.frame, "collective_max_ulp", ctx.config)
        ulp = ulp[(ulp["step"] == first["step"]) & (ulp["index"] == first["index"]) & (ulp["rank"] == first["rank"])
                  & (ulp["stage"] == first["stage"])]
        values.update(collective_step=int(first["step"]), collective_rank=int(first["rank"]),
                      collective_op=str(first["op"]), collective_group=str(first["group"]),
                      collective_dtype=str(first["dtype"]), collective_index=int(label(first, "collective", -1)),
                      collective_differing=int(first["value"]), collective_stage=str(first["stage"]),
                      collective_ulp=float(ulp.iloc[0]["value"]) if not ulp.empty else math.nan)
    if not wrong.empty:
        w = wrong.sort_values("step").iloc[0]
        values.update(wrong_dtype_step=int(w["step"]), wrong_dtype_op=str(w["op"]), wrong_dtype=str(w["dtype"]),
                      wrong_dtype_declared=str(w["declared"]))
    return Finding(key="collectives",
                   claim=("Every collective's output equals the emulation of every rank's inputs bit for bit, "
                          "and every gradient reduction runs in the dtype declared"),
                   holds=bad.empty and wrong.empty,
                   template=("{verified} collective outputs verified ({unverified} not verifiable); reductions ran "
                             "in {dtypes} (declared: {declared})"),
                   values=values)


def _proves_collectives(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    cv = finding.values
    if cv["collective_step"] >= 0:
        return Decision("bug", "collectives", finding="collective", first_divergence=cv["collective_step"],
                        values=dict(cv, first_rank=cv["collective_rank"], first_param=f"{cv['collective_op']}"),
                        summary=("bug: at step {collective_step} rank {collective_rank}'s {collective_op} "
                                 "#{collective_index} on ranks {collective_group} ({collective_dtype}) differs from "
                                 "the emulation of every rank's inputs in {collective_differing} element(s), up to "
                                 "{collective_ulp} ulp ({collective_stage})"))
    return Decision("bug", "collectives", finding="precision", first_divergence=cv["wrong_dtype_step"],
                    values=dict(cv, first_rank=-1, first_param=cv["wrong_dtype_op"]),
                    summary=("bug: from step {wrong_dtype_step} the gradients' {wrong_dtype_op} runs in "
                             "{wrong_dtype}, not in the {wrong_dtype_declared} the configuration declares"))

# --------------------------------------------------------------------------- per-rank data


def _read_data(ctx: Context) -> Finding | None:
    """The ranks' own batches against the global batch, sample by sample (:mod:`ddplab.compare.data`)."""
    checked = rows(ctx.frame, "data_checked", ctx.config)
    if checked.empty:
        return None
    diff = rows(ctx.frame, "data_difference", ctx.config)
    uneven = sorted({int(r["step"]) for _, r in checked.iterrows() if bool(label(r, "uneven", False))})
    values = dict(steps_checked=int(checked["step"].nunique()), uneven_steps=uneven or ["none"],
                  data_step=-1, data_kind="none", data_samples=[], data_differences=[], data_rank=-1)
    if not diff.empty:
        step = int(diff["step"].min())
        first = diff[diff["step"] == step]
        # A duplicated sample is named first: it is the contribution a sampler's padding adds.
        first = first.assign(_dup=(first["kind"] != "duplicated_contribution").astype(int)).sort_values(
            "_dup", kind="stable")
        lead = first.iloc[0]
        ranks = [int(r) for r in str(label(lead, "ranks", "") or "").split(",") if r != ""]
        values.update(data_step=step, data_kind=str(lead["kind"]),
                      data_samples=[str(r["sample"]) for _, r in first.iterrows()],
                      data_differences=[[str(r["sample"]), int(r["value"]), str(label(r, "ranks", "") or "")]
                                        for _, r in first.iterrows()],
                      data_rank=ranks[-1] if ranks and lead["kind"] == "duplicated_contribution" else -1)
    return Finding(key="data", claim="At every step the ranks train exactly the global batch's samples, each once",
                   holds=diff.empty,
                   template=("{steps_checked} step(s) checked sample by sample; uneven shares at step(s) "
                             "{uneven_steps}, weighted as DDP weights them (the mean of per-rank means)"),
                   values=values)


def _data_text(values: dict) -> str:
    parts = []
    for sample, extra, ranks in values["data_differences"]:
        if extra > 0:
            parts.append(f"{sample} is trained {extra} time(s) more than one process trains it at this step "
                         f"(rank(s) {ranks} hold it): a duplicated contribution")
        else:
            held = f"rank(s) {ranks} hold it" if ranks else "no rank holds it"
            parts.append(f"{sample} is trained {-extra} time(s) less than one process trains it at this step "
                         f"({held}): a missing contribution")
    return "; ".join(parts)


def _proves_data(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    dv = finding.values
    values = dict(dv, data_text=_data_text(dv), first_rank=dv["data_rank"],
                  first_param=", ".join(dv["data_samples"][:3]))
    return Decision("bug", "data", finding=dv["data_kind"], first_divergence=dv["data_step"], values=values,
                    summary=("bug: the ranks' own batches are not the global batch one process trains: at step "
                             "{data_step}, {data_text}"))


# --------------------------------------------------------------------------- the specification replay


_PHASE_TEXT = {"local_gradient": "local gradient (its bucket input)",
               "reduction": "reduced gradient (its bucket output)", "update": "update"}


def _read_replay(ctx: Context) -> Finding | None:
    """Bits against the specification replay (:mod:`ddplab.compare.replay`)."""
    from ddplab.compare.replay import first_difference

    reason = str(ctx.fact("no_replay", "") or "")
    found = rows(ctx.frame, "replay_differing", ctx.config)
    if found.empty:
        return None if not reason else Finding(
            key="replay", claim="Every rank equals the specification replay bit for bit", holds=None,
            template="no replay: {reason}", values=dict(reason=reason))
    unverified = rows(ctx.frame, "replay_unverified", ctx.config)
    first = first_difference(ctx.frame, ctx.config)
    values = dict(compared=int(len(found)), steps=int(found["step"].nunique()),
                  phases=sorted({str(p) for p in found["phase"]}),
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


def _proves_replay(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    rv = finding.values
    values = {f"replay_{key}": rv[key] for key in ("step", "rank", "phase", "quantity", "param",
                                                    "differing", "max_ulp", "max_relative", "module")}
    values.update(phase_text=rv["phase_text"], module_text=rv["module_text"], first_rank=rv["rank"],
                  first_param=rv["param"])
    if rv["quantity"] == "forward":
        summary = ("bug: at step {replay_step}, rank {replay_rank}'s forward output of module {replay_param} "
                   "differs from the specification replay's on the same input (by digest; {replay_differing} "
                   "forward output(s) differ from there on)")
    else:
        summary = ("bug: at step {replay_step}, rank {replay_rank}'s {phase_text} of {replay_param} differs "
                   "from the specification replay in {replay_differing} element(s), up to {replay_max_ulp} "
                   "ulp ({replay_max_relative} relative){module_text}")
    return Decision("bug", "replay", finding="replay", first_divergence=rv["step"], values=values,
                    summary=summary)


def _clears_replay(ctx: Context) -> Decision | None:
    """Exact: every rank equals the replay bit for bit, and the promise is one process's (or random)."""
    replay, semantic = ctx.findings.get("replay"), ctx.findings.get("semantic")
    random = bool(ctx.fact("random", False))
    if not (replay is not None and replay.holds is True and replay.values["complete"]):
        return None
    if semantic is None and not random:
        return None
    text = ("exact: every rank equals the specification replay bit for bit at every step, so the "
            "difference from one process ({max_deviation} × the reference's own rounding distance) is "
            "the batch split's rounding")
    if ctx.fact("compression"):
        text = ("exact: every rank equals the specification replay of the {compression} compression you "
                "asked for, bit for bit at every step: rounding of that compression, {max_deviation} × "
                "the reference's own rounding distance")
    if semantic is not None:
        text += "; in float64 the promise equals one process within {semantic_tolerance}"
    else:
        text += ("; the model draws random numbers (dropout), so one process draws other ones and "
                 "the semantic question is not asked")
    return Decision("exact", "replay", summary=text)


# --------------------------------------------------------------------------- the float64 promise


def _read_semantic(ctx: Context) -> Finding | None:
    """Does the float64 promise equal the float64 one-process truth?"""
    found = rows(ctx.frame, "semantic_distance", ctx.config)
    if found.empty:
        return None
    diff = rows(ctx.frame, "semantic_difference", ctx.config)
    values = dict(max_semantic_distance=float(found["value"].max()),
                  semantic_tolerance=float(found.iloc[0]["tolerance"]), step=-1, kind="none",
                  factor=math.nan, factor_name="", missing=[])
    if not diff.empty:
        d = diff.iloc[0]
        missing = label(d, "missing", "")
        values.update(step=int(d["step"]), kind=str(d["kind"]), factor=float(label(d, "factor", math.nan)),
                      factor_name=str(label(d, "factor_name", "") or ""),
                      missing=_pieces(missing))
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


def _proves_semantic(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    sv = finding.values
    # The kind the piece fit names: a factor, a missing contribution, or another computation.
    kind = sv["kind"] if sv["kind"] in ("factor", "missing_contribution") else "semantic"
    values = dict(semantic_step=sv["step"], semantic_kind=sv["kind"], semantic_factor=sv["factor"],
                  semantic_missing=sv["missing"], semantic_text=_semantic_text(sv, ctx.world, ctx.k),
                  first_rank=-1, first_param=_referee.MODEL)
    return Decision("bug", "semantic", finding=kind, first_divergence=sv["step"], values=values,
                    summary=("bug: what the configuration promises is not one process's computation: from "
                             "step {semantic_step} the float64 promise differs from the float64 truth by "
                             "{max_semantic_distance} (tolerance {semantic_tolerance}); {semantic_text}"))


# --------------------------------------------------------------------------- the symmetric twin


def _not_run(ctx: Context, evidence: str, claim: str) -> Finding | None:
    """The finding of an evidence run that could not run (its ``evidence_unavailable`` reason), or None."""
    unavailable = rows(ctx.frame, "evidence_unavailable", ctx.config)
    unavailable = unavailable[unavailable["evidence"] == evidence] if not unavailable.empty else unavailable
    if unavailable.empty:
        return None
    return Finding(key=evidence, claim=claim, holds=None, template="not run: {reason}",
                   values=dict(reason=str(unavailable.iloc[0]["reason"])))


def _read_twin(ctx: Context) -> Finding | None:
    """Every rank, given rank 0's data and RNG state, computes bitwise what rank 0 computes."""
    from ddplab.compare.twin import first_asymmetry

    found = rows(ctx.frame, "twin_differing", ctx.config)
    claim = "Given the same data and RNG state, every rank computes bitwise what rank 0 computes"
    if found.empty:
        return _not_run(ctx, "twin", claim)
    first = first_asymmetry(ctx.frame, ctx.config)
    values = dict(compared=int(len(found)), steps=int(found["step"].nunique()),
                  quantities=sorted({str(q) for q in found["quantity"]}))
    if first is not None:
        values.update({f"twin_{key}": value for key, value in first.items()})
    return Finding(key="twin", claim=claim, holds=first is None,
                   template="{compared} comparisons with rank 0 over {steps} step(s): {quantities}",
                   values=values)


_TWIN_WHAT = {"forward": "its forward output of module {twin_module}",
              "collective": "its input to collective {twin_param}",
              "grad": "its gradient of {twin_param} at optimizer.step()",
              "param": "its {twin_param} after the update"}


def _proves_twin(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False:
        return None
    tv = dict(finding.values)
    what = _TWIN_WHAT[tv["twin_quantity"]].format(**tv)
    size = (f" in {tv['twin_differing']} element(s), up to {tv['twin_max_ulp']:g} ulp"
            if tv["twin_quantity"] != "forward" and tv["twin_max_ulp"] == tv["twin_max_ulp"] else "")
    tv.update(twin_what=what + size, first_rank=tv["twin_rank"],
              first_param=tv["twin_module"] or tv["twin_param"])
    return Decision("bug", "twin", finding="asymmetry", first_divergence=tv["twin_step"], values=tv,
                    summary=("bug: the computation depends on the rank: given rank 0's data and RNG state, "
                             "rank {twin_rank} computes at step {twin_step} {twin_what} bitwise other "
                             "than rank 0's"))


# --------------------------------------------------------------------------- the user's own code in float64


def _read_float64(ctx: Context) -> Finding | None:
    """The configuration's own step, wrap and hooks, run in float64, against the float64 truth."""
    found = rows(ctx.frame, "float64_distance", ctx.config)
    claim = "Run in float64, the configuration's own code is one process's computation"
    if found.empty:
        return _not_run(ctx, "float64", claim)
    diff = rows(ctx.frame, "float64_difference", ctx.config)
    values = dict(max_float64_distance=float(found["value"].max()),
                  float64_tolerance=float(found.iloc[0]["tolerance"]),
                  judged_at=str(label(found.iloc[0], "judged_at", "float64")),
                  float64_step=-1, float64_kind="none", float64_factor=math.nan, float64_factor_name="",
                  float64_missing=[])
    if not diff.empty:
        d = diff.iloc[0]
        missing = label(d, "missing", "")
        values.update(float64_step=int(d["step"]), float64_kind=str(d["kind"]),
                      float64_factor=float(label(d, "factor", math.nan)),
                      float64_factor_name=str(label(d, "factor_name", "") or ""),
                      float64_missing=_pieces(missing))
    return Finding(key="float64", claim=claim, holds=diff.empty,
                   template=("largest distance of the float64 run from the truth {max_float64_distance} "
                             "(tolerance {float64_tolerance}, judged at {judged_at})"),
                   values=values)


def _proves_float64(finding: Finding, ctx: Context) -> Decision | None:
    if finding.holds is not False or ctx.fact("approximation"):
        return None  # a declared approximation differs in float64 too, by design
    fv = finding.values
    kind = fv["float64_kind"] if fv["float64_kind"] in ("factor", "missing_contribution") else "semantic"
    text = _semantic_text(dict(kind=fv["float64_kind"], factor=fv["float64_factor"],
                               factor_name=fv["float64_factor_name"], missing=fv["float64_missing"]),
                          ctx.world, ctx.k)
    values = dict(fv, float64_text=text, first_rank=-1, first_param=_referee.MODEL)
    return Decision("bug", "float64", finding=kind, first_divergence=fv["float64_step"], values=values,
                    summary=("bug: your code, run in float64, is not one process's computation: from step "
                             "{float64_step} it differs from the float64 truth by {max_float64_distance} "
                             "(tolerance {float64_tolerance}, judged at {judged_at}); {float64_text}"))


def _own_evidence_text(ctx: Context) -> str:
    """What the twin and the recorded collectives established, as one clause."""
    parts = []
    twin = ctx.findings.get("twin")
    if twin is not None and twin.holds:
        parts.append("every rank computes bitwise alike on the same data (the symmetric twin)")
    collectives = ctx.findings.get("collectives")
    if collectives is not None and collectives.holds:
        parts.append("every collective equals its emulation bit for bit")
    replicas, precision = ctx.findings.get("mesh_replicas"), ctx.findings.get("mesh_precision")
    if replicas is not None and replicas.holds:
        parts.append("what each mesh axis replicates is bitwise equal along it")
    if precision is not None and precision.holds:
        parts.append("every reduction on every axis runs in the dtype the policy declares")
    return ("; " + " and ".join(parts)) if parts else ""


def _clears_float64(ctx: Context) -> Decision | None:
    """Rounding, earned: in float64 the user's code is one process's computation, so what remains
    in the model's precision is rounding -- unless the band says it is orders of magnitude beyond."""
    f64 = ctx.findings.get("float64")
    if f64 is None or f64.holds is not True:
        return None
    band = ctx.findings["within_band"].values
    values = dict(f64.values, own_evidence_text=_own_evidence_text(ctx))
    if band["classification"] == "bug":
        return Decision("undetermined", "float64", values=values, summary=(
            "undetermined: in float64 your code is one process's computation (within "
            "{float64_tolerance}), yet in its own precision it lies {max_deviation} × the band from the "
            "truth, beyond every correct run measured: a difference that only the lower precision shows"
            "{own_evidence_text}"))
    return Decision("rounding", "float64", values=values, summary=(
        "rounding: in float64 your code is one process's computation (largest distance "
        "{max_float64_distance}, tolerance {float64_tolerance}, judged at {judged_at}){own_evidence_text}; "
        "in its own precision it lies {max_deviation} × the reference's own rounding distance"))


# --------------------------------------------------------------------------- declared approximations


def _read_approximation(ctx: Context) -> Finding | None:
    declared = str(ctx.fact("approximation", "") or "")
    if not declared:
        return None
    return Finding(key="approximation", claim="The configuration takes a lossy step the user chose: {approximation}",
                   holds=True, template="declared or recognized: {approximation}",
                   values=dict(approximation=declared))


def _clears_approximation(ctx: Context) -> Decision | None:
    finding = ctx.findings.get("approximation")
    if finding is None:
        return None
    twin, collectives, f64 = (ctx.findings.get(name) for name in ("twin", "collectives", "float64"))
    values = dict(finding.values,
                  approximation_relative=f64.values["max_float64_distance"] if f64 is not None and
                  f64.holds is not None else math.nan,
                  symmetric={True: "yes", False: "no", None: "not checked"}[twin.holds if twin else None],
                  collectives_exact={True: "yes", False: "no", None: "not recorded"}[
                      collectives.holds if collectives else None])
    return Decision("approximation", "approximation", values=values, summary=(
        "approximation: {approximation}: {max_deviation} × the reference's own rounding "
        "distance, {approximation_relative} relative in float64; the ranks computed symmetrically: "
        "{symmetric}; collectives exact: {collectives_exact}"))


# --------------------------------------------------------------------------- the tolerance band


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
_FIT_TEMPLATE = ("fit on the {pieces} batch pieces at step {step}: weights relative to the truth's "
                 "{piece_weights}; residual {residual_config} (truth {residual_truth}), tolerance {tolerance}")


def _read_localization(ctx: Context) -> Finding | None:
    """The piece fit at the first step that left the band (:mod:`ddplab.compare.localization`)."""
    frame, config, world, k = ctx.frame, ctx.config, ctx.world, ctx.k
    found = rows(frame, "localized", config)
    if found.empty:
        return None
    row = found.iloc[0]
    kind, step = row["finding"], int(row["step"])
    values = dict(step=step, quantity=label(row, "quantity"), tolerance=float(label(row, "tolerance", math.nan)),
                  factor=math.nan, factor_name=None, factor_named="", residual_config=math.nan,
                  residual_truth=math.nan, optimizer_steps=int(label(row, "optimizer_steps", 1)))
    factor_rows = rows(frame, "fit_factor", config)
    if not factor_rows.empty:
        values["factor"] = float(factor_rows.iloc[0]["value"])
        values["factor_name"] = label(factor_rows.iloc[0], "factor_name")
        if values["factor_name"]:
            values["factor_named"] = f"= {values['factor_name']} "
    for _, r in rows(frame, "fit_residual", config).iterrows():
        values[f"residual_{r['series']}"] = float(r["value"])
    weights = rows(frame, "piece_weight", config).sort_values("piece")
    values["piece_weights"] = [round(float(v), 6) for v in weights["value"]]
    values["pieces"] = len(values["piece_weights"])
    missing = label(row, "missing")
    values["missing"] = _pieces(missing)
    values["missing_pieces"] = [[j // k, j % k] for j in values["missing"]]
    values["missing_text"] = pieces_text(values["missing"], world, k) if values["missing"] else "none"
    desync = rows(frame, "desync_deviation", config)
    # [rank, deviation] pairs, not a dict: JSON would turn integer keys into strings.
    values["rank_deviation"] = sorted([int(r["rank"]), float(r["value"])] for _, r in desync.iterrows())
    beyond = [r for r, z in values["rank_deviation"] if z > _referee.ROUNDING_MARGIN]
    values["desync_ranks"] = beyond or ["none"]
    values["max_rank_deviation"] = max((z for _, z in values["rank_deviation"]), default=0.0)
    return Finding(key=kind, claim=_CLAIMS[kind], holds=True, template=_FIT_TEMPLATE, values=values)


def _clears_tolerance(ctx: Context) -> Decision:
    """The band decides where nothing stronger did: rounding, bug or undetermined by the margins."""
    band = ctx.findings["within_band"].values
    classification = band["classification"]
    only_degenerate = band["only_degenerate"]
    finding, values = None, {}
    extra = []
    local = ctx.findings.get("localization")
    if local is not None:
        extra.append(local)
        finding = local.key
        values["finding_text"] = "; " + local.claim_text[0].lower() + local.claim_text[1:]
    tail = "; judged by tolerance (no replay: {no_replay})" if ctx.fact("no_replay") else ""
    diverged = band["first_divergence"] >= 0
    if classification == "rounding":
        summary = ("rounding: at most {max_deviation} × the reference's own rounding distance "
                   "(margin {rounding_margin})" + tail)
    elif only_degenerate:
        summary = ("undetermined: the reference reproduces the float64 truth to within a rounding, "
                   "so its distance gives no band to judge by" + tail)
    else:
        where = " from step {first_divergence}" if diverged else ""
        if classification == "bug":
            summary = "bug: {max_deviation} × the rounding band" + where + "{finding_text}" + tail
        else:
            summary = ("undetermined: {max_deviation} × the rounding band" + where + ", beyond every correct "
                       "run measured but not by orders of magnitude{finding_text}" + tail)
    return Decision(classification, "tolerance", summary=summary, finding=finding,
                    first_divergence=band["first_divergence"] if diverged else None, values=values,
                    extra_findings=extra)


def read_band(ctx: Context, dev) -> Finding:
    """The band finding from the rank-0 ``deviation`` rows ``dev`` (not empty)."""
    frame, config = ctx.frame, ctx.config
    degenerate = set()
    bands = rows(frame, "band", config)
    for _, b in bands[bands["param"] == _referee.MODEL].iterrows():
        if b["value"] < DEGENERATE_FRACTION * float(label(b, "unit_roundoff", 0.0)):
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
    first_rows = rows(frame, "first_divergence", config)
    first = int(first_rows.iloc[0]["value"]) if not first_rows.empty else -1
    values = dict(max_deviation=max_dev, step=int(worst["step"]), param=str(worst["param"]),
                  quantity=str(worst["quantity"]), where=where, rounding_margin=_referee.ROUNDING_MARGIN,
                  bug_margin=_referee.BUG_MARGIN, steps_compared=int(dev["step"].max()) + 1,
                  degenerate_steps=len(degenerate), classification=classification,
                  only_degenerate=only_degenerate, first_divergence=first)
    return Finding(
        key="within_band",
        claim=("Every gradient and parameter stays within {rounding_margin} × the reference's own "
               "distance from the float64 truth"),
        holds=max_dev <= _referee.ROUNDING_MARGIN,
        template=("largest deviation {max_deviation} × the band at step {step}, {where}, "
                  "over {steps_compared} step(s)"),
        values=values)


# --------------------------------------------------------------------------- the registry


_MESH = {name: Evidence(name, read, proves=proves, verdicts=verdicts)
         for name, read, proves, verdicts in _mesh.SOURCES}

EVIDENCE: tuple[Evidence, ...] = (
    Evidence("finite", _read_finite, proves=_proves_finite, verdicts=(
        ("bug", "a gradient or parameter of the configuration turned NaN or Inf at a step where the "
                "single-process reference stays finite: the first step, rank and parameter (a reference "
                "that turns non-finite too means the data or model produce it; either way the steps "
                "before are judged)"),)),
    _MESH["mesh_replicas"],
    Evidence("replicas", _read_replicas, proves=_proves_replicas, verdicts=(
        ("bug", "after a synchronized step two ranks hold gradients or parameters that differ in any bit: "
                "replicas must agree, no band makes that rounding (the replay then names the rank and phase "
                "that started it)"),)),
    Evidence("collectives", _read_collectives, proves=_proves_collectives, verdicts=(
        ("bug", "every collective the ranks issued (DDP's reducer, comm hooks, FSDP2, SyncBatchNorm, your own "
                "`dist.*` calls) is recorded; one whose output differs from the emulation of every rank's "
                "recorded inputs in any bit, or a gradient reduction in another dtype than declared (a "
                "`reduce_dtype` not applied), is a bug: step, rank, op, group, dtype, elements, ulps"),)),
    Evidence("data", _read_data, proves=_proves_data, verdicts=(
        ("bug", "with per-rank batches (`Setup.rank_batches`), some step's ranks train a sample more often "
                "(a sampler's padding: `duplicated_contribution`) or less often (`missing_contribution`) "
                "than that step's global batch holds it, by the samples' bytes: the step and the samples, "
                "named by where they first appear in the global batches (`step 0 sample 3`)"),)),
    _MESH["mesh_precision"],
    _MESH["partial_sums"],
    Evidence("replay", _read_replay, proves=_proves_replay, clears=_clears_replay, verdicts=(
        ("bug", "some rank's local gradient, reduced bucket or update differs from ddplab's specification "
                "replay of that rank's step, by any amount (one ulp in one element counts): the first step, "
                "rank, phase (`local_gradient`, `reduction`, `update`), parameter, ulps and module"),
        ("exact", "every rank equals the replay bit for bit at every step, and in float64 the promise is one "
                  "process's computation: the difference from one process is provably the batch split's "
                  "rounding (its size is still in the band figures)"))),
    Evidence("twin", _read_twin, proves=_proves_twin, verdicts=(
        ("bug", "the symmetric twin: the configuration run again with every rank given rank 0's share and "
                "the same RNG state; a rank whose forward output, collective input, gradient or update "
                "differs from rank 0's in any bit computes something that depends on its rank (step, rank, "
                "what, module)"),)),
    Evidence("semantic", _read_semantic, proves=_proves_semantic, verdicts=(
        ("bug", "the replay is exact, but what the configuration promises, run in float64, differs from one "
                "process's float64 truth beyond 1e-9 relative (float64 rounding is ~1e-16): the finding "
                "names the kind (`factor`, `missing_contribution`, or another computation: `semantic`)"),)),
    Evidence("approximation", _read_approximation, clears=_clears_approximation, verdicts=(
        ("approximation", "a lossy step the configuration declares (`approximation=\"PowerSGD rank 1\"`) or "
                          "that ddplab recognizes (torch's PowerSGD hooks), with no evidence of a bug: its "
                          "size (× the band, relative in float64), whether the ranks computed symmetrically "
                          "and whether its collectives were exact; never rounding"),)),
    Evidence("float64", _read_float64, proves=_proves_float64, clears=_clears_float64, verdicts=(
        ("bug", "your own step, wrap and hooks, run on W ranks with model and data in float64, differ from "
                "the float64 truth beyond 1e-9 relative -- or, where the step still computes in a lower "
                "precision (a compression hook, a bf16 collective), beyond 4·(W+1)·u of that precision: "
                "the finding names the kind (`factor`, `missing_contribution`, `semantic`)"),
        ("rounding", "no replay exists, and in float64 your code is one process's computation: what "
                     "remains in its own precision is rounding (the band's figure is reported; beyond "
                     "10 000× it the verdict is undetermined)"))),
    Evidence("tolerance", lambda ctx: ctx.findings.get("within_band"), clears=_clears_tolerance, verdicts=(
        ("rounding", "nothing above decided (no replay, and the twin or the float64 run could not run: "
                     "the summary says why) and every step lies within 100× the reference's own rounding "
                     "distance from the float64 truth"),
        ("bug / undetermined", "by tolerance alone: ≥ 10 000× the band, or in between the margins (or no "
                               "band to judge by)"))),
)


def decide(ctx: Context) -> Decision:
    """The verdict's decision: the first source that proves a bug, else the first that clears.

    ``ctx.findings`` must hold ``within_band`` and ``localization`` (the band's own findings);
    every source's finding is added to it under the source's name.
    """
    for source in EVIDENCE:
        if source.name not in ctx.findings:
            ctx.findings[source.name] = source.read(ctx)
    for source in EVIDENCE:
        finding = ctx.findings[source.name]
        decision = source.proves(finding, ctx) if finding is not None else None
        if decision is not None:
            return decision
    for source in EVIDENCE:
        decision = source.clears(ctx)
        if decision is not None:
            return decision
    raise AssertionError("the tolerance band always decides")


def verdict_table() -> str:
    """The verdict table of the README, rendered from :data:`EVIDENCE` (strongest first).

    ``python -m ddplab.compare.evidence README.md`` writes it into the README in place.
    """
    lines = ["| verdict | evidence | meaning |", "|---|---|---|"]
    for source in EVIDENCE:
        for kind, meaning in source.verdicts:
            bold = " / ".join(f"**{k}**" for k in kind.split(" / "))
            lines.append(f"| {bold} | `{source.name}` | {meaning} |")
    return "\n".join(lines)


def _write_into(path: str) -> None:
    """Replace the README's evidence table (from its header to the run-status rows) with :func:`verdict_table`."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    start = text.index("| verdict | evidence | meaning |")
    end = text.index("| **crashed** / **hung** |", start)
    with open(path, "w", encoding="utf-8") as f:
        f.write(text[:start] + verdict_table() + "\n" + text[end:])


if __name__ == "__main__":
    import sys

    _write_into(sys.argv[1] if len(sys.argv) > 1 else "README.md")

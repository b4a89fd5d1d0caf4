"""Case 02's verdict: what DDP did to the bits, and what made the printed norm small.

:func:`ddp_facts` reads what the fingerprints say about DDP's constructor
into a :class:`DdpFacts`; each finding is one function. Findings keep their
numbers in ``values``; the sentences are templates.
"""
from __future__ import annotations

import dataclasses
import math

import torch

from ddplab.cases.half_precision.worker import STAGES
from ddplab.records import label_values, value_of, where
from ddplab.verdict import Finding, Verdict

__all__ = ["REPORT_NORM_BEFORE", "REPORT_NORM_AFTER", "REPORT_TORCH_VERSION", "SCOPE", "DdpFacts",
           "ddp_facts", "ddp_changed_kept_bits", "lane_norms", "reference_norm", "torch_norm",
           "ulps_from_true", "verdict"]

#: The norms the report printed (rank 0, 1 GPU, half precision): before and after wrapping.
REPORT_NORM_BEFORE = 5.65625
REPORT_NORM_AFTER = 13.0625
#: The torch version the report says it "just checked" (it printed the same numbers).
REPORT_TORCH_VERSION = "2.0"

SCOPE = ("Covers the bits of every weight on every rank before wrapping, after torch.compile and "
         "after DDP's constructor, and how the norm of rank 0's weights comes out of each way of "
         "accumulating it (exact, float64, float32, K-lane float16 model, torch's kernels). Not "
         "covered: training — this case reduces no gradient.")


def lane_norms(records, dtype: str = "float16") -> dict[int, float]:
    """Norm of rank 0's weights per lane count K of the K-lane accumulator model."""
    lanes = where(records, "norm", method="lanes", dtype=dtype)
    return {int(k): float(v) for k, v in sorted(zip(lanes["lanes"], lanes["value"]))}


def reference_norm(records, dtype: str) -> float:
    """The true norm of rank 0's initial weights: exact where recorded, else float64's."""
    for method in ("exact", "float64 accumulation"):
        value = value_of(records, "norm", method=method, dtype=dtype, rank=0)
        if not math.isnan(value):
            return value
    return math.nan


def torch_norm(records, dtype: str, device: str = "cpu") -> float:
    return value_of(records, "norm", method="torch.norm", dtype=dtype, stage="before", rank=0,
                    device=device)


def _torch_version(records, dtype: str | None = None) -> str:
    labels = {"dtype": dtype} if dtype else {}
    versions = label_values(records, "torch_version", "norm", method="torch.norm", **labels)
    return str(versions[0]) if versions else torch.__version__


def ulps_from_true(value: float, true_norm: float, dtype: str) -> int:
    """``value`` minus the true norm rounded once to ``dtype``, in ulps of ``dtype``."""
    from ddplab.numerics.exact import round_to_dtype
    from ddplab.numerics.ulp import ulp_distance

    dt = getattr(torch, dtype)
    rounded = round_to_dtype(torch.tensor([true_norm], dtype=torch.float64),
                             torch.zeros(1, dtype=torch.float64), dt)
    return int(ulp_distance(torch.tensor([value], dtype=torch.float64).to(dt), rounded)[0])


@dataclasses.dataclass
class DdpFacts:
    """What the weights' fingerprints say about DDP's constructor (stage ``ddp``), per rank."""

    changed: dict[int, int]             # rank -> tensors whose bits the constructor changed
    tensors: dict[int, int]             # rank -> tensors fingerprinted
    equal_after: int                    # fingerprints (all ranks) equal to rank 0's initial after wrapping
    fingerprints_after: int
    all_equal_after: bool
    differed_before: dict[int, int]     # rank != 0 -> tensors that differed from rank 0's before wrapping

    @property
    def ranks(self) -> list[int]:
        return sorted(self.changed)

    @property
    def others(self) -> list[int]:
        return [r for r in self.changed if r != 0]

    @property
    def total_changed(self) -> int:
        return sum(self.changed.values())

    @property
    def rank0_kept(self) -> bool:
        return 0 in self.changed and self.changed[0] == 0

    def per_rank(self) -> dict:
        """Changed and fingerprinted tensors per rank, as a finding quotes them."""
        return {"changed_per_rank": [self.changed[r] for r in self.ranks],
                "tensors_per_rank": [self.tensors[r] for r in self.ranks], "ranks": self.ranks}


def ddp_facts(records) -> DdpFacts:
    changed = where(records, "fingerprint_changed", stage="ddp")
    matches = where(records, "matches_rank0_initial", stage="ddp")
    matched_before = where(records, "matches_rank0_initial", stage="before")
    by_rank = {int(r): g["value"] for r, g in changed.groupby("rank")}
    return DdpFacts(
        changed={r: int(v.sum()) for r, v in by_rank.items()}, tensors={r: len(v) for r, v in by_rank.items()},
        equal_after=int(matches["value"].sum()), fingerprints_after=len(matches),
        all_equal_after=len(matches) > 0 and bool((matches["value"] == 1).all()),
        differed_before={r: int((where(matched_before, "matches_rank0_initial", rank=r)["value"] == 0).sum())
                         for r in by_rank if r != 0})


def ddp_changed_kept_bits(d: DdpFacts, same_init: bool) -> bool:
    """A bug: with the same seed DDP must change nothing; with different seeds, keep rank 0's bits."""
    return d.total_changed > 0 if same_init else not d.rank0_kept


def _replicas_finding(d: DdpFacts) -> Finding:
    return Finding(
        "replicas_equal_after_ddp",
        "After wrapping, every rank holds rank 0's initial weights bit for bit "
        "(DDP's contract: replicas start equal)",
        d.all_equal_after,
        "after wrapping, {equal} of {fingerprints} tensor fingerprints (all ranks) equal rank 0's "
        "from before wrapping",
        {"equal": d.equal_after, "fingerprints": d.fingerprints_after})


def _unchanged_finding(d: DdpFacts) -> Finding:
    """With the same seed on every rank: DDP's constructor changes no bit anywhere."""
    fingerprints = sum(d.tensors.values())
    return Finding(
        "ddp_changed_no_bit", "Wrapping the model in DDP changed no bit of any weight on any rank",
        fingerprints > 0 and d.total_changed == 0,
        "{changed} of {fingerprints} tensor fingerprints (sha256 of the bytes) changed by DDP's "
        "constructor (changed per rank {ranks}: {changed_per_rank}, of {tensors_per_rank})",
        {"changed": d.total_changed, "fingerprints": fingerprints, **d.per_rank()})


def _broadcast_finding(d: DdpFacts, replicas: Finding) -> Finding:
    """With a different seed per rank: rank 0 kept its bits, the others took rank 0's."""
    replaced = all(d.changed[r] == d.differed_before[r] > 0 for r in d.others)
    return Finding(
        "ddp_broadcast_rank0",
        "DDP's constructor broadcast rank 0's weights: rank 0 kept every bit, each other rank's "
        "differing weights were replaced by rank 0's (a real change, by design)",
        d.rank0_kept and bool(d.others) and replaced and replicas.holds,
        "ranks {ranks}: {changed_per_rank} tensors changed of {tensors_per_rank}; tensors that "
        "differed from rank 0's before wrapping on ranks {others}: {differed}",
        {**d.per_rank(), "others": d.others, "differed": [d.differed_before[r] for r in d.others]})


def _compile_finding(records) -> Finding:
    ok = where(records, "compile_ok")
    changed = where(records, "fingerprint_changed", stage="compile")
    frames = where(records, "compiled_frames")
    same = where(records, "same_parameter_objects", stage="compile")
    failed = ok[ok["value"] == 0]
    claim = ("The report's torch.compile step changed no bit: it is lazy, so without a forward "
             "call nothing is compiled and the parameters stay the same objects")
    if len(ok) == 0 or len(failed):
        errors = sorted({str(e) for e in failed.get("error", [])}) if len(failed) else []
        return Finding("compile_changed_no_bit", claim, False,
                       "torch.compile failed on ranks {ranks} ({errors}); DDP wrapped the "
                       "uncompiled model there" if len(failed) else "no torch.compile records",
                       {"ranks": label_values(failed, "rank"), "errors": "; ".join(errors)})
    n_changed = int(changed["value"].sum())
    return Finding(
        "compile_changed_no_bit", claim,
        n_changed == 0 and bool((frames["value"] == 0).all()) and bool((same["value"] == 1).all()),
        "{changed} of {fingerprints} fingerprints changed; frames compiled by dynamo: {frames}; "
        "same Parameter objects on {same} of {wrapped} rank×dtype",
        {"changed": n_changed, "fingerprints": len(changed), "frames": int(frames["value"].sum()),
         "same": int(same["value"].sum()), "wrapped": len(same)})


def _report_finding(records) -> Finding:
    lanes = lane_norms(records)
    matching = [k for k, v in lanes.items() if v == REPORT_NORM_BEFORE]
    return Finding(
        "report_number_reproduced",
        "The K-lane float16 accumulator model of these weights reproduces the report's "
        "{report_norm:r} exactly",
        bool(matching),
        "float16 norm with K = {lanes} partial accumulators: {lane_norms:r}; K giving the report's "
        "number: {matching}; true norm {true_norm:.6f}",
        {"report_norm": REPORT_NORM_BEFORE, "lanes": list(lanes), "lane_norms": list(lanes.values()),
         "matching": matching or "none", "true_norm": reference_norm(records, "float16")})


def _stall_finding(records) -> Finding:
    from ddplab.numerics.bounds import gamma

    claim = ("A float16 running sum of squares stalls: once the squares fall below half an ulp of "
             "the sum, adding them changes nothing")
    trace16 = where(records, "running_sum_of_squares", accumulator="float16", dtype="float16")
    trace32 = where(records, "running_sum_of_squares", accumulator="float32", dtype="float16")
    if not len(trace16) or not len(trace32):
        return Finding("fp16_accumulator_stalls", claim, False, "no running-sum records")
    n = int(trace16["step"].max())
    final16 = float(trace16.sort_values("step")["value"].iloc[-1])
    final32 = float(trace32.sort_values("step")["value"].iloc[-1])
    stalled_at = int(value_of(records, "stall_element", default=n, dtype="float16"))
    lane_sums = where(records, "lane_sum_of_squares", dtype="float16")
    k = 8 if 8 in set(lane_sums["lanes"]) else int(lane_sums["lanes"].max()) if len(lane_sums) else 0
    ends = where(lane_sums, "lane_sum_of_squares", lanes=k)["value"]
    return Finding(
        "fp16_accumulator_stalls", claim, final16 < 0.5 * final32 and stalled_at < n,
        "one float16 accumulator stops at {final16:r} after element {stalled_at} of {n} (the rest "
        "add nothing); a float32 accumulator reaches {final32}; with K={k} lanes every lane ends "
        "between {lane_low:r} and {lane_high:r}; the classical bound γ_(n−1) for n float16 "
        "additions is {gamma} (∞: it guarantees nothing)",
        {"final16": final16, "stalled_at": stalled_at, "n": n, "final32": final32, "k": k,
         "lane_low": float(ends.min()) if len(ends) else math.nan,
         "lane_high": float(ends.max()) if len(ends) else math.nan,
         "gamma": gamma(n - 1, torch.float16)})


def _kernel_finding(records, key: str, device: str, lanes: dict[int, float]) -> Finding | None:
    own = torch_norm(records, "float16", device=device)
    if math.isnan(own):
        return None
    true_norm = reference_norm(records, "float16")
    ulps = ulps_from_true(own, true_norm, "float16")
    return Finding(
        key,
        "torch {version}'s {device} float16 norm shows no accumulation artifact (it is the true "
        "norm rounded to float16, so it accumulates in a wider type)",
        abs(ulps) <= 1,
        "torch.norm on {device} = {own:r}, true norm {true_norm:.6f}, {ulps} float16 ulp apart; "
        "K-lane models giving the same value: {same}; the report's torch {report_version} "
        "printed {report_norm:r}",
        {"version": _torch_version(records, "float16"), "device": device.upper(), "own": own,
         "true_norm": true_norm, "ulps": ulps, "same": [k for k, v in lanes.items() if v == own] or "none",
         "report_version": REPORT_TORCH_VERSION, "report_norm": REPORT_NORM_BEFORE})


def _norm_tracks_bits_finding(records) -> Finding:
    norms = where(records, "norm", method="torch.norm", device="cpu")
    changed = where(records, "fingerprint_changed")
    unexplained, sequences = [], []
    for (rank, dtype, param), group in norms.groupby(["rank", "dtype", "param"]):
        by_stage = dict(zip(group["stage"], group["value"]))
        sequences.append(f"rank {rank} {dtype}: " + " → ".join(
            repr(float(by_stage[s])) for s in STAGES if s in by_stage))
        for stage in STAGES[1:]:
            if stage in by_stage and by_stage[stage] != by_stage.get("before"):
                bits = where(changed, "fingerprint_changed", rank=rank, dtype=dtype, param=param,
                             stage=stage)
                if not len(bits) or int(bits["value"].max()) == 0:
                    unexplained.append(f"rank {rank} {dtype} {stage}")
    return Finding(
        "norm_moves_only_with_bits",
        "On the CPU the printed torch.norm changes between stages only where the weights' bits "
        "changed (a norm that moves over unchanged bits means another kernel computed it)",
        len(norms) > 0 and not unexplained,
        "torch.norm before → compile → ddp: {sequences}; moved without a bit changing: {unexplained}",
        {"sequences": "; ".join(sequences), "unexplained": unexplained or "none"})


def _installed_finding(records, lanes: dict[int, float]) -> Finding:
    found = _kernel_finding(records, "installed_torch_no_artifact", "cpu", lanes)
    return found if found is not None else Finding(
        "installed_torch_no_artifact", "torch's CPU float16 norm", False, "no torch.norm records")


def _values(records, params: dict, d: DdpFacts, lanes: dict[int, float], report: Finding) -> dict:
    matching = report.values["matching"]
    k = (8 if 8 in matching else matching[0]) if isinstance(matching, list) else None
    closest = min(lanes, key=lambda key: abs(lanes[key] - REPORT_NORM_BEFORE)) if lanes else None
    return {"tensors": sum(d.tensors.values()),
            "world_size": params["world_size"], "report_norm": REPORT_NORM_BEFORE,
            "k": k if k is not None else "none", "true_norm": reference_norm(records, "float16"),
            "closest_k": closest if closest is not None else "none",
            "closest_norm": lanes.get(closest, math.nan), "lanes": list(lanes),
            "version": _torch_version(records), "cpu_norm": torch_norm(records, "float16"),
            "others": list(range(1, params["world_size"])), "changed": d.per_rank()["changed_per_rank"]}


def _summary(kind: str, values: dict, installed: Finding) -> str:
    norm = ("the {k}-lane float16 accumulator model gives {report_norm:r} (the report's number) "
            "against a true norm of {true_norm:.4f}" if values["k"] != "none" else
            "the report's {report_norm:r} was not reproduced by any K in {lanes} (closest: "
            "K={closest_k} gives {closest_norm:r}); true norm {true_norm:.4f}")
    kernel = ("the CPU kernel of torch {version} accumulates wider and prints {cpu_norm:r}"
              if installed.holds else
              "the CPU kernel of torch {version} still shows the artifact ({cpu_norm:r})")
    if kind == "bug":
        return ("DDP changed the weights it must keep (tensors changed per rank: {changed}). "
                "Separately, on the norm: " + norm + "; " + kernel + ".")
    if kind == "rounding":
        return ("DDP did not change the weights (0 of {tensors} weight fingerprints changed on "
                "{world_size} rank(s)); the fp16 norm computed without a wider accumulator did: "
                + norm + ". " + kernel[0].upper() + kernel[1:] + ".")
    return ("DDP did change the weights on ranks {others}: its constructor broadcast rank 0's "
            "parameters, which kept every bit (the ranks were seeded differently). The report's small "
            "norm is a separate matter, float16 accumulation: " + norm + "; " + kernel + ".")


def verdict(records, params: dict) -> Verdict:
    """kind "bug" if DDP changed bits it must keep; "by design" if it replaced other ranks'
    weights by rank 0's (``same_init=False``); "rounding" otherwise."""
    d, lanes = ddp_facts(records), lane_norms(records)
    replicas = _replicas_finding(d)
    ddp = _unchanged_finding(d) if params["same_init"] else _broadcast_finding(d, replicas)
    report, installed = _report_finding(records), _installed_finding(records, lanes)
    findings = [ddp, replicas, _compile_finding(records), report, _stall_finding(records), installed,
                _norm_tracks_bits_finding(records)]
    cuda = _kernel_finding(records, "cuda_norm_no_artifact", "cuda", lanes)
    if cuda is not None:
        findings.append(cuda)
    kind = ("bug" if ddp_changed_kept_bits(d, params["same_init"]) else
            "rounding" if params["same_init"] else "by design")
    values = _values(records, params, d, lanes, report)
    return Verdict(case="half_precision", kind=kind, summary=_summary(kind, values, installed),
                   findings=findings, values=values, scope=SCOPE,
                   key_numbers={"weight fingerprints checked after DDP": "tensors",
                                "K-lane float16 model matching the report": "k",
                                "true norm of the weights": "true_norm:.6f",
                                "installed torch's CPU float16 norm": "cpu_norm:r"})

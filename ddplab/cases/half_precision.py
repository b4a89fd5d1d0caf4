"""Case 02 — "wrapping an fp16 model in DDP changes the weights" (seed 001).

The report printed the norm of an ``nn.Linear(512, 512, bias=False,
dtype=float16)`` (seed 42) before wrapping it in DDP (5.65625), after
``torch.compile`` (5.65625) and after wrapping (13.0625), and concluded that
DDP changed the weights. Two separate questions hide in that:

* *Did any bit of the weights change?* Each rank fingerprints its parameters
  (:func:`ddplab.probes.fingerprint`, sha256 of the bytes) before wrapping,
  after the report's ``torch.compile`` step and after DDP's constructor, and
  compares them with its own initial weights and with rank 0's. With the same
  seed on every rank DDP changes nothing; with a different seed per rank
  (``same_init=False``) DDP's constructor broadcasts rank 0's parameters and
  buffers (``_sync_module_states``): a real change on ranks != 0, by design.
* *Why does the printed norm move?* ``||w||_2 = sqrt(sum w_i^2)``. Accumulated
  in float16, a running sum of squares stops growing once each increment
  ``w_i^2`` falls below half an ulp of the sum: with ``|w_i| <= 1/sqrt(512)``
  every square is ``<= 2^-9`` and half an ulp of 4.0 is ``2^-9``, so the sum
  stalls at 4.0 (ties round to the even 4.0). K partial accumulators
  ("lanes") stall at 4.0 each: ``sqrt(4K)``, and K = 8 gives
  ``sqrt(32) = 5.65625`` in float16 — the report's number. The K-lane model
  is :mod:`ddplab.numerics.accumulators`; torch's own CPU kernel of the
  installed version is measured next to it, and so is the CUDA kernel when a
  GPU is present (the report's "after" norm was computed on ``cuda:rank``,
  because the script moved the model with ``.to(rank)`` before wrapping).

Records (tidy, one table): ``fingerprint_changed`` (0/1 per tensor, rank,
dtype and stage, against the rank's own weights before wrapping),
``matches_rank0_initial`` (0/1, against rank 0's weights before wrapping),
``same_parameter_objects``, ``compile_ok``, ``compiled_frames``, ``norm``
(labels ``method``, ``stage``, ``device``, ``lanes``, ``accumulator``,
``torch_version``), ``lane_sum_of_squares`` (each lane's final float16 sum)
and ``running_sum_of_squares`` (``step`` = elements accumulated).

Example::

    >>> from ddplab.cases import half_precision as case
    >>> records = case.run(case.PARAMETERS.validate())
    >>> case.verdict(records, case.PARAMETERS.validate()).headline
"""
from __future__ import annotations

import math

import torch

from ddplab.parameters import Parameter, ParameterSet
from ddplab.records import where
from ddplab.verdict import Finding, Verdict

__all__ = [
    "NAME", "TITLE", "SEED", "NOTEBOOK", "PARAMETERS", "QUICK",
    "REPORT_NORM_BEFORE", "REPORT_NORM_AFTER", "REPORT_TORCH_VERSION", "STAGES",
    "check_params", "build_linear", "compile_step", "weight_numerics", "worker", "run",
    "verdict", "norm_table", "fingerprint_table", "versions_markdown", "fingerprint_figure",
    "running_sum_figure", "lanes_figure", "figures",
]

NAME = "half_precision"
TITLE = "Half-precision weights: does wrapping an fp16 model in DDP change the weights?"
SEED = "001_2b691f6e62abb8c9.txt"
NOTEBOOK = "02_half_precision_weights.ipynb"

#: The norms the report printed (rank 0, 1 GPU, half precision): before and after wrapping.
REPORT_NORM_BEFORE = 5.65625
REPORT_NORM_AFTER = 13.0625
#: The torch version the report says it "just checked" (it printed the same numbers).
REPORT_TORCH_VERSION = "2.0"

#: The moments at which every rank looks at its weights, in order.
STAGES = ("before", "compile", "ddp")

#: Weight dtypes the case accepts.
DTYPES = ("float16", "bfloat16", "float32", "float64")

#: Points of the running-sum trace (log-spaced over the elements, plus the last one).
TRACE_POINTS = 160

#: Launch timeout (s): generous for 2 ranks importing torch._dynamo on 2 busy cores.
LAUNCH_TIMEOUT = 240.0


def _needs_float16(dtypes: list[str]) -> str | None:
    if "float16" not in dtypes:
        return "must include 'float16', the report's dtype"
    return None


PARAMETERS = ParameterSet([
    Parameter("world_size", 2, "number of ranks (processes)", kind="int", minimum=1, maximum=8),
    Parameter("dtypes", ["float16", "float32"], "weight dtypes to build the model in",
              kind="list[str]", choices=DTYPES, check=_needs_float16),
    Parameter("seed", 42, "torch.manual_seed before building the model (the report's 42)",
              kind="int", minimum=0, maximum=2**63 - 1),
    Parameter("in_features", 512, "nn.Linear input features", kind="int", minimum=1,
              maximum=4096),
    Parameter("out_features", 512, "nn.Linear output features", kind="int", minimum=1,
              maximum=4096),
    Parameter("lanes", [1, 2, 4, 8, 16, 32], "partial accumulators K of the accumulator model",
              kind="list[int]", minimum=1, maximum=4096),
    Parameter("same_init", True, "seed every rank alike (False: rank r uses seed + r, "
              "as when users forget to seed)", kind="bool"),
])

#: Already seconds with the defaults; quick mode drops the float32 model.
QUICK = {"dtypes": ["float16"]}


# --------------------------------------------------------------------------- parameters


def check_params(params: dict) -> dict:
    """Validate ``params`` and the rules that tie parameters together; return them.

    Each parameter is checked by :data:`PARAMETERS`; on top, no lane count may
    exceed the number of weights (a lane with no element is no accumulator).
    Raises ValueError naming the parameter.
    """
    params = PARAMETERS.validate(params)
    numel = params["in_features"] * params["out_features"]
    too_many = [k for k in params["lanes"] if k > numel]
    if too_many:
        raise ValueError(f"parameter 'lanes': {too_many} exceed the {numel} weights of a "
                         f"{params['out_features']}x{params['in_features']} layer; "
                         f"it accepts lane counts from 1 to {numel}")
    return params


# --------------------------------------------------------------------------- inside a rank


def build_linear(params: dict, dtype: str, rank: int) -> torch.nn.Linear:
    """The report's model: ``nn.Linear(in, out, bias=False, dtype=dtype)`` after a seed.

    The seed is ``params["seed"]`` on every rank with ``same_init``; otherwise
    rank ``r`` uses ``seed + r`` (what happens when users forget to seed).
    """
    seed = params["seed"] + (0 if params["same_init"] else rank)
    torch.manual_seed(seed)
    return torch.nn.Linear(params["in_features"], params["out_features"], bias=False,
                           dtype=getattr(torch, dtype))


def compile_step(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The report's ``torch.compile(model)``, guarded: ``(module to wrap, facts)``.

    ``torch.compile`` is lazy: it returns an ``OptimizedModule`` that holds
    the *same* module and compiles only at the first forward call, which the
    report never makes. ``facts`` says whether it succeeded (``ok``; on
    failure ``error`` and the original model are returned, so the run goes
    on), how many Python frames dynamo processed (``frames``: 0 means nothing
    was compiled) and whether the parameters are the same objects.
    """
    try:
        from torch._dynamo.utils import counters

        frames_before = counters["frames"]["total"]
        compiled = torch.compile(model)
        frames = counters["frames"]["total"] - frames_before
        same = _same_parameters(compiled, model)
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding, not a crash
        return model, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                       "frames": 0, "same_objects": True}
    return compiled, {"ok": True, "error": None, "frames": frames, "same_objects": same}


def _same_parameters(wrapper: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether ``wrapper`` exposes exactly ``model``'s Parameter objects, in order."""
    mine = list(model.parameters())
    theirs = list(wrapper.parameters())
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs))


def _torch_norms(model: torch.nn.Module, stage: str, device: str = "cpu") -> None:
    """Emit what the report printed, ``torch.norm(w)``, and ``torch.linalg.vector_norm(w)``."""
    from ddplab.records import emit

    for name, p in model.named_parameters():
        w = p.detach().to(device)
        for method, fn in (("torch.norm", torch.norm), ("torch.linalg.vector_norm",
                                                        torch.linalg.vector_norm)):
            emit("norm", float(fn(w)), param=name, stage=stage, method=method, device=device,
                 torch_version=torch.__version__)


def _emit_fingerprints(model, stage: str, own_before: dict, rank0_before: dict) -> None:
    """Per tensor: changed against this rank's initial print, and equal to rank 0's initial."""
    from ddplab.probes import diff_fingerprints, fingerprint
    from ddplab.records import emit

    now = fingerprint(model)
    changed = {rec["param"] for rec in diff_fingerprints(own_before, now)}
    differs_from_rank0 = {rec["param"] for rec in diff_fingerprints(rank0_before, now)}
    for name, tensor_print in now.items():
        emit("fingerprint_changed", int(name in changed), param=name, kind=tensor_print.kind,
             stage=stage, sha256=tensor_print.sha256[:16])
        emit("matches_rank0_initial", int(name not in differs_from_rank0), param=name,
             kind=tensor_print.kind, stage=stage)


def _trace_steps(n: int, must: tuple[int, ...] = ()) -> list[int]:
    """Log-spaced element counts 1..n (plus ``must``): the running sum's plotted points."""
    import numpy as np

    steps = set(np.unique(np.round(np.geomspace(1, n, TRACE_POINTS)).astype(int)).tolist())
    steps.update(s for s in must if 1 <= s <= n)
    steps.add(n)
    return sorted(steps)


def weight_numerics(weight: torch.Tensor, lanes: list[int]) -> None:
    """Emit the norms of ``weight`` the kernels and the models compute, and the running sums.

    * ``norm`` with ``method`` ``"exact"`` (sqrt of the correctly rounded
      float64 sum of the squares, which are exact in float64 for 16- and 32-bit
      weights), ``"float64 accumulation"`` and ``"float32 accumulation"``
      (torch's norm of the upcast weights), and ``"lanes"`` (the K-lane model
      in the weights' dtype, :func:`ddplab.numerics.accumulators.lane_norm`,
      one record per K with labels ``lanes`` and ``accumulator``);
    * ``lane_sum_of_squares``: every lane's final sum for each K (label ``lane``);
    * ``running_sum_of_squares`` of one accumulator in the weights' dtype and
      in float32 (``step`` = elements accumulated, log-spaced points) and
      ``stall_element``: the element after which the dtype's sum never moves
      (16-bit weights only).
    """
    from ddplab.numerics.accumulators import lane_norm, lane_partials, running_sum_of_squares
    from ddplab.numerics.exact import exact_sum
    from ddplab.records import emit

    dtype = weight.dtype
    name = str(dtype).replace("torch.", "")
    flat = weight.detach().reshape(-1)
    if dtype != torch.float64:
        squares = flat.double().square().reshape(-1, 1)  # exact: 2p <= 53 for p <= 24
        emit("norm", math.sqrt(float(exact_sum(squares)[0])), method="exact", stage="before",
             accumulator="exact")
    emit("norm", float(flat.double().norm()), method="float64 accumulation", stage="before",
         accumulator="float64", device="cpu", torch_version=torch.__version__)
    if weight.element_size() <= 4:  # float32 holds 16- and 32-bit weights exactly
        emit("norm", float(flat.float().norm()), method="float32 accumulation", stage="before",
             accumulator="float32", device="cpu", torch_version=torch.__version__)
    for k in lanes:
        emit("norm", float(lane_norm(flat, dtype, lanes=k)), method="lanes", lanes=k,
             accumulator=name, stage="before")
        for lane, value in enumerate(lane_partials(flat, dtype, lanes=k, square=True).tolist()):
            emit("lane_sum_of_squares", value, lanes=k, lane=lane, accumulator=name)

    if dtype not in (torch.float16, torch.bfloat16):
        return  # the stall is a 16-bit story; float32 sums of these squares do not stall
    own = running_sum_of_squares(flat, dtype, lanes=1)[:, 0].double()
    wide = running_sum_of_squares(flat, torch.float32, lanes=1)[:, 0].double()
    moved = torch.nonzero(own[1:] != own[:-1]).reshape(-1)
    # Element count (1-based) at which the sum reached its final value.
    stall = int(moved[-1]) + 2 if len(moved) else 1
    emit("stall_element", stall, accumulator=name, lanes=1)
    for step in _trace_steps(flat.numel(), (stall - 1, stall)):
        for acc, trace in ((name, own), ("float32", wide)):
            emit("running_sum_of_squares", float(trace[step - 1]), step=step, accumulator=acc,
                 lanes=1)


def _one_model(params: dict, dtype: str, rank: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddplab.probes import fingerprint
    from ddplab.records import emit

    model = build_linear(params, dtype, rank)
    own_before = fingerprint(model)
    # Rank 0's initial print travels to every rank before DDP exists, so that
    # "replaced by rank 0's weights" is measured, not inferred.
    box = [own_before if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    rank0_before = box[0]

    _emit_fingerprints(model, "before", own_before, rank0_before)
    _torch_norms(model, "before")
    if rank == 0:
        weight_numerics(model.weight.detach(), params["lanes"])
        if torch.cuda.is_available():
            # The report's "after" norm ran on cuda:rank; measure that kernel on the same bits.
            try:
                _torch_norms(model, "before", device="cuda")
            except Exception as exc:  # noqa: BLE001 - the GPU norm is an extra, never fatal
                emit("cuda_norm_ok", 0, error=f"{type(exc).__name__}: {exc}"[:300])

    wrapped, facts = compile_step(model)
    emit("compile_ok", int(facts["ok"]), stage="compile", error=facts["error"])
    emit("compiled_frames", facts["frames"], stage="compile")
    emit("same_parameter_objects", int(facts["same_objects"]), stage="compile")
    _emit_fingerprints(model, "compile", own_before, rank0_before)
    _torch_norms(model, "compile")

    # As the report does: wrap what torch.compile returned. On CPU there is no
    # .to(rank) and no device_ids; the constructor broadcasts rank 0's state.
    ddp = DistributedDataParallel(wrapped)
    emit("same_parameter_objects", int(_same_parameters(ddp, model)), stage="ddp")
    _emit_fingerprints(model, "ddp", own_before, rank0_before)
    _torch_norms(model, "ddp")
    del ddp


def worker(params: dict) -> None:
    """What every rank runs: per dtype, fingerprints and norms at each stage.

    Rank 0 also measures the numerics of its initial weights (the report's
    weights): reference norms, the K-lane accumulator model, the running sums.
    Everything is reported through :func:`ddplab.emit`.
    """
    import torch.distributed as dist

    from ddplab.records import labels

    rank = dist.get_rank()
    for dtype in params["dtypes"]:
        with labels(dtype=dtype):
            _one_model(params, dtype, rank)


def run(params: dict, progress: bool = True):
    """Validate ``params``, launch ``world_size`` gloo ranks, return the tidy records."""
    from ddplab.launcher import launch

    params = check_params(params)
    result = launch(worker, world_size=params["world_size"], backend="gloo", args=(params,),
                    timeout=LAUNCH_TIMEOUT)
    return result.records


# --------------------------------------------------------------------------- the verdict


_rows = where  # the rows of one metric with given labels, possibly none


def _fmt(x: float) -> str:
    """A value as the report would print it: every digit of a float16 value, else 7 digits."""
    x = float(x)
    if math.isfinite(x) and float(torch.tensor(x, dtype=torch.float16)) == x:
        return repr(x)
    return f"{x:.7g}"


def _ranks(frame) -> list[int]:
    return sorted(int(r) for r in frame["rank"].dropna().unique())


def _ddp_finding(records, same_init: bool) -> tuple[Finding, Finding, bool]:
    """Did DDP's constructor change bits, and does every rank end with rank 0's weights?

    Returns the finding on changes, the finding on replicas agreeing, and
    whether DDP changed bits that it should not have (a bug).
    """
    changed = _rows(records, "fingerprint_changed", stage="ddp")
    matches = _rows(records, "matches_rank0_initial", stage="ddp")
    matched_before = _rows(records, "matches_rank0_initial", stage="before")
    ranks = _ranks(changed)
    total = len(changed)
    n_changed = int(changed["value"].sum()) if total else 0
    per_rank = {r: (int(changed[changed["rank"] == r]["value"].sum()),
                    int((changed["rank"] == r).sum())) for r in ranks}
    described = "; ".join(f"rank {r}: {c} of {n} tensors changed" for r, (c, n) in per_rank.items())
    agree = Finding(
        "replicas_equal_after_ddp",
        "After wrapping, every rank holds rank 0's initial weights bit for bit "
        "(DDP's contract: replicas start equal)",
        holds=len(matches) > 0 and bool((matches["value"] == 1).all()),
        evidence=(f"after wrapping, {int(matches['value'].sum())} of {len(matches)} tensor "
                  f"fingerprints (all ranks) equal rank 0's from before wrapping"
                  if len(matches) else "no fingerprints recorded"))
    if same_init:
        finding = Finding(
            "ddp_changed_no_bit",
            "Wrapping the model in DDP changed no bit of any weight on any rank",
            holds=total > 0 and n_changed == 0,
            evidence=(f"{n_changed} of {total} tensor fingerprints (sha256 of the bytes) changed "
                      f"by DDP's constructor ({described})" if total else "no fingerprints recorded"))
        return finding, agree, total > 0 and n_changed > 0
    rank0_kept = per_rank.get(0, (1, 0))[0] == 0 and 0 in per_rank
    others = [r for r in ranks if r != 0]
    differed = {r: int((matched_before[matched_before["rank"] == r]["value"] == 0).sum())
                for r in others}
    replaced = all(per_rank[r][0] == differed[r] and differed[r] > 0 for r in others)
    now_rank0 = {r: int(matches[matches["rank"] == r]["value"].sum()) for r in others}
    detail = "; ".join(f"rank {r}: {per_rank[r][0]} of {per_rank[r][1]} tensors changed, "
                       f"{now_rank0[r]} now equal to rank 0's initial (before wrapping: "
                       f"{per_rank[r][1] - differed[r]})" for r in others) or "no rank other than 0"
    finding = Finding(
        "ddp_broadcast_rank0",
        "DDP's constructor broadcast rank 0's weights: rank 0 kept every bit, each other "
        "rank's differing weights were replaced by rank 0's (a real change, by design)",
        holds=rank0_kept and bool(others) and replaced and agree.holds,
        evidence=f"rank 0: {per_rank.get(0, (0, 0))[0]} of {per_rank.get(0, (0, 0))[1]} tensors changed; "
                 f"{detail}")
    return finding, agree, not rank0_kept


def _compile_finding(records) -> Finding:
    ok = _rows(records, "compile_ok")
    changed = _rows(records, "fingerprint_changed", stage="compile")
    frames = _rows(records, "compiled_frames")
    same = _rows(records, "same_parameter_objects", stage="compile")
    failed = ok[ok["value"] == 0]
    if len(ok) == 0:
        return Finding("compile_changed_no_bit", "The report's torch.compile step changed no bit",
                       False, "no torch.compile records")
    if len(failed):
        errors = sorted(set(str(e) for e in failed.get("error", [])))
        return Finding(
            "compile_changed_no_bit", "The report's torch.compile step changed no bit",
            False, f"torch.compile failed on rank(s) {_ranks(failed)} ({'; '.join(errors)}); "
                   f"DDP wrapped the uncompiled model there")
    n_changed = int(changed["value"].sum())
    return Finding(
        "compile_changed_no_bit",
        "The report's torch.compile step changed no bit: it is lazy, so without a forward call "
        "nothing is compiled and the parameters stay the same objects",
        holds=n_changed == 0 and bool((frames["value"] == 0).all()) and bool((same["value"] == 1).all()),
        evidence=f"{n_changed} of {len(changed)} fingerprints changed; frames compiled by dynamo: "
                 f"{int(frames['value'].sum())}; same Parameter objects on "
                 f"{int(same['value'].sum())} of {len(same)} rank×dtype")


def _lane_norms(records, dtype: str = "float16") -> dict[int, float]:
    lanes = _rows(records, "norm", method="lanes", dtype=dtype)
    return {int(k): float(v) for k, v in sorted(zip(lanes["lanes"], lanes["value"]))}


def _reference_norm(records, dtype: str) -> float:
    """The true norm of rank 0's initial weights: exact where recorded, else float64's."""
    for method in ("exact", "float64 accumulation"):
        ref = _rows(records, "norm", method=method, dtype=dtype, rank=0)
        if len(ref):
            return float(ref["value"].iloc[0])
    return math.nan


def _ulps_from_true(value: float, true_norm: float, dtype: str) -> int:
    """``value`` minus the true norm rounded once to ``dtype``, in ulps of ``dtype``."""
    from ddplab.numerics.exact import round_to_dtype
    from ddplab.numerics.ulp import ulp_distance

    dt = getattr(torch, dtype)
    rounded = round_to_dtype(torch.tensor([true_norm], dtype=torch.float64),
                             torch.zeros(1, dtype=torch.float64), dt)
    return int(ulp_distance(torch.tensor([value], dtype=torch.float64).to(dt), rounded)[0])


def _torch_norm(records, dtype: str, device: str = "cpu") -> float:
    own = _rows(records, "norm", method="torch.norm", dtype=dtype, stage="before", rank=0,
                device=device)
    return float(own["value"].iloc[0]) if len(own) else math.nan


def _report_finding(records) -> tuple[Finding, list[int]]:
    lanes = _lane_norms(records)
    true_norm = _reference_norm(records, "float16")
    matching = [k for k, v in lanes.items() if v == REPORT_NORM_BEFORE]
    listed = ", ".join(f"K={k}: {_fmt(v)}" for k, v in lanes.items())
    if matching:
        found = f"K={', '.join(map(str, matching))} gives the report's number"
    else:
        found = f"no K gives {REPORT_NORM_BEFORE}"
    return Finding(
        "report_number_reproduced",
        f"The K-lane float16 accumulator model of these weights reproduces the report's "
        f"{REPORT_NORM_BEFORE} exactly",
        holds=bool(matching),
        evidence=(f"float16 norm with K partial accumulators: {listed}; {found}; "
                  f"true norm {true_norm:.6f}")), matching


def _stall_finding(records) -> Finding:
    from ddplab.numerics.bounds import gamma

    trace16 = _rows(records, "running_sum_of_squares", accumulator="float16", dtype="float16")
    trace32 = _rows(records, "running_sum_of_squares", accumulator="float32", dtype="float16")
    stall = _rows(records, "stall_element", dtype="float16")
    lane_sums = _rows(records, "lane_sum_of_squares", dtype="float16")
    if not len(trace16) or not len(trace32):
        return Finding("fp16_accumulator_stalls", "A float16 accumulator of squares stalls",
                       False, "no running-sum records")
    n = int(trace16["step"].max())
    final16 = float(trace16.sort_values("step")["value"].iloc[-1])
    final32 = float(trace32.sort_values("step")["value"].iloc[-1])
    stalled_at = int(stall["value"].iloc[0]) if len(stall) else n
    lanes_text = ""
    if len(lane_sums):
        by_k = lane_sums.groupby("lanes")["value"].agg(["min", "max"])
        k = int(by_k.index.max()) if 8 not in by_k.index else 8
        low, high = by_k.loc[k, "min"], by_k.loc[k, "max"]
        ends = f"at {_fmt(low)}" if low == high else f"between {_fmt(low)} and {_fmt(high)}"
        lanes_text = f"; with K={k} lanes every lane ends {ends}"
    g = gamma(n - 1, torch.float16)
    bound = "guarantees nothing (n·u ≥ 1)" if math.isinf(g) else f"is γ = {g:.3g}"
    return Finding(
        "fp16_accumulator_stalls",
        "A float16 running sum of squares stalls: once the squares fall below half an ulp of the "
        "sum, adding them changes nothing",
        holds=final16 < 0.5 * final32 and stalled_at < n,
        evidence=(f"one float16 accumulator stops at {_fmt(final16)} after element {stalled_at} "
                  f"of {n} (the rest add nothing); a float32 accumulator reaches {_fmt(final32)}"
                  f"{lanes_text}; the classical bound for n = {n} float16 additions {bound}"))


def _installed_finding(records, lanes: dict[int, float]) -> tuple[Finding, bool]:
    own = _torch_norm(records, "float16")
    true_norm = _reference_norm(records, "float16")
    version = _rows(records, "norm", method="torch.norm", dtype="float16")["torch_version"]
    version = str(version.iloc[0]) if len(version) else "?"
    if math.isnan(own) or math.isnan(true_norm):
        return Finding("installed_torch_no_artifact", "torch's CPU float16 norm", False,
                       "no torch.norm records"), False
    ulps = _ulps_from_true(own, true_norm, "float16")
    same_as = [k for k, v in lanes.items() if v == own]
    reproduced = (f"the K-lane model reproduces it for K={', '.join(map(str, same_as))}"
                  if same_as else f"no K in {sorted(lanes)} reproduces it")
    return Finding(
        "installed_torch_no_artifact",
        f"The installed torch {version}'s CPU float16 norm shows no accumulation artifact "
        f"(it is the true norm rounded to float16, so it accumulates in a wider type)",
        holds=abs(ulps) <= 1,
        evidence=(f"torch.norm on the CPU = {_fmt(own)}, true norm {true_norm:.6f}, {ulps} float16 "
                  f"ulp apart; {reproduced}; the report's torch {REPORT_TORCH_VERSION} printed "
                  f"{REPORT_NORM_BEFORE}")), abs(ulps) <= 1


def _norm_tracks_bits_finding(records) -> Finding:
    norms = _rows(records, "norm", method="torch.norm", device="cpu")
    changed = _rows(records, "fingerprint_changed")
    unexplained = []
    lines = []
    for (rank, dtype, param), group in norms.groupby(["rank", "dtype", "param"]):
        by_stage = dict(zip(group["stage"], group["value"]))
        before = by_stage.get("before")
        seq = " → ".join(_fmt(by_stage[s]) for s in STAGES if s in by_stage)
        lines.append(f"rank {rank} {dtype}: {seq}")
        for stage in STAGES[1:]:
            if stage in by_stage and by_stage[stage] != before:
                bits = changed[(changed["rank"] == rank) & (changed["dtype"] == dtype)
                               & (changed["param"] == param) & (changed["stage"] == stage)]
                if not len(bits) or int(bits["value"].max()) == 0:
                    unexplained.append(f"rank {rank} {dtype} {stage}")
    return Finding(
        "norm_moves_only_with_bits",
        "On the CPU the printed torch.norm changes between stages only where the weights' bits "
        "changed (a norm that moves over unchanged bits means another kernel computed it)",
        holds=len(norms) > 0 and not unexplained,
        evidence=("torch.norm before → compile → ddp: " + "; ".join(lines)
                  + (f"; moved without a bit changing: {', '.join(unexplained)}" if unexplained else "")))


def _cuda_finding(records) -> Finding | None:
    cuda = _torch_norm(records, "float16", device="cuda")
    if math.isnan(cuda):
        return None
    true_norm = _reference_norm(records, "float16")
    ulps = _ulps_from_true(cuda, true_norm, "float16")
    return Finding("cuda_norm_no_artifact",
                   "The CUDA float16 norm of the same weights shows no accumulation artifact",
                   holds=abs(ulps) <= 1,
                   evidence=f"torch.norm on CUDA = {_fmt(cuda)}, true norm {true_norm:.6f}, "
                            f"{ulps} float16 ulp apart")


def verdict(records, params: dict) -> Verdict:
    """The verdict rule: what DDP did to the bits, and what made the norm small.

    kind "bug" if DDP changed bits it must keep (same seed on every rank, or
    rank 0's); "by design" if it replaced other ranks' weights by rank 0's
    (``same_init=False``); "rounding" otherwise.
    """
    params = PARAMETERS.validate(params)
    ddp, agree, ddp_bug = _ddp_finding(records, params["same_init"])
    report, matching = _report_finding(records)
    lanes = _lane_norms(records)
    installed, installed_clean = _installed_finding(records, lanes)
    findings = [ddp, agree, _compile_finding(records), report, _stall_finding(records),
                installed, _norm_tracks_bits_finding(records)]
    cuda = _cuda_finding(records)
    if cuda is not None:
        findings.append(cuda)

    true_norm = _reference_norm(records, "float16")
    own = _torch_norm(records, "float16")
    version = torch.__version__
    versions = _rows(records, "norm", method="torch.norm")["torch_version"]
    if len(versions):
        version = str(versions.iloc[0])
    if matching:
        k = 8 if 8 in matching else matching[0]
        norm_part = (f"the {k}-lane float16 accumulator model gives {REPORT_NORM_BEFORE} (the "
                     f"report's number) against a true norm of {true_norm:.4f}")
    else:
        closest = min(lanes.items(), key=lambda kv: abs(kv[1] - REPORT_NORM_BEFORE)) if lanes else None
        norm_part = (f"the report's {REPORT_NORM_BEFORE} was not reproduced by any K in "
                     f"{sorted(lanes)}" + (f" (closest: K={closest[0]} gives {_fmt(closest[1])})"
                                           if closest else "")
                     + f"; true norm {true_norm:.4f}")
    torch_part = (f"the CPU kernel of torch {version} accumulates wider and prints {_fmt(own)}"
                  if installed_clean else
                  f"the CPU kernel of torch {version} still shows the artifact ({_fmt(own)})")
    n_tensors = len(_rows(records, "fingerprint_changed", stage="ddp"))
    if ddp_bug:
        kind = "bug"
        headline = (f"DDP changed the weights it must keep: {ddp.evidence}. Separately, on the "
                    f"norm: {norm_part}; {torch_part}.")
    elif params["same_init"]:
        kind = "rounding"
        headline = (f"DDP did not change the weights (0 of {n_tensors} weight fingerprints "
                    f"changed on {params['world_size']} rank(s)); the fp16 norm computed "
                    f"without a wider accumulator did: {norm_part}. "
                    f"{torch_part[0].upper()}{torch_part[1:]}.")
    else:
        others = [r for r in range(1, params["world_size"])]
        kind = "by design"
        headline = (f"DDP did change the weights on rank(s) {', '.join(map(str, others)) or 'none'}: "
                    f"its constructor broadcast rank 0's parameters, which kept every bit "
                    f"(the ranks were seeded differently). The report's small norm is a separate "
                    f"matter, float16 accumulation: {norm_part}; {torch_part}.")
    return Verdict(case=NAME, kind=kind, headline=headline, findings=findings)


# --------------------------------------------------------------------------- tables and figures


def fingerprint_table(records):
    """Per rank, dtype and stage: tensors whose bits changed, and tensors equal to rank 0's initial."""
    import pandas as pd

    changed = _rows(records, "fingerprint_changed")
    matches = _rows(records, "matches_rank0_initial")
    keys = ["rank", "dtype", "stage"]
    table = changed.groupby(keys)["value"].agg(changed="sum", tensors="count")
    table["equal to rank 0's initial"] = matches.groupby(keys)["value"].sum()
    table = table.reset_index()
    table["stage"] = pd.Categorical(table["stage"], categories=list(STAGES), ordered=True)
    table = table.sort_values(["dtype", "rank", "stage"]).astype({"changed": int, "tensors": int})
    table["equal to rank 0's initial"] = table["equal to rank 0's initial"].astype(int)
    return table.set_index(["dtype", "rank", "stage"])


def norm_table(records):
    """Every norm rank 0 computed of its initial weights on the CPU: a row per method, a column per dtype.

    Values are float64 copies of what was computed (float16 results are exact in them).
    """
    import pandas as pd

    norms = _rows(records, "norm", rank=0, stage="before")
    if "device" in norms:
        norms = norms[norms["device"].fillna("cpu") == "cpu"]
    rows = {}
    for method in ("torch.norm", "torch.linalg.vector_norm", "exact", "float64 accumulation",
                   "float32 accumulation"):
        sub = norms[norms["method"] == method]
        if len(sub):
            rows[method] = sub.set_index("dtype")["value"]
    lanes = norms[norms["method"] == "lanes"]
    for k in sorted(int(k) for k in lanes["lanes"].unique()):
        rows[f"K={k} lanes"] = lanes[lanes["lanes"] == k].set_index("dtype")["value"]
    table = pd.DataFrame(rows).T
    table.index.name = "norm of rank 0's weights"
    table.columns.name = "dtype"
    return table


def fingerprint_figure(records, params: dict):
    """Rank × stage grid per dtype: did the weights' bits change, and whose weights are they now?"""
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import ListedColormap

    from ddplab.plots import theme

    table = fingerprint_table(records).reset_index()
    dtypes = list(dict.fromkeys(table["dtype"]))
    ranks = sorted(table["rank"].unique())
    with theme():
        fig, axes = plt.subplots(1, len(dtypes), figsize=(3.4 * len(dtypes) + 0.6, 0.9 + 0.55 * len(ranks)),
                                 squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            sub = table[table["dtype"] == dtype]
            grid = np.zeros((len(ranks), len(STAGES)))
            text = np.empty(grid.shape, dtype=object)
            for i, rank in enumerate(ranks):
                for j, stage in enumerate(STAGES):
                    row = sub[(sub["rank"] == rank) & (sub["stage"] == stage)]
                    if not len(row):
                        text[i, j] = "—"
                        continue
                    c, n = int(row["changed"].iloc[0]), int(row["tensors"].iloc[0])
                    same0 = int(row["equal to rank 0's initial"].iloc[0])
                    grid[i, j] = 1.0 if c else 0.0
                    text[i, j] = (f"{c}/{n} changed" if c else "no bit changed") + \
                        ("\n= rank 0's" if same0 == n else "\n≠ rank 0's")
            ax.imshow(grid, cmap=ListedColormap(["#cfe8cf", "#f4b6b6"]), vmin=0, vmax=1,
                      aspect="auto")
            for i in range(len(ranks)):
                for j in range(len(STAGES)):
                    ax.text(j, i, text[i, j], ha="center", va="center", fontsize=8)
            ax.set_xticks(range(len(STAGES)), ["before", "after compile", "after DDP"])
            ax.set_yticks(range(len(ranks)), [f"rank {r}" for r in ranks])
            ax.grid(False)
            ax.set_title(dtype)
        init = "same seed on every rank" if params["same_init"] else "seed + rank on each rank"
        fig.suptitle(f"Weight fingerprints (sha256 of the bytes) against each rank's initial "
                     f"weights — {init}", y=1.02, fontsize=10)
        fig.tight_layout()
    return fig


def running_sum_figure(records, params: dict):
    """The float16 running sum of squares stalling, against the float32 one (log-log axes)."""
    from ddplab.plots import metric_lines

    fig = metric_lines(records, "running_sum_of_squares", x="step", hue="accumulator",
                       filters={"dtype": "float16", "lanes": 1}, log=True,
                       ylabel="running sum of squares",
                       title="One accumulator, elements added in order: float16 stops growing")
    ax = fig.axes[0]
    ax.set_xscale("log")
    ax.set_xlabel("elements accumulated")
    stall = _rows(records, "stall_element", dtype="float16")
    trace = _rows(records, "running_sum_of_squares", dtype="float16", accumulator="float16")
    if len(stall) and len(trace):
        at = int(stall["value"].iloc[0])
        level = float(trace.sort_values("step")["value"].iloc[-1])
        ax.axhline(level, color="grey", lw=0.8, ls="--")
        ax.axvline(at, color="grey", lw=0.8, ls=":")
        ax.annotate(f"stalls at {_fmt(level)} after element {at}:\nlater squares are below half "
                    f"an ulp of {_fmt(level)}", xy=(at, level), xytext=(0.03, 0.8),
                    textcoords="axes fraction", fontsize=8,
                    arrowprops=dict(arrowstyle="->", color="grey"))
    return fig


def lanes_figure(records, params: dict):
    """Norm against the number of lanes K (log2 axis), with the true norm and torch's own."""
    import matplotlib.pyplot as plt

    from ddplab.plots import theme

    dtypes = [d for d in params["dtypes"] if len(_rows(records, "norm", method="lanes", dtype=d))]
    with theme():
        fig, axes = plt.subplots(1, len(dtypes), figsize=(5.2 * len(dtypes), 3.6), squeeze=False)
        for ax, dtype in zip(axes[0], dtypes):
            lanes = _lane_norms(records, dtype)
            ks, values = list(lanes), list(lanes.values())
            ax.plot(ks, values, "o-", color="C0", label=f"K-lane {dtype} accumulator model")
            for k, v in lanes.items():
                ax.annotate(_fmt(v), (k, v), textcoords="offset points", xytext=(4, -12), fontsize=7)
            true_norm = _reference_norm(records, dtype)
            own = _torch_norm(records, dtype)
            version = _rows(records, "norm", method="torch.norm", dtype=dtype)["torch_version"]
            version = str(version.iloc[0]) if len(version) else "?"
            ax.axhline(true_norm, color="C2", lw=1.2, label=f"true norm {true_norm:.4f}")
            ax.axhline(own, color="C1", lw=1.2, ls="--",
                       label=f"torch.norm, CPU, torch {version}: {_fmt(own)}")
            cuda = _torch_norm(records, dtype, device="cuda")
            if not math.isnan(cuda):
                ax.axhline(cuda, color="C4", lw=1.0, ls=":", label=f"torch.norm, CUDA: {_fmt(cuda)}")
            if dtype == "float16":
                ax.axhline(REPORT_NORM_BEFORE, color="C3", lw=1.0, ls=":",
                           label=f"report (torch {REPORT_TORCH_VERSION}, CPU): {REPORT_NORM_BEFORE}")
            ax.set_xscale("log", base=2)
            ax.set_xticks(ks, [str(k) for k in ks])
            ax.set_xlabel("partial accumulators K (lanes)")
            ax.set_ylabel("norm")
            ax.set_ylim(0, max(values + [true_norm, own]) * 1.15)
            ax.set_title(f"{dtype} weights")
            ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.2), ncol=2,
                      frameon=False)
        fig.tight_layout()
    return fig


def figures(records, params: dict) -> list:
    """The case's figures, most telling first: lanes, running sums, fingerprints."""
    return [lanes_figure(records, params), running_sum_figure(records, params),
            fingerprint_figure(records, params)]


def versions_markdown(records) -> str:
    """Which torch kernel computes what: the report's number and the installed kernels, per dtype.

    The report's version is known only by what it printed (quoted in the
    seed); the installed version's kernels are measured. Each is compared with
    the true norm (error in ulps of the weights' dtype, and relative) and with
    every K-lane model of the weights' dtype that gives the same value.
    """
    lines = ["| torch | device | weights | torch.norm | true norm (weights built here) | error (ulps) | "
             "relative error | "
             "K-lane models giving the same |", "|---|---|---|---|---|---|---|---|"]
    rows = []
    true16 = _reference_norm(records, "float16")
    report_k = [k for k, v in _lane_norms(records, "float16").items() if v == REPORT_NORM_BEFORE]
    rows.append((f"{REPORT_TORCH_VERSION} (the report, before wrapping)", "CPU", "float16",
                 REPORT_NORM_BEFORE, true16, report_k))
    # The report's "after" norm ran on cuda:rank (the script's .to(rank)).
    after_k = [k for k, v in _lane_norms(records, "float16").items() if v == REPORT_NORM_AFTER]
    rows.append((f"{REPORT_TORCH_VERSION} (the report, after .to(rank) and wrapping)", "CUDA",
                 "float16", REPORT_NORM_AFTER, true16, after_k))
    for dtype in list(dict.fromkeys(_rows(records, "norm", method="lanes")["dtype"])):
        version = _rows(records, "norm", method="torch.norm", dtype=dtype)["torch_version"]
        version = str(version.iloc[0]) if len(version) else "?"
        for device in ("cpu", "cuda"):
            own = _torch_norm(records, dtype, device=device)
            if math.isnan(own):
                continue
            same = [k for k, v in _lane_norms(records, dtype).items() if v == own]
            rows.append((f"{version} (installed)", device.upper(), dtype, own,
                         _reference_norm(records, dtype), same))
    for version, device, dtype, value, true_norm, same in rows:
        ulps = _ulps_from_true(value, true_norm, dtype)
        lines.append(f"| {version} | {device} | {dtype} | {_fmt(value)} | {true_norm:.6f} | {ulps} | "
                     f"{(value - true_norm) / true_norm:+.2e} | "
                     f"{', '.join(f'K={k}' for k in same) or 'none'} |")
    return "\n".join(lines) + "\n"

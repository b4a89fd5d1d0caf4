"""Where and how a configuration leaves the rounding band.

At the first step where some deviation exceeds
:data:`~ddplab.compare.referee.ROUNDING_MARGIN` (the *first divergence*),
the configuration and the reference still started from the same weights up
to rounding, so their gradients can be explained in one common basis: the
gradients of the W·k *pieces* of the global batch (rank r's micro-batch m
is piece ``r*k + m``), computed here in float64 at the truth's weights.

    g ≈ Σ_j a_j · ∇loss(piece_j)           (least squares over all elements)

The truth has weights ``a_truth`` (1/(W·k) each for a loss that averages);
the configuration's rank 0 has ``a_config``. Their ratio ρ = a_config /
a_truth names the difference:

* ``factor``: every ρ_j equals one c ≠ 1 (c = W, 1/W, k, ... when it is one of them);
* ``missing_contribution``: some ρ_j are 0 and the others equal: those
  pieces' gradients are missing (the difference equals their gradient);
* ``desync``: the ranks hold different gradients or parameters, beyond the
  band (checked first: it is the cause when present);
* ``update``: the gradients agree within the band but the parameters after
  the step do not (the update itself differs);
* ``semantic``: none of these -- the gradient is not a combination of the
  pieces' gradients (residual beyond tolerance), or the weights have no simple form.

Tolerances: a weight counts as 0 or as equal to another when it is within
``FIT_TOLERANCE`` (relative) -- rounding moves float32 weights by ~1e-6,
the factors and missing pieces move them by O(1) -- and the decomposition
holds when its relative residual is within ``FIT_TOLERANCE`` too. When the
band itself is wider (low precision), the tolerance widens to
:data:`~ddplab.compare.referee.ROUNDING_MARGIN` × band, capped at 0.5.

Everything found is returned as records (numbers first): ``first_divergence``,
``localized`` (label ``finding``), ``fit_residual``, ``piece_weight``,
``fit_factor``, ``desync_deviation`` and ``sample_grad`` (a few hundred
gradient elements for the figure).
"""
from __future__ import annotations

import math

import torch

from ddplab.compare import referee as _referee
from ddplab.compare.captures import StepRecords, common_steps
from ddplab.compare.configurations import Configuration
from ddplab.compare import data as _data
from ddplab.compare import stand_in
from ddplab.compare.compiled import eager
from ddplab.compare.setup import Setup, cast_batch, forward_loss, global_batches, named_trainable, split
from ddplab.records import record

__all__ = ["FINDINGS", "FIT_TOLERANCE", "SAMPLE_ELEMENTS", "localize_steps", "piece_gradients", "fit_weights",
           "name_factor", "classify_weights"]

#: The kinds of difference localization names.
FINDINGS = ("desync", "missing_contribution", "factor", "update", "semantic")
#: Relative tolerance of the piece decomposition and of equal/zero weights.
FIT_TOLERANCE = 1e-3
#: How many gradient elements the figure's records keep.
SAMPLE_ELEMENTS = 400


# --------------------------------------------------------------------------- the pieces basis


def _flat(tensors: dict, names: list[str], like: dict) -> torch.Tensor:
    parts = []
    for n in names:
        t = tensors.get(n) if tensors is not None else None
        parts.append((t if t is not None else torch.zeros_like(like[n])).reshape(-1).to(torch.float64))
    return torch.cat(parts)


def piece_gradients(setup: Setup, step: int, pieces: int, params_before: dict | None,
                    shape: tuple[int, int] | None = None) -> tuple[list[str], torch.Tensor]:
    """``(names, G)``: the float64 gradient of each of ``pieces`` pieces of batch ``step``,
    at the weights ``params_before`` (None: the initial weights), as columns of G. With per-rank
    data the pieces are the ranks' micro-batches (``shape``: the configuration's W and k)."""
    model = setup.build_model(torch.float64)
    named = named_trainable(model)
    if params_before is not None:
        with torch.no_grad():
            for name, p in named:
                p.copy_(params_before[name].to(torch.float64))
    batch = cast_batch(global_batches(setup, step + 1)[step], torch.float64)
    columns = []
    world, k = shape or (pieces, 1)
    parts = _data.batch_pieces(setup, batch, step, world, k, torch.float64) if setup.rank_batches else \
        split(batch, pieces)
    for piece in parts:
        model.zero_grad(set_to_none=True)
        with stand_in.process_group(0, 1), eager():  # one process's pieces, as the reference computes them
            forward_loss(model, setup.loss, piece).backward()
        columns.append(torch.cat([(p.grad if p.grad is not None else torch.zeros_like(p)).reshape(-1)
                                  for _, p in named]))
    return [n for n, _ in named], torch.stack(columns, dim=1)


def fit_weights(basis: torch.Tensor, g: torch.Tensor) -> tuple[torch.Tensor, float]:
    """Least-squares weights ``a`` with ``basis @ a ≈ g`` and the relative residual ‖basis a − g‖/‖g‖."""
    a = torch.linalg.lstsq(basis, g.unsqueeze(1)).solution.squeeze(1)
    norm = float(torch.linalg.vector_norm(g))
    resid = float(torch.linalg.vector_norm(basis @ a - g))
    return a, (resid / norm if norm > 0 else (0.0 if resid == 0 else math.inf))


def name_factor(c: float, world_size: int, k: int, tol: float) -> str | None:
    """The name of factor ``c`` ("W", "1/W", "k", "W·k", ...) when it is one of them within ``tol``."""
    candidates = {"W": world_size, "1/W": 1 / world_size, "k": k, "1/k": 1 / k,
                  "W·k": world_size * k, "1/(W·k)": 1 / (world_size * k), "k/W": k / world_size,
                  "W/k": world_size / k, "-1": -1.0}
    for name, value in candidates.items():
        if value != 1 and abs(c / value - 1) <= tol:
            return name
    return None


def classify_weights(rho: torch.Tensor, tol: float) -> dict:
    """What the weight ratios say: ``{"kind": "factor"|"missing_contribution"|"same"|"weights",
    "factor": c, "missing": [piece indices]}``."""
    scale = float(rho.abs().max())
    if scale == 0:
        return dict(kind="missing_contribution", factor=0.0, missing=list(range(len(rho))))
    zero = (rho.abs() <= tol * scale)
    kept = rho[~zero]
    c = float(kept.mean())
    equal = bool(((kept - c).abs() <= tol * abs(c)).all())
    if not equal:
        return dict(kind="weights", factor=math.nan, missing=[])
    if bool(zero.any()):
        return dict(kind="missing_contribution", factor=c, missing=[int(j) for j in torch.nonzero(zero)])
    if abs(c - 1) <= tol:
        return dict(kind="same", factor=c, missing=[])
    return dict(kind="factor", factor=c, missing=[])


# --------------------------------------------------------------------------- from records to a finding


def _max_rows(recs: list[dict], metric: str, quantity: str | None = None, param: str | None = None) -> dict:
    """step -> max value of ``metric`` rows (of ``quantity``; ``param`` the whole model or None for any)."""
    out: dict[int, float] = {}
    for r in recs:
        if r["metric"] != metric or (quantity and r["quantity"] != quantity):
            continue
        if param is not None and r["param"] != param:
            continue
        out[r["step"]] = max(out.get(r["step"], -math.inf), r["value"])
    return out


def first_divergence(recs: list[dict]) -> tuple[int, str, str] | None:
    """``(step, quantity, worst param)`` of the first deviation beyond the rounding margin, or None."""
    beyond = [r for r in recs if r["metric"] == "deviation" and r["rank"] == 0
              and r["value"] > _referee.ROUNDING_MARGIN]
    if not beyond:
        return None
    step = min(r["step"] for r in beyond)
    at = [r for r in beyond if r["step"] == step]
    # The gradient is computed before the update: when both diverge, the gradient is first.
    quantity = "grad" if any(r["quantity"] == "grad" for r in at) else "param"
    worst = max((r for r in at if r["quantity"] == quantity and r["param"] != _referee.MODEL),
                key=lambda r: r["value"], default=None)
    return step, quantity, worst["param"] if worst else _referee.MODEL


def _band(recs: list[dict], step: int, quantity: str) -> float:
    for r in recs:
        if (r["metric"] == "band" and r["step"] == step and r["quantity"] == quantity
                and r["param"] == _referee.MODEL):
            return r["value"]
    return math.nan


def _desync(recs: list[dict], labels: dict) -> tuple[list[dict], int | None]:
    """Per rank, the largest distance from rank 0 in band units; the first step beyond the margin."""
    bands = {(r["step"], r["quantity"]): r["value"] for r in recs
             if r["metric"] == "band" and r["param"] == _referee.MODEL}
    worst: dict[int, tuple[float, int]] = {}
    first = None
    for r in recs:
        if r["metric"] != "rank_distance" or r["param"] != _referee.MODEL:
            continue
        band = bands.get((r["step"], r["quantity"]), math.nan)
        z = 0.0 if r["value"] == 0 else (r["value"] / band if band > 0 else math.inf)
        if z > worst.get(r["rank"], (-1.0, 0))[0]:
            worst[r["rank"]] = (z, r["step"])
        if z > _referee.ROUNDING_MARGIN and (first is None or r["step"] < first):
            first = r["step"]
    out = [record("desync_deviation", z, step=step, rank=rank, **labels)
           for rank, (z, step) in sorted(worst.items())]
    return out, first


def _sample(values: torch.Tensor, n: int = SAMPLE_ELEMENTS) -> list[int]:
    count = values.numel()
    if count <= n:
        return list(range(count))
    return torch.linspace(0, count - 1, n).round().to(torch.int64).unique().tolist()


def localize_steps(setup: Setup, config: Configuration, caps: dict, ranks: list, recs: list[dict]) -> StepRecords:
    """Localize ``config``'s first divergence, a step at a time: ``recs`` is the list its distance
    records are appended to as each step is judged (:func:`ddplab.compare.referee.distance_records`).

    At the first step where rank 0 leaves the band or the ranks disagree (the same step
    :func:`first_divergence` and the desync margin name over the whole run) the divergence is
    localized there, while that step's captures exist (``caps``: reference run ids -> per-step
    captures; ``ranks[r][step]``: rank r's). Once every step is judged: each rank's largest
    distance from rank 0 (``desync_deviation``).
    """
    labels = dict(config=config.label)
    found, start = False, 0
    for step in common_steps(ranks[0], caps["truth"]):
        new, start = recs[start:], len(recs)   # this step's records; the steps before had no divergence
        out: list[dict] = []
        if not found:
            first, (_, desync_step) = first_divergence(new), _desync(new, labels)
            if first is not None or desync_step is not None:
                found = True
                out = _localize_at(setup, config, caps, ranks, recs, first, desync_step, labels)
        yield out
    yield _desync(recs, labels)[0]


def _localize_at(setup: Setup, config: Configuration, caps: dict, ranks, recs: list[dict], first, desync_step,
                 labels: dict) -> list[dict]:
    """The records that localize a divergence first seen at ``first`` (step, quantity, worst parameter)
    or, when rank 0 stays within the band, at ``desync_step`` where the ranks disagree."""
    out = []
    if first is None:  # ranks disagree, rank 0 alone within the band
        first = (desync_step, "param", _referee.MODEL)
    step, quantity, worst = first
    out.append(record("first_divergence", step, step=step, quantity=quantity, param=worst, **labels))
    band = _band(recs, step, "grad")
    tol = min(0.5, max(FIT_TOLERANCE, _referee.ROUNDING_MARGIN * band)) if band == band else 0.5
    truth = caps["truth"]
    names = list(truth[step]["grads"])
    like = truth[step]["grads"]
    g_truth = _flat(truth[step]["grads"], names, like)
    g_config = _flat(ranks[0][step]["grads"], names, like)
    g_ref = _flat(caps["reference"][step]["grads"], names, like)
    before = truth[step - 1]["params"] if step > 0 else None
    basis_names, basis = piece_gradients(setup, step, config.pieces, before, (config.world_size, config.k))
    if basis_names != names:  # the captures name the same parameters as a fresh model
        raise AssertionError(f"capture names {names[:3]}... differ from the model's {basis_names[:3]}...")
    a_truth, resid_truth = fit_weights(basis, g_truth)
    a_config, resid_config = fit_weights(basis, g_config)
    fit = dict(step=step, **labels)
    out.append(record("fit_residual", resid_truth, series="truth", **fit))
    out.append(record("fit_residual", resid_config, series="config", **fit))
    rho = a_config / a_truth
    for j, value in enumerate(rho.tolist()):
        out.append(record("piece_weight", value, piece=j, piece_rank=j // config.k, micro=j % config.k, **fit))
    weights = classify_weights(rho, tol) if max(resid_truth, resid_config) <= tol else \
        dict(kind="weights", factor=math.nan, missing=[])
    # "update" only when no gradient left the band at that step: a gradient beyond it whose
    # piece weights look the same is a different computation, not an update difference.
    if desync_step is not None and desync_step <= step:
        kind = "desync"
    elif quantity == "param":
        kind = "update"
    elif weights["kind"] in ("factor", "missing_contribution"):
        kind = weights["kind"]
    else:
        kind = "semantic"
    extra = {}
    if weights["kind"] in ("factor", "missing_contribution") and weights["factor"] == weights["factor"]:
        out.append(record("fit_factor", weights["factor"], **fit,
                          factor_name=name_factor(weights["factor"], config.world_size, config.k, tol)))
    if weights["kind"] == "missing_contribution":
        extra["missing"] = ",".join(map(str, weights["missing"]))
    out.append(record("localized", 1, finding=kind, quantity=quantity, tolerance=tol,
                      optimizer_steps=int(ranks[0][step].get("optimizer_steps", 1)), **fit, **extra))
    # A few hundred elements of the gradients, for the figure that shows the finding.
    missing_part = torch.zeros_like(g_truth)
    for j in weights["missing"]:
        missing_part += a_truth[j] * basis[:, j]
    for i in _sample(g_truth):
        for series, vec in (("reference", g_ref), ("config", g_config), ("missing", missing_part)):
            out.append(record("sample_grad", float(vec[i]), series=series, element=int(i), **fit))
    return out


def semantic_fit(setup: Setup, shape: tuple[int, int, int], step: int, g_promise: dict, caps: dict) -> dict:
    """The kind of a semantic difference at ``step``: the float64 promise's gradient fitted on the
    gradients of the pieces of ``shape`` = (W, k, pieces), like the configuration's (``{"kind",
    "factor", "factor_name", "missing", "residual"}``; kind "other" when it is no factor and no
    missing contribution)."""
    world, k, pieces = shape
    truth = caps["truth"]
    names = list(truth[step]["grads"])
    like = truth[step]["grads"]
    before = truth[step - 1]["params"] if step > 0 else None
    _, basis = piece_gradients(setup, step, pieces, before, (world, k))
    a_truth, _ = fit_weights(basis, _flat(like, names, like))
    a_promise, resid = fit_weights(basis, _flat(g_promise, names, like))
    weights = classify_weights(a_promise / a_truth, FIT_TOLERANCE) if resid <= FIT_TOLERANCE else \
        dict(kind="weights", factor=math.nan, missing=[])
    kind = weights["kind"] if weights["kind"] in ("factor", "missing_contribution") else "other"
    factor = weights["factor"]
    return dict(kind=kind, factor=factor, residual=resid, missing=weights["missing"],
                factor_name=name_factor(factor, world, k, FIT_TOLERANCE) if factor == factor else None)

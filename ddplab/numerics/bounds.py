"""Rounding-error bounds: how far from the exact sum rounding alone can take a result.

Model (Higham, *Accuracy and Stability of Numerical Algorithms*, ch. 3-4):
``fl(a op b) = (a op b)(1 + δ)``, ``|δ| <= u``, for results in the normal
range. A contribution that passes through k roundings is multiplied by
``Π(1 + δ_i) = 1 + θ_k``, ``|θ_k| <= γ_k = k·u / (1 - k·u)``, so a summation
tree in which no addend passes through more than ``d`` additions satisfies

    |Ŝ - S| <= γ_d · Σ_r |x_r|,

with ``d = W - 1`` for sequential sums and rings, ``ceil(log2 W)`` for
pairwise trees. The right-hand side uses Σ|x_r|, never |S|: under
cancellation |S| is tiny and a legal result can be far from S relative to
|S|. Two orders A and B may therefore differ by up to
``(γ_dA + γ_dB) · Σ|x_r|`` per element.

:func:`reduction_bounds` follows a contribution through everything a
reduction does to it, in the dtype each step rounds in: k - 1 local
additions (gradient accumulation), the cast to a narrower ``reduce_dtype``
(one rounding; two from float64 to a 16-bit type, which torch converts
through float32), scaling by 1/W before the sum (one rounding for a
division, two for a multiplication by fl(1/W)), the d additions; then the
post-division of ``sum_then_divide``, the final rounding of a wider
accumulator and the cast to the result's dtype, each one more rounding of
the result. Underflow is absolute, not relative: each cast or scaled
contribution may lose η/2 (η the smallest subnormal). A result beyond the
bound cannot be explained by rounding.

γ_k is infinite once k·u >= 1 (bfloat16 with DDP's averaging at W >= 255,
float16 at W >= 2047): no deterministic bound exists, and :func:`classify`
answers "undetermined" instead of a ratio of 0. For that case the
*probabilistic* bound of Higham & Mary (2019, "A new approach to
probabilistic rounding error analysis", SIAM J. Sci. Comput. 41(5)) is
given beside it, labelled as such: if the δ_i are independent random
variables of mean zero, then for any λ > 0

    |θ_k| <= γ̃_k(λ) = exp(λ·√k·u + k·u²/(1 - u)) - 1  ≈ λ·√k·u

with probability at least ``1 - 2·exp(-λ²(1 - u)²/2)`` (Hoeffding's
inequality applied to Σ log(1 + δ_i)). ddplab takes the union over every
contribution's product in every element and picks λ so that the whole
result is within the bound with probability :data:`PROBABILISTIC_CONFIDENCE`
under that model. Rounding to nearest on real data is not random, so this
is a statement about a model, never a proof.

Example::

    >>> x = torch.tensor([[1.0, 3.0], [2.0 ** -24, -3.0]])
    >>> rounding_bound(x, "sequential").tolist() == [gamma(1, torch.float32) * (1 + 2.0 ** -24), gamma(1, torch.float32) * 6]
    True
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ddplab.glossary import ReductionLabel
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.fpformat import float_format, parse_dtype, unit_roundoff
from ddplab.numerics.orders import check_reduction, reduction_pieces

__all__ = ["ROUNDING", "NOT_ROUNDING", "UNDETERMINED", "OVERFLOW", "LABELS", "PROBABILISTIC_CONFIDENCE",
           "gamma", "probabilistic_gamma", "abs_sum", "finite_abs_sum", "rounding_bound", "probabilistic_bound",
           "reduction_bounds", "ReductionBounds", "pair_bound", "classify", "Classification"]

# The referee's words (:class:`ddplab.glossary.ReductionLabel`, where each is defined).
ROUNDING = ReductionLabel.ROUNDING
NOT_ROUNDING = ReductionLabel.NOT_ROUNDING
UNDETERMINED = ReductionLabel.UNDETERMINED
OVERFLOW = ReductionLabel.OVERFLOW
#: Every verdict label, from "explained by rounding" to "range exceeded".
LABELS = tuple(ReductionLabel)

#: Probability (under Higham & Mary's model) that a whole result lies within its probabilistic bound.
PROBABILISTIC_CONFIDENCE = 1 - 1e-6

# Roundings of each contribution when it is scaled by 1/W before the sum. For
# multiply_float32_reciprocal on a 16-bit type there are three (fl32(1/W), the
# float32 product, the rounding to the dtype), but (1 + u32)^2 (1 + u) <= (1 + u)^2.
_SCALE_ROUNDINGS = {"divide_first": 1, "multiply_reciprocal": 2, "multiply_float32_reciprocal": 2}


def gamma(k, dtype) -> float:
    """γ_k = k·u / (1 - k·u) for the unit roundoff u of ``dtype``; inf once k·u >= 1 (no bound)."""
    if k < 0:
        raise ValueError(f"gamma needs k >= 0, got {k}")
    ku = k * unit_roundoff(dtype)
    return math.inf if ku >= 1 else ku / (1 - ku)


def probabilistic_gamma(k, dtype, lam: float) -> float:
    """Higham & Mary's γ̃_k(λ) = exp(λ√k·u + k·u²/(1-u)) - 1.

    |θ_k| <= γ̃_k(λ) with probability >= 1 - 2exp(-λ²(1-u)²/2) when the k
    rounding errors are independent with mean zero.
    """
    if k < 0 or lam <= 0:
        raise ValueError(f"probabilistic_gamma needs k >= 0 and λ > 0, got k={k}, λ={lam}")
    u = unit_roundoff(dtype)
    return math.expm1(lam * math.sqrt(k) * u + k * u * u / (1 - u))


def _gamma_tensor(k, u: float) -> torch.Tensor:
    ku = torch.as_tensor(k, dtype=torch.float64) * u
    return torch.where(ku < 1, ku / (1 - ku), torch.full_like(ku, math.inf))


def _gamma_tilde_tensor(k, u: float, lam: float) -> torch.Tensor:
    k = torch.as_tensor(k, dtype=torch.float64)
    return torch.expm1(lam * k.sqrt() * u + k * (u * u / (1 - u)))


def _compose(*thetas):
    """θ of a product of factors (1 + θ_i): Σθ and cross terms, exact when all but one are 0."""
    out = thetas[0]
    for t in thetas[1:]:
        out = out + t + out * t
    return out


def abs_sum(contributions) -> torch.Tensor:
    """Σ_r |x_r| per element, in float64 (relative error below W·2^-53)."""
    c = as_contributions(contributions)
    total = torch.zeros(c.numel, dtype=torch.float64)
    if c.streams_rows:
        for r in range(c.world_size):
            total += c.row(r).to(torch.float64).abs()   # not abs_(): .to() may return the caller's tensor
        return total
    for start, stop, cols in c.blocks(max(1, (8 << 20) // (8 * c.world_size))):
        total[start:stop] = cols.to(torch.float64).abs().sum(0)
    return total


def finite_abs_sum(contributions) -> torch.Tensor:
    """Σ_r |x_r| over the finite x_r only, per element (float64): what an overflow could grow from."""
    c = as_contributions(contributions)
    return abs_sum(c.map(lambda t: torch.where(torch.isfinite(t), t, torch.zeros_like(t))))


def _depth_per_element(order: str, numel: int, world_size: int, element_size: int, options: dict) -> torch.Tensor:
    from ddplab.numerics._programs import program_depth

    depth = torch.zeros(numel, dtype=torch.int64)
    if order == "exact":
        return depth
    known: dict[tuple, int] = {}    # a ring's W chunks share W programs
    for piece in reduction_pieces(order, numel, world_size, element_size, **options):
        if piece.program not in known:
            known[piece.program] = program_depth(piece.program)
        depth[piece.start:piece.stop] = known[piece.program]
    return depth


def _cast_roundings(source, target) -> int:
    """Roundings of torch's ``.to(target)`` from ``source``: 0 (wider), 1, or 2 (float64 to 16 bits, via float32)."""
    fs, ft = float_format(source), float_format(target)
    if ft.p >= fs.p:
        return 0
    return 2 if fs.p == 53 and ft.bits == 16 else 1


class ReductionBounds(NamedTuple):
    """Per-element bounds of one reduction (float64 tensors) and the model behind the probabilistic one.

    ``rigorous``: |result - exact| <= it always (inf where γ is); ``probabilistic``:
    <= it in every element together with probability >= ``confidence`` if rounding
    errors were independent with mean zero; ``peak``: the largest magnitude any
    intermediate value can reach (overflow is possible where it reaches the
    dtype's overflow threshold, :attr:`overflow_threshold`); ``depth``: the
    roundings on a contribution's longest path.
    """

    rigorous: torch.Tensor
    probabilistic: torch.Tensor
    confidence: float
    peak: torch.Tensor
    overflow_threshold: float
    depth: torch.Tensor


def reduction_bounds(contributions, order: str, *, op: str = "sum", averaging: str | None = None,
                     accumulate=None, reduce_dtype=None, result_dtype=None, local_steps: int = 1,
                     abs_total: torch.Tensor | None = None, exact_value: torch.Tensor | None = None,
                     confidence: float = PROBABILISTIC_CONFIDENCE, depth: torch.Tensor | None = None,
                     whole_numel: int | None = None, **options) -> ReductionBounds:
    """Bound what rounding can do to the reduction of ``contributions`` in ``order``, per element.

    ``op``, ``averaging``, ``accumulate``, ``reduce_dtype`` and ``options``
    as for :func:`ddplab.numerics.reduce`, whose result this bounds;
    ``result_dtype`` is the dtype the result is delivered in (default: the
    contributions'). ``local_steps=k``: each rank's contribution is the sum
    of k rows accumulated in its dtype first (gradient accumulation), which
    adds k - 1 roundings; ``abs_total`` must then be Σ|x| over all W·k rows
    and ``exact_value`` |S| or |S/W| of all of them. Otherwise both are
    computed when not given (Σ|x_r| and the exact |S| or |S/W|, float64).
    For a chunk of elements of a larger buffer, ``depth`` gives each element's
    additions in the whole buffer's layout and ``whole_numel`` the buffer's size
    (the probabilistic bound's union runs over all its elements).
    """
    c = as_contributions(contributions)
    w = c.world_size
    spec = check_reduction(order, w, op=op, averaging=averaging, accumulate=accumulate,
                           reduce_dtype=reduce_dtype, **options)
    if not isinstance(local_steps, int) or isinstance(local_steps, bool) or local_steps < 1:
        raise ValueError(f"local_steps must be an int >= 1, got {local_steps!r}")
    if local_steps > 1 and (abs_total is None or exact_value is None):
        raise ValueError("local_steps > 1 needs abs_total and exact_value of all W·k rows")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must lie in (0, 1), got {confidence!r}")
    data = parse_dtype(c.dtype)
    red = spec["reduce_dtype"] or data
    exact_order = order == "exact"
    acc = red if exact_order or spec["accumulate"] is None else spec["accumulate"]
    out = data if result_dtype is None else parse_dtype(result_dtype)
    if float_format(acc).p < float_format(red).p:
        raise ValueError(f"accumulate={acc} is less precise than the reduction's {red}")
    averaging = None if exact_order else spec["averaging"]
    if exact_value is None:
        from ddplab.numerics.exact import exact_parts

        exact_value = exact_parts(c, op)[0].abs()
    total = abs_sum(c) if abs_total is None else abs_total
    if depth is None:
        depth = _depth_per_element(order, c.numel, w, torch.empty((), dtype=red).element_size(), spec["options"])
    elif depth.shape != (c.numel,):
        raise ValueError(f"depth must give one count per element ({c.numel}), got shape {tuple(depth.shape)}")

    ft, fr, fa, fo = (float_format(d) for d in (data, red, acc, out))
    local = local_steps - 1
    casts = _cast_roundings(data, red)
    back = _cast_roundings(red, out)
    scale = _SCALE_ROUNDINGS.get(averaging, 0)
    # What the relative errors multiply: Σ|x_r|, or Σ|x_r|/W once each contribution is divided first.
    divided = scale > 0 or (exact_order and op == "avg")
    base = total / w if divided else total
    # Underflow: each of the W (cast, scaled) contributions may lose η/2 absolutely.
    tiny = w * ((fr.smallest_subnormal / 2 if casts else 0.0) + (fa.smallest_subnormal / 2 if scale else 0.0))
    if exact_order and op == "avg":
        tiny /= w

    def bound(growth):
        theta = _compose(growth(local, ft.u), growth(casts, fr.u), growth(depth + scale, fa.u))
        b = theta * base + (1 + theta) * tiny
        if exact_order:   # one correct rounding of the (cast) contributions' exact value
            b = b + fr.u * (exact_value + b) + fr.smallest_subnormal / 2
        elif averaging == "sum_then_divide":
            b = (1 + fa.u) * b / w + fa.u * exact_value + fa.smallest_subnormal / 2
        if acc != red:    # the wider accumulator rounds to the reduction's dtype once
            b = b + fr.u * (exact_value + b) + fr.smallest_subnormal / 2
        if back:          # the cast back to the result's dtype
            b = b + ((1 + fo.u) ** back - 1) * (exact_value + b) + back * fo.smallest_subnormal / 2
        return b, theta

    rigorous, theta = bound(_gamma_tensor)
    # Higham & Mary: each contribution's product of (1 + δ) is one event per dtype
    # it rounds in; the union over all of them, in every element, fails with
    # probability <= events · 2exp(-λ²(1-u)²/2) = 1 - confidence.
    products = 1 + (casts > 0) + (local > 0)
    events = max(1, c.numel if whole_numel is None else whole_numel) * w * local_steps * products
    u_max = max(ft.u if local else 0.0, fr.u, fa.u)
    lam = math.sqrt(2 * math.log(2 * events / (1 - confidence))) / (1 - u_max)
    probabilistic, _ = bound(lambda k, u: _gamma_tilde_tensor(k, u, lam))
    # Intermediates: partial sums of (possibly divided) contributions, or the cast values themselves.
    peak = (1 + theta) * (base if (scale and not casts) else total) + tiny
    thresholds = [fr.overflow_threshold, fo.overflow_threshold] + ([ft.overflow_threshold] if local else [])
    return ReductionBounds(rigorous, probabilistic, confidence, peak, min(thresholds),
                           depth + (local + casts + scale))


def rounding_bound(contributions, order: str, dtype=None, *, op: str = "sum", averaging: str | None = None,
                   accumulate=None, abs_total: torch.Tensor | None = None,
                   exact_value: torch.Tensor | None = None, result_dtype=None, **options) -> torch.Tensor:
    """Per element, the largest |result - exact| that rounding in ``order`` can produce (float64).

    ``dtype`` is the dtype the reduction computes in (default: the
    contributions'; a narrower one costs one rounding per contribution);
    the result is delivered in ``result_dtype`` (default ``dtype``). ``op``,
    ``averaging`` and ``accumulate`` as in :func:`ddplab.numerics.reduce`,
    whose result this bounds; ``options`` are the order's. The depth d is
    taken per element from the order's pieces (the two NCCL trees may
    differ). ``abs_total`` (Σ|x_r|) and ``exact_value`` (|S| or |S/W|,
    float64) may be passed when already known. Infinite where γ is.
    """
    c = as_contributions(contributions)
    reduce_dtype = None if dtype is None else parse_dtype(dtype)
    out = result_dtype if result_dtype is not None else (reduce_dtype or c.dtype)
    return reduction_bounds(c, order, op=op, averaging=averaging, accumulate=accumulate,
                            reduce_dtype=reduce_dtype, result_dtype=out, abs_total=abs_total,
                            exact_value=exact_value, **options).rigorous


def probabilistic_bound(contributions, order: str, *, confidence: float = PROBABILISTIC_CONFIDENCE,
                        **kwargs) -> tuple[torch.Tensor, float]:
    """Higham & Mary's probabilistic bound per element and its confidence (see the module docstring).

    Arguments as for :func:`reduction_bounds`. Finite for every W; valid only
    under the model of independent, mean-zero rounding errors.
    """
    b = reduction_bounds(contributions, order, confidence=confidence, **kwargs)
    return b.probabilistic, b.confidence


def pair_bound(contributions, order_a: str, order_b: str, dtype=None, *, op: str = "sum",
               averaging: str | None = None, accumulate=None, options_a: dict | None = None,
               options_b: dict | None = None) -> torch.Tensor:
    """Per element, how far results of ``order_a`` and ``order_b`` may differ by rounding alone.

    The sum of the two :func:`rounding_bound` s: (γ_dA + γ_dB)·Σ|x_r| for
    plain sums (each result is within its own bound of the exact value).
    """
    c = as_contributions(contributions)
    total = abs_sum(c)
    kw = dict(op=op, averaging=averaging, accumulate=accumulate, abs_total=total)
    return (rounding_bound(c, order_a, dtype, **kw, **(options_a or {}))
            + rounding_bound(c, order_b, dtype, **kw, **(options_b or {})))


class Classification(NamedTuple):
    """``label``: one of :data:`LABELS` (never "overflow" here); ``ratio``: max |error|/bound, NaN if undetermined."""

    label: ReductionLabel
    ratio: float


def classify(error, bound) -> Classification:
    """Compare errors with their bounds elementwise: ``(label, ratio)``.

    Per element the ratio is |error| / bound: 0 for a zero error (an exact
    result needs no bound), inf for a NaN error or a positive error over a
    zero bound, and undefined (NaN) for a positive error whose bound is
    infinite or NaN. The label is "not rounding" when some ratio exceeds 1
    (``ratio`` is then the largest), else "undetermined" when some ratio is
    undefined (``ratio`` NaN, never 0), else "rounding".

    Example::

        >>> classify(torch.tensor([1e-7, 0.0]), torch.tensor([2e-7, 0.0]))
        Classification(label='rounding', ratio=0.5)
        >>> classify(torch.tensor([1e-7]), torch.tensor([math.inf])).label
        'undetermined'
    """
    error = torch.as_tensor(error, dtype=torch.float64).abs()
    bound = torch.as_tensor(bound, dtype=torch.float64)
    error, bound = torch.broadcast_tensors(error, bound)
    if error.numel() == 0:
        return Classification(ROUNDING, 0.0)
    zero = error == 0
    ratio = torch.where(zero, torch.zeros_like(error), error / bound)
    ratio = torch.where(~zero & ~torch.isfinite(bound), torch.full_like(ratio, math.nan), ratio)
    ratio = torch.where(torch.isnan(error), torch.full_like(ratio, math.inf), ratio)
    undefined = torch.isnan(ratio)
    some_undefined = bool(undefined.any())
    defined = ratio[~undefined] if some_undefined else ratio
    worst = float(defined.max()) if defined.numel() else 0.0
    if worst > 1.0:
        return Classification(NOT_ROUNDING, worst)
    if some_undefined:
        return Classification(UNDETERMINED, math.nan)
    return Classification(ROUNDING, worst)

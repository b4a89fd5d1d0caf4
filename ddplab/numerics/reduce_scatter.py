"""Reduce-scatter orders emulated bit for bit, and the divide factors FSDP2 wraps around them.

A reduce-scatter of W contributions of N = W*n elements leaves on rank r
shard r, the elements ``[r*n, (r+1)*n)`` of the reduction. :func:`reduce_scatter`
returns the shards concatenated (N elements, shard r = what rank r receives),
or one shard (``shard=r``), rounding exactly where the backend rounds.

Orders (read in the sources named, and matched bit for bit against live gloo):

* ``gloo_ring``: torch's ProcessGroupGloo has no reduce-scatter algorithm of
  its own. ``reduce_scatter_single`` / ``reduce_scatter_tensor`` /
  ``_reduce_scatter_base`` (what FSDP2 calls) clone the whole N-element input,
  run gloo's ring **all-reduce** on it (``gloo::allreduce`` with no algorithm
  set: the ring, segments from the whole buffer's byte count, see
  :func:`ddplab.numerics.orders.gloo_ring_segments`) and copy out
  ``chunk(W)[rank]``. So shard r is a slice of the all-reduce, and ring
  segment boundaries do not follow shard boundaries. ``list_input=True`` is
  ``dist.reduce_scatter`` with a list of W tensors: gloo then all-reduces
  each list entry separately (W all-reduces of n elements, segments from n),
  and rank r keeps the result of entry r.
* ``nccl_ring``: NCCL's ring reduce-scatter (``src/device/reduce_scatter.h``,
  ``runRing``): shard c travels once around the ring, starting at the rank
  after c and ending at its owner: ``((x_{c+1} + x_{c+2}) + ...) + x_c``
  (ranks in ring order, option ``ring``). Channels and chunk sizes split a
  shard's elements but not this order.
* ``sequential``, ``reverse``, ``pairwise``: the all-reduce orders of
  :mod:`ddplab.numerics.orders`, sliced.
* ``exact``: the correctly rounded result.

Averaging and scaling, applied exactly as the backend or FSDP2 applies them:
``op="avg"`` with ``averaging`` (:data:`ddplab.numerics.orders.AVERAGING`;
default what the order's backend does: gloo sums then divides the whole
buffer by W, NCCL's ncclAvg multiplies each contribution by fl(1/W));
``op="sum"`` with ``pre_divide`` (each contribution divided in its dtype
before the collective), ``post_divide`` (the result divided in its dtype
after it) or ``premul`` (ReduceOp.PREMUL_SUM: each contribution multiplied
by fl(premul) as it enters the sum, NCCL only). :func:`fsdp_reduction` says
which of these FSDP2 uses.

Example::

    >>> x = torch.randn(4, 8)
    >>> shards = reduce_scatter(x, "gloo_ring", op="avg")
    >>> bool((shards == reduce(x, "gloo_ring", op="avg")).all())   # gloo: the all-reduce, sliced
    True
"""
from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ddplab.numerics._programs import Piece, chain_program, merge_pieces, run
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.exact import exact_mean, exact_parts, exact_sum, round_to_dtype
from ddplab.numerics.fpformat import parse_dtype
from ddplab.numerics.limits import check_additions, check_program_steps
from ddplab.numerics.orders import (_arithmetic, default_averaging, gloo_ring_segments,
                                    order_options, reduction_pieces)

__all__ = [
    "REDUCE_SCATTER_ORDERS",
    "reduce_scatter",
    "reduce_scatter_pieces",
    "shard_range",
    "FSDPReduction",
    "fsdp_reduction",
]

REDUCE_SCATTER_ORDERS = ("sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring", "exact")

# Beyond this many pieces, stored contributions are streamed by rows (see reduce_scatter).
_MAX_BLOCKED_PIECES = 256

# Options each order takes here (nccl_ring's channels and chunk sizes do not change
# a reduce-scatter's order, so only the ring is an option).
_OPTIONS = {
    "sequential": {},
    "reverse": {},
    "pairwise": {},
    "exact": {},
    "gloo_ring": {"list_input": False, "max_segment_bytes": None},
    "nccl_ring": {"ring": None},
}


def _check_options(order: str, world_size: int, options: dict) -> dict:
    if order not in _OPTIONS:
        raise ValueError(f"unknown reduce-scatter order {order!r}; choose one of {', '.join(REDUCE_SCATTER_ORDERS)}")
    unknown = set(options) - set(_OPTIONS[order])
    if unknown:
        accepted = ", ".join(_OPTIONS[order]) or "none"
        raise ValueError(f"reduce-scatter order {order!r} takes no option {', '.join(sorted(unknown))} "
                         f"(accepted: {accepted})")
    opts = {**_OPTIONS[order], **options}
    if order == "nccl_ring":
        opts["ring"] = order_options("nccl_ring", world_size, ring=opts["ring"])["ring"]
    if order == "gloo_ring" and opts["max_segment_bytes"] is not None:
        order_options("gloo_ring", world_size, max_segment_bytes=opts["max_segment_bytes"])
    return opts


def shard_range(numel: int, world_size: int, rank: int) -> tuple[int, int]:
    """``(start, stop)`` of rank ``rank``'s shard of an N-element reduce-scatter input.

    N must be a multiple of W (``reduce_scatter_single`` requires it; FSDP2
    pads every gradient to make it so).
    """
    if world_size < 1 or numel % world_size:
        raise ValueError(f"a reduce-scatter needs N a multiple of W; got N={numel}, W={world_size}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} outside [0, {world_size})")
    n = numel // world_size
    return rank * n, (rank + 1) * n


def reduce_scatter_pieces(order: str, numel: int, world_size: int, element_size: int, **options) -> list[Piece]:
    """The program of every element of the N-element input: which ranks it adds, in which order.

    Pieces cover ``[0, N)``; the elements of shard r are reduced by the
    pieces over ``shard_range(N, W, r)``.
    """
    opts = _check_options(order, world_size, options)
    if order == "exact":
        raise ValueError("the exact order has no summation program")
    n = numel // world_size
    shard_range(numel, world_size, 0)
    if order == "nccl_ring" or (order == "gloo_ring" and opts["list_input"]):
        check_program_steps(world_size, world_size, order)  # one program per shard or list entry
    if order == "gloo_ring":
        seg = {} if opts["max_segment_bytes"] is None else {"max_segment_bytes": opts["max_segment_bytes"]}
        if not opts["list_input"]:
            return reduction_pieces("gloo_ring", numel, world_size, element_size, **seg)
        programs = {c: chain_program([(c - 1 - k) % world_size for k in range(world_size)])
                    for c in range(world_size)}
        return merge_pieces([Piece(r * n + a, r * n + b, programs[owner])
                             for r in range(world_size)
                             for a, b, owner in gloo_ring_segments(n, world_size, element_size, **seg)])
    if order == "nccl_ring":
        ring = opts["ring"] or list(range(world_size))
        position = {rank: p for p, rank in enumerate(ring)}
        pieces = []
        for c in range(world_size):
            p = position[c]
            program = chain_program([ring[(p + 1 + k) % world_size] for k in range(world_size)])
            pieces.append(Piece(c * n, (c + 1) * n, program))
        return merge_pieces(pieces)
    return reduction_pieces(order, numel, world_size, element_size)


def _clip(pieces, start: int, stop: int) -> list[Piece]:
    """The pieces over ``[start, stop)``, shifted to start at 0."""
    return [Piece(max(p.start, start) - start, min(p.stop, stop) - start, p.program)
            for p in pieces if p.start < stop and p.stop > start]


def _columns(c, start: int, stop: int):
    """Contributions restricted to elements ``[start, stop)`` (a view for tensors)."""
    if start == 0 and stop == c.numel:
        return c
    if c.kind == "tensor":
        return as_contributions(c.materialize()[:, start:stop])
    if c.kind == "slices":
        return as_contributions(lambda r, a, b: c.row_slice(r, start + a, start + b), c.world_size,
                                kind="slices", numel=stop - start, dtype=c.dtype)
    return as_contributions(lambda r: c.row(r)[start:stop], c.world_size, kind="rows",
                            numel=stop - start, dtype=c.dtype)


def _check_scaling(op, averaging, pre_divide, post_divide, premul):
    for name, value in (("pre_divide", pre_divide), ("post_divide", post_divide), ("premul", premul)):
        if value is None:
            continue
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
            raise ValueError(f"{name} must be a positive finite number or None, got {value!r}")
        if op != "sum":
            raise ValueError(f"{name} goes with op='sum' (FSDP2 uses divide factors only around a SUM)")
    if pre_divide is not None and premul is not None:
        raise ValueError("pre_divide and premul are two ways of scaling before the sum; give one")


def _exact(c, op, pre_divide, post_divide, premul, dtype):
    """The correctly rounded value of the ideal result: S, S/W, or S scaled by the factors."""
    if op == "avg":
        return exact_mean(c)
    scale = (premul or 1.0) / ((pre_divide or 1.0) * (post_divide or 1.0))
    if scale == 1.0:
        return exact_sum(c)
    if scale * c.world_size == 1.0:
        return exact_mean(c)
    mantissa, _ = math.frexp(scale)
    if mantissa != 0.5:
        raise ValueError(f"the exact order scales S by 1, 1/W or a power of two; the factors give {scale!r}")
    hi, lo = exact_parts(c, "sum")
    return round_to_dtype(hi * scale, lo * scale, dtype)      # exact: a power of two, far from float64's limits


def reduce_scatter(contributions, order: str = "gloo_ring", *, op: str = "sum", averaging: str | None = None,
                   accumulate=None, pre_divide: float | None = None, post_divide: float | None = None,
                   premul: float | None = None, shard: int | None = None, shard_only: bool = False,
                   **options) -> torch.Tensor:
    """Reduce-scatter W contributions in ``order``, rounding exactly where that backend rounds.

    Returns the N-element concatenation of the W shards (shard r at
    ``shard_range(N, W, r)`` is what rank r receives), or only shard
    ``shard`` (n elements, computing nothing else; with ``shard_only=True``
    the contributions hold only that shard's ``[W, n]`` columns, what an
    all_to_all brings rank ``shard``). ``op``, ``averaging``
    and ``accumulate`` as in :func:`ddplab.numerics.reduce`; ``pre_divide``,
    ``post_divide`` (FSDP2's divide factors, each one rounding in the data's
    dtype, before and after the collective) and ``premul`` (PREMUL_SUM's
    factor) go with ``op="sum"``. Contributions may be row callables: W=1024
    virtual ranks take O(N) memory. ``options`` are the order's
    (``list_input`` and ``max_segment_bytes`` for gloo_ring, ``ring`` for nccl_ring).

    Example::

        >>> x = torch.randn(3, 6, dtype=torch.bfloat16)
        >>> reduce_scatter(x, "nccl_ring", shard=1).shape
        torch.Size([2])
    """
    c = as_contributions(contributions)
    dtype = parse_dtype(c.dtype)
    w = c.world_size
    opts = _check_options(order, w, options)
    if shard_only and shard is None:
        raise ValueError("shard_only=True needs shard=r: the rank whose shard the contributions hold")
    numel = c.numel * w if shard_only else c.numel
    start, stop = (0, numel) if shard is None else shard_range(numel, w, shard)
    shard_range(numel, w, 0)
    _check_scaling(op, averaging, pre_divide, post_divide, premul)
    if op == "avg" and order != "exact":
        averaging = averaging or default_averaging(order)
    arith = _arithmetic(dtype, order, op, averaging, accumulate, w)
    check_additions(w, stop - start, f"reduce_scatter in order {order!r}")
    part = c if shard_only else _columns(c, start, stop)
    if order == "exact":
        return _exact(part, op, pre_divide, post_divide, premul, dtype)
    if premul is not None:
        scale = torch.tensor(premul, dtype=torch.float64).to(arith.compute).item()
        arith = type(arith)(arith.dtype, arith.compute, scale="mul", scale_value=scale)
    if pre_divide is not None and pre_divide != 1:
        if arith.compute == dtype:
            arith = type(arith)(arith.dtype, arith.compute, scale="div", scale_value=pre_divide)
        else:   # FSDP divides the reduce-dtype buffer before a wider reduction sees it
            part = part.map(lambda x: x.div(pre_divide))
    element_size = torch.empty((), dtype=dtype).element_size()
    pieces = _clip(reduce_scatter_pieces(order, numel, w, element_size, **opts), start, stop)
    if part.kind == "tensor" and len(pieces) > _MAX_BLOCKED_PIECES:
        # Many short pieces (W shards or segments of a few elements): column blocks would
        # cost one tiny op per piece and rank; streaming rows merges neighbouring pieces
        # at the same step into one op per rank.
        rows = part.materialize()
        part = as_contributions(lambda r: rows[r], w, kind="rows", numel=rows.shape[1], dtype=rows.dtype)
    out = run(part, pieces, arith) if pieces else torch.empty(0, dtype=dtype)
    if post_divide is not None and post_divide != 1:
        out.div_(post_divide)
    return out


# --------------------------------------------------------------------------- FSDP2's choice


class FSDPReduction(NamedTuple):
    """How FSDP2 reduces one parameter group's gradients (torch 2.13, ``_get_gradient_divide_factors``).

    ``op``: "avg" (ReduceOp.AVG), "premul_sum" (ReduceOp.PREMUL_SUM(1/factor))
    or "sum"; ``pre_divide`` / ``post_divide``: FSDP's own divisions of the
    reduce-dtype buffers around a SUM (None: not done); ``premul``: the
    PREMUL_SUM factor; ``gloo_supported``: False where gloo raises ("Cannot
    use ReduceOp.PREMUL_SUM with Gloo").
    """

    op: str
    pre_divide: float | None
    post_divide: float | None
    premul: float | None
    gloo_supported: bool

    def reduce_scatter_kwargs(self, order: str = "gloo_ring") -> dict:
        """Keyword arguments for :func:`reduce_scatter` that compute what FSDP2 computes in ``order``."""
        if self.op == "avg":
            return {"op": "avg", "averaging": default_averaging(order) if order != "exact" else None}
        if self.op == "premul_sum":
            return {"op": "sum", "premul": self.premul}
        return {"op": "sum", "pre_divide": self.pre_divide, "post_divide": self.post_divide}


def fsdp_reduction(reduce_dtype, world_size: int, *, gradient_divide_factor: float | None = None,
                   force_sum: bool = False) -> FSDPReduction:
    """What FSDP2 does around its gradient reduce-scatter, for ``reduce_dtype`` and W ranks.

    The rule of ``torch/distributed/fsdp/_fully_shard/_fsdp_collectives.py``
    (FSDP without HSDP), restated: float32 and bfloat16 ("no overflow risk")
    reduce with ReduceOp.AVG, or PREMUL_SUM(1/f) for a
    ``set_gradient_divide_factor(f)`` other than W (AVG when f == W, SUM when
    W == 1); float16 and float64, and any dtype under
    ``set_force_sum_reduction_for_comms(True)``, reduce with SUM and divide by
    ``f`` (default W) themselves: after the collective for float32/bfloat16;
    for float16/float64 by ``pre`` before (the largest power of two with
    ``f % pre == 0`` and ``pre < f / pre``, doubling from 1) and ``f / pre`` after.

    Example::

        >>> fsdp_reduction(torch.float16, 3)
        FSDPReduction(op='sum', pre_divide=2, post_divide=1.5, premul=None, gloo_supported=True)
    """
    dtype = parse_dtype(reduce_dtype)
    if isinstance(world_size, bool) or not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    if gradient_divide_factor is not None and not (gradient_divide_factor > 0):
        raise ValueError(f"gradient_divide_factor must be positive, got {gradient_divide_factor!r}")
    overflow_risk = dtype not in (torch.float32, torch.bfloat16)
    factor = gradient_divide_factor
    if not overflow_risk and not force_sum:
        if factor is None:
            if world_size == 1:
                return FSDPReduction("sum", None, None, None, True)
            return FSDPReduction("avg", None, None, None, True)
        if factor == world_size:
            return FSDPReduction("avg", None, None, None, True)
        return FSDPReduction("premul_sum", None, None, 1 / factor, False)
    if factor is None:
        factor = float(world_size)
    if overflow_risk:
        # Divide by about sqrt(f) before and after, to keep float16 sums in range.
        pre = 1
        while factor % pre == 0 and factor / pre > pre:
            pre *= 2
        return FSDPReduction("sum", pre, factor / pre, None, True)
    return FSDPReduction("sum", None, factor, None, True)

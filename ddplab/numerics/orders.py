"""Reduction orders emulated bit for bit: what each backend adds to what, and when it rounds.

Floating-point addition is not associative, so an all-reduce's result depends
on the order in which the backend adds the W contributions. Each order here
computes in the dtype and rounds at every addition exactly as the real
implementation does; :func:`reduce` is the one entry point.

Orders (chunk c is the part of the buffer that rank c finishes):

* ``sequential``: ``((x0 + x1) + x2) + ...``; ``reverse``: from x_{W-1} down.
* ``pairwise``: adjacent pairs, level by level, an odd one out carried up:
  ``((x0 + x1) + (x2 + x3)) + x4``; depth ceil(log2 W).
* ``gloo_ring``: gloo's ring all-reduce (``gloo/allreduce.cc``, ``ring()``).
  The buffer is cut into ``S = roundUp(max(ceil(bytes / 1 MiB), 2W), W)``
  segments of ``ceil(N / S)`` elements; rank c owns segments
  ``[c*S/W, (c+1)*S/W)``. Rank r sends to r-1, so chunk c accumulates
  descending by rank, ending with c: ``(((x_{c-1} + x_{c-2}) + ...) + x_{c+1}) + x_c``.
* ``nccl_ring``: NCCL's ring (``src/device/all_reduce.h``, ``runRing``):
  chunk c accumulates ascending by ring position from c+1, ending with c.
  The buffer is split into ``channels`` contiguous parts, each processed in
  loops of W chunks of ``chunk_elements`` (the last loop shrinks its chunks
  to ``ceil(rest / W)``). NCCL's real chunk size depends on protocol
  (LL/LL128/Simple), channel count and message size, so it is an option; the
  default is one channel and one loop (``chunk_elements = ceil(N / W)``).
  ``ring`` gives the ranks in ring order (NCCL's topology search picks it).
* ``nccl_tree``: an approximation of NCCL's tree (``src/graph/trees.cc``,
  ``runTreeUpDown``): within a node of ``ranks_per_node`` ranks a chain,
  across nodes NCCL's double binary tree (``ncclGetDtree``), half of the
  ``channels`` on each tree (contiguous halves of the buffer by default).
  Every rank adds its own value first, then its children's partial sums in
  NCCL's order (chain child, then tree children). Inter-node links attach
  at each node's first rank; NCCL's split-tree pattern and protocol-level
  pipelining are not modelled.
* ``exact``: the correctly rounded sum or mean (:mod:`ddplab.numerics.exact`).

Averaging (``op="avg"``): ``divide_first`` (torch's Python ``allreduce_hook``
in ``default_hooks.py``: each rank divides by W, then SUM; DDP *without* a
hook multiplies instead, see below), ``sum_then_divide`` (gloo's AVG),
``multiply_reciprocal`` (NCCL's ncclAvg on floats: each contribution is
multiplied by fl(1/W) in the dtype as it enters the sum) and
``multiply_float32_reciprocal`` (DDP's reducer without a hook:
``grad.mul_(1/W)``, which torch computes for float16/bfloat16 in float32, with
float32's 1/W, rounding to the dtype after; the same as
``multiply_reciprocal`` for float32 and float64).

Narrower reductions (``reduce_dtype``): torch's ``fp16_compress_hook`` and
``bf16_compress_hook`` cast the bucket to float16/bfloat16, divide by W in
that dtype (``divide_first``), all-reduce SUM in it and cast the result
back; FSDP's ``reduce_dtype`` casts likewise. :func:`reduce` with
``reduce_dtype`` does the same, with torch's own casts.

Which orders are bit for bit (:data:`BIT_EXACT_ORDERS`): gloo's ring
(checked against live gloo for W = 2..8, every dtype, sizes on and off the
1 MiB segment boundaries), the fixed orders and ``exact``. ``nccl_ring`` and
``nccl_tree`` are models of NCCL, bit for bit only when ddplab itself
computed them (an emulating hook), never for a live NCCL result.

Example::

    >>> x = torch.tensor([[1.0], [1e-8], [-1.0], [1e-8]])   # float32
    >>> reduce(x, "sequential").item(), reduce(x, "pairwise").item()   # vs (1 + 1e-8) + (-1 + 1e-8)
    (9.99999993922529e-09, 0.0)
"""
from __future__ import annotations

import torch

from ddplab.numerics._programs import (ADD, Arithmetic, Piece, chain_program, merge_pieces, program_depth,
                                       run, tree_program)
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.fpformat import float_format, parse_dtype
from ddplab.numerics.limits import check_additions, check_program_steps

__all__ = [
    "ORDERS",
    "BIT_EXACT_ORDERS",
    "AVERAGING",
    "DDP_AVERAGING",
    "GLOO_MAX_SEGMENT_BYTES",
    "reduce",
    "check_reduction",
    "order_depth",
    "order_options",
    "default_averaging",
    "gloo_ring_segments",
    "nccl_ring_chunks",
    "nccl_double_binary_tree",
    "reduction_pieces",
]

ORDERS = ("sequential", "reverse", "pairwise", "gloo_ring", "nccl_ring", "nccl_tree", "exact")
AVERAGING = ("divide_first", "sum_then_divide", "multiply_reciprocal", "multiply_float32_reciprocal")
#: Orders whose emulation is the live computation bit for bit (NCCL's are models, see above).
BIT_EXACT_ORDERS = ("sequential", "reverse", "pairwise", "gloo_ring", "exact")
#: DDP's reducer without a hook: ``grad.mul_(1/W)`` before the SUM (float32's 1/W for half types).
DDP_AVERAGING = "multiply_float32_reciprocal"

# gloo::AllreduceOptions::kMaxSegmentSize: each send/recv moves at most 1 MiB.
GLOO_MAX_SEGMENT_BYTES = 1 << 20

# Accepted options per order, with their defaults.
_OPTIONS = {
    "sequential": {},
    "reverse": {},
    "pairwise": {},
    "exact": {},
    "gloo_ring": {"max_segment_bytes": GLOO_MAX_SEGMENT_BYTES},
    "nccl_ring": {"channels": 1, "chunk_elements": None, "ring": None},
    "nccl_tree": {"ranks_per_node": 1, "channels": 2},
}

# What op="avg" does when averaging is not given: what each backend does.
_DEFAULT_AVERAGING = {
    "sequential": "sum_then_divide",
    "reverse": "sum_then_divide",
    "pairwise": "sum_then_divide",
    "gloo_ring": "sum_then_divide",
    "nccl_ring": "multiply_reciprocal",
    "nccl_tree": "multiply_reciprocal",
    "exact": "sum_then_divide",
}


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def _round_up(a: int, b: int) -> int:
    return _ceil_div(a, b) * b


def default_averaging(order: str) -> str:
    """What ``op="avg"`` does in ``order`` unless told otherwise: what that backend does."""
    if order not in _DEFAULT_AVERAGING:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    return _DEFAULT_AVERAGING[order]


def order_options(order: str, world_size: int | None = None, **options) -> dict:
    """Validate ``order`` and its options; return the options with defaults filled in.

    Raises ValueError for an unknown order, an option the order does not
    take, or an option value that cannot work (e.g. ``ranks_per_node`` not
    dividing W).
    """
    if order not in _OPTIONS:
        raise ValueError(f"unknown order {order!r}; choose one of {', '.join(ORDERS)}")
    unknown = set(options) - set(_OPTIONS[order])
    if unknown:
        accepted = ", ".join(_OPTIONS[order]) or "none"
        raise ValueError(f"order {order!r} takes no option {', '.join(sorted(unknown))} (accepted: {accepted})")
    opts = {**_OPTIONS[order], **options}
    for key in ("channels", "ranks_per_node", "max_segment_bytes"):
        if key in opts and (not isinstance(opts[key], int) or opts[key] < 1):
            raise ValueError(f"{key} must be a positive int, got {opts[key]!r}")
    if opts.get("chunk_elements") is not None and (not isinstance(opts["chunk_elements"], int) or opts["chunk_elements"] < 1):
        raise ValueError(f"chunk_elements must be a positive int or None, got {opts['chunk_elements']!r}")
    if world_size is not None:
        if order == "nccl_tree" and world_size % opts["ranks_per_node"]:
            raise ValueError(f"ranks_per_node={opts['ranks_per_node']} must divide world_size={world_size}")
        if order == "nccl_ring" and opts["ring"] is not None:
            ring = [int(r) for r in opts["ring"]]
            if sorted(ring) != list(range(world_size)):
                raise ValueError(f"ring must list each of ranks 0..{world_size - 1} once, got {opts['ring']}")
            opts["ring"] = ring
    return opts


def gloo_ring_segments(numel: int, world_size: int, element_size: int,
                       max_segment_bytes: int = GLOO_MAX_SEGMENT_BYTES) -> list[tuple[int, int, int]]:
    """gloo's ring segmentation: ``(start, stop, owner)`` per non-empty segment, in elements.

    ``numSegments = roundUp(max(ceil(bytes / maxSegmentBytes), 2W), W)``,
    ``segmentBytes = roundUp(ceil(bytes / numSegments), elementSize)``; rank c
    finishes (owns) segments ``[c*numSegments/W, (c+1)*numSegments/W)``. Segments past
    the end are empty and the last non-empty one may be short, so the final
    ranks may own fewer elements or none.

    Example::

        >>> gloo_ring_segments(10, 2, 4)
        [(0, 3, 0), (3, 6, 0), (6, 9, 1), (9, 10, 1)]
    """
    if numel < 0 or world_size < 1 or element_size < 1:
        raise ValueError("numel >= 0, world_size >= 1 and element_size >= 1 required")
    if numel == 0:
        return []
    if world_size == 1:
        return [(0, numel, 0)]      # gloo short-circuits a single process
    total = numel * element_size
    max_seg = element_size * max(1, max_segment_bytes // element_size)
    num_segments = _round_up(max(_ceil_div(total, max_seg), 2 * world_size), world_size)
    per_rank = num_segments // world_size
    seg = _round_up(_ceil_div(total, num_segments), element_size) // element_size
    out = []
    for s in range(num_segments):
        start, stop = s * seg, min(numel, (s + 1) * seg)
        if start >= stop:
            break
        out.append((start, stop, s // per_rank))
    return out


def nccl_ring_chunks(numel: int, world_size: int, channels: int = 1,
                     chunk_elements: int | None = None) -> list[tuple[int, int, int]]:
    """The model's NCCL ring chunks: ``(start, stop, c)``, c being the ring position that finishes them.

    Channel b handles ``[b*ceil(N/channels), (b+1)*ceil(N/channels))`` in loops of
    W chunks of ``chunk_elements`` (default: ``ceil(channel_elements / W)``,
    one loop); the last loop uses ``min(chunk, ceil(rest / W))``.
    """
    out = []
    per_channel = _ceil_div(numel, channels)
    for b in range(channels):
        g0, g1 = b * per_channel, min(numel, (b + 1) * per_channel)
        if g0 >= g1:
            break
        count = g1 - g0
        chunk = chunk_elements if chunk_elements is not None else _ceil_div(count, world_size)
        offset = 0
        while offset < count:
            real = min(chunk, _ceil_div(count - offset, world_size))
            for c in range(world_size):
                start = g0 + offset + c * real
                stop = min(g1, start + real)
                if start < stop:
                    out.append((start, stop, c))
            offset += world_size * real
    return out


def _btree(nranks: int, rank: int) -> tuple[int, int, int]:
    # ncclGetBtree, line for line: (up, down0, down1), -1 for none.
    bit = 1
    while bit < nranks:
        if bit & rank:
            break
        bit <<= 1
    if rank == 0:
        return -1, -1, (bit >> 1) if nranks > 1 else -1
    up = (rank ^ bit) | (bit << 1)
    if up >= nranks:
        up = rank ^ bit
    lowbit = bit >> 1
    down0 = -1 if lowbit == 0 else rank - lowbit
    down1 = -1 if lowbit == 0 else rank + lowbit
    while down1 >= nranks:
        down1 = -1 if lowbit == 0 else rank + lowbit
        lowbit >>= 1
    return up, down0, down1


def nccl_double_binary_tree(nranks: int) -> tuple[list[tuple[int, int, int]], list[tuple[int, int, int]]]:
    """NCCL's two trees over ``nranks`` nodes (``ncclGetDtree``): per node ``(up, down0, down1)``.

    The second tree mirrors the first (even counts) or shifts it by one (odd),
    so that a node that is a leaf in one tree is inside the other.
    """
    first = [_btree(nranks, r) for r in range(nranks)]
    second = []
    for r in range(nranks):
        if nranks % 2 == 1:
            u, d0, d1 = _btree(nranks, (r - 1 + nranks) % nranks)
            second.append(tuple(-1 if v == -1 else (v + 1) % nranks for v in (u, d0, d1)))
        else:
            u, d0, d1 = _btree(nranks, nranks - 1 - r)
            second.append(tuple(-1 if v == -1 else nranks - 1 - v for v in (u, d0, d1)))
    return first, second


def _nccl_tree_program(tree: list[tuple[int, int, int]], ranks_per_node: int) -> tuple:
    """Postfix program of one NCCL tree: each rank adds its value, then each child's partial sum."""
    def children(g):
        node, local = divmod(g, ranks_per_node)
        kids = [g + 1] if local < ranks_per_node - 1 else []
        if local == 0:
            kids += [d * ranks_per_node for d in tree[node][1:] if d != -1]
        return kids

    root = next(n for n, (up, _, _) in enumerate(tree) if up == -1) * ranks_per_node
    # value(g) = ((x_g + v(k0)) + v(k1)) + v(k2); addition commutes, so emit v(k0), x_g, ADD, ...
    # Built iteratively: an intra-node chain can be longer than Python's recursion limit.
    program: list[int] = []
    stack = [("enter", root)]
    while stack:
        action, g = stack.pop()
        if action == "emit":
            program.extend(g)
            continue
        kids = children(g)
        todo = []
        if kids:
            todo += [("enter", kids[0]), ("emit", (g, ADD))]
            for k in kids[1:]:
                todo += [("enter", k), ("emit", (ADD,))]
        else:
            todo.append(("emit", (g,)))
        stack.extend(reversed(todo))
    return tuple(program)


def _pairwise_tree(world_size: int):
    level = list(range(world_size))
    while len(level) > 1:
        nxt = [(level[i], level[i + 1]) for i in range(0, len(level) - 1, 2)]
        if len(level) % 2:
            nxt.append(level[-1])
        level = nxt
    return level[0]


class _ChunkPrograms(dict):
    """A ring's W chain programs, built when a chunk first asks (W of them cost O(W^2) to build)."""

    def __init__(self, world_size: int, ranks_of_chunk):
        super().__init__()
        self._w, self._ranks = world_size, ranks_of_chunk

    def __missing__(self, c: int) -> tuple:
        self[c] = program = chain_program(self._ranks(c))
        return program


def _order_programs(order: str, world_size: int, opts: dict) -> dict:
    """Every program the order can use, keyed by what selects it (chunk, tree, ...)."""
    w = world_size
    if order == "sequential":
        return {0: chain_program(range(w))}
    if order == "reverse":
        return {0: chain_program(range(w - 1, -1, -1))}
    if order == "pairwise":
        return {0: tree_program(_pairwise_tree(w))}
    if order == "gloo_ring":
        return _ChunkPrograms(w, lambda c: [(c - 1 - k) % w for k in range(w)])
    if order == "nccl_ring":
        ring = opts["ring"] or list(range(w))
        return _ChunkPrograms(w, lambda c: [ring[(c + 1 + k) % w] for k in range(w)])
    if order == "nccl_tree":
        trees = nccl_double_binary_tree(w // opts["ranks_per_node"])
        return {t: _nccl_tree_program(trees[t], opts["ranks_per_node"]) for t in (0, 1)}
    raise ValueError(f"order {order!r} has no summation program")


def reduction_pieces(order: str, numel: int, world_size: int, element_size: int, **options) -> list[Piece]:
    """The :class:`~ddplab.numerics._programs.Piece` list (element range -> program) of an order.

    ValueError before any program is built when the programs would pass
    :data:`~ddplab.numerics.limits.MAX_PROGRAM_STEPS` (a ring over many ranks).
    """
    opts = order_options(order, world_size, **options)
    if order in ("gloo_ring", "nccl_ring"):
        # A ring has a program per chunk owner: count them before building any.
        chunks = (gloo_ring_segments(numel, world_size, element_size, opts["max_segment_bytes"])
                  if order == "gloo_ring" else
                  nccl_ring_chunks(numel, world_size, opts["channels"], opts["chunk_elements"]))
        check_program_steps(len({owner for _, _, owner in chunks}), world_size, order)
    else:
        check_program_steps(1 if order in ("sequential", "reverse", "pairwise") else 2, world_size, order)
    programs = _order_programs(order, world_size, opts)
    if order in ("sequential", "reverse", "pairwise"):
        pieces = [Piece(0, numel, programs[0])]
    elif order in ("gloo_ring", "nccl_ring"):
        pieces = [Piece(a, b, programs[owner]) for a, b, owner in chunks]
    else:
        channels = opts["channels"]
        per_channel = _ceil_div(numel, channels)
        pieces = [Piece(b * per_channel, min(numel, (b + 1) * per_channel),
                        programs[0 if channels == 1 or b < channels // 2 else 1])
                  for b in range(channels)]
    return merge_pieces(pieces)


def order_depth(order: str, world_size: int, **options) -> int:
    """The largest number of additions any addend passes through: the d of the bound gamma_d.

    W-1 for sequential, reverse and the rings; ceil(log2 W) for pairwise;
    computed from both trees for nccl_tree; 0 for exact (one rounding, no sum error).

    Example::

        >>> order_depth("gloo_ring", 8), order_depth("pairwise", 5), order_depth("nccl_tree", 8)
        (7, 3, 5)
    """
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    opts = order_options(order, world_size, **options)
    if order == "exact":
        return 0
    if order in ("gloo_ring", "nccl_ring"):
        return world_size - 1          # every chunk is a chain through all W ranks
    programs = _order_programs(order, world_size, opts)
    return max(program_depth(p) for p in programs.values())


def check_reduction(order: str, world_size: int | None = None, *, op: str = "sum",
                    averaging: str | None = None, accumulate=None, reduce_dtype=None,
                    **options) -> dict:
    """Validate everything :func:`reduce` accepts; return it with the defaults filled in.

    Returns ``dict(op, averaging, accumulate, reduce_dtype, options)``:
    ``averaging`` resolved for ``op="avg"`` (None for sums), dtypes as torch
    dtypes or None, ``options`` as :func:`order_options` gives them. Raises
    ValueError naming what is wrong, before any data is touched; whether
    ``accumulate`` is wide enough is checked against the data in :func:`reduce`.
    """
    opts = order_options(order, world_size, **options)
    if op not in ("sum", "avg"):
        raise ValueError(f"op must be 'sum' or 'avg', got {op!r}")
    if op == "sum" and averaging is not None:
        raise ValueError("averaging applies to op='avg' only")
    if op == "avg":
        averaging = averaging or default_averaging(order)
        if averaging not in AVERAGING:
            raise ValueError(f"unknown averaging {averaging!r}; choose one of {', '.join(AVERAGING)}")
    return dict(op=op, averaging=averaging,
                accumulate=None if accumulate is None else parse_dtype(accumulate),
                reduce_dtype=None if reduce_dtype is None else parse_dtype(reduce_dtype),
                options=opts)


def _arithmetic(dtype, order, op, averaging, accumulate, world_size) -> Arithmetic:
    averaging = check_reduction(order, op=op, averaging=averaging)["averaging"]
    compute = dtype if accumulate is None else parse_dtype(accumulate)
    if float_format(compute).p < float_format(dtype).p:
        raise ValueError(f"accumulate={compute} is less precise than the data's {dtype}")
    if op == "sum":
        return Arithmetic(dtype, compute)
    if averaging == "divide_first":
        return Arithmetic(dtype, compute, scale="div", scale_value=world_size)
    if averaging == "multiply_reciprocal":
        recip = torch.tensor(1.0 / world_size, dtype=torch.float64).to(compute).item()
        return Arithmetic(dtype, compute, scale="mul", scale_value=recip)
    if averaging == "multiply_float32_reciprocal":
        # torch's mul_ by a Python float casts it to the op's compute type, float32
        # for the half types (and float64 for float64): pass float32's 1/W and let
        # torch do exactly that.
        wide = torch.float64 if compute == torch.float64 else torch.float32
        recip = torch.tensor(1.0 / world_size, dtype=torch.float64).to(wide).item()
        return Arithmetic(dtype, compute, scale="mul", scale_value=recip)
    return Arithmetic(dtype, compute, post_divide=world_size)


def reduce(contributions, order: str = "gloo_ring", *, op: str = "sum", averaging: str | None = None,
           accumulate=None, reduce_dtype=None, **options) -> torch.Tensor:
    """Reduce W contributions elementwise in ``order``, rounding exactly where that backend rounds.

    ``op="avg"`` averages with ``averaging`` (default: what the backend of
    ``order`` does, see the module docstring). ``accumulate`` (e.g.
    ``torch.float32`` for half-precision data) converts the contributions
    exactly, does every operation in that dtype and rounds to the data's
    dtype once at the end; it has no effect on ``"exact"``. ``reduce_dtype``
    runs the whole reduction in another dtype, as compression hooks do:
    each contribution is cast to it (torch's ``.to``, rounding when it is
    narrower), reduced there (``averaging`` and ``accumulate`` included) and
    the result cast back. ``options`` are the order's own (see
    :func:`order_options`). Returns a 1-D tensor of N elements in the
    contributions' dtype.

    Example::

        >>> x = torch.randn(4, 1000, dtype=torch.float16)
        >>> bool((reduce(x, "gloo_ring") == reduce(x, "nccl_ring")).all())   # different orders
        False
    """
    c = as_contributions(contributions)
    dtype = parse_dtype(c.dtype)
    opts = order_options(order, c.world_size, **options)
    check_additions(c.world_size, c.numel, f"reduce in order {order!r}")
    if reduce_dtype is not None and parse_dtype(reduce_dtype) != dtype:
        narrow = parse_dtype(reduce_dtype)
        cast = c.map(lambda t: t.to(narrow), dtype=narrow)
        return reduce(cast, order, op=op, averaging=averaging, accumulate=accumulate, **opts).to(dtype)
    arith = _arithmetic(dtype, order, op, averaging, accumulate, c.world_size)
    if order == "exact":
        from ddplab.numerics.exact import exact_mean, exact_sum
        return exact_sum(c) if op == "sum" else exact_mean(c)
    element_size = torch.empty((), dtype=dtype).element_size()
    pieces = reduction_pieces(order, c.numel, c.world_size, element_size, **opts)
    return run(c, pieces, arith)


"""What each rank's outputs of a gloo collective must be, computed from every rank's recorded inputs.

Reductions run in the dtype they ran in, in gloo's order
(:func:`ddplab.numerics.reduce` and :func:`ddplab.numerics.reduce_scatter`
with ``"gloo_ring"``, both matched bit for bit against live gloo): an
all-reduce is gloo's ring over the whole buffer; ``allreduce_coalesced``
the ring over the ranks' tensors flattened and concatenated; a
reduce-scatter of one tensor (``reduce_scatter_single``, FSDP2's) the ring
all-reduce of the whole input, sliced; a reduce-scatter of a list gloo's
ring over each list entry. MAX, MIN and the bitwise ops do not depend on the
order. Copies (all-gather, broadcast, scatter, gather, all-to-all) must be
exact copies. :class:`Unverifiable` says why a collective has no emulation
here (``reduce``: gloo's reduce algorithm is not emulated; PRODUCT; send/recv).
"""
from __future__ import annotations

import functools

import torch

from ddplab.numerics import SUPPORTED_DTYPES, reduce, reduce_scatter

__all__ = ["Unverifiable", "emulate", "EMULATED_OPS"]

Inputs = list[list[torch.Tensor]]        # [group rank][tensor]
Shapes = list[tuple]                     # [group rank] -> tuple of output shapes


class Unverifiable(ValueError):
    """The collective has no emulation here; the message says why."""


def _flat(ts: list[torch.Tensor]) -> torch.Tensor:
    return torch.cat([t.reshape(-1) for t in ts]) if ts else torch.empty(0)


def _shaped(flat: torch.Tensor, shapes: tuple) -> list[torch.Tensor]:
    out, start = [], 0
    for shape in shapes:
        n = 1
        for d in shape:
            n *= d
        out.append(flat[start:start + n].reshape(shape))
        start += n
    if start != flat.numel():
        raise Unverifiable(f"the outputs hold {start} elements, the emulation {flat.numel()}")
    return out


_BITWISE = {"band": torch.bitwise_and, "bor": torch.bitwise_or, "bxor": torch.bitwise_xor}


def _reduce_rows(rows: torch.Tensor, reduce_op: str) -> torch.Tensor:
    """Reduce ``[W, N]`` rows elementwise as gloo does."""
    dtype = rows.dtype
    if reduce_op in ("sum", "avg") and dtype in SUPPORTED_DTYPES:
        return reduce(rows, "gloo_ring", op=reduce_op)
    if reduce_op == "sum" and not dtype.is_floating_point and not dtype.is_complex and dtype != torch.bool:
        return rows.sum(0, dtype=dtype)            # integer sums wrap alike in any order
    if reduce_op == "max":
        return rows.amax(0)
    if reduce_op == "min":
        return rows.amin(0)
    if reduce_op in _BITWISE and not dtype.is_floating_point:
        return functools.reduce(_BITWISE[reduce_op], rows.unbind(0))
    raise Unverifiable(f"no emulation of {reduce_op} on {dtype}")


def _one_each(inputs: Inputs, what: str) -> list[torch.Tensor]:
    if any(len(ts) != 1 for ts in inputs):
        raise Unverifiable(f"{what} with several tensors per rank is not emulated")
    return [ts[0] for ts in inputs]


def _allreduce(inputs, shapes, reduce_op, root, extra):
    rows = torch.stack([t.reshape(-1) for t in _one_each(inputs, "allreduce")])
    out = _reduce_rows(rows, reduce_op)
    return [_shaped(out, s) for s in shapes]


def _allreduce_coalesced(inputs, shapes, reduce_op, root, extra):
    out = _reduce_rows(torch.stack([_flat(ts) for ts in inputs]), reduce_op)
    return [_shaped(out, s) for s in shapes]


def _broadcast(inputs, shapes, reduce_op, root, extra):
    return [list(inputs[root]) for _ in shapes]


def _allgather(inputs, shapes, reduce_op, root, extra):
    ins = _one_each(inputs, "allgather")
    return [list(ins) for _ in shapes]


def _all_gather_single(inputs, shapes, reduce_op, root, extra):
    flat = torch.cat([t.reshape(-1) for t in _one_each(inputs, "all_gather_single")])
    return [_shaped(flat, s) for s in shapes]


def _all_gather_coalesced(inputs, shapes, reduce_op, root, extra):
    k = len(inputs[0])
    per_tensor = [torch.cat([ts[i].reshape(-1) for ts in inputs]) for i in range(k)]
    return [_shaped(torch.cat(per_tensor), s) for s in shapes]


def _shards(rows: torch.Tensor, reduce_op: str, *, list_input: bool) -> list[torch.Tensor]:
    """Every rank's shard of a gloo reduce-scatter of ``[W, N]`` rows."""
    w = rows.shape[0]
    if reduce_op in ("sum", "avg") and rows.dtype in SUPPORTED_DTYPES:
        return [reduce_scatter(rows, "gloo_ring", op=reduce_op, shard=r, list_input=list_input)
                for r in range(w)]
    return list(_reduce_rows(rows, reduce_op).chunk(w))


def _reduce_scatter(inputs, shapes, reduce_op, root, extra):
    rows = torch.stack([_flat(ts) for ts in inputs])
    return [_shaped(shard, s) for shard, s in zip(_shards(rows, reduce_op, list_input=True), shapes)]


def _reduce_scatter_single(inputs, shapes, reduce_op, root, extra):
    rows = torch.stack([t.reshape(-1) for t in _one_each(inputs, "reduce_scatter_single")])
    return [_shaped(shard, s) for shard, s in zip(_shards(rows, reduce_op, list_input=False), shapes)]


def _reduce_scatter_coalesced(inputs, shapes, reduce_op, root, extra):
    per_tensor = [_shards(torch.stack([ts[i].reshape(-1) for ts in inputs]), reduce_op, list_input=False)
                  for i in range(len(inputs[0]))]
    return [_shaped(torch.cat([shards[r] for shards in per_tensor]), s) for r, s in enumerate(shapes)]


def _all_to_all_single(inputs, shapes, reduce_op, root, extra):
    ins = _one_each(inputs, "all_to_all_single")
    w = len(ins)
    pieces = []
    for s, t in enumerate(ins):
        splits = list(extra[s].get("input_split_sizes") or ())
        pieces.append(list(t.split(splits or t.shape[0] // w)))
    return [_shaped(torch.cat([pieces[s][r].reshape(-1) for s in range(w)]), sh) for r, sh in enumerate(shapes)]


def _all_to_all(inputs, shapes, reduce_op, root, extra):
    return [[inputs[s][r] for s in range(len(inputs))] for r in range(len(shapes))]


def _gather(inputs, shapes, reduce_op, root, extra):
    ins = _one_each(inputs, "gather")
    return [list(ins) if r == root else [] for r in range(len(shapes))]


def _scatter(inputs, shapes, reduce_op, root, extra):
    return [[inputs[root][r]] for r in range(len(shapes))]


def _barrier(inputs, shapes, reduce_op, root, extra):
    return [[] for _ in shapes]


_EMULATIONS = {
    "allreduce": _allreduce,
    "allreduce_coalesced": _allreduce_coalesced,
    "broadcast": _broadcast,
    "allgather": _allgather,
    "all_gather_single": _all_gather_single,
    "all_gather_single_coalesced": _all_gather_coalesced,
    "reduce_scatter": _reduce_scatter,
    "reduce_scatter_single": _reduce_scatter_single,
    "reduce_scatter_single_coalesced": _reduce_scatter_coalesced,
    "all_to_all_single": _all_to_all_single,
    "all_to_all": _all_to_all,
    "gather": _gather,
    "scatter": _scatter,
    "barrier": _barrier,
}
#: The canonical ops :func:`emulate` knows.
EMULATED_OPS = frozenset(_EMULATIONS)


def emulate(op: str, inputs: Inputs, output_shapes: list[tuple], *, reduce_op: str | None = None,
            root: int | None = None, extra: list[dict] | None = None) -> list[list[torch.Tensor]]:
    """Every group rank's expected outputs of ``op``, from every group rank's inputs (index = group rank).

    ``output_shapes[r]`` are rank r's recorded output shapes; ``extra[r]`` its
    op-specific record (all-to-all splits). Raises :class:`Unverifiable`. What a
    collective only moves is returned as the input tensors themselves (a broadcast's
    W outputs are the root's input, not W copies of it): read them, never write them.
    """
    if op not in _EMULATIONS:
        raise Unverifiable(f"{op} is not emulated")
    if len(inputs) != len(output_shapes):
        raise ValueError(f"{len(inputs)} ranks' inputs but {len(output_shapes)} ranks' output shapes")
    return _EMULATIONS[op](inputs, output_shapes, reduce_op, root, extra or [{} for _ in inputs])

"""The c10d dispatcher ops every ProcessGroup collective runs through, and what their arguments mean.

In torch 2.13 every collective method of a C++ ``c10d::ProcessGroup``
(``ProcessGroup.hpp``) calls a ``c10d::<op>`` dispatcher op whose CPU kernel
(``Ops.cpp``) hands the call to the group's CPU backend, gloo here. Python's
``dist.*``, DDP's C++ reducer, its built-in C++ comm hooks, FSDP2, the C++
functional collectives behind DTensor and ``_functional_collectives`` all
arrive there. Each :class:`OpSpec` says, for one of those ops, where the group,
the input and output tensors, the reduce op and the root or peer sit in the
op's boxed arguments, and where its ``Work`` sits in what the kernel returns.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import torch

__all__ = ["OpSpec", "OP_SPECS", "REDUCTIONS", "POINT_TO_POINT"]

Args = tuple
Tensors = Callable[[Args], list[torch.Tensor]]


def _arg(i: int) -> Tensors:
    return lambda args: [args[i]]


def _list(i: int) -> Tensors:
    return lambda args: list(args[i])


def _nested(i: int) -> Tensors:
    return lambda args: [t for inner in args[i] for t in inner]


def _none(args: Args) -> list[torch.Tensor]:
    return []


@dataclasses.dataclass(frozen=True)
class OpSpec:
    """Where one c10d op keeps its pieces: ``inputs``/``outputs`` read the boxed arguments."""

    c10d_op: str
    op: str                          # the canonical name records carry
    group_arg: int
    inputs: Tensors
    outputs: Tensors
    reduce_arg: int | None = None
    root_arg: int | None = None      # root's group rank, or the peer of send/recv
    returns_tuple: bool = True       # (tensors, Work) rather than Work alone
    in_place: bool = False           # outputs overwrite the inputs
    extra: Callable[[Args], dict] | None = None

    def work(self, result):
        return result[1] if self.returns_tuple else result


def _tag(args: Args) -> dict:
    return {"tag": int(args[3])}


def _splits(args: Args) -> dict:
    return {"output_split_sizes": tuple(args[3]), "input_split_sizes": tuple(args[4])}


OP_SPECS: dict[str, OpSpec] = {s.c10d_op: s for s in (
    OpSpec("allreduce_", "allreduce", 1, _list(0), _list(0), reduce_arg=2, in_place=True),
    OpSpec("allreduce_coalesced_", "allreduce_coalesced", 1, _list(0), _list(0), reduce_arg=2,
           returns_tuple=False, in_place=True),
    OpSpec("broadcast_", "broadcast", 1, _list(0), _list(0), root_arg=2, in_place=True),
    OpSpec("allgather_", "allgather", 2, _list(1), _nested(0)),
    OpSpec("_allgather_base_", "all_gather_single", 2, _arg(1), _arg(0)),
    OpSpec("allgather_into_tensor_coalesced_", "all_gather_single_coalesced", 2, _list(1), _list(0),
           returns_tuple=False),
    OpSpec("allgather_coalesced_", "allgather_coalesced", 2, _list(1), _nested(0), returns_tuple=False),
    OpSpec("reduce_scatter_", "reduce_scatter", 2, _nested(1), _list(0), reduce_arg=3),
    OpSpec("_reduce_scatter_base_", "reduce_scatter_single", 2, _arg(1), _arg(0), reduce_arg=3),
    OpSpec("reduce_scatter_tensor_coalesced_", "reduce_scatter_single_coalesced", 2, _list(1), _list(0),
           reduce_arg=3, returns_tuple=False),
    OpSpec("alltoall_base_", "all_to_all_single", 2, _arg(1), _arg(0), returns_tuple=False, extra=_splits),
    OpSpec("alltoall_", "all_to_all", 2, _list(1), _list(0)),
    OpSpec("barrier", "barrier", 1, _none, _none, returns_tuple=False),
    OpSpec("reduce_", "reduce", 1, _list(0), _list(0), reduce_arg=2, root_arg=3, returns_tuple=False,
           in_place=True),
    OpSpec("gather_", "gather", 2, _list(1), _nested(0), root_arg=3, returns_tuple=False),
    OpSpec("scatter_", "scatter", 2, _nested(1), _list(0), root_arg=3),
    OpSpec("send", "send", 1, _list(0), _none, root_arg=2, returns_tuple=False, extra=_tag),
    OpSpec("recv_", "recv", 1, _none, _list(0), root_arg=2, returns_tuple=False, extra=_tag),
)}

#: Ops that reduce: the dtypes a step "reduced in" are theirs.
REDUCTIONS = frozenset({"allreduce", "allreduce_coalesced", "reduce_scatter", "reduce_scatter_single",
                        "reduce_scatter_single_coalesced", "reduce"})
#: Ops between two ranks: they take no place in the group's issue order; the k-th send from s to d
#: with a tag pairs with the k-th receive on d from s with that tag.
POINT_TO_POINT = frozenset({"send", "recv"})

"""What one rank records of one collective, and of one DDP comm hook's result.

A :class:`CollectiveRecord` names the collective (canonical ``op``, the c10d
dispatcher op it came through, the reduce op, root or peer), its group (the
group's name and global ranks, this rank's place in it, and the collective's
position in the group's issue order: ``sequence``), the ``step`` label the
caller set, the dtype and shapes, and the bits of the inputs (taken when the
collective is issued) and of the outputs (taken when it completes): a BLAKE2b
digest of each tensor's bytes, plus the tensors themselves while they are
needed for verification, in memory or spilled to a per-rank, per-step file.

A :class:`HookResult` is the tensor a DDP comm hook handed back to the
reducer for one bucket, linked to the collectives the hook issued.
"""
from __future__ import annotations

import dataclasses
import functools
import hashlib

import torch

__all__ = ["CollectiveRecord", "HookResult", "tensor_digest", "load_spilled"]

_DIGEST_BYTES = 16


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b (128-bit) of the tensor's bytes in row-major order; the dtype is not hashed."""
    flat = t.detach().reshape(-1)
    if not flat.is_contiguous():
        flat = flat.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    return hashlib.blake2b(flat.view(torch.uint8).numpy(), digest_size=_DIGEST_BYTES).hexdigest()


@functools.lru_cache(maxsize=4)
def _load_file(path: str) -> dict:
    return torch.load(path, weights_only=True)


def load_spilled(path: str, index: int) -> dict:
    """The tensors of record ``index`` (this rank's issue index) stored in spill file ``path``."""
    return _load_file(path)[index]


@dataclasses.dataclass
class _Stored:
    """Tensors of one record: held in memory, or in a spill file under the record's index."""

    rank: int
    index: int
    tensors: dict | None = None      # {"inputs": [...], "outputs": [...]} or {"result": [...]}
    spill: str | None = None

    def load(self, key: str) -> list[torch.Tensor] | None:
        """The tensors under ``key``; one the recording kept as a caller's stand-in
        (:meth:`~ddplab.collectives.Recorder.inputs_held_as`) is computed here, by its ``value()``."""
        if self.tensors is not None:
            kept = self.tensors.get(key)
            return None if kept is None else [t if isinstance(t, torch.Tensor) else t.value() for t in kept]
        if self.spill is not None:
            return load_spilled(self.spill, self.index).get(key)
        return None


@dataclasses.dataclass
class CollectiveRecord(_Stored):
    """One collective as one rank issued it (see the module docstring for the fields' meaning)."""

    step: int | None = None
    op: str = ""
    c10d_op: str = ""
    group: str = ""
    group_ranks: tuple[int, ...] | None = None
    group_rank: int = -1
    sequence: int | None = None      # position in the group's issue order; None for point-to-point
    reduce_op: str | None = None
    root: int | None = None          # group rank of the root (broadcast, gather, scatter, reduce) or peer
    dtype: str | None = None
    input_shapes: tuple = ()
    output_shapes: tuple = ()
    input_digests: tuple[str, ...] = ()
    output_digests: tuple[str, ...] | None = None    # None until it completed; () for send/recv (not copied)
    #                                                  and where the recording takes no digests
    extra: dict = dataclasses.field(default_factory=dict)
    bucket: int | None = None        # the DDP bucket whose comm hook issued it
    error: str | None = None         # why the record is incomplete (the collective itself ran)

    @property
    def complete(self) -> bool:
        return self.output_digests is not None or self.error is not None

    def inputs(self) -> list[torch.Tensor] | None:
        return self.load("inputs")

    def outputs(self) -> list[torch.Tensor] | None:
        return self.load("outputs")


@dataclasses.dataclass
class HookResult(_Stored):
    """The tensor a DDP comm hook returned for one bucket, and the collectives it issued (issue indices)."""

    step: int | None = None
    bucket: int = -1
    collectives: tuple[int, ...] = ()
    dtype: str | None = None
    shape: tuple = ()
    digest: str | None = None        # None until the hook's future completed; "" where no digest is taken
    error: str | None = None

    @property
    def complete(self) -> bool:
        return self.digest is not None or self.error is not None

    def result(self) -> torch.Tensor | None:
        got = self.load("result")
        return None if got is None else got[0]

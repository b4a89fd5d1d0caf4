"""The W per-rank inputs of one elementwise reduction, stored or generated.

Every function in :mod:`ddplab.numerics` that reduces "across ranks" takes a
:class:`Contributions`: W vectors of N elements, rank ``r``'s vector being
``x_r``. Three sources give the same interface:

* a ``[W, N]`` tensor: row ``r`` is ``x_r``;
* a *row callable* ``fn(rank) -> 1-D tensor`` of N elements;
* a *slice callable* ``fn(rank, start, stop) -> 1-D tensor`` of ``stop - start``
  elements, ``x_r[start:stop]``.

Callables are called again whenever data is needed, so W=1024 virtual ranks
of 1M float32 elements never occupy W*N memory. They must be deterministic:
the same arguments must give the same values on every call (seed a
``torch.Generator`` from the rank). Row callables suit rank-by-rank streaming
(what :func:`ddplab.numerics.reduce` does with them); slice callables also
allow column blocks ``[W, block]``, the cache-friendly order that tensors use.

Example::

    >>> c = as_contributions(lambda r: torch.full((5,), float(r)), world_size=3)
    >>> c.world_size, c.numel, c.kind
    (3, 5, 'rows')
    >>> next(c.blocks(2))[2]
    tensor([[0., 0.],
            [1., 1.],
            [2., 2.]])
"""
from __future__ import annotations

import inspect
from typing import Callable, Iterator, Sequence

import torch

__all__ = ["Contributions", "as_contributions"]

KINDS = ("tensor", "rows", "slices")


def _positional_arity(fn: Callable) -> int | None:
    """How many positional arguments ``fn`` requires, or None when it cannot be told."""
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    required = 0
    for param in sig.parameters.values():
        if param.kind == param.VAR_POSITIONAL:
            return None
        if param.kind in (param.POSITIONAL_ONLY, param.POSITIONAL_OR_KEYWORD) and param.default is param.empty:
            required += 1
    return required


class Contributions:
    """W contributions of N elements each: a ``[W, N]`` tensor or a callable plus ``world_size``.

    ``kind`` is ``"tensor"``, ``"rows"`` (``fn(rank)``) or ``"slices"``
    (``fn(rank, start, stop)``); for callables it is inferred from the number
    of required positional parameters unless given. ``numel`` and ``dtype``
    are read from rank 0's data unless given.
    """

    def __init__(self, source, world_size: int | None = None, *, kind: str | None = None,
                 numel: int | None = None, dtype: torch.dtype | None = None):
        if isinstance(source, Contributions):
            raise ValueError("already a Contributions; use as_contributions() to pass it through")
        if isinstance(source, torch.Tensor):
            self._init_tensor(source, world_size)
            return
        if not callable(source):
            raise ValueError(
                "contributions must be a [W, N] tensor, a sequence of 1-D tensors, or a callable "
                f"rank -> tensor (or (rank, start, stop) -> tensor); got {type(source).__name__}"
            )
        if world_size is None:
            raise ValueError("a callable source needs world_size=W")
        if not isinstance(world_size, int) or isinstance(world_size, bool) or world_size < 1:
            raise ValueError(f"world_size must be a positive int, got {world_size!r}")
        if kind is None:
            kind = "slices" if _positional_arity(source) == 3 else "rows"
        if kind not in ("rows", "slices"):
            raise ValueError(f"kind for a callable must be 'rows' or 'slices', got {kind!r}")
        self.kind = kind
        self.world_size = world_size
        self._fn = source
        self._tensor = None
        if numel is None or dtype is None:
            probe = self._fn(0) if kind == "rows" else None
            if kind == "slices":
                if numel is None:
                    raise ValueError("a slice callable needs numel=N (it cannot be asked for a whole row)")
                probe = self._fn(0, 0, min(numel, 1))
            if not isinstance(probe, torch.Tensor):
                raise ValueError(f"the callable returned {type(probe).__name__} for rank 0, not a tensor")
            numel = probe.numel() if numel is None else numel
            dtype = probe.dtype if dtype is None else dtype
        if not isinstance(numel, int) or numel < 0:
            raise ValueError(f"numel must be a non-negative int, got {numel!r}")
        self.numel = numel
        self.dtype = dtype

    @classmethod
    def unstacked(cls, rows: Sequence[torch.Tensor]) -> "Contributions":
        """W tensors of one dtype and numel, each rank's, read a column block at a time: never stacked
        into one ``[W, N]`` tensor (W sizes of the data less held for a large reduction)."""
        flat = [t.reshape(-1) for t in rows]
        if not flat or len({(t.numel(), t.dtype) for t in flat}) != 1:
            raise ValueError("unstacked contributions need at least one tensor, all of one numel and dtype")
        return cls(lambda r, start, stop: flat[r][start:stop], len(flat), kind="slices", numel=flat[0].numel(),
                   dtype=flat[0].dtype)

    def _init_tensor(self, x: torch.Tensor, world_size: int | None) -> None:
        if x.dim() != 2:
            raise ValueError(f"a contributions tensor must be [W, N] (one row per rank), got shape {tuple(x.shape)}")
        if x.shape[0] < 1:
            raise ValueError("a contributions tensor needs at least one rank (W >= 1)")
        if world_size is not None and world_size != x.shape[0]:
            raise ValueError(f"world_size={world_size} but the tensor has {x.shape[0]} rows")
        if x.device.type != "cpu":
            x = x.cpu()
        self.kind = "tensor"
        self._tensor = x.contiguous()
        self._fn = None
        self.world_size = int(x.shape[0])
        self.numel = int(x.shape[1])
        self.dtype = x.dtype

    # -- data access -----------------------------------------------------------------

    def _checked(self, t, rank: int, length: int) -> torch.Tensor:
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"the callable returned {type(t).__name__} for rank {rank}, not a tensor")
        if t.numel() != length:
            raise ValueError(f"rank {rank}: expected {length} elements, the callable returned {t.numel()}")
        if t.dtype != self.dtype:
            raise ValueError(f"rank {rank}: expected dtype {self.dtype}, the callable returned {t.dtype}")
        return t.reshape(-1).cpu()

    def row(self, rank: int) -> torch.Tensor:
        """Rank ``rank``'s whole contribution, a 1-D tensor of ``numel`` elements."""
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} outside [0, {self.world_size})")
        if self.kind == "tensor":
            return self._tensor[rank]
        if self.kind == "rows":
            return self._checked(self._fn(rank), rank, self.numel)
        return self._checked(self._fn(rank, 0, self.numel), rank, self.numel)

    def row_slice(self, rank: int, start: int, stop: int) -> torch.Tensor:
        """``x_rank[start:stop]``; for a row callable this generates the whole row first."""
        if self.kind == "tensor":
            return self._tensor[rank, start:stop]
        if self.kind == "slices":
            return self._checked(self._fn(rank, start, stop), rank, stop - start)
        return self.row(rank)[start:stop]

    def columns(self, start: int, stop: int) -> torch.Tensor:
        """The ``[W, stop - start]`` block of all ranks' elements ``start:stop``.

        A view for tensors; generated for callables (for a row callable that
        costs W whole rows, so prefer streaming rows with :meth:`row`).
        """
        if not 0 <= start <= stop <= self.numel:
            raise ValueError(f"column range [{start}, {stop}) outside [0, {self.numel}]")
        if self.kind == "tensor":
            return self._tensor[:, start:stop]
        return torch.stack([self.row_slice(r, start, stop) for r in range(self.world_size)])

    def blocks(self, block_size: int) -> Iterator[tuple[int, int, torch.Tensor]]:
        """Yield ``(start, stop, [W, stop - start] tensor)`` over the columns in blocks."""
        if block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {block_size}")
        for start in range(0, self.numel, block_size):
            stop = min(self.numel, start + block_size)
            yield start, stop, self.columns(start, stop)

    @property
    def streams_rows(self) -> bool:
        """True when data can only be had a whole row at a time (a row callable)."""
        return self.kind == "rows"

    def materialize(self) -> torch.Tensor:
        """The whole ``[W, N]`` tensor (allocates W*N elements for callables)."""
        if self.kind == "tensor":
            return self._tensor
        return torch.stack([self.row(r) for r in range(self.world_size)])

    def map(self, fn: Callable[[torch.Tensor], torch.Tensor], dtype: torch.dtype | None = None) -> "Contributions":
        """Contributions whose rows are ``fn(x_r)``; ``fn`` must act elementwise (e.g. quantize, convert).

        Callables stay callables (``fn`` runs on each generated row or slice);
        ``dtype`` is the result's dtype when it differs from the source's.
        """
        out_dtype = self.dtype if dtype is None else dtype
        if self.kind == "tensor":
            return Contributions(fn(self._tensor))
        if self.kind == "slices":
            return Contributions(lambda r, a, b: fn(self.row_slice(r, a, b)), self.world_size,
                                 kind="slices", numel=self.numel, dtype=out_dtype)
        return Contributions(lambda r: fn(self.row(r)), self.world_size, kind="rows",
                             numel=self.numel, dtype=out_dtype)

    def permuted(self, perm: Sequence[int]) -> "Contributions":
        """The same data with rank ``i`` holding what rank ``perm[i]`` held."""
        perm = [int(p) for p in perm]
        if sorted(perm) != list(range(self.world_size)):
            raise ValueError(f"perm must be a permutation of range({self.world_size}), got {perm}")
        if self.kind == "tensor":
            return Contributions(self._tensor[perm])
        if self.kind == "slices":
            return Contributions(lambda r, a, b: self.row_slice(perm[r], a, b), self.world_size,
                                 kind="slices", numel=self.numel, dtype=self.dtype)
        return Contributions(lambda r: self.row(perm[r]), self.world_size, kind="rows",
                             numel=self.numel, dtype=self.dtype)

    def __repr__(self) -> str:
        return (f"Contributions(kind={self.kind!r}, world_size={self.world_size}, "
                f"numel={self.numel}, dtype={self.dtype})")


def as_contributions(x, world_size: int | None = None, **kwargs) -> Contributions:
    """Return ``x`` as :class:`Contributions`.

    Accepts a Contributions (returned as is), a ``[W, N]`` tensor, a sequence of
    W 1-D tensors (stacked), or a callable with ``world_size``. Raises
    ValueError for anything else, for W < 1, or for ragged rows.
    """
    if isinstance(x, Contributions):
        if world_size is not None and world_size != x.world_size:
            raise ValueError(f"world_size={world_size} but the contributions have {x.world_size} ranks")
        return x
    if isinstance(x, (list, tuple)):
        if not x:
            raise ValueError("need at least one rank's contribution (W >= 1)")
        if not all(isinstance(t, torch.Tensor) for t in x):
            raise ValueError("a sequence of contributions must hold tensors, one per rank")
        sizes = {t.numel() for t in x}
        dtypes = {t.dtype for t in x}
        if len(sizes) != 1 or len(dtypes) != 1:
            raise ValueError(f"every rank's contribution needs the same numel and dtype, got {sizes} and {dtypes}")
        x = torch.stack([t.reshape(-1) for t in x])
    return Contributions(x, world_size, **kwargs)

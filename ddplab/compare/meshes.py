"""Data parallel on device meshes: HSDP, tensor parallel, and FSDP2 × tensor parallel.

Each configuration lays its W ranks out on a named ``DeviceMesh`` (row
major, as ``init_device_mesh`` does) and says which axes split the data:

* :class:`HSDP` -- ``fully_shard`` on a 2-D mesh ``("replicate", "shard")``:
  parameters sharded along ``shard``, replicated along ``replicate``; both
  axes split the data (W shares). Micro-batches run as users write them:
  ``set_requires_all_reduce(False)`` (reduce-scatter every micro-batch, the
  replicate all-reduce on the last) or ``set_requires_gradient_sync(False)``
  (no communication before the last).
* :class:`TP` -- ``parallelize_module`` with a plan on a 1-D mesh ``("tp",)``:
  every rank trains the same data (one share).
* :class:`FSDP2TP` -- tensor parallel on ``tp``, then ``fully_shard`` over
  ``dp``: the ``dp`` axis splits the data, ranks of one ``dp`` coordinate
  train the same share.

A plan is ``{module name: ParallelStyle}`` (``ColwiseParallel``,
``RowwiseParallel``, ``SequenceParallel``, ``PrepareModuleInput`` ...), or a
function ``model -> plan``; without one, the model's own ``tp_plan()`` if it
has one, else each pair of consecutive ``nn.Linear`` layers of an
``nn.Sequential`` as column- then row-wise (:func:`resolve_plan`).

A configuration is a description only (picklable, validated here); the
ranks' side is :mod:`ddplab.compare.mesh_training`, the evidence per axis
:mod:`ddplab.compare.mesh_evidence`.
"""
from __future__ import annotations

import dataclasses
import math
from typing import Callable, ClassVar

import torch
import torch.nn as nn

from ddplab.compare.configurations import Configuration, _check_int, _dtype_name

__all__ = ["MeshLayout", "MeshConfiguration", "HSDP", "TP", "FSDP2TP", "NO_SYNC", "resolve_plan",
           "default_plan", "check_plans"]

#: How HSDP skips synchronization on all but the last micro-batch: ``set_requires_all_reduce(False)``
#: (reduce-scatter each micro-batch, all-reduce the partial sums on the last) or
#: ``set_requires_gradient_sync(False)`` (no communication until the last).
NO_SYNC = ("all_reduce", "gradient_sync")


@dataclasses.dataclass(frozen=True)
class MeshLayout:
    """A mesh's named axes and sizes, ranks laid out row major (the last axis varies fastest)."""

    names: tuple[str, ...]
    sizes: tuple[int, ...]

    @classmethod
    def parse(cls, text: str) -> "MeshLayout":
        """The layout :meth:`text` wrote, e.g. ``"dp=2,tp=2"``."""
        pairs = [item.split("=") for item in str(text).split(",") if item]
        return cls(tuple(n for n, _ in pairs), tuple(int(s) for _, s in pairs))

    @property
    def text(self) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.names, self.sizes))

    @property
    def world(self) -> int:
        return math.prod(self.sizes)

    def coordinate(self, rank: int) -> dict[str, int]:
        """``{axis: index}`` of ``rank``."""
        out, rest = {}, rank
        for name, size in reversed(list(zip(self.names, self.sizes))):
            out[name] = rest % size
            rest //= size
        return {n: out[n] for n in self.names}

    def rank_at(self, coordinate: dict[str, int]) -> int:
        rank = 0
        for name, size in zip(self.names, self.sizes):
            rank = rank * size + coordinate[name]
        return rank

    def where(self, rank: int) -> str:
        """``rank``'s coordinate in words: ``"dp=1, tp=0"``."""
        return ", ".join(f"{n}={i}" for n, i in self.coordinate(rank).items())

    def axis_of(self, group) -> str:
        """The axis a group of ranks (a tuple, or ``"0,2"`` as records write it) spans: the names of the
        axes along which its members' coordinates vary, joined by ``+`` ("?" when unknown)."""
        if isinstance(group, str):
            if not group or group == "?":
                return "?"
            group = [int(r) for r in group.split(",")]
        if not group:
            return "?"
        coords = [self.coordinate(int(r)) for r in group]
        varying = [n for n in self.names if len({c[n] for c in coords}) > 1]
        return "+".join(varying) if varying else "self"

    def peers(self, rank: int, axis: str) -> list[int]:
        """The ranks that differ from ``rank`` only along ``axis``, in axis order (``rank`` included)."""
        coord = self.coordinate(rank)
        size = self.sizes[self.names.index(axis)]
        return [self.rank_at({**coord, axis: i}) for i in range(size)]


def _check_policy(policy) -> None:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    if policy is not None and not isinstance(policy, MixedPrecisionPolicy):
        raise ValueError(f"mp_policy must be a torch.distributed.fsdp.MixedPrecisionPolicy or None, "
                         f"got {type(policy).__name__}")


def _check_plan(plan) -> None:
    from torch.distributed.tensor.parallel import ParallelStyle

    if plan is None or callable(plan) and not isinstance(plan, dict):
        return
    if not isinstance(plan, dict) or not plan:
        raise ValueError(f"plan must be a non-empty dict {{module name: ParallelStyle}}, a function "
                         f"model -> plan, or None (the default plan), got {plan!r}")
    for name, style in plan.items():
        if not isinstance(name, str) or not isinstance(style, ParallelStyle):
            raise ValueError(f"plan entry {name!r}: {style!r} must map a module name to a ParallelStyle "
                             "(ColwiseParallel(), RowwiseParallel(), SequenceParallel(), ...)")


@dataclasses.dataclass(kw_only=True)
class MeshConfiguration(Configuration):
    """What every mesh configuration has: a layout, the axes that split the data, a precision policy.

    ``mp_policy`` is FSDP2's ``MixedPrecisionPolicy`` (None: the model's dtype
    throughout). Gradient reductions are declared to run in its
    ``reduce_dtype`` (else ``param_dtype``, else the model's dtype) on every
    axis; every other reduction (activations, their gradients) in the
    compute dtype ``param_dtype`` (else the model's).
    """

    mp_policy: object | None = None
    reshard_after_forward: bool = True

    #: The axes that split the global batch (ranks along them train different shares).
    data_axes: ClassVar[tuple[str, ...]] = ()
    #: The axis FSDP shards parameters along (None: no FSDP).
    sharding_axis: ClassVar[str | None] = None

    kind = "mesh"

    def layout(self) -> MeshLayout:
        raise NotImplementedError

    # ------------------------------------------------------------------ data

    @property
    def shares(self) -> int:
        layout = self.layout()
        return math.prod(s for n, s in zip(layout.names, layout.sizes) if n in self.data_axes)

    def share_of(self, rank: int, world: int) -> int:
        """The row-major index of ``rank``'s coordinates on the data axes: ranks that differ only on
        the other axes (tensor parallel) train the same share."""
        layout = self.layout()
        coord, share = layout.coordinate(rank), 0
        for name, size in zip(layout.names, layout.sizes):
            if name in self.data_axes:
                share = share * size + coord[name]
        return share

    def axis_of(self, group) -> str:
        return self.layout().axis_of(group)

    def twin_partner(self, rank: int, group=None) -> int:
        """The rank whose computation ``rank``'s must equal bitwise in the symmetric twin (every data
        share made rank 0's): the same coordinates on the axes that do not split the data, 0 on the ones
        that do. ``group``: the ranks of a collective whose inputs are compared (None: forward outputs,
        gradients, parameters)."""
        layout = self.layout()
        coord = layout.coordinate(rank)
        return layout.rank_at({n: 0 if n in self.data_axes else i for n, i in coord.items()})

    # ------------------------------------------------------------------ precision

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        if self.mp_policy is None:
            return None, None
        param_dtype, reduce_dtype = self.mp_policy.param_dtype, self.mp_policy.reduce_dtype
        return param_dtype, reduce_dtype if reduce_dtype is not None else param_dtype

    def declared_precision(self, model_dtype: torch.dtype) -> dict[str, str]:
        """``{"gradient": dtype, "activation": dtype}`` the reductions are declared to run in."""
        param_dtype, reduce_dtype = self.dtypes()
        return dict(gradient=_dtype_name(reduce_dtype or model_dtype),
                    activation=_dtype_name(param_dtype or model_dtype))

    def _precision_name(self) -> str:
        param_dtype, reduce_dtype = self.dtypes()
        if param_dtype is None and reduce_dtype is None:
            return ""
        if param_dtype is None:
            return f" reduce {_dtype_name(reduce_dtype)}"
        return f" {_dtype_name(param_dtype)}" + (f"/reduce {_dtype_name(reduce_dtype)}"
                                                 if reduce_dtype != param_dtype else "")

    # ------------------------------------------------------------------ description

    def describe(self) -> dict:
        out = super().describe()
        out.update(mesh=self.layout().text, data_axes=",".join(self.data_axes),
                   sharding_axis=self.sharding_axis)
        return out

    def validate(self) -> None:
        super().validate()
        _check_policy(self.mp_policy)
        if not isinstance(self.reshard_after_forward, bool):
            raise ValueError(f"reshard_after_forward must be True or False, got {self.reshard_after_forward!r}")

    def check_model(self, model: nn.Module) -> None:
        """Raise ValueError when this configuration cannot wrap ``model`` (a plan naming no module)."""


@dataclasses.dataclass(kw_only=True)
class HSDP(MeshConfiguration):
    """``fully_shard`` on a ``(replicate, shard)`` mesh: sharded within a replica, replicated across them.

    Every rank trains its own share (W = replicate × shard shares). With
    ``k > 1`` micro-batches, ``no_sync`` says how the first k-1 skip
    synchronization (:data:`NO_SYNC`).
    """

    replicate: int = 2
    shard: int = 2
    no_sync: str = "all_reduce"
    world_size: int = dataclasses.field(default=4, init=False)

    data_axes = ("replicate", "shard")
    sharding_axis = "shard"

    kind = "hsdp"

    def __post_init__(self):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (self.replicate, self.shard)):
            self.world_size = self.replicate * self.shard

    def layout(self) -> MeshLayout:
        return MeshLayout(("replicate", "shard"), (self.replicate, self.shard))

    def twin_partner(self, rank: int, group=None) -> int:
        # A replicate all-reduce reduces the rank's own shard: compare it with the same shard's.
        layout = self.layout()
        coord = layout.coordinate(rank)
        keep_shard = group is not None and layout.axis_of(group) == "replicate"
        return layout.rank_at(dict(replicate=0, shard=coord["shard"] if keep_shard else 0))

    def _default_name(self) -> str:
        name = f"hsdp {self.replicate}x{self.shard}" + (f" k={self.k}" if self.k > 1 else "")
        if self.k > 1 and self.no_sync != NO_SYNC[0]:
            name += f" no_sync={self.no_sync}"
        return name + self._precision_name()

    def validate(self) -> None:
        _check_int("replicate", self.replicate)
        _check_int("shard", self.shard)
        self.__post_init__()
        super().validate()
        if self.no_sync not in NO_SYNC:
            raise ValueError(f"no_sync must be one of {NO_SYNC}, got {self.no_sync!r}")

    def describe(self) -> dict:
        return dict(super().describe(), no_sync=self.no_sync if self.k > 1 else None)


def _plan_name(plan) -> str:
    if plan is None:
        return ""
    return f" plan={getattr(plan, '__name__', None) or 'own'}"


@dataclasses.dataclass(kw_only=True)
class _Parallelized(MeshConfiguration):
    """A configuration that applies a tensor-parallel ``plan`` along the ``tp`` axis."""

    plan: dict | Callable | None = None

    def validate(self) -> None:
        super().validate()
        _check_plan(self.plan)

    def check_model(self, model: nn.Module) -> None:
        resolve_plan(self.plan, model)


@dataclasses.dataclass
class TP(_Parallelized):
    """Tensor parallel alone: ``parallelize_module(model, mesh["tp"], plan)`` on ``world_size`` ranks.

    Every rank trains the whole global batch (one share); no mixed-precision
    policy (TP has none). ``k > 1`` accumulates micro-batches locally.
    """

    world_size: int = 2

    kind = "tp"

    def layout(self) -> MeshLayout:
        return MeshLayout(("tp",), (self.world_size,))

    def _default_name(self) -> str:
        return f"tp {self.world_size}" + (f" k={self.k}" if self.k > 1 else "") + _plan_name(self.plan)

    def validate(self) -> None:
        super().validate()
        if self.mp_policy is not None:
            raise ValueError("TP takes no mp_policy (FSDP2's policy needs fully_shard: use FSDP2TP)")


@dataclasses.dataclass(kw_only=True)
class FSDP2TP(_Parallelized):
    """Tensor parallel along ``tp``, then ``fully_shard`` of every module with parameters along ``dp``.

    Ranks of one ``dp`` coordinate train the same share (``dp`` shares).
    ``k > 1`` accumulates with ``set_requires_gradient_sync(False)`` on all
    but the last micro-batch.
    """

    dp: int = 2
    tp: int = 2
    world_size: int = dataclasses.field(default=4, init=False)

    data_axes = ("dp",)
    sharding_axis = "dp"

    kind = "fsdp2_tp"

    def __post_init__(self):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in (self.dp, self.tp)):
            self.world_size = self.dp * self.tp

    def layout(self) -> MeshLayout:
        return MeshLayout(("dp", "tp"), (self.dp, self.tp))

    def _default_name(self) -> str:
        return (f"fsdp2 dp={self.dp} x tp={self.tp}" + (f" k={self.k}" if self.k > 1 else "")
                + self._precision_name() + _plan_name(self.plan))

    def validate(self) -> None:
        _check_int("dp", self.dp)
        _check_int("tp", self.tp)
        self.__post_init__()
        super().validate()


# --------------------------------------------------------------------------- plans


def default_plan(model: nn.Module) -> dict:
    """The model's ``tp_plan()``, else column- then row-wise for each pair of consecutive ``nn.Linear``
    layers in an ``nn.Sequential`` (an empty dict when there is none)."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    if callable(getattr(model, "tp_plan", None)):
        return model.tp_plan()
    plan = {}
    for prefix, module in model.named_modules():
        if not isinstance(module, nn.Sequential):
            continue
        linears = [name for name, child in module.named_children() if isinstance(child, nn.Linear)]
        for first, second in zip(linears[0::2], linears[1::2]):
            plan[f"{prefix}.{first}" if prefix else first] = ColwiseParallel()
            plan[f"{prefix}.{second}" if prefix else second] = RowwiseParallel()
    return plan


def resolve_plan(plan, model: nn.Module) -> dict:
    """The plan to apply to ``model`` (see the module docstring); ValueError naming what does not fit."""
    resolved = default_plan(model) if plan is None else plan(model) if callable(plan) and not isinstance(
        plan, dict) else plan
    if not resolved:
        raise ValueError(f"no default tensor-parallel plan for {type(model).__name__} (it has no tp_plan() "
                         "and no consecutive nn.Linear layers in an nn.Sequential): give plan={module name: "
                         "ColwiseParallel() / RowwiseParallel() / ...}")
    _check_plan(resolved)
    missing = []
    for name in resolved:
        try:
            model.get_submodule(name)
        except AttributeError:
            missing.append(name)
    if missing:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(f"the plan names modules the model does not have: {missing}; it has {names}")
    return resolved


def check_plans(setup, configurations) -> None:
    """What a mesh configuration cannot wrap in ``setup``'s model, refused before any rank starts."""
    meshes = [c for c in configurations if isinstance(c, MeshConfiguration)]
    if not meshes:
        return
    model = setup.build_model()
    for config in meshes:
        try:
            config.check_model(model)
        except ValueError as exc:
            raise ValueError(f"configuration {config.label!r}: {exc}") from None

"""The distributed configurations a comparison runs against the single-process reference.

Each configuration trains the setup's model on the same global batches as
the reference: rank ``r`` of ``world_size`` W takes the ``r``-th of W equal
contiguous shares of every global batch and, with ``k`` micro-batches, cuts
its share into k equal parts (:func:`ddplab.compare.setup.split`). With a
loss that averages over its batch, W·k equal pieces averaged over ranks and
micro-batches give the reference's gradient up to rounding.

* :class:`DDP` -- ``DistributedDataParallel`` (``bucket_cap_mb``, a comm hook, other options);
* :class:`Accumulate` -- DDP with k micro-batches: k-1 backwards under
  ``no_sync()`` and one synchronized, each loss divided by k;
* :class:`Fabric` -- Lightning Fabric ``strategy="ddp"`` inside ddplab's process group;
* :class:`FSDP2` -- ``fully_shard`` with an optional ``MixedPrecisionPolicy``;
* :class:`Custom` -- the user's own training step (:class:`StepContext`).

A configuration is a description only (picklable, validated here); what a
rank does with it lives in :mod:`ddplab.compare.runners`.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable

import torch

__all__ = ["Configuration", "DDP", "Accumulate", "Fabric", "FSDP2", "Custom", "StepContext",
           "check_configurations"]


def _check_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name} must be an int >= {minimum}, got {value!r}")


def _dtype_name(dtype: torch.dtype | None) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


@dataclasses.dataclass
class Configuration:
    """What every configuration has: ranks, micro-batches per rank, a name, the compute precision.

    ``timeout`` (seconds) overrides the comparison's per-launch timeout for
    this configuration: past it, the configuration counts as hung.

    ``approximation`` declares a lossy step the user chose (e.g.
    ``"PowerSGD rank 1"``): its difference from one process is then an
    approximation, never rounding, and a bug only on evidence that proves one
    (ranks that disagree, asymmetry, a collective that differs from its
    emulation). torch's PowerSGD hooks are recognized without it.

    :meth:`dtypes` says in which dtype the forward and backward passes
    compute when it differs from the model's (mixed precision); the referee
    then measures the rounding band with a single-process reference that
    computes in that dtype too.
    """

    world_size: int = 2
    k: int = 1
    name: str | None = None
    timeout: float | None = None
    approximation: str | None = None

    kind = "configuration"

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        """``(param_dtype, reduce_dtype)`` of a mixed-precision configuration; None: the model's dtype."""
        return None, None

    @property
    def shares(self) -> int:
        """How many distinct shares each global batch is cut into: one per rank, unless ranks share data
        (tensor-parallel ranks of one data-parallel coordinate train the same share)."""
        return self.world_size

    def share_of(self, rank: int, world: int) -> int:
        """Which of the :attr:`shares` rank ``rank`` of ``world`` trains."""
        return rank

    @property
    def pieces(self) -> int:
        """Equal pieces of each global batch: the shares × k micro-batches."""
        return self.shares * self.k

    @property
    def label(self) -> str:
        """The configuration's name in records and figures."""
        return self.name or self._default_name()

    def _default_name(self) -> str:
        return f"{self.kind} W={self.world_size}" + (f" k={self.k}" if self.k > 1 else "")

    def validate(self) -> None:
        _check_int("world_size", self.world_size)
        _check_int("k", self.k)
        if self.name is not None and (not isinstance(self.name, str) or not self.name.strip()):
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        # What a launch would refuse is refused here, before any configuration runs.
        from ddplab.launcher import check_timeout, check_world_size
        check_world_size(self.world_size)
        if self.timeout is not None:
            check_timeout(self.timeout)
        if self.approximation is not None and (not isinstance(self.approximation, str) or
                                               not self.approximation.strip()):
            raise ValueError(f"approximation must be a non-empty description (e.g. 'PowerSGD rank 1') or None, "
                             f"got {self.approximation!r}")

    def approximates(self) -> str | None:
        """The lossy step this configuration takes, declared or recognized; None when it takes none."""
        return self.approximation

    def describe(self) -> dict:
        """The configuration as plain data (for records, reports and the case's parameters)."""
        param_dtype, reduce_dtype = self.dtypes()
        return dict(config=self.label, kind=self.kind, world_size=self.world_size, k=self.k,
                    param_dtype=_dtype_name(param_dtype), reduce_dtype=_dtype_name(reduce_dtype),
                    approximation=self.approximates())


@dataclasses.dataclass
class DDP(Configuration):
    """``DistributedDataParallel`` over ``world_size`` ranks.

    ``bucket_cap_mb`` and ``options`` (e.g. ``gradient_as_bucket_view``)
    go to DDP's constructor. ``comm_hook`` is registered with
    ``register_comm_hook``; its state comes from ``hook_state``, a
    zero-argument callable run on each rank once the process group exists
    (a state such as :class:`ddplab.comm_hooks.AuditState` needs it).
    ``k > 1`` accumulates k micro-batches (see :class:`Accumulate`).
    On gloo torch's ``fp16_compress_hook``, ``bf16_compress_hook`` (which
    refuses gloo) and ``allreduce_hook`` run as ddplab's hooks of the same
    math (:func:`ddplab.comm_hooks.gloo_equivalent`); :meth:`describe`'s
    ``hook_note`` says so. ``sync_batchnorm=True`` converts the model's
    BatchNorm layers (and torch's SyncBatchNorm, which DDP refuses on CPU) to
    :class:`ddplab.sync_batchnorm.SyncBatchNorm` before wrapping, as
    ``torch.nn.SyncBatchNorm.convert_sync_batchnorm`` would on GPUs.
    ``compile=True`` (or a dict of ``torch.compile`` keyword arguments)
    compiles the wrapped model: ``torch.compile(DistributedDataParallel(model))``
    (a model compiled before wrapping comes from ``Setup.model``).
    """

    bucket_cap_mb: float | None = None
    comm_hook: Callable | None = None
    hook_state: Callable[[], Any] | None = None
    options: dict = dataclasses.field(default_factory=dict)
    sync_batchnorm: bool = False
    compile: bool | dict = False

    kind = "ddp"

    def _default_name(self) -> str:
        name = super()._default_name()
        if self.bucket_cap_mb is not None:
            name += f" bucket={self.bucket_cap_mb:g}MB"
        if self.comm_hook is not None:
            name += f" hook={getattr(self.comm_hook, '__name__', 'hook')}"
        if self.sync_batchnorm:
            name += " sync_batchnorm"
        if self.compile is not False:
            name += " compiled"
        return name

    def ddp_kwargs(self) -> dict:
        """The keyword arguments ``DistributedDataParallel`` is built with (``options``, ``bucket_cap_mb``)."""
        kwargs = dict(self.options)
        if self.bucket_cap_mb is not None:
            kwargs["bucket_cap_mb"] = self.bucket_cap_mb
        return kwargs

    def approximates(self) -> str | None:
        if self.approximation is not None or self.comm_hook is None:
            return self.approximation
        name = getattr(self.comm_hook, "__name__", "")
        if getattr(self.comm_hook, "__module__", "").endswith("powerSGD_hook") or "powerSGD" in name:
            return f"PowerSGD ({name})"  # a low-rank approximation of the gradient, by design
        return None

    def describe(self) -> dict:
        out = super().describe()
        if self.comm_hook is not None:
            from ddplab.comm_hooks import gloo_equivalent  # compare's ranks are gloo
            out["hook_note"] = gloo_equivalent(self.comm_hook)[1]
        if self.sync_batchnorm:
            out["sync_batchnorm"] = True
        return out

    def validate(self) -> None:
        super().validate()
        if self.bucket_cap_mb is not None and (isinstance(self.bucket_cap_mb, bool) or
                                               not isinstance(self.bucket_cap_mb, (int, float)) or
                                               self.bucket_cap_mb <= 0):
            raise ValueError(f"bucket_cap_mb must be a positive number of MB, got {self.bucket_cap_mb!r}")
        if self.comm_hook is not None and not callable(self.comm_hook):
            raise ValueError(f"comm_hook must be a DDP comm hook (state, bucket) -> Future, "
                             f"got {type(self.comm_hook).__name__}")
        if self.hook_state is not None and not callable(self.hook_state):
            raise ValueError("hook_state must be a zero-argument callable returning the hook's state "
                             "(it runs on each rank once the process group exists)")
        if not isinstance(self.compile, (bool, dict)):
            raise ValueError(f"compile must be True, False or a dict of torch.compile keyword arguments, "
                             f"got {self.compile!r}")
        if not isinstance(self.sync_batchnorm, bool):
            raise ValueError(f"sync_batchnorm must be True or False, got {self.sync_batchnorm!r}")
        if not isinstance(self.options, dict):
            raise ValueError(f"options must be a dict of DDP keyword arguments, got {type(self.options).__name__}")
        reserved = {"module", "bucket_cap_mb", "process_group"} & set(self.options)
        if reserved:
            raise ValueError(f"options must not set {sorted(reserved)}")


@dataclasses.dataclass
class Accumulate(DDP):
    """Gradient accumulation under DDP: ``k`` micro-batches per rank and optimizer step.

    Micro-batches 0..k-2 run forward and backward inside ``model.no_sync()``
    (gradients accumulate locally, no communication); the last runs outside
    it, and its backward reduces the accumulated gradient. Every micro-batch
    loss is divided by k, so the accumulated gradient is the mean over the
    rank's share. ``no_sync=False`` leaves ``no_sync()`` out: every
    micro-batch's backward all-reduces the gradient accumulated so far (more
    communication, the same mean up to rounding); the replay follows it
    all-reduce by all-reduce.
    """

    k: int = 2
    no_sync: bool = True

    kind = "accumulate"

    def _default_name(self) -> str:
        return super()._default_name() + ("" if self.no_sync else " sync every micro-batch")

    def validate(self) -> None:
        super().validate()
        if self.k < 2:
            raise ValueError(f"Accumulate needs k >= 2 micro-batches, got {self.k} (use DDP for k=1)")
        if not isinstance(self.no_sync, bool):
            raise ValueError(f"no_sync must be True or False, got {self.no_sync!r}")


@dataclasses.dataclass
class Fabric(Configuration):
    """Lightning Fabric with ``strategy="ddp"`` on the CPU, inside ddplab's process group.

    ``fabric.setup(model, optimizer)`` and ``fabric.backward(loss)``;
    ``k > 1`` accumulates with ``fabric.no_backward_sync``.
    """

    kind = "fabric"


@dataclasses.dataclass
class FSDP2(Configuration):
    """``torch.distributed.fsdp.fully_shard`` on every leaf module with parameters, then the root.

    ``param_dtype`` / ``reduce_dtype`` form the ``MixedPrecisionPolicy``
    (None: the model's dtype). Gradients and parameters are compared as
    full tensors (``DTensor.full_tensor()``). ``k > 1`` accumulates with
    ``set_requires_gradient_sync(False)`` on all but the last micro-batch.
    """

    param_dtype: torch.dtype | None = None
    reduce_dtype: torch.dtype | None = None
    reshard_after_forward: bool = True

    kind = "fsdp2"

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        # FSDP2 reduces in param_dtype unless reduce_dtype says otherwise.
        return self.param_dtype, self.reduce_dtype if self.reduce_dtype is not None else self.param_dtype

    def _default_name(self) -> str:
        name = super()._default_name()
        param_dtype, reduce_dtype = self.dtypes()
        if param_dtype is not None:
            name += f" {_dtype_name(param_dtype)}"
            if reduce_dtype != param_dtype:
                name += f"/reduce {_dtype_name(reduce_dtype)}"
        elif reduce_dtype is not None:
            name += f" reduce {_dtype_name(reduce_dtype)}"
        return name

    def validate(self) -> None:
        super().validate()
        for field in ("param_dtype", "reduce_dtype"):
            value = getattr(self, field)
            if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
                raise ValueError(f"{field} must be a floating torch.dtype or None, got {value!r}")


@dataclasses.dataclass
class StepContext:
    """What a :class:`Custom` training step gets on each rank, for one step.

    ``model`` is the wrapped model (``wrap``'s result), ``optimizer`` the
    setup's optimizer over it, ``loss`` the setup's loss function. ``batch``
    is the global batch; ``shard`` this rank's share of it and
    ``micro_batches`` the share cut into ``k`` parts (each a tuple
    ``(inputs..., target)``). ``step``, ``rank``, ``world_size``, ``k`` say where it is.
    Call :meth:`apply_before_step` between the reduction and ``optimizer.step()``
    to run the setup's ``before_step`` (e.g. clipping), as the reference does.
    ``state`` is a dict that the rank keeps from step to step: the place for an
    optimizer the step builds itself (``ctx.state.setdefault("opt", ...)``);
    ddplab observes whichever optimizer steps the model's parameters, though
    the reference trains with the setup's.
    """

    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    loss: Callable
    batch: tuple
    shard: tuple
    micro_batches: list
    step: int
    rank: int
    world_size: int
    k: int
    before_step: Callable | None = None
    state: dict = dataclasses.field(default_factory=dict)

    def apply_before_step(self) -> None:
        """The setup's ``before_step(model)``, if it has one."""
        if self.before_step is not None:
            self.before_step(self.model)

    def forward_loss(self, batch: tuple) -> torch.Tensor:
        """``loss(model(*inputs), target)`` for a batch ``(inputs..., target)``."""
        return self.loss(self.model(*batch[:-1]), batch[-1])


@dataclasses.dataclass
class Custom(Configuration):
    """The user's own training step, for loops ddplab does not know.

    ``train_step(ctx)`` (a :class:`StepContext`) runs one whole step on each
    rank -- forward, backward, whatever synchronization, ``optimizer.step()``
    and zeroing the gradients -- and may return the loss. ddplab reads the
    gradient each parameter holds when ``optimizer.step()`` is called and the
    parameters after it. ``wrap(model)`` prepares the model once (default
    ``"ddp"``: ``DistributedDataParallel(model)``; None: the bare model, for
    steps that synchronize by hand). ``k`` is how many micro-batches per rank
    the step uses (it sets ``ctx.micro_batches`` and the pieces findings are
    stated in). ``precision`` declares the dtype the step computes in
    (``torch.bfloat16`` for a step under ``autocast(bfloat16)``): the
    reference then computes in it too. Undeclared, a step whose modules
    return a lower-precision dtype is measured against such a reference all
    the same.
    """

    train_step: Callable[[StepContext], Any] | None = None
    wrap: Callable | str | None = "ddp"
    precision: torch.dtype | None = None

    kind = "custom"

    def dtypes(self) -> tuple[torch.dtype | None, torch.dtype | None]:
        # A step that computes in a lower precision (autocast) is measured against a reference
        # computing in it too; its gradients stay in the model's dtype.
        return self.precision, None

    def _default_name(self) -> str:
        fn = getattr(self.train_step, "__name__", "custom")
        return f"{fn} W={self.world_size}" + (f" k={self.k}" if self.k > 1 else "")

    def validate(self) -> None:
        super().validate()
        if not callable(self.train_step):
            raise ValueError("Custom needs train_step, a callable taking a StepContext")
        if not (self.wrap is None or self.wrap == "ddp" or callable(self.wrap)):
            raise ValueError(f"wrap must be 'ddp', None or a callable model -> model, got {self.wrap!r}")
        value = self.precision
        if value is not None and (not isinstance(value, torch.dtype) or not value.is_floating_point):
            raise ValueError(f"precision must be a floating torch.dtype or None, got {value!r}")


def check_configurations(configurations) -> list[Configuration]:
    """Validate a configuration or a list of them; names must be unique. Returns the list."""
    if isinstance(configurations, Configuration):
        configurations = [configurations]
    try:
        configurations = list(configurations)
    except TypeError:
        raise ValueError(f"configurations must be a Configuration or a list of them, "
                         f"got {type(configurations).__name__}") from None
    if not configurations:
        raise ValueError("give at least one configuration to compare with the reference")
    for c in configurations:
        if not isinstance(c, Configuration):
            raise ValueError(f"expected DDP, Accumulate, Fabric, FSDP2 or Custom, got {type(c).__name__}")
        c.validate()
    names = [c.label for c in configurations]
    dupes = sorted({n for n in names if names.count(n) > 1})
    if dupes:
        raise ValueError(f"configuration names must be unique; repeated: {dupes} (give name=...)")
    reserved = {"reference", "truth"} & set(names)
    if reserved or any(n.startswith("reference ") for n in names):
        raise ValueError(f"configuration names {sorted(reserved) or names} clash with the reference runs' names")
    return configurations

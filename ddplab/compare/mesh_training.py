"""What a rank does with a mesh configuration: build the mesh, apply the plan, shard, and keep local shards.

:func:`wrap` is the trainer :mod:`ddplab.compare.runners` calls for every
:class:`~ddplab.compare.meshes.MeshConfiguration` (registered here): it
builds the ``DeviceMesh`` over gloo, applies ``parallelize_module`` with the
configuration's plan along ``tp``, then ``fully_shard`` on every module that
owns parameters and on the root (along ``shard`` of HSDP's 2-D mesh, or
``dp``), with the configuration's ``MixedPrecisionPolicy``.

Two things leave each step besides the full gradients and parameters every
run captures:

* **each rank's local shards** (:func:`local_state`): ``to_local()`` of every
  parameter and gradient, and their placement on every mesh axis (``R``
  replicated, ``S`` sharded, ``P`` partial, ``-`` not a DTensor along that
  axis: each rank holds its own copy), so that replicas can be compared
  along each axis, local shard against local shard;
* **which reductions carry gradients** (:func:`label_gradient_reductions`):
  while a collectives recording is active, the collectives FSDP2 issues in
  its post-backward carry ``grad_of`` (the parameters whose gradients they
  reduce) and ``unit`` (the FSDP module); the ones that redistribute a
  tensor-parallel gradient (``Partial`` → ``Replicate``) carry the one
  parameter's name. Every other reduction is an activation's (or its
  gradient's). This wraps two methods of torch 2.13's FSDP2 internals
  (``FSDPParamGroup.post_backward``, ``FSDPParam._get_grad_inner_tensor``);
  where they do not exist the collectives go unlabelled and the evidence says
  it cannot attribute them.
"""
from __future__ import annotations

import contextlib
import functools

import torch
import torch.distributed as dist

from ddplab.compare.meshes import FSDP2TP, HSDP, TP, MeshConfiguration, resolve_plan
from ddplab.compare.runners import _Trainer, register_trainer
from ddplab.compare.setup import named_trainable

__all__ = ["wrap", "local_state", "placement_of", "label_gradient_reductions"]


# --------------------------------------------------------------------------- which reductions carry gradients


def _labelled(method, labels):
    """``method`` run inside the active recording's ``labelled(**labels(self))`` block."""
    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        from ddplab.collectives import active_recorder

        recorder = active_recorder()
        if recorder is None:
            return method(self, *args, **kwargs)
        with recorder.labelled(**labels(self)):
            return method(self, *args, **kwargs)

    wrapper.ddplab_labelled = True
    return wrapper


def _unit_labels(group) -> dict:
    names = [p._param_fqn or "?" for p in group.fsdp_params]
    return dict(grad_of=",".join(names), unit=group._module_fqn or "(model)")


def label_gradient_reductions() -> bool:
    """Label FSDP2's gradient reductions in this process (idempotent); False where torch lacks the hooks."""
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup
    except ImportError:
        return False
    if not (hasattr(FSDPParamGroup, "post_backward") and hasattr(FSDPParam, "_get_grad_inner_tensor")):
        return False
    if not getattr(FSDPParamGroup.post_backward, "ddplab_labelled", False):
        FSDPParamGroup.post_backward = _labelled(FSDPParamGroup.post_backward, _unit_labels)
    if not getattr(FSDPParam._get_grad_inner_tensor, "ddplab_labelled", False):
        FSDPParam._get_grad_inner_tensor = _labelled(FSDPParam._get_grad_inner_tensor,
                                                     lambda p: dict(grad_of=p._param_fqn or "?"))
    return True


# --------------------------------------------------------------------------- local shards


def placement_of(t: torch.Tensor, axes: tuple[str, ...]) -> dict[str, str]:
    """``{axis: "R" | "S" | "P" | "-"}`` of a tensor on each global mesh axis (``-``: not a DTensor along it)."""
    out = dict.fromkeys(axes, "-")
    mesh = getattr(t, "device_mesh", None)
    if mesh is None:
        return out
    for name, placement in zip(mesh.mesh_dim_names or (), t.placements):
        out[name] = "P" if placement.is_partial() else "R" if placement.is_replicate() else "S"
    return out


def _local(t: torch.Tensor) -> torch.Tensor:
    if hasattr(t, "to_local"):
        t = t.to_local()
    if hasattr(t, "wait"):  # an AsyncCollectiveTensor
        t = t.wait()
    return t.detach().clone()


def local_state(named: list, axes: tuple[str, ...]):
    """``keep()`` for the step's capture: each parameter's and gradient's local shard and placements."""
    def keep() -> dict:
        grads = [(n, p.grad) for n, p in named if p.grad is not None]
        return {"mesh_local": dict(
            params={n: _local(p) for n, p in named},
            grads={n: _local(g) for n, g in grads},
            placements={n: placement_of(p, axes) for n, p in named},
            grad_placements={n: placement_of(g, axes) for n, g in grads})}
    return keep


# --------------------------------------------------------------------------- the wrap


def _shard_units(raw: torch.nn.Module, mesh, config: MeshConfiguration) -> None:
    """``fully_shard`` every module that owns parameters, then the root: the usual layout."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kwargs = dict(mesh=mesh, mp_policy=config.mp_policy or MixedPrecisionPolicy(),
                  reshard_after_forward=config.reshard_after_forward)
    for module in list(raw.modules())[1:]:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, **kwargs)
    fully_shard(raw, **kwargs)


def _skipping(raw, setter: str):
    """A no_sync context: ``raw.<setter>(False)`` inside, True after -- as users write micro-batches."""
    @contextlib.contextmanager
    def no_sync():
        getattr(raw, setter)(False)
        try:
            yield
        finally:
            getattr(raw, setter)(True)
    return no_sync


def wrap(raw: torch.nn.Module, setup, config: MeshConfiguration) -> _Trainer:
    """The mesh, the plan, the sharding, the optimizer: a :class:`~ddplab.compare.runners._Trainer`."""
    from torch.distributed.device_mesh import init_device_mesh

    label_gradient_reductions()
    layout = config.layout()
    if dist.get_world_size() != layout.world:
        raise ValueError(f"{config.label} lays out {layout.world} ranks, the launch has {dist.get_world_size()}")
    mesh = init_device_mesh("cpu", layout.sizes, mesh_dim_names=layout.names)
    if isinstance(config, (TP, FSDP2TP)):
        from torch.distributed.tensor.parallel import parallelize_module
        parallelize_module(raw, mesh["tp"], resolve_plan(config.plan, raw))
    no_sync = contextlib.nullcontext
    if isinstance(config, HSDP):
        _shard_units(raw, mesh, config)
        no_sync = _skipping(raw, "set_requires_all_reduce" if config.no_sync == "all_reduce"
                            else "set_requires_gradient_sync")
    elif isinstance(config, FSDP2TP):
        _shard_units(raw, mesh["dp"], config)
        no_sync = _skipping(raw, "set_requires_gradient_sync")
    named = named_trainable(raw)  # the wrapped parameters, under the reference's names
    optimizer = setup.optimizer(raw.parameters())
    return _Trainer(raw, optimizer, optimizer, lambda loss: loss.backward(), no_sync,
                    keep=local_state(named, layout.names))


register_trainer(MeshConfiguration, wrap)

"""Case 05's parameters made real: the Setup and the configurations that ``module:function`` names.

``setup`` names a function returning a :class:`ddplab.compare.Setup`;
each ``configurations`` entry is a built-in name (:data:`BUILTIN_CONFIGURATIONS`)
or a function returning ddplab.compare configurations. Anything that does
not resolve raises ValueError naming the parameter, before any process starts.
"""
from __future__ import annotations

import importlib

import torch

from ddplab import compare

__all__ = ["BUILTIN_CONFIGURATIONS", "DEFAULT_SETUP", "resolve", "resolve_setup",
           "resolve_configurations", "configuration_entry"]

#: Configuration names the ``configurations`` parameter accepts besides ``module:function``:
#: ``ddp_fp16_compress`` / ``ddp_bf16_compress`` are DDP with torch's compression hook (on gloo,
#: ddplab's stand-in of the same math), ``ddp_sync_batchnorm`` DDP with the setup's BatchNorm
#: layers converted to ddplab's SyncBatchNorm. The mesh ones lay out their own ranks, whatever
#: ``world_size`` says: ``hsdp`` / ``hsdp_bf16`` HSDP on 2 x 2 ranks (k micro-batches under
#: ``set_requires_all_reduce(False)``; bf16: ``param_dtype=bfloat16``), ``tp`` tensor parallel on 2
#: ranks and ``fsdp2_tp`` / ``fsdp2_tp_bf16`` FSDP2 over it on dp=2 x tp=2, with the default plan.
BUILTIN_CONFIGURATIONS = ("ddp", "accumulate", "fabric", "fsdp2", "fsdp2_bf16", "ddp_fp16_compress",
                          "ddp_bf16_compress", "ddp_sync_batchnorm", "hsdp", "hsdp_bf16", "tp", "fsdp2_tp",
                          "fsdp2_tp_bf16")
#: The default setup: the shipped digits example, correct.
DEFAULT_SETUP = "ddplab.compare.examples:digits_setup"


def resolve(path: str, what: str):
    """The object ``module:attribute`` names; called when it is a function (with no arguments)."""
    module_name, sep, attribute = path.partition(":")
    if not sep or not module_name or not attribute:
        raise ValueError(f"{what} must be written module:function (e.g. mypackage.training:setup), got {path!r}")
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        raise ValueError(f"{what} {path!r}: cannot import {module_name!r}: {exc}") from None
    if not hasattr(module, attribute):
        raise ValueError(f"{what} {path!r}: module {module_name!r} has no {attribute!r}")
    obj = getattr(module, attribute)
    if callable(obj) and not isinstance(obj, type):
        if not isinstance(obj, (compare.Setup, compare.Configuration)):
            try:
                obj = obj()
            except Exception as exc:  # noqa: BLE001 - the user's function, named
                raise ValueError(f"{what} {path!r} raised {type(exc).__name__}: {exc}") from exc
            except SystemExit as exc:  # its sys.exit() must not end ddplab (with code 0, silently)
                raise ValueError(f"{what} {path!r} called sys.exit({exc.code!r})") from None
    return obj


def resolve_setup(path: str):
    """The :class:`ddplab.compare.Setup` that parameter ``setup`` names."""
    setup = resolve(path, "parameter 'setup'")
    if not isinstance(setup, compare.Setup):
        raise ValueError(f"parameter 'setup': {path!r} gave a {type(setup).__name__}, not a ddplab.compare.Setup")
    return setup


def resolve_configurations(params: dict) -> list:
    """The configurations parameter ``configurations`` names, built for ``world_size`` and ``k``."""
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.fsdp import MixedPrecisionPolicy

    world, k = params["world_size"], params["k"]
    built = {"ddp": lambda: compare.DDP(world), "accumulate": lambda: compare.Accumulate(world, k=k),
             "fabric": lambda: compare.Fabric(world), "fsdp2": lambda: compare.FSDP2(world),
             "fsdp2_bf16": lambda: compare.FSDP2(world, param_dtype=torch.bfloat16),
             "ddp_fp16_compress": lambda: compare.DDP(world, comm_hook=default_hooks.fp16_compress_hook),
             "ddp_bf16_compress": lambda: compare.DDP(world, comm_hook=default_hooks.bf16_compress_hook),
             "ddp_sync_batchnorm": lambda: compare.DDP(world, sync_batchnorm=True),
             "hsdp": lambda: compare.HSDP(k=k), "tp": lambda: compare.TP(2), "fsdp2_tp": lambda: compare.FSDP2TP(),
             "hsdp_bf16": lambda: compare.HSDP(k=k, mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16)),
             "fsdp2_tp_bf16": lambda: compare.FSDP2TP(mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))}
    out = []
    for name in params["configurations"]:
        if name in built:
            out.append(built[name]())
            continue
        obj = resolve(name, "parameter 'configurations': entry")
        items = obj if isinstance(obj, (list, tuple)) else [obj]
        if not items or not all(isinstance(c, compare.Configuration) for c in items):
            raise ValueError(f"parameter 'configurations': {name!r} must give a ddplab.compare "
                             f"configuration or a list of them, got {type(obj).__name__}")
        out.extend(items)
    try:
        return compare.configurations.check_configurations(out)
    except ValueError as exc:
        raise ValueError(f"parameter 'configurations': {exc}") from None


def configuration_entry(name: str) -> str | None:
    """Why ``name`` cannot be a ``configurations`` entry, or None (the parameter's check)."""
    if name in BUILTIN_CONFIGURATIONS or ":" in name:
        return None
    return f"{name!r} is neither one of {', '.join(BUILTIN_CONFIGURATIONS)} nor module:function"

"""Lightning Fabric inside ddplab's ranks: Fabric adopts the process group ddplab already made.

ddplab starts the ranks and initializes ``torch.distributed`` itself (the
notebook launcher or torchrun). Fabric normally does both; here it must do
neither and use the existing group. Two facts of Lightning make that work:

* a :class:`~lightning.fabric.plugins.environments.ClusterEnvironment` whose
  ``creates_processes_externally`` is True tells ``fabric.launch()`` to start
  no process (:func:`existing_group_environment` reads ranks and sizes from
  ``torch.distributed`` and sets nothing);
* Fabric's ``_init_dist_connection`` returns early when the default process
  group is already initialized, so ``strategy="ddp"`` wraps models in a
  ``DistributedDataParallel`` over ddplab's group.

Inside a rank::

    from ddplab.fabric import ddp_of, fabric_available, make_fabric

    ok, why = fabric_available()          # (True, "2.6.6") or (False, the import error)
    fabric = make_fabric("cpu")            # launched Fabric(strategy="ddp") on this rank
    model, optimizer = fabric.setup(model, optimizer)
    fabric.backward(loss)                  # DDP's reducer all-reduces the gradients
    ddp_of(model)                          # the DistributedDataParallel Fabric built
"""
from __future__ import annotations

import functools

import torch

__all__ = ["fabric_available", "existing_group_environment", "make_fabric", "ddp_of"]


def fabric_available() -> tuple[bool, str]:
    """``(True, lightning's version)`` when Lightning Fabric imports, else ``(False, why not)``."""
    try:
        import lightning
        from lightning.fabric import Fabric  # noqa: F401
    except Exception as exc:  # noqa: BLE001 - any import failure means "no Fabric here", said why
        return False, f"lightning is not importable ({type(exc).__name__}: {exc})"
    return True, lightning.__version__


def _local_layout() -> tuple[int, int]:
    """``(local_rank, local_world_size)`` of this rank: ddplab's rank context, else one machine."""
    import torch.distributed as dist

    from ddplab.rank import current_context

    ctx = current_context()
    if ctx is not None:
        return ctx.local_rank, ctx.local_world_size
    return dist.get_rank(), dist.get_world_size()


@functools.lru_cache(maxsize=None)
def _environment_class():
    # Built on first use: importing Lightning costs seconds, and ddplab works without it.
    import torch.distributed as dist
    from lightning.fabric.plugins.environments import ClusterEnvironment

    class ExistingGroupEnvironment(ClusterEnvironment):
        """Ranks and sizes read from the initialized ``torch.distributed`` group; nothing is set."""

        @property
        def creates_processes_externally(self) -> bool:
            return True

        @property
        def main_address(self) -> str:
            return "127.0.0.1"  # never used: the group exists

        @property
        def main_port(self) -> int:
            return 0

        @staticmethod
        def detect() -> bool:
            return dist.is_available() and dist.is_initialized()

        def world_size(self) -> int:
            return dist.get_world_size()

        def set_world_size(self, size: int) -> None:
            pass  # the group decides

        def global_rank(self) -> int:
            return dist.get_rank()

        def set_global_rank(self, rank: int) -> None:
            pass

        def local_rank(self) -> int:
            return _local_layout()[0]

        def node_rank(self) -> int:
            return self.global_rank() // _local_layout()[1]

    return ExistingGroupEnvironment


def existing_group_environment():
    """A Lightning ``ClusterEnvironment`` that adopts the already-initialized process group."""
    return _environment_class()()


def make_fabric(device: "torch.device | str" = "cpu"):
    """A launched ``Fabric(strategy="ddp")`` on ``device`` (this rank's), in ddplab's process group.

    ``devices`` is the number of ranks on this machine and ``num_nodes`` the
    number of machines, as Fabric expects. Call it inside a rank (every rank
    alike): ValueError when ``torch.distributed`` is not initialized,
    ImportError saying why when Lightning does not import, RuntimeError if
    Fabric's view of the ranks differs from ``torch.distributed``'s.
    """
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("make_fabric runs inside a rank: torch.distributed is not initialized "
                         "(start the ranks with ddplab.launch or torchrun first)")
    ok, why = fabric_available()
    if not ok:
        raise ImportError(why)
    from lightning.fabric import Fabric

    device = torch.device(device)
    local = _local_layout()[1]
    fabric = Fabric(accelerator="cuda" if device.type == "cuda" else "cpu", devices=local,
                    num_nodes=dist.get_world_size() // local, strategy="ddp",
                    plugins=[existing_group_environment()])
    fabric.launch()
    if fabric.world_size != dist.get_world_size() or fabric.global_rank != dist.get_rank():
        raise RuntimeError(f"Fabric sees rank {fabric.global_rank} of {fabric.world_size}, "
                           f"torch.distributed rank {dist.get_rank()} of {dist.get_world_size()}")
    return fabric


def ddp_of(model: torch.nn.Module):
    """The ``DistributedDataParallel`` inside ``model``: a DDP model itself, or the one a
    Fabric module (what ``fabric.setup`` returns) forwards to. ValueError for anything else."""
    from torch.nn.parallel import DistributedDataParallel

    inner = getattr(model, "_forward_module", model)  # Fabric's _FabricModule
    if not isinstance(inner, DistributedDataParallel):
        raise ValueError(f"expected a DDP model or a Fabric module around one, got {type(model).__name__}")
    return inner

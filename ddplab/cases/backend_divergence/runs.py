"""Case 01's runs: which models a launch trains side by side, and how each one reduces.

A *run* is one fresh model from the shared seed, trained in lockstep with the
others of its launch on the same batches; only its gradient reduction
differs. The names below are the ``run`` labels of every record.
"""
from __future__ import annotations

import dataclasses

__all__ = ["EMULATED_ORDERS", "LIVE_NCCL_ORDERS", "LIVE_BOUND_ORDER", "ORDERS", "REFERENCE",
           "REPEAT_SUFFIX", "REVERSED_SUFFIX", "RunSpec", "plan_runs", "launch_groups",
           "base_run", "kind_of"]

#: Orders the order hook emulates (any backend, any device): ddplab.numerics.orders.
EMULATED_ORDERS = ("nccl_ring", "nccl_tree", "exact", "gloo_ring", "sequential", "pairwise")
#: Live NCCL orders: the value of NCCL_ALGO each one runs under.
LIVE_NCCL_ORDERS = {"nccl_live_ring": "Ring", "nccl_live_tree": "Tree"}
#: The emulated order whose rounding bound judges a live NCCL result.
LIVE_BOUND_ORDER = {"nccl_live_ring": "nccl_ring", "nccl_live_tree": "nccl_tree"}
ORDERS = ("gloo",) + EMULATED_ORDERS + tuple(LIVE_NCCL_ORDERS)
#: The reference run every other run is measured against.
REFERENCE = "exact"
REPEAT_SUFFIX = " (repeat)"
REVERSED_SUFFIX = " (reversed ranks)"


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One training run inside a launch.

    ``order`` is what reduces the gradients (one of :data:`ORDERS`, or
    ``"reproducible"``); ``placement`` which shard rank r trains (identity: r;
    reversed: W-1-r); ``emit`` whether it records (a launch that needs the
    exact run only as the reference of its distances keeps it silent). Every
    recording run but the exact reference is audited.
    """

    name: str
    order: str
    placement: str = "identity"
    emit: bool = True

    @property
    def hook(self) -> str:
        """How DDP reduces: "ddp" (no hook: the live backend), "order" or "reproducible"."""
        if self.order in ("gloo", *LIVE_NCCL_ORDERS):
            return "ddp"
        return "reproducible" if self.order == "reproducible" else "order"


def plan_runs(params: dict) -> list[RunSpec]:
    """The runs of the main launch of one world size, the exact reference first."""
    runs = [RunSpec(REFERENCE, REFERENCE)]
    for order in params["orders"]:
        if order == "gloo":
            # The report's observation: the same order twice gives the same bits.
            runs += [RunSpec("gloo", "gloo"), RunSpec("gloo" + REPEAT_SUFFIX, "gloo")]
        elif order in EMULATED_ORDERS and order != REFERENCE:
            runs.append(RunSpec(order, order))
    if params["reproducible"]:
        runs += [RunSpec("reproducible", "reproducible"),
                 RunSpec("reproducible" + REVERSED_SUFFIX, "reproducible", placement="reversed")]
        if "gloo" in params["orders"]:
            # The control: the same placement change does change plain gloo's bits (W > 2).
            runs.append(RunSpec("gloo" + REVERSED_SUFFIX, "gloo", placement="reversed"))
    return runs


def launch_groups(params: dict) -> list[tuple[list[RunSpec], dict[str, str]]]:
    """``(runs, extra environment)`` of every launch one world size needs.

    The main launch runs everything but live NCCL; each live NCCL order gets
    a launch of its own under its NCCL_ALGO (NCCL reads it when it creates a
    communicator), with a silent exact run as the reference of its distances.
    """
    groups = [(plan_runs(params), {})]
    for order in params["orders"]:
        if order in LIVE_NCCL_ORDERS:
            groups.append(([RunSpec(REFERENCE, REFERENCE, emit=False), RunSpec(order, order)],
                           {"NCCL_ALGO": LIVE_NCCL_ORDERS[order]}))
    if params["backend"] == "nccl":
        # Deterministic cuBLAS needs a fixed workspace (the report set the same).
        for _, env in groups:
            env["CUBLAS_WORKSPACE_CONFIG"] = ":4096:8"
    return groups


def base_run(run: str) -> str:
    """The order a run name stands for, without its repeat/placement suffix."""
    for suffix in (REPEAT_SUFFIX, REVERSED_SUFFIX):
        if run.endswith(suffix):
            return run[: -len(suffix)]
    return run


def kind_of(run: str) -> str:
    """"reproducible", "repeat", "placement" (re-placed shards) or "order"."""
    if run.startswith("reproducible"):
        return "reproducible"
    if run.endswith(REPEAT_SUFFIX):
        return "repeat"
    return "placement" if run.endswith(REVERSED_SUFFIX) else "order"

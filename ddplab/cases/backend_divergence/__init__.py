"""Case 01 — "NCCL and Gloo give different training losses with 4 workers, identical with 2".

The report trains a ResNet-50 on CIFAR-10 in float64 with DDP: the same
seeded initialization on every rank, ``DistributedSampler(shuffle=False)``,
``drop_last=True``, deterministic algorithms, the loss all-reduced (SUM,
then /W) for the log, 20 mini-batches. Each backend reproduces its own
losses bit for bit; the two agree bit for bit with 2 workers and drift apart
with 4. Which one is correct?

This case trains the same way and swaps *only the gradient reduction*. Per
world size W, one launch of W ranks trains one fresh model per *run* on the
same batches, in lockstep (:mod:`.runs`, :mod:`.worker`):

``exact``
    :func:`ddplab.comm_hooks.order_hook` with the correctly rounded mean: the
    reference every other run is measured against;
``gloo`` and ``gloo (repeat)``
    the live backend with DDP's own reduction (scale by 1/W, then SUM);
``nccl_ring``, ``nccl_tree`` (and ``gloo_ring``, ``sequential``, ``pairwise``)
    what those orders compute, bit for bit where the emulation is exact
    (NCCL's tree is an approximation);
``reproducible``, ``reproducible (reversed ranks)``, ``gloo (reversed ranks)``
    :func:`ddplab.comm_hooks.reproducible_hook` with rank r training shard r,
    and with rank r training shard W-1-r (the ring meets the shards in
    another order); the same change under plain gloo is the control;
``nccl_live_ring``, ``nccl_live_tree`` (``backend="nccl"``, GPUs only)
    live NCCL under ``NCCL_ALGO=Ring`` / ``Tree``, a launch each.

Every reduction but the reference's is wrapped in :func:`ddplab.comm_hooks.audit_hook`, which
returns the inner result unchanged and measures each bucket against the
correctly rounded mean of the same contributions (``max_ulp``, ``mean_ulp``,
``frac_correctly_rounded``, ``max_bound_ratio``, ``matches_order``, ...).

Records per run and step (rank 0 unless noted; labels ``world_size``,
``run``, ``order``, ``hook``, ``placement``, ``dtype``): ``loss`` (the
report's logged loss, before the update), ``local_loss`` (every rank, label
``shard``), ``grad_norm``, ``param_distance`` and ``param_max_ulp`` (from
the exact run's parameters after the update), ``gloo_distance`` (from live
gloo's) and ``param_digest`` (equal digests: bitwise equal parameters).
"""
from __future__ import annotations

import math

from ddplab.cases.backend_divergence import figures, verdict, worker
from ddplab.cases.backend_divergence.verdict import loss_gaps
from ddplab.cases.backend_divergence.runs import EMULATED_ORDERS, LIVE_NCCL_ORDERS, ORDERS, REFERENCE, launch_groups
from ddplab.cases.backend_divergence.worker import DTYPES
from ddplab.cases.base import Case, LaunchPlan
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "BackendDivergence"]


def _positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


def _has_reference(orders) -> str | None:
    if REFERENCE not in orders:
        return f"must include {REFERENCE!r}: every order is measured against the exact reduction"
    return None


class BackendDivergence(Case):
    name = "backend_divergence"
    title = "NCCL vs Gloo: different losses with 4 workers, identical with 2 -- which one is correct?"
    notebook = "01_backend_divergence.ipynb"
    reproduces = "backend_divergence"
    parameters = ParameterSet([
        Parameter("world_sizes", [2, 4], "numbers of ranks to compare (the report: 2 and 4 GPUs)",
                  kind="list[int]", minimum=2, maximum=64, role="world_size"),
        Parameter("orders", ["gloo", "nccl_ring", "nccl_tree", "exact"],
                  "gloo (live backend); emulated: nccl_ring, nccl_tree, exact (the reference), "
                  "gloo_ring, sequential, pairwise; live NCCL (backend nccl): nccl_live_ring, nccl_live_tree",
                  kind="list[str]", choices=ORDERS, check=_has_reference),
        Parameter("dtype", "float64", "dtype of model, data and gradients (the report: float64)",
                  choices=tuple(DTYPES)),
        Parameter("steps", 20, "training steps per run (the report printed 20 mini-batches)",
                  kind="int", minimum=1, role="steps"),
        Parameter("batch_size", 32, "mini-batch per rank (the report: 32)", kind="int", minimum=1),
        Parameter("lr", 0.1, "SGD learning rate (the report: 0.1)", kind="float", check=_positive),
        Parameter("model", "resnet", "resnet (small, CPU) or resnet50 (as the report, for GPUs)",
                  choices=("resnet", "resnet50")),
        Parameter("norm", "batch", "normalization layers: batch (as the report) or group",
                  choices=("batch", "group")),
        Parameter("data", "digits", "digits (embedded) or cifar10 (needs data_root)",
                  choices=("digits", "cifar10")),
        Parameter("data_root", None, "folder with the CIFAR-10 python batches (for data cifar10)",
                  kind="path", nullable=True),
        Parameter("seed", 0, "seed of the initialization every rank and run shares", kind="int",
                  minimum=0),
        Parameter("backend", "gloo", "gloo (CPU) or nccl (one GPU per rank)", choices=("gloo", "nccl"),
                  role="backend"),
        # Every 4th: the audit of every step is a fifth of the case's time on 2 cores, and steps
        # 0, 4, ... already hold hundreds of buckets; the parameter digests cover every step.
        Parameter("audit_every", 4, "audit every run's reduction at steps 0, k, 2k, ... (1: every step)",
                  kind="int", minimum=1),
        Parameter("bucket_cap_mb", 0.1, "DDP bucket size in MiB (small: several buckets to audit)",
                  kind="float", check=_positive),
        Parameter("reproducible", True, "also run the reproducible hook under two rank placements",
                  kind="bool"),
        Parameter("timeout", 600.0, "seconds before a launch is declared hung", kind="float",
                  check=_positive),
    ])
    #: Seconds, not minutes: ``ddplab report --quick`` and the notebook test.
    quick = {"steps": 4}
    figures_by_name = {"param_distance": figures.plot_param_distance, "loss_gap": figures.plot_loss_gap,
                       "bucket_errors": figures.plot_bucket_errors, "loss_curves": figures.plot_loss_curves,
                       "grad_norms": figures.plot_grad_norms}
    key_figure = "param_distance"
    tables_by_name = {"loss_gaps": loss_gaps}
    run_label = "run"
    worker = worker.worker                  # kwargs runs: the runs one launch trains
    verdict = verdict.verdict

    def check(self, params: dict) -> None:
        """Live NCCL needs backend nccl and GPUs; CIFAR-10 needs its folder; a batch must fit a shard."""
        live = [o for o in params["orders"] if o in LIVE_NCCL_ORDERS]
        if live and params["backend"] != "nccl":
            raise ValueError(f"parameter 'orders': {', '.join(live)} run the live NCCL backend and "
                             f"need backend='nccl' (GPUs); on CPU use the emulated {', '.join(EMULATED_ORDERS)}")
        if params["backend"] == "nccl":
            from ddplab.rank import check_backend
            try:
                check_backend("nccl", max(params["world_sizes"]))
            except ValueError as exc:
                raise ValueError(f"parameter 'backend': {exc}") from None
        if params["data"] == "cifar10":
            from ddplab.datasets import check_cifar10
            if params["data_root"] is None:
                raise ValueError("parameter 'data_root': data='cifar10' needs the folder holding the "
                                 "CIFAR-10 python batches (data_batch_1..5); see data/README.md")
            try:
                check_cifar10(params["data_root"])
            except FileNotFoundError as exc:
                raise ValueError(f"parameter 'data_root': {exc}") from None
            samples = 50_000
        elif params["data_root"] is not None:
            raise ValueError("parameter 'data_root': only read with data='cifar10' "
                             f"(data={params['data']!r}); leave it None")
        else:
            samples = 1797
        for w in params["world_sizes"]:
            # DistributedSampler pads to a multiple of W; drop_last drops a partial batch.
            if math.ceil(samples / w) < params["batch_size"]:
                raise ValueError(f"parameter 'batch_size': {params['batch_size']} is more than the "
                                 f"{math.ceil(samples / w)} samples each of {w} ranks holds "
                                 f"(data={params['data']!r})")

    def launches(self, params: dict) -> list[LaunchPlan]:
        """Per world size, the main launch, then one per live NCCL order (under its NCCL_ALGO)."""
        return [LaunchPlan(world_size=w, backend=params["backend"], kwargs={"runs": runs}, env=dict(env),
                           label=f"W={w}" + (f" NCCL_ALGO={env['NCCL_ALGO']}" if "NCCL_ALGO" in env else ""),
                           steps=params["steps"], timeout=params["timeout"])
                for w in params["world_sizes"] for runs, env in launch_groups(params)]


CASE = BackendDivergence()

"""Case 03 — "moving a DDP model to CPU and back silently stops gradient sync".

The report wraps the ToyModel (``Linear(10, 10)``, ReLU, ``Linear(10, 5)``)
with Lightning Fabric (``strategy="ddp"``) or plain DDP, moves the *wrapped*
model to the CPU and back to the GPU, runs a step on different data per rank
and finds, with an ``all_gather`` of the gradients and ``torch.allclose``,
that the gradients differ across ranks: no error, no warning, each rank
trains alone. A maintainer traced it to DDP, not Fabric.

Why (measured and explained in :mod:`ddplab.probes`): DDP's reducer puts its
autograd hooks on each parameter's gradient accumulator when the model is
wrapped. ``.cpu()``, ``.cuda()``, ``.double()`` and ``.float()`` assign
``param.data``; torch drops the cached accumulator when the dtype or device
changes, and the next forward creates a new one *without* the reducer's
hook. The round trip restores dtype and device but not the hooks, so no
bucket is reduced again. ``.double()`` then ``.float()`` does the same on a
CPU; the report's own ``.cpu()``/``.cuda()`` runs when every rank has a GPU
and is otherwise skipped with a note. Fabric runs inside ddplab's ranks
through :mod:`ddplab.fabric`.

One launch trains, one after the other, a fresh ToyModel per configuration:
framework (``ddp``, ``fabric``) × round trip (``none``, ``dtype``,
``device``) × variant (``as reported``; for a round trip also
``re-wrapped``, the fix). Records per configuration (labels ``framework``,
``roundtrip``, ``variant``, ``config``), per step and rank: ``loss``;
``grad_bitwise_equal`` and ``grad_max_abs_diff`` (label ``param``; this
rank's gradient against rank 0's); ``report_allclose`` (the report's check,
1 passes); ``buckets_reduced`` (buckets DDP's reducer handed to its comm
hook in this backward); ``weight_distance`` and ``weight_max_abs_diff``
(against rank 0's weights, after the update); ``detector_alarm`` (labels
``when``, ``params``, ``message``: the detached-reducer guard raised). Once
per configuration: ``roundtrip_applied`` (dtype and device before and after),
``detector_alarms``, ``steps_completed``, ``training_warnings``. Rank 0
emits ``configuration_skipped`` (labels ``cause``, ``reason``) and
``fabric_version``.
"""
from __future__ import annotations

from ddplab.cases.base import Case, LaunchPlan
from ddplab.cases.device_roundtrip import figures, verdict, worker
from ddplab.cases.device_roundtrip.worker import FRAMEWORKS, ROUNDTRIPS, plan_backend
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "DeviceRoundtrip"]

#: Seconds before the launch is declared hung (importing Lightning takes several on 2 busy cores).
LAUNCH_TIMEOUT = 240.0


class DeviceRoundtrip(Case):
    name = "device_roundtrip"
    title = "Device round trip: moving a wrapped DDP model away and back silently stops gradient sync"
    notebook = "03_device_roundtrip.ipynb"
    reproduces = "device_roundtrip"
    parameters = ParameterSet([
        Parameter("world_size", 2, "number of ranks (processes); the report used 2 GPUs",
                  kind="int", minimum=2, maximum=8, role="world_size"),
        Parameter("roundtrip", list(ROUNDTRIPS),
                  "round trips after wrapping: none (control), dtype (.double() then .float(), "
                  "runs on CPU), device (.cpu() then .cuda(), the report's, needs a GPU per rank)",
                  kind="list[str]", choices=ROUNDTRIPS),
        Parameter("framework", list(FRAMEWORKS), "ddp (torch DistributedDataParallel) and/or "
                  "fabric (Lightning Fabric with its ddp strategy)", kind="list[str]",
                  choices=FRAMEWORKS),
        Parameter("steps", 20, "SGD steps per configuration", kind="int", minimum=1, maximum=1000,
                  role="steps"),
        Parameter("roundtrip_step", 5, "the round trip happens before this step "
                  "(0: right after wrapping, as in the report)", kind="int", minimum=0),
        Parameter("seed", 0, "seed of the shared initial weights and of each rank's data",
                  kind="int", minimum=0, maximum=2**31 - 1),
    ])
    #: Seconds: the control and the CPU round trip, both frameworks, a few steps.
    quick = {"roundtrip": ["none", "dtype"], "steps": 6, "roundtrip_step": 2}
    figures_by_name = {"timeline": figures.plot_timeline, "grad_diff": figures.plot_grad_diff,
                       "weight_distance": figures.plot_weight_distance,
                       "loss_gap": figures.plot_loss_gap, "loss": figures.plot_loss}
    key_figure = "timeline"
    tables_by_name = {"skipped": figures.skipped_markdown, "alarms": figures.alarms_markdown,
                      "summary": figures.summary_table, "alarm_log": figures.alarms_table,
                      "loss_gaps": figures.loss_gap_table}
    run_label = "config"
    worker = worker.worker
    verdict = verdict.verdict

    def check(self, params: dict) -> None:
        """The round trip must happen during training: ``roundtrip_step < steps``."""
        if params["roundtrip_step"] >= params["steps"]:
            raise ValueError(f"parameter 'roundtrip_step': {params['roundtrip_step']} is not before "
                             f"the last of the {params['steps']} steps; it accepts 0 to "
                             f"{params['steps'] - 1}")

    def launches(self, params: dict) -> list[LaunchPlan]:
        # No launcher bar (steps=None): every configuration restarts at step 0, so one bar per
        # launch would be full after the first; the explorer draws one per configuration
        # (run_label) with progress_total steps each.
        return [LaunchPlan(world_size=params["world_size"], backend=plan_backend(params),
                           label=f"W={params['world_size']}", timeout=LAUNCH_TIMEOUT)]

    def progress_total(self, params: dict) -> int:
        return params["steps"]


CASE = DeviceRoundtrip()

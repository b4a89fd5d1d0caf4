"""Case 05 — your training: a distributed run against a single-process reference, rounding or bug?

The reports users bring most: "my DDP run's gradients differ from one GPU",
"accumulation with no_sync gives a different model than a big batch",
"FSDP in bf16 diverges at more ranks". This case runs the user's own
training (a :class:`ddplab.compare.Setup` named by ``module:function``)
under the configurations asked for and compares every step's gradient and
updated parameters with the single-process reference, judged against a
float64 truth (:mod:`ddplab.compare`)::

    ddplab report your_training -p setup mypackage.module:function

Each launch is its own: the reference runs (one process), then each
configuration on its W ranks; :meth:`YourTraining.run` drives them through
:func:`ddplab.compare.run` and returns its tidy records. Under torchrun the
case does not run (it needs launches of different sizes).
"""
from __future__ import annotations

from ddplab import compare
from ddplab.cases.base import Case, LaunchPlan
from ddplab.cases.your_training import figures
from ddplab.cases.your_training.configure import (BUILTIN_CONFIGURATIONS, DEFAULT_SETUP,
                                                  configuration_entry, resolve_configurations,
                                                  resolve_setup)
from ddplab.compare.setup import check_setup, global_batches
from ddplab.compare.verdicts import comparison_verdict, verdicts_markdown
from ddplab.launcher import LaunchResult, LaunchStopped
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "YourTraining", "BUILTIN_CONFIGURATIONS", "resolve_setup", "resolve_configurations"]


def refuse_torchrun(params: dict, **kwargs):
    """The worker torchrun would start: this case's launches differ in size, so it refuses."""
    raise ValueError("your_training runs several launches of different sizes (the reference in one "
                     "process, each configuration on its own ranks); run it with `ddplab report "
                     "your_training` or ddplab.compare.run, not under torchrun")


def verdict(records, params: dict):
    """The comparison's verdict (:func:`ddplab.compare.verdicts.comparison_verdict`); the records say it all."""
    return comparison_verdict(records, case="your_training")


class YourTraining(Case):
    name = "your_training"
    title = "Your training: a distributed run against a single-process reference, rounding or bug?"
    notebook = "05_your_training.ipynb"
    reproduces = None
    parameters = ParameterSet([
        Parameter("setup", DEFAULT_SETUP,
                  "module:function returning a ddplab.compare.Setup (model, batches, loss, optimizer); "
                  "the default is the shipped digits example", kind="str"),
        Parameter("configurations", ["ddp", "accumulate", "fabric", "fsdp2", "fsdp2_bf16"],
                  "what to compare with the reference: " + ", ".join(BUILTIN_CONFIGURATIONS) +
                  ", or module:function returning ddplab.compare configurations (e.g. a Custom step)",
                  kind="list[str]", check=lambda names: next(filter(None, map(configuration_entry, names)), None)),
        Parameter("world_size", 2, "ranks of the built-in configurations", kind="int", minimum=1, maximum=8,
                  role="world_size"),
        Parameter("k", 4, "micro-batches per rank of 'accumulate', 'hsdp' and 'hsdp_bf16'", kind="int", minimum=2, maximum=64),
        Parameter("steps", 0, "steps to compare (0: every batch of the setup)", kind="int", minimum=0),
        Parameter("timeout", 300.0, "seconds a launch may take before it counts as hung", kind="float",
                  minimum=1),
        Parameter("own_code_demo", True, "also run the shipped Custom steps that show the evidence needing no "
                  "specification (twin, float64, approximation)", kind="bool"),
    ])
    quick = {"configurations": ["ddp", "accumulate", "fsdp2_bf16"], "steps": 3, "own_code_demo": False}
    figures_by_name = {"deviation": figures.plot_deviation, "loss": figures.plot_loss,
                       "grad_norm": figures.plot_grad_norm, "heatmap": figures.plot_heatmap,
                       "finding": figures.plot_finding}
    key_figure = "deviation"
    tables_by_name = {"verdicts": verdicts_markdown}
    run_label = "config"
    worker = refuse_torchrun
    verdict = verdict

    def check(self, params: dict) -> None:
        """The setup resolves to a usable Setup and the configurations build and fit its batches."""
        setup = resolve_setup(params["setup"])
        configs = resolve_configurations(params)
        try:
            check_setup(setup, steps=params["steps"] or None, divisors={c.label: c.pieces for c in configs})
        except ValueError as exc:
            raise ValueError(f"parameter 'setup': {exc}") from None

    def params_as_run(self, params: dict, records) -> dict:
        """``steps = 0`` (every batch of the setup) as the number of steps the run compared."""
        ran = dict(params)
        if not params["steps"] and "step" in records.columns and records["step"].notna().any():
            ran["steps"] = int(records["step"].max()) + 1
        return ran

    def launches(self, params: dict) -> list[LaunchPlan]:
        # What runs (for the environment block): the reference runs in one process, then
        # each configuration on its ranks. run() performs them through ddplab.compare.
        plans = [LaunchPlan(world_size=1, label="reference", timeout=params["timeout"])]
        plans += [LaunchPlan(world_size=c.world_size, label=c.label, timeout=c.timeout or params["timeout"])
                  for c in resolve_configurations(params)]
        return plans

    def progress_total(self, params: dict) -> int:
        if params["steps"]:
            return params["steps"]
        return len(global_batches(resolve_setup(params["setup"])))

    def run(self, params, *, progress: bool = True):
        """Validate, compare (:func:`ddplab.compare.run`), return the tidy records.

        A stopped comparison raises :class:`~ddplab.launcher.LaunchStopped`
        carrying every record so far (as a stopped launch does).
        """
        params = self.check_params(params)
        result = compare.run(resolve_setup(params["setup"]), resolve_configurations(params),
                             steps=params["steps"] or None, timeout=params["timeout"], progress=progress)
        if result.stopped:
            rows = result.records.astype(object).where(result.records.notna(), None).to_dict("records")
            partial = LaunchResult(world_size=1, backend="gloo", returns=[], stdout=[], stderr=[],
                                   wall_time=result.wall_time, exitcodes=[], record_list=rows)
            raise LaunchStopped("your_training: the comparison was stopped on request", partial)
        return result.records


CASE = YourTraining()

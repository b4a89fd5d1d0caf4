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

import importlib

import torch

from ddplab.cases.base import Case, LaunchPlan
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "YourTraining", "BUILTIN_CONFIGURATIONS", "resolve", "resolve_setup",
           "resolve_configurations"]

#: Configuration names the ``configurations`` parameter accepts besides ``module:function``.
BUILTIN_CONFIGURATIONS = ("ddp", "accumulate", "fabric", "fsdp2", "fsdp2_bf16")
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
        from ddplab.compare import Configuration, Setup
        if not isinstance(obj, (Setup, Configuration)):
            try:
                obj = obj()
            except Exception as exc:  # noqa: BLE001 - the user's function, named
                raise ValueError(f"{what} {path!r} raised {type(exc).__name__}: {exc}") from exc
    return obj


def resolve_setup(path: str):
    """The :class:`ddplab.compare.Setup` that parameter ``setup`` names."""
    from ddplab.compare import Setup

    setup = resolve(path, "parameter 'setup'")
    if not isinstance(setup, Setup):
        raise ValueError(f"parameter 'setup': {path!r} gave a {type(setup).__name__}, not a ddplab.compare.Setup")
    return setup


def resolve_configurations(params: dict) -> list:
    """The configurations parameter ``configurations`` names, built for ``world_size`` and ``k``."""
    from ddplab import compare

    world, k = params["world_size"], params["k"]
    built = {"ddp": lambda: compare.DDP(world), "accumulate": lambda: compare.Accumulate(world, k=k),
             "fabric": lambda: compare.Fabric(world), "fsdp2": lambda: compare.FSDP2(world),
             "fsdp2_bf16": lambda: compare.FSDP2(world, param_dtype=torch.bfloat16)}
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


def _configuration_entry(name: str) -> str | None:
    if name in BUILTIN_CONFIGURATIONS or ":" in name:
        return None
    return f"{name!r} is neither one of {', '.join(BUILTIN_CONFIGURATIONS)} nor module:function"


# --------------------------------------------------------------------------- figures (records, params, ax)


def _first_diverged(records) -> str | None:
    from ddplab.records import where

    rows = where(records, "first_divergence")
    return None if rows.empty else str(rows.iloc[0]["config"])


def plot_deviation(records, params, ax=None):
    """Each configuration's largest deviation per step, in multiples of its rounding band."""
    from ddplab.compare import figures
    return figures.deviation_over_steps(records, ax=ax)


def plot_loss(records, params, ax=None):
    """The loss per step of every configuration, the reference and the float64 truth."""
    from ddplab.compare import figures
    return figures.loss_curves(records, ax=ax)


def plot_grad_norm(records, params, ax=None):
    """The gradient norm at optimizer.step() per step."""
    from ddplab.compare import figures
    return figures.grad_norms(records, ax=ax)


def plot_heatmap(records, params, ax=None):
    """Step × parameter deviation of the first configuration that leaves the band (else the first)."""
    from ddplab.compare import figures
    from ddplab.compare.verdicts import configurations_in

    config = _first_diverged(records) or configurations_in(records)[0]
    return figures.deviation_heatmap(records, config, ax=ax)


def plot_finding(records, params, ax=None):
    """The finding of the first configuration that leaves the band, shown on its gradient elements."""
    from ddplab.compare import figures
    from ddplab.plots import own_axes

    config = _first_diverged(records)
    if config is not None:
        return figures.finding_figure(records, config, ax=ax)
    fig, ax = own_axes(ax)
    ax.text(0.5, 0.5, "no configuration left the rounding band:\nnothing to localize",
            ha="center", va="center", transform=ax.transAxes)
    ax.set_axis_off()
    return fig


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
                  kind="list[str]", check=lambda names: next(filter(None, map(_configuration_entry, names)), None)),
        Parameter("world_size", 2, "ranks of the built-in configurations", kind="int", minimum=1, maximum=8),
        Parameter("k", 4, "micro-batches per rank of 'accumulate'", kind="int", minimum=2, maximum=64),
        Parameter("steps", 0, "steps to compare (0: every batch of the setup)", kind="int", minimum=0),
        Parameter("timeout", 300.0, "seconds a launch may take before it counts as hung", kind="float",
                  minimum=1),
    ])
    quick = {"configurations": ["ddp", "accumulate", "fsdp2_bf16"], "steps": 3}
    figures_by_name = {"deviation": plot_deviation, "loss": plot_loss, "grad_norm": plot_grad_norm,
                       "heatmap": plot_heatmap, "finding": plot_finding}
    key_figure = "deviation"
    run_label = "config"

    def check(self, params: dict) -> None:
        """The setup resolves to a usable Setup and the configurations build and fit its batches."""
        from ddplab.compare.setup import check_setup

        setup = resolve_setup(params["setup"])
        configs = resolve_configurations(params)
        try:
            check_setup(setup, steps=params["steps"] or None, divisors={c.label: c.pieces for c in configs})
        except ValueError as exc:
            raise ValueError(f"parameter 'setup': {exc}") from None

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
        from ddplab.compare.setup import global_batches
        return len(global_batches(resolve_setup(params["setup"])))

    def worker(self, params: dict, **kwargs):
        raise ValueError("your_training runs several launches of different sizes (the reference in one "
                         "process, each configuration on its own ranks); run it with `ddplab report "
                         "your_training` or ddplab.compare.run, not under torchrun")

    def run(self, params, *, progress: bool = True):
        """Validate, compare (:func:`ddplab.compare.run`), return the tidy records.

        A stopped comparison raises :class:`~ddplab.launcher.LaunchStopped`
        carrying every record so far (as a stopped launch does).
        """
        from ddplab import compare
        from ddplab.launcher import LaunchResult, LaunchStopped

        params = self.check_params(params)
        result = compare.run(resolve_setup(params["setup"]), resolve_configurations(params),
                             steps=params["steps"] or None, timeout=params["timeout"], progress=progress)
        if result.stopped:
            rows = result.records.astype(object).where(result.records.notna(), None).to_dict("records")
            partial = LaunchResult(world_size=1, backend="gloo", returns=[], stdout=[], stderr=[],
                                   wall_time=result.wall_time, exitcodes=[], record_list=rows)
            raise LaunchStopped("your_training: the comparison was stopped on request", partial)
        return result.records

    def verdict(self, records, params: dict):
        from ddplab.compare.verdicts import comparison_verdict
        return comparison_verdict(records, case=self.name)

    @staticmethod
    def verdicts_markdown(records) -> str:
        """One row per configuration: verdict, largest deviation, first divergence, finding."""
        from ddplab.compare.verdicts import verdicts_markdown
        return verdicts_markdown(records)


CASE = YourTraining()

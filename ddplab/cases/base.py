"""The Case base: what every case shares, so that a case is only its own logic.

A case reproduces one report, and is declarations: its parameters
(:class:`~ddplab.parameters.ParameterSet`), what each rank runs
(``worker``), how many launches it needs (:meth:`Case.launches`), and how
the tidy records become a :class:`~ddplab.verdict.Verdict` (``verdict``),
figures and tables, by name. Everything else -- validation before anything starts, launching
with progress and timing, the environment block, torchrun's world size, the
notebook file -- lives here, and the notebook helper, ``ddplab report``, the
explorer and torchrun use only this interface.

Example (a complete case; see the README's "Add a case")::

    class Allreduce(Case):
        name = "my_allreduce"
        title = "Does all_reduce sum?"
        parameters = ParameterSet([Parameter("world_size", 2, "ranks", kind="int", minimum=1,
                                             role="world_size")])
        figures_by_name = {"sums": plot_sums}     # fn(records, params, ax=None) -> Figure
        worker = rank_main                        # fn(params): every rank, reports with emit
        verdict = judge                           # fn(records, params) -> Verdict

    CASE = Allreduce()
"""
from __future__ import annotations

import dataclasses
import inspect
import pathlib
import time
from typing import Any, Callable, ClassVar, Mapping

from ddplab.parameters import ParameterSet
from ddplab.verdict import Verdict

__all__ = ["Case", "LaunchPlan", "BUILTIN_NOTEBOOK_DIR"]

#: Where the built-in cases' notebooks live.
BUILTIN_NOTEBOOK_DIR = pathlib.Path(__file__).resolve().parent.parent / "notebooks"

#: Launch timeout (s) when a case's plan does not set one.
DEFAULT_LAUNCH_TIMEOUT = 300.0


@dataclasses.dataclass
class LaunchPlan:
    """One launch of a case: ``world_size`` ranks on ``backend``.

    ``kwargs`` go to the worker besides the parameters; ``env`` to the ranks'
    environment (e.g. ``NCCL_ALGO``); ``label`` names the launch on progress
    bars and in its ``launch_seconds`` record; ``steps`` is how many steps
    rank 0 reports (``step`` of its records), for progress.
    """

    world_size: int
    backend: str = "gloo"
    kwargs: dict = dataclasses.field(default_factory=dict)
    env: dict = dataclasses.field(default_factory=dict)
    label: str = ""
    steps: int | None = None
    timeout: float = DEFAULT_LAUNCH_TIMEOUT


class Case:
    """Base class of every case; a case module exposes one instance as ``CASE``.

    Class attributes a case sets: ``name``, ``title``, ``parameters``,
    ``notebook`` (file name, ``<name>.ipynb`` by default: built-in cases in
    the package's notebooks folder, others next to their module), ``quick``
    (overrides that make a run take seconds), ``reproduces`` (the reproduced report's id in
    :mod:`ddplab.reproduced`, or None for a case of one's own),
    ``figures_by_name`` (``{name: fn(records, params, ax=None) -> Figure}``,
    most telling first), ``key_figure`` (the one an issue thread shows),
    ``tables_by_name`` (``{name: fn(records[, params]) -> DataFrame or
    Markdown text}``, the tables a notebook shows beside the figures),
    ``run_label`` (the record label that names a run inside a launch, for
    one progress bar per run), and two functions: ``worker`` (what every
    rank runs, ``fn(params, **plan.kwargs)``) and ``verdict`` (``fn(records,
    params) -> Verdict``). A function assigned there (``worker = rank_main``)
    is called as it is; a method written in the class body stays a method.

    Methods a case overrides where the defaults do not fit: :meth:`check`
    (rules tying parameters together) and :meth:`launches`.
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    notebook: ClassVar[str] = ""
    parameters: ClassVar[ParameterSet] = ParameterSet([])
    quick: ClassVar[dict] = {}
    reproduces: ClassVar[str | None] = None
    figures_by_name: ClassVar[Mapping[str, Callable]] = {}
    key_figure: ClassVar[str | None] = None
    tables_by_name: ClassVar[Mapping[str, Callable]] = {}
    run_label: ClassVar[str | None] = None

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        for attribute in ("worker", "verdict"):
            fn = cls.__dict__.get(attribute)
            # Declared as a plain function: no self to bind (a rank pickles it by reference).
            if inspect.isfunction(fn) and not fn.__qualname__.startswith(f"{cls.__qualname__}."):
                setattr(cls, attribute, staticmethod(fn))
        if cls.key_figure is not None and cls.key_figure not in cls.figures_by_name:
            raise TypeError(f"case {cls.__name__}: key_figure {cls.key_figure!r} is not in figures_by_name")

    def __repr__(self) -> str:
        return f"<case {self.name}: {self.title}>"

    # -- parameters ------------------------------------------------------------------

    def check(self, params: dict) -> None:
        """Rules that tie parameters together; raise ValueError naming the parameter."""

    def check_params(self, values: Mapping[str, Any] | None = None) -> dict:
        """The full parameters: defaults updated by ``values``, each parsed and checked.

        Everything that starts a case calls this first, so bad input is
        refused (ValueError naming the parameter) before any process starts.
        """
        params = self.parameters.validate(dict(values or {}))
        self.check(params)
        return params

    def for_world_size(self, params: dict, world_size: int, overridden: Mapping[str, Any] = ()) -> dict:
        """``params`` for a job of ``world_size`` ranks (torchrun: the job's size decides).

        The parameter with the role ``world_size`` (an int, or a list of one)
        is set from the job, or refused when the user set it to something else.
        """
        params = dict(params)
        p = self.parameters.with_role("world_size")
        if p is not None:
            value = [world_size] if p.kind.startswith("list[") else world_size
            if p.name in overridden and params.get(p.name) != value:
                raise ValueError(f"parameter {p.name!r} = {params.get(p.name)!r}, but this job has "
                                 f"{world_size} ranks; drop -p {p.name} (the job's size decides it)")
            params[p.name] = value
        return self.check_params(params)

    def params_as_run(self, params: dict, records) -> dict:
        """``params`` as the run used them: where a value stands for another (a sentinel such as
        ``steps = 0``, "every batch"), the value it stood for, read from the run's ``records``.
        Reports show these, and the given value beside a changed one."""
        return dict(params)

    # -- running ---------------------------------------------------------------------

    def launches(self, params: dict) -> list[LaunchPlan]:
        """The launches one run needs; by default one per size of the ``world_size`` role (2
        without one), on the ``backend`` role's backend (gloo), reporting the ``steps`` role's steps."""
        role = self.parameters.role_value
        sizes = role(params, "world_size", 2)
        return [LaunchPlan(world_size=int(w), backend=role(params, "backend", "gloo"),
                           steps=role(params, "steps"), label=f"W={w}")
                for w in (sizes if isinstance(sizes, list) else [sizes])]

    def worker(self, params: dict, **kwargs) -> Any:
        """What every rank runs (torch.distributed is initialized); reports with :func:`ddplab.emit`.

        A case declares it: ``worker = rank_main``.
        """
        raise NotImplementedError(f"case {self.name!r} defines no worker")

    def progress_total(self, params: dict) -> int:
        """Steps a run reports, for progress bars (at least 1)."""
        return max([plan.steps or 1 for plan in self.launches(params)] + [1])

    def run(self, params: Mapping[str, Any], *, progress: bool = True):
        """Validate ``params``, run every planned launch, return the tidy records.

        Each launch adds a ``launch_seconds`` record. A failing launch raises
        its :class:`~ddplab.launcher.LaunchError` carrying the records of
        every launch before it too (nothing recorded is lost).
        """
        from ddplab.launcher import LaunchError, launch
        from ddplab.records import record, to_frame

        params = self.check_params(params)
        recs: list[dict] = []
        for plan in self.launches(params):
            t0 = time.perf_counter()
            try:
                result = launch(self.worker, plan.world_size, plan.backend, args=(params,),
                                kwargs=plan.kwargs, timeout=plan.timeout, env=plan.env,
                                progress=plan.steps if progress and plan.steps else None,
                                progress_desc=f"{self.name} {plan.label}".strip())
            except LaunchError as exc:
                exc.result.record_list[:0] = recs
                raise
            recs.extend(result.ordered_records)
            recs.append(record("launch_seconds", time.perf_counter() - t0, launch=plan.label,
                               world_size=plan.world_size, backend=plan.backend))
        return to_frame(recs)

    def environment(self, params: dict) -> dict:
        """The environment block of a run with ``params`` (versions, hardware, backend, sizes)."""
        from ddplab.environment import environment_info

        plans = self.launches(params)
        backends = sorted({p.backend for p in plans})
        sizes = sorted({p.world_size for p in plans})
        return environment_info(backend=", ".join(backends) if backends else None,
                                world_sizes=sizes or None)

    # -- conclusions -----------------------------------------------------------------

    def verdict(self, records, params: dict) -> Verdict:
        """The verdict rule: a :class:`~ddplab.verdict.Verdict` computed from ``records``.

        A case declares it: ``verdict = judge`` (a function of ``records, params``).
        """
        raise NotImplementedError(f"case {self.name!r} defines no verdict")

    def figure(self, name: str, records, params: dict, ax=None):
        """The figure called ``name`` (see ``figures_by_name``)."""
        if name not in self.figures_by_name:
            raise ValueError(f"case {self.name!r} has no figure {name!r}; "
                             f"it has {', '.join(self.figures_by_name) or 'none'}")
        fn = self.figures_by_name[name]
        if ax is not None and "ax" in inspect.signature(fn).parameters:
            return fn(records, params, ax=ax)
        return fn(records, params)

    def table(self, name: str, records, params: dict):
        """The table called ``name`` (see ``tables_by_name``): a DataFrame, or Markdown text.

        ``params`` goes to table functions that take a ``params`` argument.
        """
        if name not in self.tables_by_name:
            raise ValueError(f"case {self.name!r} has no table {name!r}; "
                             f"it has {', '.join(self.tables_by_name) or 'none'}")
        fn = self.tables_by_name[name]
        if "params" in inspect.signature(fn).parameters:
            return fn(records, params=params)
        return fn(records)

    def figures(self, records, params: dict) -> list:
        """Every figure, the key figure first (the explorer shows them in this order)."""
        names = list(self.figures_by_name)
        if self.key_figure in names:
            names.remove(self.key_figure)
            names.insert(0, self.key_figure)
        return [self.figure(n, records, params) for n in names]

    # -- files -----------------------------------------------------------------------

    def notebook_path(self) -> pathlib.Path:
        """The case's notebook: built-in ones in the notebooks folder, others beside their module."""
        path = pathlib.Path(self.notebook or f"{self.name}.ipynb")
        if path.is_absolute():
            return path
        module = inspect.getmodule(type(self))
        if module is not None and module.__name__.startswith("ddplab.cases."):
            return BUILTIN_NOTEBOOK_DIR / path
        if module is None or not getattr(module, "__file__", None):
            raise ValueError(f"case {self.name!r}: cannot tell where its notebook {path} lies "
                             "(give an absolute path)")
        return pathlib.Path(module.__file__).resolve().parent / path

"""The few calls every case notebook makes, so that notebooks stay thin.

A case notebook is a papermill ``parameters`` cell -- the one place the
notebook repeats the case's parameters -- then::

    lab = notebook.setup("half_precision")   # reads the parameters cell, validates, shows them
    records = lab.run()                      # launches the ranks (or reads run_dir)
    lab.show("lanes")                        # a figure of the case, by name
    lab.table("norms")                       # a table of the case, by name
    verdict = lab.conclude()                 # computes, displays and saves the verdict

:func:`setup` reads every parameter the case declares from the notebook's
namespace, so no value papermill injected can be dropped on the way: a
declared parameter missing from the namespace is an error, and
``ddplab report`` refuses names the case does not declare before it starts.
"""
from __future__ import annotations

import json
import pathlib
import sys
import time
from typing import Any, Mapping

from ddplab.artifacts import save_results
from ddplab.cases import Case, get_case
from ddplab.environment import environment_markdown
from ddplab.markup import parameters_table
from ddplab.progress import in_batch
from ddplab.verdict import Verdict

__all__ = ["setup", "CaseSession", "IO_PARAMETERS", "KERNELSPEC", "parameters_source", "template_notebook"]

#: Notebook parameters every case notebook has besides its case's own.
IO_PARAMETERS = ("results_dir", "run_dir")
#: The kernel every notebook opens on: the one ``make setup`` registers for
#: this environment (``ipykernel install --sys-prefix --name ddplab``), so
#: JupyterLab starts ddplab's Python, not whichever "python3" it finds first.
KERNELSPEC = {"name": "ddplab", "display_name": "Python (ddplab)", "language": "python"}


def _warnings_to_stdout() -> None:
    """In batch reports, print warnings as plain output: stderr is styled as an error there."""
    import warnings

    def show(message, category, filename, lineno, file=None, line=None):
        print(f"{category.__name__}: {message} ({pathlib.Path(filename).name}:{lineno})")

    warnings.showwarning = show


def _display_markdown(text: str) -> None:
    from IPython.display import Markdown, display
    display(Markdown(text))


class CaseSession:
    """One case run in a notebook: its parameters, records, figures and verdict."""

    def __init__(self, case: Case, params: dict, environment: dict, *,
                 results_dir: str | None = None, run_dir: str | None = None):
        self.case = case
        self.params = params
        self.environment = environment
        self.results_dir = results_dir
        self.run_dir = run_dir
        self.records = None
        self.verdict: Verdict | None = None

    def run(self, *, progress: bool = True):
        """Run the case (or read the finished run in ``run_dir``); keep and return the records.

        With ``run_dir`` the run's own parameters (its ``params.json``) replace
        the notebook's, so that figures and verdict describe the run that
        produced the records; what changed is printed.
        """
        t0 = time.perf_counter()
        if self.run_dir:
            from ddplab.torchrun import load_run

            self.records = load_run(self.run_dir)
            saved = pathlib.Path(self.run_dir) / "params.json"
            if saved.exists():
                ran = self.case.check_params({k: v for k, v in json.loads(saved.read_text()).items()
                                              if k in self.case.parameters})
                changed = {k: v for k, v in ran.items() if self.params.get(k) != v}
                self.params.update(ran)
                if changed:
                    print("parameters taken from the run: "
                          + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
            print(f"read {len(self.records)} records from {self.run_dir}")
        else:
            self.records = self.case.run(self.params, progress=progress)
            print(f"{self.case.name}: {len(self.records)} records in "
                  f"{time.perf_counter() - t0:.1f} s")
        return self.records

    def _need_records(self):
        if self.records is None:
            raise RuntimeError("no records yet: call run() first")
        return self.records

    def figure(self, name: str, ax=None):
        """The case's figure ``name`` of this run's records."""
        return self.case.figure(name, self._need_records(), self.params, ax=ax)

    def show(self, name: str) -> None:
        """Display the case's figure ``name`` (as PNG, whatever the matplotlib backend)."""
        from ddplab.plots import show
        show(self.figure(name))

    def table(self, name: str):
        """The case's table ``name`` of this run's records, as a notebook cell shows it.

        A DataFrame as it is; a table the case writes as Markdown text as
        :class:`IPython.display.Markdown` (``case.table`` gives the text).
        """
        table = self.case.table(name, self._need_records(), self.params)
        if isinstance(table, str):
            from IPython.display import Markdown
            return Markdown(table)
        return table

    def conclude(self, *, display: bool = True) -> Verdict:
        """Compute the verdict from the records, display it, save the results (``results_dir``)."""
        records = self._need_records()
        self.verdict = self.case.verdict(records, self.params)
        if display:
            from IPython.display import display as ipy_display
            ipy_display(self.verdict)
        if self.results_dir:
            save_results(self.results_dir, records=records, verdict=self.verdict,
                         params=self.params, environment=self.environment)
        return self.verdict


def setup(case: "str | Case", namespace: Mapping[str, Any] | None = None, *,
          display: bool = True) -> CaseSession:
    """Read the case's parameters from ``namespace`` (default: the caller's globals), validate them.

    Every parameter the case declares must be defined there (the notebook's
    parameters cell); ``results_dir`` and ``run_dir`` are read when present.
    Raises ValueError naming a missing or bad parameter before anything runs.
    Shows the parameters and the environment unless ``display`` is False.
    """
    case = get_case(case)
    if namespace is None:
        namespace = sys._getframe(1).f_globals
    if in_batch():
        _warnings_to_stdout()
    missing = [name for name in case.parameters.names() if name not in namespace]
    if missing:
        raise ValueError(f"case {case.name!r}: the notebook's parameters cell does not define "
                         f"{', '.join(map(repr, missing))}; it must define every parameter of the "
                         f"case: {', '.join(case.parameters.names())}")
    params = case.check_params({name: namespace[name] for name in case.parameters.names()})
    environment = case.environment(params)
    session = CaseSession(case, params, environment, results_dir=namespace.get("results_dir"),
                          run_dir=namespace.get("run_dir"))
    if display:
        _display_markdown(f"### Parameters\n\n{parameters_table(params)}\n"
                          f"### Environment\n\n{environment_markdown(environment)}")
    return session


# --------------------------------------------------------------------------- a new case's notebook


def parameters_source(case: "str | Case") -> str:
    """The papermill parameters cell of ``case``: ``name = default  # help`` per parameter.

    papermill reads each line's trailing comment as the parameter's help;
    ``results_dir`` and ``run_dir`` follow (``ddplab report`` sets the first,
    a torchrun run folder the second).
    """
    case = get_case(case)
    lines = [f"{p.name} = {p.default!r}  # {p.help}" for p in case.parameters]
    lines += ["results_dir = None  # save records, verdict and parameters here (None: do not save)",
              "run_dir = None  # read the records of a finished run (e.g. torchrun) instead of launching"]
    return "\n".join(lines)


def template_notebook(case: "str | Case", case_path: str | None = None):
    """A complete notebook for ``case``: its parameters cell, run, every figure and table, the verdict.

    ``case_path`` is how the notebook names the case to :func:`setup`
    (default: the built-in name, or the module path it was loaded from).
    Write it with ``nbformat.write``, or run ``ddplab new-notebook CASE``.
    """
    import nbformat

    case = get_case(case)
    name = case_path or (case.name if case.name in _builtin_names() else type(case).__module__)
    v4 = nbformat.v4
    params = v4.new_code_cell(parameters_source(case))
    params.metadata["tags"] = ["parameters"]
    key = v4.new_code_cell("lab.show(lab.case.key_figure or next(iter(lab.case.figures_by_name)))")
    key.metadata["tags"] = ["key-figure"]
    verdict = v4.new_code_cell("verdict = lab.conclude()")
    verdict.metadata["tags"] = ["verdict"]
    nb = v4.new_notebook(cells=[
        v4.new_markdown_cell(f"# {case.title}\n\nWhat was reported, what this notebook measures, "
                             "and how the verdict at the end is computed from the records."),
        v4.new_markdown_cell("## Parameters\n\nOverride with papermill or `ddplab report "
                             f"{name} -p NAME VALUE`."),
        params,
        v4.new_code_cell(f"from ddplab import notebook\n\nlab = notebook.setup({name!r})"),
        v4.new_markdown_cell("## Run\n\nReal `torch.distributed` ranks; the cell prints how long "
                             "they took."),
        v4.new_code_cell("records = lab.run()"),
        v4.new_markdown_cell("## The key figure"),
        key,
        v4.new_markdown_cell("## Every figure"),
        v4.new_code_cell("for figure in lab.case.figures_by_name:\n"
                         "    if figure != lab.case.key_figure:\n"
                         "        lab.show(figure)"),
        *([v4.new_markdown_cell("## Every table"),
           v4.new_code_cell("from IPython.display import display\n\n"
                            "for table in lab.case.tables_by_name:\n"
                            "    display(lab.table(table))")] if case.tables_by_name else []),
        v4.new_markdown_cell("## Verdict\n\nComputed from the records above."),
        verdict,
    ])
    nb.metadata["kernelspec"] = dict(KERNELSPEC)
    return nb


def _builtin_names() -> list[str]:
    from ddplab.cases import case_names
    return case_names()

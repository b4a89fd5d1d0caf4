"""The few calls every case notebook makes, so that notebooks stay thin.

A case notebook is: a papermill ``parameters`` cell, then
:func:`setup` (validate, show parameters and environment), :func:`run`
(launch the ranks, print the time), figure cells (``plots.show``), and
:func:`conclude` (compute, display and save the verdict).

Example::

    params, env = setup("backend_divergence", dict(world_sizes=world_sizes, ...))
    records = run("backend_divergence", params)
    verdict = conclude("backend_divergence", records, params, env, results_dir=results_dir)
"""
from __future__ import annotations

import time

from ddplab.artifacts import save_results
from ddplab.cases import get_case
from ddplab.environment import environment_info, environment_markdown
from ddplab.verdict import Verdict

__all__ = ["setup", "run", "conclude", "parameters_markdown"]


def parameters_markdown(params: dict) -> str:
    rows = ["| parameter | value |", "|---|---|"]
    rows += [f"| {k} | `{v!r}` |" for k, v in params.items()]
    return "\n".join(rows) + "\n"


def _display_markdown(text: str) -> None:
    from IPython.display import Markdown, display
    display(Markdown(text))


def setup(case: str, values: dict, *, display: bool = True) -> tuple[dict, dict]:
    """Validate ``values`` against the case's parameters; show them and the environment.

    Raises ValueError naming a bad parameter before anything runs.
    """
    module = get_case(case)
    params = module.check_params(values)
    world_sizes = params.get("world_sizes") or ([params["world_size"]] if "world_size" in params else None)
    env = environment_info(backend=params.get("backend", "gloo"), world_sizes=world_sizes)
    if display:
        _display_markdown(f"### Parameters\n\n{parameters_markdown(params)}\n"
                          f"### Environment\n\n{environment_markdown(env)}")
    return params, env


def run(case: str, params: dict, *, run_dir: str | None = None, progress: bool = True):
    """Run the case (or read a finished run from ``run_dir``) and return its records.

    With ``run_dir`` the run's own parameters (its ``params.json``) replace
    those in ``params``, in place, so that figures and verdict describe the
    run that produced the records; what changed is printed.
    """
    if run_dir:
        import json
        import pathlib

        from ddplab.torchrun import load_run
        records = load_run(run_dir)
        print(f"read {len(records)} records from {run_dir}")
        saved = pathlib.Path(run_dir) / "params.json"
        if saved.exists():
            ran = get_case(case).PARAMETERS.validate(
                {k: v for k, v in json.loads(saved.read_text()).items()
                 if k in get_case(case).PARAMETERS})
            changed = {k: v for k, v in ran.items() if params.get(k) != v}
            params.update(ran)
            if changed:
                print("parameters taken from the run: "
                      + ", ".join(f"{k}={v!r}" for k, v in changed.items()))
        return records
    t0 = time.perf_counter()
    records = get_case(case).run(params, progress=progress)
    print(f"{case}: {len(records)} records in {time.perf_counter() - t0:.1f} s")
    return records


def conclude(case: str, records, params: dict, environment: dict, *,
             results_dir: str | None = None, display: bool = True) -> Verdict:
    """Compute the case's verdict from ``records``, display it, save the results."""
    verdict = get_case(case).verdict(records, params)
    if display:
        from IPython.display import display as ipy_display
        ipy_display(verdict)
    if results_dir:
        save_results(results_dir, records=records, verdict=verdict, params=params,
                     environment=environment)
    return verdict

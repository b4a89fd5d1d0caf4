"""The case contract, checked for every registered case and for a case written from the README.

Each registered case: its notebook's parameters cell mirrors its declared
parameters, its quick values are valid, and one quick end-to-end run through
``ddplab report`` (real papermill, real ranks) produces records, a verdict
that states its scope and carries its numbers, and figures. A fifth case,
taken verbatim from the README's "Add a case" section into a package outside
ddplab, runs through ``ddplab report``, the explorer and torchrun.
"""
from __future__ import annotations

import ast
import json
import os
import pathlib
import socket
import subprocess
import sys

import matplotlib.pyplot as plt
import papermill
import pytest

from ddplab.artifacts import load_results
from ddplab.cases import case_names, get_case
from ddplab.notebook import IO_PARAMETERS
from ddplab.report import plan_batch, run_batch
from ddplab.verdict import KINDS, Verdict

from readme import python_block, readme_section

README_CASE_MODULE = "allreduce_sum"


def _check_parameters_cell(case) -> None:
    path = case.notebook_path()
    assert path.exists(), f"case {case.name!r} has no notebook {path}"
    nb = json.loads(path.read_text())
    tagged = [c for c in nb["cells"] if "parameters" in c.get("metadata", {}).get("tags", [])]
    assert len(tagged) == 1, "exactly one cell tagged 'parameters'"
    inspected = papermill.inspect_notebook(str(path))
    expected = {**case.parameters.defaults(), **{k: None for k in IO_PARAMETERS}}
    assert set(inspected) == set(expected)
    for name, info in inspected.items():
        assert ast.literal_eval(info["default"]) == expected[name], name
        assert info["help"], f"parameter {name!r} needs a trailing '# help' comment"
    case.check_params(case.quick)


def _check_results(case, case_dir: pathlib.Path) -> Verdict:
    """What every case's quick run must leave: records, a verdict with scope and numbers, figures."""
    saved = load_results(case_dir / "results")
    assert len(saved.records) > 0
    verdict = saved.verdict
    assert verdict is not None and verdict.case == case.name
    assert verdict.kind in KINDS
    assert verdict.scope and verdict.findings
    assert all(isinstance(f.values, dict) for f in verdict.findings)
    assert verdict.key_table(), "a verdict names its key numbers"
    raw = json.loads((case_dir / "results" / "verdict.json").read_text())
    assert all("values" in f for f in raw["findings"])
    assert (case_dir / "key-figure.png").stat().st_size > 0
    params = case.check_params({k: v for k, v in saved.params.items() if k in case.parameters})
    figures = case.figures(saved.records, params)
    assert len(figures) >= 1 and len(figures) == len(case.figures_by_name)
    for fig in figures:
        assert fig.axes
        plt.close(fig)
    # The verdict is a pure function of the records: recomputed, it is the same.
    assert case.verdict(saved.records, params).to_dict() == verdict.to_dict()
    return verdict


@pytest.mark.parametrize("name", case_names())
def test_parameters_cell_mirrors_the_case(name):
    _check_parameters_cell(get_case(name))


# What a rank does first: unpickle the case's worker, in a fresh interpreter.
UNPICKLE_WORKER = """
import pickle, sys
pickle.loads(sys.stdin.buffer.read())
print(" ".join(m for m in ("matplotlib", "seaborn", "pandas", "IPython") if m in sys.modules))
"""


@pytest.mark.parametrize("name", case_names())
def test_a_rank_unpickling_the_worker_imports_no_plotting(name):
    """Every rank imports its case's package; figures' libraries there cost ~2 s per rank and launch."""
    import cloudpickle
    payload = cloudpickle.dumps(get_case(name).worker)
    proc = subprocess.run([sys.executable, "-c", UNPICKLE_WORKER], input=payload, capture_output=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr.decode()
    assert proc.stdout.decode().split() == []


@pytest.fixture(scope="session")
def quick_reports(tmp_path_factory):
    """One quick batch of every registered case (papermill, real ranks): ``(folder, outcomes, log)``.

    Two notebooks at a time, as ``make report`` runs them.
    """
    out = tmp_path_factory.mktemp("quick-reports")
    lines: list[str] = []
    outcomes = run_batch(plan_batch(quick=True), out, timeout=400, echo=lines.append,
                         jobs=2)
    return out, {o.name: o for o in outcomes}, "\n".join(lines)


@pytest.mark.parametrize("name", case_names())
def test_quick_run_end_to_end(name, quick_reports):
    """One quick end-to-end per case: papermill, real ranks, the published results."""
    out, outcomes, log = quick_reports
    assert outcomes[name].status == "ok", log
    _check_results(get_case(name), out / name)
    html = (out / name / "report.html").read_text()
    assert html.count("data:image/png;base64,") >= 2, name
    assert html.index("Verdict") < html.index("Environment")
    assert len(html) < 3_000_000, (name, len(html))


@pytest.mark.browser
def test_quick_reports_render_offline_in_chromium(quick_reports, tmp_path):
    from browser import check_pages_offline

    out, outcomes, log = quick_reports
    check_pages_offline({"index": out / "index.html",
                         **{name: out / name / "report.html" for name in outcomes}}, tmp_path,
                        successful=tuple(n for n, o in outcomes.items() if o.status == "ok"))
    # Formulas became MathML: typeset by the browser itself, offline.
    assert "<math" in (out / "half_precision" / "report.html").read_text()


# --------------------------------------------------------------------------- a fifth case from the README


def _readme_case_source() -> str:
    return python_block(readme_section("Add a case"))


@pytest.fixture(scope="module")
def readme_case(tmp_path_factory):
    """The README's example case as a package outside ddplab, importable here and in child processes."""
    root = tmp_path_factory.mktemp("outside")
    package = root / "mycases"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / f"{README_CASE_MODULE}.py").write_text(_readme_case_source())
    sys.path.insert(0, str(root))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")])}
    old = os.environ.get("PYTHONPATH")
    os.environ["PYTHONPATH"] = env["PYTHONPATH"]   # papermill's kernel and torchrun inherit it
    try:
        out = subprocess.run([sys.executable, "-m", "ddplab", "new-notebook",
                              f"mycases.{README_CASE_MODULE}"], env=env, capture_output=True,
                             text=True, timeout=120)
        assert out.returncode == 0, out.stderr
        yield root, f"mycases.{README_CASE_MODULE}", env
    finally:
        sys.path.remove(str(root))
        if old is None:
            os.environ.pop("PYTHONPATH", None)
        else:
            os.environ["PYTHONPATH"] = old


def test_readme_case_runs_through_the_report(readme_case, tmp_path):
    root, path, env = readme_case
    case = get_case(path)
    _check_parameters_cell(case)
    out = subprocess.run([sys.executable, "-m", "ddplab", "report", path, "--quick", "--output",
                          str(tmp_path)], env=env, capture_output=True, text=True, timeout=400)
    assert out.returncode == 0, out.stdout + out.stderr
    verdict = _check_results(case, tmp_path / case.name)
    assert verdict.kind == "rounding" and verdict.finding("rounding").values["n"] == 2


def test_readme_case_runs_in_the_explorer(readme_case):
    from ddplab.explore import CaseExplorer

    root, path, env = readme_case
    explorer = CaseExplorer(path)
    assert explorer.case.name == "allreduce_sum" and "allreduce_sum" in explorer.case_picker.options
    explorer.set_values(steps=2, numel=500)
    explorer.run()
    explorer.wait(120)
    assert explorer.error is None, explorer.error
    assert explorer.verdict.kind == "rounding" and len(explorer.records) > 0


def test_readme_case_runs_under_torchrun(readme_case, tmp_path):
    from ddplab.torchrun import load_run

    root, path, env = readme_case
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc-per-node", "2",
           "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--max-restarts", "0",
           "-m", "ddplab", "run", path, "--out", str(tmp_path / "run"), "-p", "steps", "2",
           "-p", "numel", "300"]
    out = subprocess.run(cmd, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=240)
    assert out.returncode == 0, out.stdout + out.stderr
    records = load_run(tmp_path / "run")
    params = json.loads((tmp_path / "run" / "params.json").read_text())
    assert params["world_size"] == 2          # the job's size decided it
    assert get_case(path).verdict(records, params).kind == "rounding"

"""The case contract, checked for every registered case and for a case written from the README.

Each registered case: its notebook's parameters cell mirrors its declared
parameters (defaults and help texts), its quick values are valid, every
figure and table its notebook names is declared, and one quick end-to-end
run through ``ddplab report`` (real papermill, real ranks) produces records,
a verdict that states its scope and carries its numbers, every declared
figure and every declared table. A fifth case,
taken verbatim from the README's "Add a case" section into a package outside
ddplab, runs through ``ddplab report``, the explorer and torchrun.
"""
from __future__ import annotations

import ast
import inspect
import json
import os
import pathlib
import re
import socket
import subprocess
import sys

import matplotlib.pyplot as plt
import pandas as pd
import papermill
import pytest

from ddplab.artifacts import load_results
from ddplab.cases import Case, case_names, get_case
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
        # The declaration is the one source: the cell's comment says what it says.
        if name in case.parameters:
            assert info["help"] == case.parameters[name].help, name
    case.check_params(case.quick)


#: ``lab.show("name")``, ``lab.figure("name")`` or ``lab.table("name")`` in a notebook's code.
_NAMED_CALL = re.compile(r"""\blab\.(show|figure|table)\(\s*["']([^"']+)["']""")


def _check_notebook_names(case) -> None:
    """Every figure and table the notebook asks for by name is declared; nothing else is called on the case."""
    nb = json.loads(case.notebook_path().read_text())
    code = "\n".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "code")
    declared = {"show": case.figures_by_name, "figure": case.figures_by_name, "table": case.tables_by_name}
    for call, name in _NAMED_CALL.findall(code):
        assert name in declared[call], f"{case.notebook}: lab.{call}({name!r}) is not declared"
    assert not re.search(r"\blab\.case\.\w+\(", code), "tables and figures are asked for by name"


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
    for name in case.tables_by_name:
        table = case.table(name, saved.records, params)
        assert isinstance(table, (str, pd.DataFrame)) and len(table) > 0, name
    # The verdict is a pure function of the records: recomputed, it is the same.
    assert case.verdict(saved.records, params).to_dict() == verdict.to_dict()
    return verdict


# --------------------------------------------------------------------------- parameters, every case

#: Per case: overrides it must refuse before anything runs, and what the refusal says (the
#: parameter's name, and why). An undeclared name is checked for every case below.
BAD_PARAMETERS = {
    "backend_divergence": [
        ({"orders": ["gloo", "nccl_ring"]}, r"parameter 'orders'.*must include 'exact'"),
        ({"orders": ["gloo", "mpi", "exact"]}, r"parameter 'orders'.*from gloo"),
        ({"orders": ["nccl_live_ring", "exact"]}, r"parameter 'orders'.*need backend='nccl'"),
        ({"backend": "nccl"}, r"parameter 'backend'.*needs CUDA GPUs"),
        ({"data": "cifar10"}, r"parameter 'data_root'.*needs the folder"),
        ({"data_root": "/tmp"}, r"parameter 'data_root'.*only read with data='cifar10'"),
        ({"world_sizes": [1, 2]}, r"parameter 'world_sizes'.*>= 2"),
        ({"lr": 0}, r"parameter 'lr'.*must be > 0"),
        ({"bucket_cap_mb": -1}, r"parameter 'bucket_cap_mb'.*must be > 0"),
        ({"audit_every": 0}, r"parameter 'audit_every'"),
        ({"dtype": "float16"}, r"parameter 'dtype'.*float64, float32"),
        ({"batch_size": 1000}, r"parameter 'batch_size'.*1000 is more than the 899 samples"),
    ],
    "half_precision": [
        ({"world_size": 0}, "world_size"),
        ({"world_size": "two"}, "world_size"),
        ({"dtypes": ["float32"]}, "dtypes"),           # the report's float16 is required
        ({"dtypes": ["float16", "int8"]}, "dtypes"),
        ({"seed": -1}, "seed"),
        ({"in_features": 0}, "in_features"),
        ({"out_features": 5000}, "out_features"),
        ({"lanes": [0, 8]}, "lanes"),
        ({"lanes": [8, 8]}, "lanes"),
        ({"same_init": "maybe"}, "same_init"),
        ({"in_features": 2, "out_features": 2, "lanes": [1, 8]}, "lanes"),  # 8 lanes, 4 weights
    ],
    "device_roundtrip": [
        ({"world_size": 1}, "world_size"),              # one rank has nothing to synchronize
        ({"world_size": "two"}, "world_size"),
        ({"roundtrip": ["sideways"]}, "roundtrip"),
        ({"roundtrip": ["dtype", "dtype"]}, "roundtrip"),
        ({"framework": ["jax"]}, "framework"),
        ({"steps": 0}, "steps"),
        ({"roundtrip_step": -1}, "roundtrip_step"),
        ({"steps": 5, "roundtrip_step": 5}, "roundtrip_step"),  # the round trip must happen while training
        ({"seed": -3}, "seed"),
    ],
    "allreduce_correctness": [
        ({"world_size": 1}, "world_size"),          # all_sum needs two towers (the report asserts it)
        ({"world_size": "two"}, "world_size"),
        ({"steps": 0}, "steps"),
        ({"mode": ["fixed", "eager"]}, "mode"),
        ({"mode": []}, "mode"),
        ({"mode": ["fixed", "fixed"]}, "mode"),
        ({"tolerance": 0}, "tolerance"),
        ({"tolerance": "small"}, "tolerance"),
        ({"seed": -1}, "seed"),
        ({"width": 0}, "width"),
        ({"width": 1.5}, "width"),
        ({"width": 0.001}, "width"),                # 64·width rounds to no channel at all
    ],
    "your_training": [
        ({"setup": "nope"}, r"parameter 'setup' must be written module:function"),
        ({"setup": "ddplab.compare.examples:nothing"}, r"has no 'nothing'"),
        ({"setup": "ddplab.compare.examples:MODELS"}, r"gave a tuple, not a ddplab\.compare\.Setup"),
        ({"setup": "no_such_package.mod:setup"}, r"cannot import 'no_such_package\.mod'"),
        ({"configurations": ["ddp", "horovod"]}, r"'horovod' is neither one of"),
        ({"configurations": ["ddplab.compare.examples:digits_setup"]},
         r"must give a ddplab\.compare configuration"),
        ({"configurations": ["accumulate"], "k": 5}, r"parameter 'setup'.*cannot split into 10 equal pieces"),
        ({"steps": 100}, r"parameter 'setup': steps=100 but setup\.batches has only 6"),
        ({"world_size": 0}, r"parameter 'world_size'"),
    ],
}

#: Per case: its defaults, the reported run's where the report said.
DEFAULTS = {
    "half_precision": {"world_size": 2, "dtypes": ["float16", "float32"], "seed": 42, "in_features": 512,
                       "out_features": 512, "lanes": [1, 2, 4, 8, 16, 32], "same_init": True},
    "device_roundtrip": {"world_size": 2, "roundtrip": ["none", "dtype", "device"],
                         "framework": ["ddp", "fabric"], "steps": 20, "roundtrip_step": 5, "seed": 0},
    "allreduce_correctness": {"world_size": 2, "steps": 100, "mode": ["fixed", "as_ready", "race"],
                              "tolerance": 1e-4, "seed": 0, "width": 0.0625},
}


def _bad_parameters():
    for name in case_names():
        refusals = BAD_PARAMETERS[name] + [({"no_such_parameter": 2}, r"unknown parameter.*'no_such_parameter'")]
        for i, (overrides, match) in enumerate(refusals):
            yield pytest.param(name, overrides, match, id=f"{name}-{i}")


@pytest.mark.parametrize("name, overrides, match", list(_bad_parameters()))
def test_bad_parameters_are_named_before_anything_runs(name, overrides, match):
    case = get_case(name)
    with pytest.raises(ValueError, match=match):
        case.check_params(overrides)
    with pytest.raises(ValueError, match=match):
        case.run(overrides, progress=False)  # run() validates before it launches any rank


@pytest.mark.parametrize("name", case_names())
def test_defaults_validate_and_quick_changes_some(name):
    case = get_case(name)
    params = case.check_params({})
    assert params == case.parameters.defaults() == {**params, **DEFAULTS.get(name, {})}
    quick = case.check_params(case.quick)
    assert case.quick and all(quick[k] != params[k] for k in case.quick), "quick overrides defaults"


@pytest.mark.parametrize("name", case_names())
def test_papermill_strings_parse_back_to_the_values(name):
    """papermill's -p hands every value over as a string: each default, written so, reads back."""
    case = get_case(name)
    for p in case.parameters:
        assert case.parameters.validate({p.name: str(p.default)})[p.name] == p.default, p.name


@pytest.mark.parametrize("name", case_names())
def test_parameters_cell_mirrors_the_case(name):
    _check_parameters_cell(get_case(name))


@pytest.mark.parametrize("name", case_names())
def test_notebook_asks_for_declared_figures_and_tables_only(name):
    _check_notebook_names(get_case(name))


@pytest.mark.parametrize("name", case_names())
def test_worker_and_verdict_are_declared_functions(name):
    """Declared (worker = fn), not forwarded by a method: what a rank unpickles is the function."""
    case = get_case(name)
    for attribute in ("worker", "verdict"):
        assert inspect.isfunction(getattr(case, attribute)), (name, attribute)


def test_a_worker_written_as_a_method_stays_a_method():
    def judge(records, params):
        return (records, params)

    class Mine(Case):
        name = "mine"
        verdict = judge

        def worker(self, params):
            return self.name, params

    assert Mine().worker({"n": 1}) == ("mine", {"n": 1}) and Mine().verdict(1, 2) == (1, 2)


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
    _check_notebook_names(case)
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

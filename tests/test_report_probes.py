"""The report's edges: what a parameters file may hold, a disk that refuses files,
a kernel killed mid-batch, and names that try to leave the output folder."""
from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import nbformat
import pytest

from ddplab.cases import get_case
from ddplab.report import plan_batch, run_batch

from mounts import needs_mount, on_tmpfs
from notebook_cases import notebook_case

PY = sys.executable
REPO = pathlib.Path(__file__).resolve().parent.parent
# The tests folder too: the drivers below build their cases with tests/notebook_cases.py.
ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"),
                                                    os.environ.get("PYTHONPATH", "")])}


def _notebook(path: pathlib.Path, *cells: str) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("results_dir = None\nrun_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells]
    nbformat.write(nb, path)
    return path


def _case(folder: pathlib.Path, name: str, *cells: str):
    return notebook_case(name, _notebook(folder / f"{name}.ipynb", *cells))


def _report(*args, cwd, env=ENV, timeout=120):
    return subprocess.run([PY, "-m", "ddplab", "report", *args], capture_output=True, text=True,
                          cwd=cwd, env=env, timeout=timeout)


def _hidden(folder: pathlib.Path) -> list[str]:
    """Temporary and scratch files (dot names) anywhere below ``folder``."""
    return [str(p.relative_to(folder)) for p in folder.rglob(".*")]


# ---------------------------------------------------------------- --params: plain data only


PYTHON_TAGS = [
    'steps: !!python/object/apply:os.system ["touch {marker}"]',
    "steps: !!python/object/new:os.system [touch {marker}]",
    "steps: !!python/name:os.system",
]


@pytest.mark.parametrize("line", PYTHON_TAGS, ids=["apply", "new", "name"])
def test_a_params_file_with_python_tags_is_refused(tmp_path, line):
    marker = tmp_path / "ran"
    params = tmp_path / "evil.yaml"
    params.write_text(line.format(marker=marker) + "\n")
    with pytest.raises(ValueError, match="YAML tag that is not plain data.*python/"):
        plan_batch(["half_precision"], params_file=params)
    assert not marker.exists()  # safe loading: the tag built nothing, ran nothing


def test_the_command_refuses_python_tags_before_running(tmp_path):
    marker = tmp_path / "ran"
    params = tmp_path / "evil.yaml"
    params.write_text(PYTHON_TAGS[0].format(marker=marker) + "\n")
    proc = _report("half_precision", "--params", str(params), "--output", "out", cwd=tmp_path)
    assert proc.returncode == 2, proc.stderr
    assert "not plain data" in proc.stderr and "Traceback" not in proc.stderr
    assert not marker.exists() and not (tmp_path / "out").exists()


# ---------------------------------------------------------------- --output on a disk that refuses


@needs_mount
def test_a_read_only_output_is_refused_before_any_notebook_runs(tmp_path):
    disk = tmp_path / "disk"
    proc = on_tmpfs(disk, "ro", [PY, "-m", "ddplab", "report", "half_precision", "--quick",
                                 "--output", str(disk / "reports")], cwd=tmp_path, env=ENV)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert f"cannot write to the output folder {disk / 'reports'}: Read-only file system" in proc.stderr
    assert "started" not in proc.stdout and "Traceback" not in proc.stderr


#: Runs in the mount namespace: a case publishes, the disk fills up, the case runs again
#: and cannot publish; prints what it saw as JSON.
FULL_DISK_DRIVER = """
import errno, hashlib, json, os, pathlib, sys
from ddplab.report import plan_batch, run_batch
from notebook_cases import notebook_case

notebook, out = pathlib.Path(sys.argv[1]), pathlib.Path(sys.argv[2])
case = notebook_case("tiny", notebook)
first = run_batch(plan_batch([case]), out, timeout=120, echo=lambda _: None)
before = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "tiny").iterdir() if p.is_file()}
with open(out.parent / "filler", "wb") as fh:  # fill the disk, then leave a little room
    try:
        while True:
            fh.write(b"x" * 65536)
            fh.flush()
    except OSError as exc:
        assert exc.errno == errno.ENOSPC, exc
    fh.truncate(max(0, fh.tell() - 96 * 1024))
lines = []
try:
    second = run_batch(plan_batch([case]), out, timeout=120, echo=lines.append)
    status, error = second[0].status, second[0].error
except OSError as exc:
    status, error = "raised", str(exc)
after = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "tiny").iterdir() if p.is_file()}
print(json.dumps({"first": first[0].status, "status": status, "error": error, "before": before,
                  "after": after, "lines": lines,
                  "index": json.loads((out / "index.json").read_text())["cases"][0]}))
"""


@needs_mount
def test_a_full_disk_fails_the_case_and_keeps_the_previous_report_whole(tmp_path):
    disk = tmp_path / "disk"
    driver = tmp_path / "driver.py"
    driver.write_text(FULL_DISK_DRIVER)
    notebook = _notebook(tmp_path / "tiny.ipynb", "print('a small notebook')")
    proc = on_tmpfs(disk, "size=2m", [PY, str(driver), str(notebook), str(disk / "reports")],
                    cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["first"] == "ok" and "report.html" in seen["before"]
    assert seen["status"] == "failed", seen
    assert "No space left on device" in seen["error"] and "unchanged" in seen["error"]
    assert any("tiny: failed" in line and "No space left" in line for line in seen["lines"])
    # The previous report, every file of it, is as it was: no mix of two runs, nothing half-written.
    assert seen["after"] == seen["before"]
    # The index (written after the failed case freed its scratch) says what happened.
    assert seen["index"]["status"] == "failed" and "No space left" in seen["index"]["error"]


#: Runs in the mount namespace: a case publishes, then runs again with a notebook whose output
#: fills the disk while it runs; prints what it saw as JSON.
FILLS_WHILE_RUNNING_DRIVER = """
import hashlib, json, pathlib, sys
from ddplab.report import plan_batch, run_batch
from notebook_cases import notebook_case

small, big, out = map(pathlib.Path, sys.argv[1:4])
first = run_batch(plan_batch([notebook_case("tiny", small)]), out, timeout=120, echo=lambda _: None)
files = lambda: {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in (out / "tiny").iterdir()}
before = files()
lines = []
second = run_batch(plan_batch([notebook_case("tiny", big)]), out, timeout=120, echo=lines.append)
print(json.dumps({"first": first[0].status, "status": second[0].status, "error": second[0].error,
                  "before": before, "after": files(), "lines": lines,
                  "hidden": [str(p) for p in out.rglob(".*")],
                  "index": json.loads((out / "index.json").read_text())["cases"][0]}))
"""


@needs_mount
def test_a_disk_that_fills_while_the_notebook_runs_fails_the_case_and_keeps_the_report(tmp_path):
    """Issue 33 item 6: papermill's output notebook is cut short by ENOSPC while the notebook runs."""
    disk = tmp_path / "disk"
    driver = tmp_path / "driver.py"
    driver.write_text(FILLS_WHILE_RUNNING_DRIVER)
    small = _notebook(tmp_path / "small.ipynb", "print('a small notebook')")
    # 4 MB of output on a 2 MB disk: papermill's saves of the notebook and its log hit ENOSPC.
    big = _notebook(tmp_path / "big.ipynb", "for i in range(1000):\n    print('x' * 4000)",
                    "print('never reached')")
    proc = on_tmpfs(disk, "size=2m", [PY, str(driver), str(small), str(big), str(disk / "reports")],
                    cwd=tmp_path, env=ENV)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    seen = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["first"] == "ok" and "report.html" in seen["before"]
    assert seen["status"] == "failed", seen
    assert "No space left on device" in seen["error"] and "unchanged" in seen["error"], seen["error"]
    assert len(seen["error"]) < 3000  # the reason, not the notebook's output
    assert any("tiny: failed" in line and "No space left" in line for line in seen["lines"])
    assert seen["after"] == seen["before"]  # the earlier report, every file, as it was
    assert seen["hidden"] == []  # no scratch: the cut-short notebook, the log, the results
    assert seen["index"]["status"] == "failed" and "No space left" in seen["index"]["error"]


# ---------------------------------------------------------------- a kernel killed mid-batch


def test_a_killed_kernel_fails_its_case_and_the_others_publish(tmp_path):
    cases = [_case(tmp_path, "killed", "print('before the kill', flush=True)",
                   "import os, signal\nos.kill(os.getpid(), signal.SIGKILL)", "print('never')"),
             _case(tmp_path, "fine", "print('fine')")]
    out = tmp_path / "reports"
    lines = []
    outcomes = {o.name: o for o in run_batch(plan_batch(cases), out, timeout=120, echo=lines.append)}
    killed, fine = outcomes["killed"], outcomes["fine"]
    # Not ok, with the reason (papermill 2.7 reports it as the kernel dying).
    assert killed.status in ("kernel died", "failed"), killed
    assert "died" in killed.error.lower() or "DeadKernel" in killed.error, killed.error
    assert fine.status == "ok"
    index = json.loads((out / "index.json").read_text())
    assert [(c["name"], c["status"]) for c in index["cases"]] == [("killed", killed.status), ("fine", "ok")]
    for name in ("killed", "fine"):
        assert {"report.html", "summary.md", "notebook.ipynb"} <= {p.name for p in (out / name).iterdir()}
    assert "before the kill" in (out / "killed" / "report.html").read_text()
    assert _hidden(out) == []


# ---------------------------------------------------------------- names that try to leave --output


@pytest.mark.parametrize("name", ["../outside", "..", "/etc/passwd", "a/../../b", ".hidden"])
def test_a_case_whose_name_leaves_the_output_folder_is_refused(tmp_path, name):
    with pytest.raises(ValueError, match="cannot name a report folder"):
        plan_batch([notebook_case(name, _notebook(tmp_path / "x.ipynb"))])


def test_a_case_module_whose_name_leaves_the_output_folder_is_refused(tmp_path, monkeypatch):
    (tmp_path / "escaping.py").write_text(textwrap.dedent("""
        from ddplab.cases import Case
        from ddplab.parameters import ParameterSet

        class Escaping(Case):
            name = "../../escaped"
            title = "a case that writes beside --output"
            notebook = "escaping.ipynb"
            parameters = ParameterSet([])

        CASE = Escaping()
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="case 'escaping:CASE'.*cannot name a report folder"):
        get_case("escaping:CASE")


@pytest.mark.parametrize("selector", ["../../outside", "../reports/x.y", "a.b/../c"])
def test_the_command_refuses_a_case_path_that_is_not_a_module(tmp_path, selector):
    work = tmp_path / "work"
    work.mkdir()
    proc = _report(selector, "--output", "out", cwd=work)
    assert proc.returncode == 2, proc.stderr
    assert "neither a built-in case" in proc.stderr and "Traceback" not in proc.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["work"] and list(work.iterdir()) == []


@pytest.mark.parametrize("kwargs, match", [
    (dict(overrides=[("../../x", "1")]), "unknown parameter '../../x'"),
    (dict(overrides=[("results_dir", "../../elsewhere")]), "set by ddplab report"),
    (dict(file={"../x": {"steps": 1}}), r"unknown parameter '\.\./x'"),
    (dict(file={"half_precision": {"results_dir": "/tmp/elsewhere"}}), "set by ddplab report"),
])
def test_parameters_cannot_redirect_where_reports_are_written(tmp_path, kwargs, match):
    """Only case names become paths under --output; a parameter that names a place is either
    unknown or ddplab's own (results_dir), and refused before anything runs."""
    params_file = None
    if "file" in kwargs:
        params_file = tmp_path / "params.yaml"
        params_file.write_text(json.dumps(kwargs.pop("file")))  # JSON is YAML
    with pytest.raises(ValueError, match=match):
        plan_batch(["half_precision"], params_file=params_file, **kwargs)

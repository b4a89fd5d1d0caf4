"""Stopping a report batch: signals end the whole process tree and leave the folder consistent."""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time

import nbformat
import psutil
import pytest

from ddplab.notebook_run import StopRequest, execute_notebook

from processes import still_alive

PY = sys.executable
REPO = pathlib.Path(__file__).resolve().parent.parent


def _notebook(path: pathlib.Path, *cells: str) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell("results_dir = None\nrun_dir = None")
    params.metadata["tags"] = ["parameters"]
    nb.cells = [params] + [nbformat.v4.new_code_cell(textwrap.dedent(c)) for c in cells]
    nbformat.write(nb, path)
    return path


def _wait_for(paths, proc=None, within=180.0):
    deadline = time.monotonic() + within
    while not all(p.exists() for p in paths):
        assert time.monotonic() < deadline, f"not written within {within} s: {paths}"
        assert proc is None or proc.poll() is None, proc.stdout.read()
        time.sleep(0.1)


def _rank_pids(markers) -> set[int]:
    return {int(pid) for m in markers for pid in m.read_text().split()}


@pytest.fixture
def scratch():
    """A TMPDIR for the run, in the system's temporary folder: shorter than
    pytest's ``tmp_path``, as the kernel's AF_UNIX socket paths need."""
    folder = pathlib.Path(tempfile.mkdtemp(prefix="ddplab-test-"))
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


# Ranks that start a child each, report the pids, then never return.
STUCK_CELL = """
import os, pathlib, subprocess, time
import torch.distributed as dist
from ddplab import launch

def stuck(folder):
    import tempfile
    (pathlib.Path(folder) / "tmpdir").write_text(tempfile.gettempdir())
    child = subprocess.Popen(["sleep", "300"])
    path = pathlib.Path(folder) / f"rank{{dist.get_rank()}}"
    path.with_suffix(".tmp").write_text(f"{{os.getpid()}} {{child.pid}}")
    path.with_suffix(".tmp").rename(path)
    while True:
        time.sleep(0.1)

launch(stuck, world_size=2, args=({folder!r},), timeout=600)
"""

DRIVER = """
import pathlib, sys
from ddplab.report import plan_batch, run_batch
from notebook_cases import notebook_case

case = notebook_case("stuck", pathlib.Path(sys.argv[1]), title="Stuck ranks")
outcomes = run_batch(plan_batch([case]), sys.argv[2], timeout=600)
print("STATUS", outcomes[0].status, "|", outcomes[0].error, flush=True)
"""


@pytest.mark.slow  # papermill, a kernel and a launch start first: 5-25 s on 2 cores
def test_sigterm_stops_the_whole_tree_and_the_index_says_interrupted(tmp_path, scratch):
    markers = tmp_path / "markers"
    markers.mkdir()
    nb = _notebook(tmp_path / "stuck.ipynb", STUCK_CELL.format(folder=str(markers)))
    driver = tmp_path / "driver.py"
    driver.write_text(DRIVER)
    out = tmp_path / "reports"
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([PY, str(driver), str(nb), str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    tree: set[int] = set()
    try:
        files = [markers / "rank0", markers / "rank1"]
        _wait_for(files, proc)
        # papermill, the kernel, the forkserver, the ranks and their children.
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)} | _rank_pids(files)
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert "STATUS interrupted | stopped by SIGTERM" in output, output
        assert still_alive(tree, within=5) == []
        index = json.loads((out / "index.json").read_text())
        assert [(c["name"], c["status"]) for c in index["cases"]] == [("stuck", "interrupted")]
        case = out / "stuck"
        assert {"report.html", "summary.md", "notebook.ipynb", "papermill.log"} <= {p.name for p in case.iterdir()}
        assert not [p.name for p in case.iterdir() if p.name.startswith(".")]  # nothing half-done
        assert "interrupted" in (out / "index.html").read_text()
        # The kernel had a temporary folder of its own (ddplab-launch-*, pymp-* in it) ...
        assert pathlib.Path((markers / "tmpdir").read_text()).parent == scratch
        assert list(scratch.iterdir()) == []  # ... and it is gone
    finally:
        proc.kill()
        proc.communicate()
        for pid in still_alive(tree, within=5):  # on failure, leave nothing running
            psutil.Process(pid).kill()


SLEEPY_CELL = """
import pathlib, time
pathlib.Path({marker!r}).write_text("running")
time.sleep(600)
"""

PARALLEL_DRIVER = """
import pathlib, sys
from ddplab.report import plan_batch, run_batch
from notebook_cases import notebook_case

cases = [notebook_case(n, pathlib.Path(p)) for n, p in zip(("first", "second", "third"), sys.argv[1:4])]
outcomes = run_batch(plan_batch(cases), sys.argv[4], timeout=600, jobs=2)
print("STATUS", [(o.name, o.status) for o in outcomes], flush=True)
"""


def test_sigterm_stops_every_running_notebook_of_a_parallel_batch(tmp_path, scratch):
    markers = [tmp_path / f"running{i}" for i in range(3)]
    notebooks = [str(_notebook(tmp_path / f"nb{i}.ipynb", SLEEPY_CELL.format(marker=str(m))))
                 for i, m in enumerate(markers)]
    driver = tmp_path / "driver.py"
    driver.write_text(PARALLEL_DRIVER)
    out = tmp_path / "reports"
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join([str(REPO), str(REPO / "tests"), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([PY, str(driver), *notebooks, str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env)
    tree: set[int] = set()
    try:
        _wait_for(markers[:2], proc)  # two notebooks at once; the third waits its turn
        tree = {p.pid for p in psutil.Process(proc.pid).children(recursive=True)}
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=60)
        assert "STATUS [('first', 'interrupted'), ('second', 'interrupted')]" in output, output
        assert "not run: third" in output
        assert not markers[2].exists()
        assert still_alive(tree, within=5) == []
        index = json.loads((out / "index.json").read_text())
        assert [(c["name"], c["status"]) for c in index["cases"]] == [
            ("first", "interrupted"), ("second", "interrupted")]
        for name in ("first", "second"):
            assert not [p.name for p in (out / name).iterdir() if p.name.startswith(".")]
    finally:
        proc.kill()
        proc.communicate()
        for pid in still_alive(tree, within=5):
            psutil.Process(pid).kill()


def test_sighup_and_sigint_become_stop_requests_too():
    stop = StopRequest()
    with stop.catching():
        os.kill(os.getpid(), signal.SIGHUP)
        os.kill(os.getpid(), signal.SIGINT)
        time.sleep(0.05)
    assert stop.requested and stop.signal_name == "SIGHUP"  # the first one is reported
    assert signal.getsignal(signal.SIGHUP) == signal.SIG_DFL
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


KILLED_KERNEL_CELLS = [
    """
    import os, pathlib, signal, time
    import torch.distributed as dist
    from ddplab import launch, Launch
    launch(lambda: dist.get_rank(), world_size=2)  # the forkserver is up (its pymp-* folder)
    """,
    """
    import tempfile
    pathlib.Path({folder!r}, "tmpdir").write_text(tempfile.gettempdir())

    def wait(folder):
        path = pathlib.Path(folder) / f"rank{{dist.get_rank()}}"
        path.with_suffix(".tmp").write_text(str(os.getpid()))
        path.with_suffix(".tmp").rename(path)
        time.sleep(600)

    running = Launch(wait, world_size=2, args=({folder!r},), timeout=600).start()  # its ddplab-launch-*
    while len(list(pathlib.Path({folder!r}).glob("rank?"))) < 2:
        time.sleep(0.1)
    os.kill(os.getpid(), signal.SIGKILL)  # the kernel dies without cleaning up
    """,
]


def test_a_killed_kernel_leaves_no_temporary_folders(tmp_path, scratch, monkeypatch):
    markers = tmp_path / "markers"
    markers.mkdir()
    monkeypatch.setenv("TMPDIR", str(scratch))
    monkeypatch.setattr(tempfile, "tempdir", None)
    nb = _notebook(tmp_path / "killed.ipynb", *[c.format(folder=str(markers)) for c in KILLED_KERNEL_CELLS])
    outcome = execute_notebook(nb, tmp_path / "out" / "killed.ipynb", parameters={}, timeout=300,
                               env={"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])})
    assert outcome.status in ("kernel died", "failed"), outcome
    assert sorted(p.name for p in markers.iterdir()) == ["rank0", "rank1", "tmpdir"]  # the ranks ran
    assert still_alive(_rank_pids([markers / "rank0", markers / "rank1"]), within=5) == []
    assert pathlib.Path((markers / "tmpdir").read_text()).parent == scratch  # the kernel's own folder ...
    assert list(scratch.iterdir()) == []  # ... is gone, with ddplab-launch-* and pymp-* in it


def _ranks_running(root: psutil.Process) -> list[psutil.Process]:
    """Processes forked by a forkserver below ``root``: the ranks of a running launch."""
    found = []
    for p in root.children(recursive=True):
        try:
            if "forkserver" in " ".join(p.parent().cmdline()) and "forkserver" in " ".join(p.cmdline()):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied, AttributeError):
            pass
    return found


@pytest.mark.slow  # a real case notebook: kernel, forkserver and ranks start first (10-30 s)
def test_sigterm_to_ddplab_report_stops_a_builtin_case(tmp_path, scratch):
    out = tmp_path / "reports"
    env = {**os.environ, "TMPDIR": str(scratch),
           "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.Popen([PY, "-m", "ddplab", "report", "backend_divergence", "--quick",
                             "--output", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, env=env, cwd=tmp_path)
    tree: set[int] = set()
    try:
        me = psutil.Process(proc.pid)
        deadline = time.monotonic() + 180
        while not _ranks_running(me):
            assert proc.poll() is None, proc.stdout.read()
            assert time.monotonic() < deadline, "no rank started within 180 s"
            time.sleep(0.05)
        # papermill, the kernel, its forkserver, the ranks (and the resource tracker).
        tree = {p.pid for p in me.children(recursive=True)}
        kinds = " ".join(" ".join(psutil.Process(p).cmdline()) for p in tree if psutil.pid_exists(p))
        assert "papermill" in kinds and "ipykernel" in kinds and "forkserver" in kinds
        proc.send_signal(signal.SIGTERM)
        output, _ = proc.communicate(timeout=30)
        assert proc.returncode == 128 + signal.SIGTERM, output
        left = still_alive(tree, within=5)
        assert left == [], [psutil.Process(p).cmdline() for p in left]
        index = json.loads((out / "index.json").read_text())
        assert [(c["name"], c["status"]) for c in index["cases"]] == [("backend_divergence", "interrupted")]
        assert "stopped by SIGTERM" in index["cases"][0]["error"]
        assert not [p.name for p in (out / "backend_divergence").iterdir() if p.name.startswith(".")]
        assert list(scratch.iterdir()) == []  # the run's TMPDIR (pymp-*, ddplab-launch-*) is gone
    finally:
        proc.kill()
        proc.communicate()
        for pid in still_alive(tree, within=5):
            psutil.Process(pid).kill()

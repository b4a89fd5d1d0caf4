"""The batch report: real papermill + nbconvert runs, failures, offline HTML in Chromium."""
from __future__ import annotations

import dataclasses
import json
import pathlib
import re
import shutil
import subprocess
import sys

import nbformat
import pytest

from ddplab.artifacts import atomic_write_text
from ddplab.notebook_run import _PAPERMILL_MAIN
from ddplab.parameters import Parameter, ParameterSet
from ddplab.report import _longest_first, plan_batch, run_batch

from browser import check_pages_offline
from notebook_cases import notebook_case

PS = ParameterSet([
    Parameter("n", 3, "how many points", kind="int", minimum=1),
    Parameter("sizes", [2, 4], "world sizes", kind="list[int]", minimum=1),
])

PARAMS_CELL = ("n = 3  # how many points\n"
               "sizes = [2, 4]  # world sizes\n"
               "results_dir = None  # where to save\n"
               "run_dir = None  # unused here")

OK_CELLS = [
    "import matplotlib.pyplot as plt\n"
    "from ddplab import plots, to_frame, record\n"
    "from ddplab.artifacts import save_results\n"
    "from ddplab.verdict import Verdict, Finding\n"
    "assert isinstance(sizes, list), type(sizes)",
    "records = to_frame([record('loss', 1.0 / (s + 1), step=s, rank=0, world_size=w)\n"
    "                    for w in sizes for s in range(n)])\n"
    "plots.show(plots.metric_lines(records, 'loss', hue='world_size', log=True))",
    "verdict = Verdict('fixture', 'rounding', '{n} records, all finite',\n"
    "                  [Finding('finite', 'every loss is finite', bool(records['value'].notna().all()),\n"
    "                           '{n} values', {'n': len(records)})], values={'n': len(records)},\n"
    "                  scope='the fixture', key_numbers={'records': 'n'})\n"
    "display(verdict)\n"
    "if results_dir:\n"
    "    save_results(results_dir, records=records, verdict=verdict, params={'n': n, 'sizes': sizes},\n"
    "                 environment={'torch': 'fixture'})",
]
FAIL_CELLS = ["print('before the failure')", "raise RuntimeError('planted notebook failure')",
              "print('never reached')"]
SLEEP_CELLS = ["import time\nprint('sleeping', flush=True)", "time.sleep(600)"]


def _notebook(path: pathlib.Path, cells: list[str], key_figure: int | None = None) -> pathlib.Path:
    nb = nbformat.v4.new_notebook()
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    params = nbformat.v4.new_code_cell(PARAMS_CELL)
    params.metadata["tags"] = ["parameters"]
    nb.cells = [nbformat.v4.new_markdown_cell("# fixture"), params]
    for i, src in enumerate(cells):
        cell = nbformat.v4.new_code_cell(src)
        if i == key_figure:
            cell.metadata["tags"] = ["key-figure"]
        nb.cells.append(cell)
    nbformat.write(nb, path)
    return path


def _case(tmp_path, name, cells, **kw):
    nb = _notebook(tmp_path / f"{name}.ipynb", cells, **kw)
    return notebook_case(name, nb, PS, title=f"Fixture {name}", quick={"n": 2})


# ---------------------------------------------------------------- planning (no notebook runs)


def test_plan_merges_defaults_quick_file_and_overrides(tmp_path):
    case = _case(tmp_path, "a", OK_CELLS)
    pfile = tmp_path / "p.yaml"
    pfile.write_text("a:\n  sizes: [3]\n")
    [planned] = plan_batch([case], quick=True, params_file=pfile, overrides=[("n", "7")])
    assert planned.params == {"n": 7, "sizes": [3]}
    [planned] = plan_batch([case], overrides=[("sizes", "[2, 5]")])
    assert planned.params["sizes"] == [2, 5]  # a list given with -p arrives as a string and is parsed


@pytest.mark.parametrize("kwargs, match", [
    (dict(overrides=[("nn", "3")]), "unknown parameter 'nn': no selected case accepts it"),
    (dict(overrides=[("n", "three")]), "case 'a': parameter 'n': got 'three'.*an integer"),
    (dict(overrides=[("sizes", "[0]")]), "parameter 'sizes'.*>= 1"),
    (dict(overrides=[("results_dir", "/tmp/x")]), "set by ddplab report"),
    (dict(overrides=[("run_dir", "/nonexistent/run")]), "is not a directory"),
])
def test_bad_parameters_are_rejected_before_running(tmp_path, kwargs, match):
    with pytest.raises(ValueError, match=match):
        plan_batch([_case(tmp_path, "a", OK_CELLS)], **kwargs)


def test_unknown_case_is_rejected():
    with pytest.raises(ValueError, match="unknown case 'nope'; built-in cases"):
        plan_batch(["nope"])


def test_cli_rejects_bad_input_without_running(tmp_path):
    out = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "ddplab", "report", "nope", "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "unknown case 'nope'" in proc.stderr
    assert not out.exists()


@pytest.mark.parametrize("command", [["-m", "ddplab", "report", "--help"],
                                     ["-c", _PAPERMILL_MAIN, "--help"]], ids=["ddplab", "papermill"])
def test_ddplab_processes_skip_jsonschemas_iri_checker(command):
    """rfc3987_syntax builds a grammar when imported (about 2 s): the CLI and the papermill runner do without."""
    proc = subprocess.run([sys.executable, "-X", "importtime", *command], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    imported = {line.rsplit("|", 1)[-1].strip() for line in proc.stderr.splitlines() if "|" in line}
    assert "nbformat" in imported and "jsonschema" in imported
    # rfc3987_syntax's import is attempted (and refused at once); its grammar library never loads.
    assert "lark" not in imported


@pytest.mark.parametrize("jobs", ["0", "two"])
def test_cli_rejects_bad_jobs_without_running(tmp_path, jobs):
    out = tmp_path / "reports"
    proc = subprocess.run([sys.executable, "-m", "ddplab", "report", "--jobs", jobs, "--output", str(out)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "--jobs: must be a whole number >= 1" in proc.stderr
    assert not out.exists()


def test_run_batch_rejects_bad_jobs(tmp_path):
    with pytest.raises(ValueError, match="jobs must be an int >= 1"):
        run_batch([], tmp_path, jobs=0)
    assert list(tmp_path.iterdir()) == []


def test_parallel_batch_starts_the_longest_cases_first(tmp_path):
    planned = plan_batch([_case(tmp_path, name, OK_CELLS) for name in ("a", "b", "c", "d")])
    # No earlier batch here: planned order.
    assert _longest_first(planned, tmp_path) == [0, 1, 2, 3]
    (tmp_path / "index.json").write_text(json.dumps({"cases": [
        {"name": "a", "seconds": 10.0}, {"name": "b", "seconds": 60.0}, {"name": "d", "seconds": 30.0}]}))
    # c never ran here: first; then b, d, a by their last time.
    assert _longest_first(planned, tmp_path) == [2, 1, 3, 0]


def test_atomic_write_keeps_the_old_file_on_failure(tmp_path):
    path = tmp_path / "report.html"
    atomic_write_text(path, "<html>good</html>")
    with pytest.raises(TypeError):
        atomic_write_text(path, None)  # the write itself fails half-way
    assert path.read_text() == "<html>good</html>"
    assert [p.name for p in tmp_path.iterdir()] == ["report.html"]


# ---------------------------------------------------------------- a real batch


@pytest.fixture(scope="module")
def batch(tmp_path_factory):
    tmp_path = tmp_path_factory.mktemp("batch")
    cases = [_case(tmp_path, "good", OK_CELLS, key_figure=1),
             _case(tmp_path, "broken", FAIL_CELLS),
             _case(tmp_path, "sleepy", SLEEP_CELLS)]
    planned = plan_batch(cases, overrides=[("sizes", "[2, 4]")])
    out = tmp_path / "reports"
    lines = []
    # The first batch: "sleepy" gets a generous timeout per notebook, it still times out.
    outcomes = run_batch(planned, out, timeout=20, echo=lines.append)
    return out, {o.name: o for o in outcomes}, lines, planned


@pytest.mark.slow
def test_each_case_ends_with_its_status(batch):
    out, outcomes, lines, _ = batch
    assert {n: o.status for n, o in outcomes.items()} == {
        "good": "ok", "broken": "failed", "sleepy": "timed out"}
    assert outcomes["good"].verdict.holds("finite")
    assert "planted notebook failure" in outcomes["broken"].error
    assert any("[3/3] sleepy: timed out" in line for line in lines)  # terminal progress
    assert any(line.strip().startswith("total") for line in lines)


@pytest.mark.slow
def test_failed_and_timed_out_reports_still_exist(batch):
    out, outcomes, _, _ = batch
    broken = (out / "broken" / "report.html").read_text()
    assert "planted notebook failure" in broken and "RuntimeError" in broken
    assert "before the failure" in broken
    executed = nbformat.read(out / "broken" / "notebook.ipynb", as_version=4)
    assert executed.cells[-1].outputs == []  # nothing ran after the failing cell
    sleepy = (out / "sleepy" / "report.html").read_text()
    assert "timed out" in sleepy and "sleeping" in sleepy
    for name in ("good", "broken", "sleepy"):
        assert (out / name / "notebook.ipynb").exists() and (out / name / "summary.md").exists()
        assert not list((out / name).glob(".*"))  # no temporary leftovers


@pytest.mark.slow
def test_report_is_self_contained(batch):
    out, _, _, _ = batch
    text = (out / "good" / "report.html").read_text()
    assert len(text) < 2_000_000
    assert "data:image/png;base64," in text
    assert not re.search(r"<(script|link|img|iframe)[^>]+(src|href)=[\"']https?://", text)
    assert "require.js" not in text and "mathjax" not in text.lower().replace("mathjax_", "")
    # The verdict, parameters and environment come first.
    head = text.index("Verdict")
    assert head < text.index("Parameters") < text.index("Environment") < text.index('id="fixture"')


@pytest.mark.slow
def test_index_and_summary(batch):
    out, _, _, planned = batch
    index = json.loads((out / "index.json").read_text())
    assert [(c["name"], c["status"]) for c in index["cases"]] == [
        ("good", "ok"), ("broken", "failed"), ("sleepy", "timed out")]
    html = (out / "index.html").read_text()
    assert "timed out" in html and "good/report.html" in html
    summary = (out / "good" / "summary.md").read_text()
    # Short first: verdict, scope, key numbers, figure, command; the findings folded below.
    assert summary.index("**Verdict (rounding):**") < summary.index("*Scope:* the fixture") \
        < summary.index("| records | 6 |") < summary.index("![key figure]") \
        < summary.index("Reproduce: `ddplab report ") < summary.index("<details>")
    assert "| ✔ holds | every loss is finite |" in summary.split("<details>", 1)[1]
    assert "![key figure](key-figure.png)" in summary
    assert (out / "good" / "key-figure.png").read_bytes().startswith(b"\x89PNG")
    assert "-p sizes" not in summary  # defaults are not repeated in the reproduce command


@pytest.mark.slow
def test_rerun_replaces_reports_whole(batch):
    out, _, _, planned = batch
    good = [p for p in planned if p.name == "good"]
    before = (out / "good" / "report.html").stat().st_mtime_ns
    run_batch(good, out, timeout=60, echo=lambda _: None)
    assert (out / "good" / "report.html").stat().st_mtime_ns > before
    index = json.loads((out / "index.json").read_text())
    # A partial re-run keeps the other cases in the index.
    assert [c["name"] for c in index["cases"]] == ["good", "broken", "sleepy"]
    assert not list((out / "good").glob(".*"))


# ---------------------------------------------------------------- a real browser, offline


@pytest.mark.slow
@pytest.mark.browser
def test_pages_render_offline_in_chromium(batch, tmp_path):
    out, _, _, _ = batch
    check_pages_offline({"index": out / "index.html", "good": out / "good" / "report.html"}, tmp_path)


# A cell that writes when it started and ended.
TIMED_CELL = ("import pathlib, time\n"
              "stamp = pathlib.Path({folder!r}) / '{name}'\n"
              "start = time.time(); time.sleep(3)\n"
              "stamp.write_text(f'{{start}} {{time.time()}}')")


def test_parallel_batch_runs_notebooks_side_by_side(tmp_path):
    stamps = tmp_path / "stamps"
    stamps.mkdir()
    cases = [_case(tmp_path, name, [TIMED_CELL.format(folder=str(stamps), name=name)] + cells)
             for name, cells in (("good", OK_CELLS), ("broken", FAIL_CELLS))]
    out = tmp_path / "reports"
    lines = []
    outcomes = run_batch(plan_batch(cases), out, timeout=120, echo=lines.append, jobs=2)
    # Planned order and each case's own status, whatever order they finished in.
    assert [(o.name, o.status) for o in outcomes] == [("good", "ok"), ("broken", "failed")]
    assert "planted notebook failure" in outcomes[1].error
    index = json.loads((out / "index.json").read_text())
    assert [(c["name"], c["status"]) for c in index["cases"]] == [("good", "ok"), ("broken", "failed")]
    for name in ("good", "broken"):
        assert {"report.html", "summary.md", "notebook.ipynb"} <= {p.name for p in (out / name).iterdir()}
        assert not list((out / name).glob(".*"))
    # The two timed cells overlapped: both notebooks were running at once.
    (a0, a1), (b0, b1) = (map(float, (stamps / n).read_text().split()) for n in ("good", "broken"))
    assert max(a0, b0) < min(a1, b1), ((a0, a1), (b0, b1))
    assert any("[1/2] good: ok" in line for line in lines)
    assert any("[2/2] broken: failed" in line for line in lines)


def test_rules_across_parameters_are_checked_before_running():
    # Each value is valid alone; together they are not (live NCCL needs backend nccl).
    with pytest.raises(ValueError, match="case 'backend_divergence'.*nccl"):
        plan_batch(["backend_divergence"], overrides=[("orders", "[gloo, nccl_live_ring]")])


def test_published_files_are_shareable_and_name_no_local_path(tmp_path, monkeypatch):
    """Mode 0666 less the umask, no machine path inside, no stale figure after a failed re-run."""
    import os

    from ddplab.artifacts import local_path_scrubber

    monkeypatch.chdir(tmp_path)
    old = os.umask(0o022)
    try:
        [planned] = plan_batch([_case(tmp_path, "good", OK_CELLS, key_figure=1)])
        run_batch([planned], "reports", timeout=120, echo=lambda _: None)
        files = [p for p in (tmp_path / "reports").rglob("*") if p.is_file()]
        assert {f.name for f in files} >= {"report.html", "summary.md", "index.html", "index.json",
                                         "verdict.json", "records.jsonl", "key-figure.png"}
        for f in files:
            assert f.stat().st_mode & 0o777 == 0o644, (f, oct(f.stat().st_mode))
            text = f.read_text(errors="replace")
            scrubbed = local_path_scrubber(planned.case.notebook_path().parent)(text)
            for path in {str(tmp_path), os.getcwd(), sys.prefix, os.path.expanduser("~")}:
                if f.suffix == ".png":
                    continue
                assert path not in text or text == scrubbed, (f, path)
            if f.suffix != ".png":
                assert text == scrubbed, f
        # The same case failing on a re-run: its old key figure must not stay beside the new report.
        broken = notebook_case("good", _notebook(tmp_path / "b.ipynb", FAIL_CELLS), PS)
        run_batch([dataclasses.replace(planned, case=broken)], "reports", timeout=120, echo=lambda _: None)
        assert not (tmp_path / "reports" / "good" / "key-figure.png").exists()
        assert "key-figure" not in (tmp_path / "reports" / "good" / "summary.md").read_text()
    finally:
        os.umask(old)

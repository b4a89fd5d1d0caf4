"""The pages a batch publishes, rendered from data: what the index lists, which parameter
values they show, and that no text from data can run as script (real headless Chromium)."""
from __future__ import annotations

import html
import json
import os
import pathlib
import re
import subprocess
import sys

import nbformat
import pandas as pd
import pytest

from ddplab import markup
from ddplab.cases import get_case
from ddplab.glossary import NotebookStatus
from ddplab.html_report import header_markdown, notebook_to_html
from ddplab.index_page import CaseOutcome, index_html, summary_markdown
from ddplab.verdict import Finding, Verdict

from browser import INJECTED, inert_page_facts

REPO = pathlib.Path(__file__).resolve().parent.parent

SCRIPT = f"<script>window.{INJECTED}=1; alert('script')</script>"
IMAGE = f"<img src=x onerror=window.{INJECTED}=1>"
#: A backtick first: inside a code span it would end the span and free what follows.
PAYLOAD = f"x`{SCRIPT}` {IMAGE} `y"


def _verdict(case: str = "c") -> Verdict:
    return Verdict(case, "rounding", "Rounding, not a bug: {what} (ratio {r:.2g}). With {w} ranks more. Third.",
                   [Finding("k", "claim about {what}", True, "evidence {what}", {"what": PAYLOAD})],
                   values={"what": PAYLOAD, "r": 0.5, "w": 4}, scope=f"scope {PAYLOAD}",
                   key_numbers={PAYLOAD: "r"})


def _outcome(**kw) -> CaseOutcome:
    data = dict(name="backend_divergence", title="A title", reproduces="backend_divergence",
                status="ok", seconds=1.0, verdict=_verdict(), report="backend_divergence/report.html",
                summary="backend_divergence/summary.md", notebook="backend_divergence/notebook.ipynb")
    data.update(kw)
    return CaseOutcome(**data)


# ---------------------------------------------------------------- what the index lists


def test_the_index_row_is_the_kind_and_the_headlines_first_sentence():
    page = index_html([_outcome(verdict=_verdict())], total_seconds=1.0)
    first = _verdict().headline_line
    assert first.endswith("(ratio 0.5).") and "With 4 ranks" not in first
    assert html.escape(first) in page and "With 4 ranks" not in page
    assert "<b>rounding</b>" in page
    # The row names the reproduced report, not the case's own name a second time.
    assert "reproduces backend_divergence" not in page and "reproduces “" in page


def test_a_parameter_shows_what_ran_and_what_was_given():
    case = get_case("your_training")
    given = case.check_params({"steps": 0})
    records = pd.DataFrame({"step": [0, 1, 5, None], "metric": ["a"] * 4, "value": [1.0] * 4})
    ran = case.params_as_run(given, records)
    assert ran["steps"] == 6 and given["steps"] == 0
    assert case.params_as_run({**given, "steps": 2}, records)["steps"] == 2  # not a sentinel: kept
    rows = {line.split("|")[1].strip(): line.split("|")[2].strip()
            for line in markup.parameters_table(ran, given).splitlines()[2:]}
    assert rows["steps"] == f"{markup.code(6)} (given {markup.code(0)})"
    assert rows[markup.text("world_size")] == markup.code(2)


# ---------------------------------------------------------------- nothing from data runs


def _payload_notebook() -> nbformat.NotebookNode:
    """A notebook as a run leaves it: the parameters shown, printed output, an error, a formula."""
    v4 = nbformat.v4
    params = v4.new_code_cell("lab = notebook.setup('x')")
    params.outputs = [v4.new_output("display_data", data={
        "text/markdown": "### Parameters\n\n" + markup.parameters_table({"data_root": PAYLOAD})})]
    printed = v4.new_code_cell("print(data_root)")
    printed.outputs = [v4.new_output("stream", name="stdout", text=PAYLOAD + "\n")]
    failed = v4.new_code_cell("records = lab.run()")
    failed.outputs = [v4.new_output("error", ename="RunIncomplete", evalue=PAYLOAD, traceback=[PAYLOAD])]
    formula = v4.new_code_cell("display(Markdown(...))")
    formula.outputs = [v4.new_output("display_data", data={
        "text/markdown": f"the formula $\\text{{{SCRIPT}}}$ here"})]
    return v4.new_notebook(cells=[params, printed, failed, formula])


def _payload_pages(folder: pathlib.Path) -> dict[str, pathlib.Path]:
    header = header_markdown(title=f"Title {PAYLOAD}", status=NotebookStatus.FAILED, seconds=2.0,
                             verdict=_verdict(), params={"data_root": PAYLOAD, "steps": 6},
                             given={"steps": f"{PAYLOAD}"}, environment={"cpu": PAYLOAD, "note": PAYLOAD},
                             failing_cell=2, error=f"RunIncomplete: {PAYLOAD}",
                             failing_source=f"run({PAYLOAD!r})\n```\n{IMAGE}")
    report = folder / "report.html"
    report.write_text(notebook_to_html(_payload_notebook(), header=header, no_input=True))
    index = folder / "index.html"
    index.write_text(index_html([_outcome(title=PAYLOAD, name=PAYLOAD, status="failed", error=PAYLOAD,
                                          key_figure=f"{PAYLOAD}.png", report=f"{PAYLOAD}/report.html")],
                                total_seconds=1.0))
    return {"report": report, "index": index}


@pytest.mark.browser
def test_no_text_from_data_runs_in_the_pages_and_each_shows_literally(tmp_path):
    for name, page in _payload_pages(tmp_path).items():
        facts = inert_page_facts(page)
        assert (facts["ran"], facts["dialogs"], facts["handlers"], facts["scripts"]) == (False, [], [], []), name
        assert SCRIPT in facts["text"] and IMAGE in facts["text"], name
    report_text = inert_page_facts(tmp_path / "report.html")["text"]
    # Every field: title, error, parameter, environment, verdict, notebook output, the failing cell.
    for shown in (f"Title {PAYLOAD}", f"RunIncomplete: {PAYLOAD}", repr(PAYLOAD), f"scope {PAYLOAD}",
                  f"claim about {PAYLOAD}", f"evidence {PAYLOAD}", IMAGE):
        assert shown in report_text, shown


def test_the_summary_shows_data_literally_in_a_markdown_renderer():
    from nbconvert.filters.markdown import markdown2html

    summary = summary_markdown(_outcome(title=PAYLOAD, status="failed", error=PAYLOAD),
                               params={"data_root": PAYLOAD}, environment={"cpu": PAYLOAD},
                               figure_name=None, command=f"ddplab report x -p data_root '{PAYLOAD}'")
    rendered = markdown2html(summary)
    assert "<script" not in rendered and "<img" not in rendered
    shown = html.unescape(re.sub(r"<[^>]+>", "", rendered))
    # Title, status, verdict headline, scope, key number, command, claim, evidence, parameter, environment.
    assert shown.count(PAYLOAD) == 10


# ---------------------------------------------------------------- end to end: a run folder's error


@pytest.mark.browser
def test_a_run_folders_error_and_a_path_with_markup_stay_text_in_the_report(tmp_path):
    """Issue 33 item 7: rank-0.error.json holding a script, in a run folder named with a backtick
    and an <img onerror>, through `ddplab report` (papermill, nbconvert) into Chromium."""
    run = tmp_path / f"run`{IMAGE}`"
    run.mkdir()
    (run / "rank-0.jsonl").write_text("")
    (run / "rank-0.error.json").write_text(json.dumps(
        {"rank": 0, "type": "RuntimeError", "message": SCRIPT, "time": 1.0}))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-m", "ddplab", "report", "backend_divergence", "--output", "out",
                           "-p", "run_dir", str(run), "--timeout", "300"],
                          capture_output=True, text=True, cwd=tmp_path, env=env, timeout=400)
    assert proc.returncode == 1, proc.stdout + proc.stderr  # the case failed: its run did not complete
    index = json.loads((tmp_path / "out" / "index.json").read_text())
    assert index["cases"][0]["status"] == "failed" and SCRIPT in index["cases"][0]["error"]
    facts = inert_page_facts(tmp_path / "out" / "backend_divergence" / "report.html")
    assert (facts["ran"], facts["dialogs"], facts["handlers"], facts["scripts"]) == (False, [], [], [])
    assert SCRIPT in facts["text"] and IMAGE in facts["text"]
    assert inert_page_facts(tmp_path / "out" / "index.html")["ran"] is False


def test_the_page_renderers_sit_below_the_case_framework():
    """html_report and index_page render from data: importing them loads no case, notebook helper
    or comparison (they used to import the parameters table from ddplab.notebook)."""
    code = ("import sys, ddplab.html_report, ddplab.index_page; print(sorted(m for m in sys.modules "
            "if m.startswith(('ddplab.cases', 'ddplab.notebook', 'ddplab.compare', 'ddplab.report'))))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"

"""``ddplab report``: run the case notebooks with papermill and publish reports/.

For every selected case: validate its parameters (before any notebook runs),
execute the notebook in a subprocess under a per-notebook timeout, then
write ``reports/<case>/``: ``report.html`` (self-contained, offline),
``summary.md`` + ``key-figure.png`` (for issue threads), the executed
``notebook.ipynb``, ``results/`` (records, verdict, parameters, environment)
and ``papermill.log``. Finally ``reports/index.html`` lists every case.
A failing or timed-out notebook does not stop the others; the command exits
non-zero if any case did not end ok. A case's files are written under
temporary names and renamed into place together once all are written, so a
re-run -- or a disk that fills up, while the notebook runs or while its
report is written -- never leaves a half-written report behind; a case whose
files cannot be written ends "failed", saying why, and keeps its earlier report.

Everything checkable is checked before any notebook runs (:func:`plan_batch`):
names, values, the rules between them -- and for a case whose check calls
the user's code (``-p setup mypackage:fn``), that call is bounded by
``--timeout`` and its ``sys.exit()`` is an error (:mod:`ddplab.user_code`).

``jobs`` notebooks run at once (``--jobs``). Each case is mostly one process
at a time -- a kernel drawing figures, a papermill waiting, two ranks
waiting on each other -- so on 2 cores two notebooks side by side finish the
four built-in cases in about three quarters of the time of one after the other.
Their launches then share the cores, so each case's own run time grows.
"""
from __future__ import annotations

import base64
import dataclasses
import errno
import json
import os
import pathlib
import shlex
import shutil
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

import nbformat
import yaml

from ddplab.artifacts import atomic_write_files, load_results, local_path_scrubber, scrub_notebook
from ddplab.cases import Case, case_names, check_case_name, get_case
from ddplab.environment import environment_info
from ddplab.glossary import NotebookStatus
from ddplab.html_report import header_markdown, notebook_to_html
from ddplab.index_page import CaseOutcome, summary_markdown, write_index
from ddplab.notebook import IO_PARAMETERS
from ddplab.notebook_run import ExecutionOutcome, StopRequest, execute_notebook
from ddplab.progress import PROGRESS_FILE_ENV, read_progress
from ddplab.user_code import call_bounded
from ddplab.verdict import Verdict, verdicts_from_notebook

__all__ = ["PlannedCase", "Batch", "check_output_dir", "plan_batch", "run_batch", "run_report",
           "DEFAULT_TIMEOUT", "IO_PARAMETERS"]

#: Seconds one notebook may run before it is stopped and reported as timed out; also the
#: seconds a case's parameter check may take (it may call the user's code).
DEFAULT_TIMEOUT = 900.0


@dataclasses.dataclass
class PlannedCase:
    """A case the batch will run: the case, its validated parameters (the notebook's input/output
    parameters among them), how the user named it (a built-in name or a module path) and the
    steps each of its launches will report, by progress label (for the progress line)."""

    case: Case
    params: dict
    named: str
    steps: dict[str, int] = dataclasses.field(default_factory=dict)

    @property
    def name(self) -> str:
        return self.case.name


def _checked(case: Case, values: dict) -> tuple[dict, dict[str, int]]:
    """The case's full parameters and its launches' steps (both may call the user's code)."""
    params = case.check_params(values)
    return params, {f"{case.name} {p.label}".strip(): p.steps for p in case.launches(params) if p.steps}


def _as_case(item: "str | Case") -> tuple[Case, str]:
    """The case ``item`` names and how a command names it; ValueError before anything runs."""
    case = get_case(item)
    check_case_name(case.name)  # it becomes a folder under --output
    notebook = case.notebook_path()
    if not notebook.exists():
        raise ValueError(f"case {case.name!r}: notebook {notebook} does not exist")
    if isinstance(item, str):
        return case, item
    return case, case.name if case.name in case_names() else type(case).__module__


def _read_params_file(params_file, selected: set[str]) -> tuple[dict[str, dict], dict]:
    """``(per case, shared)`` from a YAML parameters file (see :func:`plan_batch`)."""
    try:
        loaded = yaml.safe_load(pathlib.Path(params_file).read_text()) or {}
    except OSError as exc:
        raise ValueError(f"cannot read parameters file {params_file}: {exc}") from None
    except yaml.constructor.ConstructorError as exc:
        # safe_load builds plain data only: a tag such as !!python/object would run code.
        raise ValueError(f"parameters file {params_file} holds a YAML tag that is not plain data "
                         f"({exc.problem}); only plain YAML is read (mappings, lists, numbers, "
                         f"strings)") from None
    except yaml.YAMLError as exc:
        raise ValueError(f"parameters file {params_file} is not valid YAML: {exc}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"parameters file {params_file} must hold a mapping")
    per_case: dict[str, dict] = {}
    shared: dict = {}
    for key, value in loaded.items():
        if key in case_names() or key in selected:
            if key not in selected:
                continue  # a section for a case not selected this time
            if not isinstance(value, dict):
                raise ValueError(f"parameters file {params_file}: section {key!r} must be a mapping")
            per_case[key] = value
        else:
            shared[key] = value
    return per_case, shared


def plan_batch(cases: Iterable["str | Case"] = (), *, overrides: Iterable[tuple[str, str]] = (),
               params_file: str | os.PathLike | None = None, quick: bool = False,
               timeout: float = DEFAULT_TIMEOUT) -> list[PlannedCase]:
    """Validated parameters per case: defaults < quick < params file < ``-p`` overrides.

    ``cases``: built-in names, module paths or :class:`~ddplab.cases.Case` s
    (default: every built-in case). ``params_file`` is YAML: ``{case: {name:
    value}}`` per case, or a flat ``{name: value}`` applied like ``-p``. A
    ``-p``/flat name applies to every selected case that declares it and is
    an error if none does. Each case's check runs within ``timeout`` seconds
    (:func:`~ddplab.user_code.call_bounded`: it may call the user's code).
    Raises ValueError (naming the case and parameter) before anything runs.
    """
    selected = [_as_case(item) for item in (list(cases) or case_names())]
    names = {case.name for case, _ in selected}
    per_case, shared = _read_params_file(params_file, names) if params_file is not None else ({}, {})
    shared.update(dict(overrides))
    for key in shared:
        if not any(key in case.parameters or key in IO_PARAMETERS for case, _ in selected):
            accepted = "; ".join(f"{case.name}: {', '.join(case.parameters.names() + list(IO_PARAMETERS))}"
                                 for case, _ in selected)
            raise ValueError(f"unknown parameter {key!r}: no selected case accepts it ({accepted})")
    planned = []
    for case, named in selected:
        values = dict(case.quick) if quick else {}
        values.update({k: v for k, v in shared.items() if k in case.parameters or k in IO_PARAMETERS})
        values.update(per_case.get(case.name, {}))
        io = {k: values.pop(k) for k in list(values) if k in IO_PARAMETERS}
        if "results_dir" in io:
            raise ValueError("parameter 'results_dir' is set by ddplab report (reports/<case>/results)")
        given = ", ".join(f"{k}={v!r}" for k, v in values.items())
        try:
            params, steps = call_bounded(_checked, case, values, timeout=timeout,
                                         what=f"checking its parameters ({given or 'the defaults'})")
        except ValueError as exc:
            raise ValueError(f"case {case.name!r}: {exc}") from None
        if io.get("run_dir") is not None and not pathlib.Path(io["run_dir"]).is_dir():
            raise ValueError(f"case {case.name!r}: parameter 'run_dir': {io['run_dir']!r} is not a directory")
        params.update(io)
        planned.append(PlannedCase(case, params, named, steps))
    return planned


def _replace_dir(new: pathlib.Path, final: pathlib.Path) -> None:
    """Put directory ``new`` at ``final``, removing the old one only once the new is in place."""
    old = final.with_name(f".{final.name}.old")
    shutil.rmtree(old, ignore_errors=True)
    if final.exists():
        os.replace(final, old)
    if new.exists():
        os.replace(new, final)
    shutil.rmtree(old, ignore_errors=True)


def _key_figure(nb) -> bytes | None:
    """PNG of the cell tagged ``key-figure``, else the notebook's first PNG."""
    def pngs(cells):
        for cell in cells:
            for out in cell.get("outputs", []):
                data = out.get("data", {})
                if "image/png" in data:
                    yield base64.b64decode(data["image/png"])
    tagged = [c for c in nb.cells if "key-figure" in c.get("metadata", {}).get("tags", [])]
    for png in pngs(tagged):
        return png
    for png in pngs(nb.cells):
        return png
    return None


def _progress_line(name: str, elapsed: float, bars: dict[str, dict], planned: dict[str, int]) -> str:
    """``case: W=4 12/20 steps · 45 s, about 30 s left`` from the progress file's bars."""
    if not bars:
        return f"{name}: starting, {elapsed:.0f} s"
    desc, state = list(bars.items())[-1]
    label = desc[len(name):].strip() if desc.startswith(name) else desc
    text = f"{name}: {label + ' ' if label else ''}{state['n']}/{state['total']} steps, {elapsed:.0f} s"
    total = sum(planned.values()) or sum(b["total"] for b in bars.values())
    done = sum(min(b["n"], b["total"]) for b in bars.values())
    if total and 0 < done < total:
        text += f", about {elapsed * (total - done) / done:.0f} s left"
    return text


def _progress_printer(name: str, index: int, total: int, echo: Callable[[str], None],
                      progress_file: pathlib.Path, planned: dict[str, int], *, interactive: bool):
    """``on_poll`` for :func:`execute_notebook`: one updating line per case on a terminal
    (``interactive``), else a line every 15 s."""
    state = {"last": 0.0}

    def on_poll(elapsed: float, cell: int | None) -> None:
        line = f"[{index}/{total}] " + _progress_line(name, elapsed, read_progress(progress_file), planned)
        if interactive:
            sys.stdout.write("\r" + line.ljust(78))
            sys.stdout.flush()
        elif elapsed - state["last"] >= 15:
            state["last"] = elapsed
            echo(line)

    return on_poll


def _reproduce_command(planned: PlannedCase, given: dict) -> str:
    defaults = planned.case.parameters.defaults()
    overrides = " ".join(f"-p {k} {shlex.quote(v if isinstance(v, str) else json.dumps(v))}"
                         for k, v in given.items()
                         if (k in IO_PARAMETERS and v is not None) or (k in defaults and v != defaults[k]))
    return f"ddplab report {planned.named} {overrides}".strip()


#: How a disk refuses a case's files: full, read-only, over quota, too large, not allowed, failing.
_WRITE_REFUSED = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                  errno.EIO}
#: Publishing (nbconvert, the files) takes a second; one case at a time keeps it simple.
_PUBLISH_LOCK = threading.Lock()
#: What a running case writes in its folder: renamed or removed once it is published.
_EXECUTING, _NEW_RESULTS, _PROGRESS, _LOG = (".notebook.executing.ipynb", ".results.new",
                                              ".progress.jsonl", ".papermill.log")


@dataclasses.dataclass
class Batch:
    """What every case of one batch shares: where reports go, the limits, how progress is told."""

    out_dir: pathlib.Path
    total: int
    timeout: float = DEFAULT_TIMEOUT
    no_input: bool = False
    echo: Callable[[str], None] = print
    stop: StopRequest = dataclasses.field(default_factory=StopRequest)
    #: One updating progress line on a terminal (one case at a time), else a line every 15 s.
    interactive: bool = False

    def case_dir(self, planned: PlannedCase) -> pathlib.Path:
        return self.out_dir / planned.name

    def say(self, index: int, text: str) -> None:
        self.echo(f"[{index}/{self.total}] {text}")


def _run_one(batch: Batch, index: int, planned: PlannedCase) -> CaseOutcome:
    """Run one case's notebook and publish it; a disk that refuses its files makes it "failed"."""
    t0 = time.perf_counter()
    outcome = None
    try:
        outcome = _execute(batch, index, planned)
        with _PUBLISH_LOCK:
            return _publish(batch, index, planned, outcome)
    except OSError as exc:
        if exc.errno not in _WRITE_REFUSED:
            raise
        # The disk, not the case: the other cases still run (and may fit).
        return _unpublished(batch, index, planned, time.perf_counter() - t0, exc, outcome)


def _execute(batch: Batch, index: int, planned: PlannedCase) -> ExecutionOutcome:
    """Run the case's notebook into its folder's scratch files (papermill, under the timeout)."""
    case_dir = batch.case_dir(planned)
    case_dir.mkdir(parents=True, exist_ok=True)
    new_results, progress_file = case_dir / _NEW_RESULTS, case_dir / _PROGRESS
    shutil.rmtree(new_results, ignore_errors=True)
    progress_file.unlink(missing_ok=True)
    # The kernel runs where `ddplab report` runs, so the user's relative paths (run_dir, data_root)
    # mean what they meant, and the results folder is named relative to it: no machine path is
    # written into the published notebook.
    nb_params = {**planned.params, "results_dir": os.path.relpath(new_results)}
    batch.say(index, f"{planned.name}: started")
    outcome = execute_notebook(
        planned.case.notebook_path(), case_dir / _EXECUTING, parameters=nb_params, timeout=batch.timeout,
        cwd=os.getcwd(), log_path=case_dir / _LOG,
        env={"DDPLAB_BATCH": "1", "PYTHONUNBUFFERED": "1",
             PROGRESS_FILE_ENV: str(progress_file.resolve())},
        on_poll=_progress_printer(planned.name, index, batch.total, batch.echo, progress_file,
                                  planned.steps, interactive=batch.interactive),
        stop=batch.stop)
    if batch.interactive:
        sys.stdout.write("\n")
    progress_file.unlink(missing_ok=True)
    return outcome


@dataclasses.dataclass
class _Executed:
    """What a finished execution left, read back: the notebook, the verdict, the parameters as
    given and as they ran, the environment, and what could not be read (said in the report)."""

    nb: nbformat.NotebookNode
    verdict: Verdict | None
    given: dict
    ran: dict
    environment: dict
    problems: list[str]


def _read_notebook(planned: PlannedCase, executing: pathlib.Path, problems: list[str]):
    """The executed notebook; the case's own (unexecuted) one where papermill left none or a
    file cut short (a full disk, a kill in the middle of a save)."""
    if executing.exists():
        try:
            return nbformat.read(executing, as_version=4)
        except (OSError, ValueError) as exc:  # nbformat's NotJSONError is a ValueError
            problems.append(f"papermill's output notebook could not be read ({type(exc).__name__}: "
                            f"{str(exc).splitlines()[0][:120]}), so the report shows the notebook "
                            "without its outputs")
    return nbformat.read(planned.case.notebook_path(), as_version=4)


def _read_back(planned: PlannedCase, case_dir: pathlib.Path) -> _Executed:
    """Read what the notebook left in ``case_dir`` (:class:`_Executed`)."""
    problems: list[str] = []
    nb = _read_notebook(planned, case_dir / _EXECUTING, problems)
    given, verdict, environment, records = dict(planned.params), None, None, None
    try:
        saved = load_results(case_dir / _NEW_RESULTS)
        verdict, environment, records = saved.verdict, saved.environment, saved.records
        # What the notebook used (a run_dir brings its own parameters).
        given.update({k: v for k, v in saved.params.items() if k in planned.case.parameters})
    except FileNotFoundError:
        pass
    except (OSError, ValueError) as exc:  # a results file cut short
        problems.append(f"its results could not be read ({type(exc).__name__}: {exc})")
    if verdict is None:
        found = verdicts_from_notebook(nb.cells)
        verdict = found[-1] if found else None
    if environment is None:
        environment = {**environment_info(backend=planned.case.parameters.role_value(given, "backend")),
                       "note": "of the machine that ran the batch; the notebook saved none"}
    given = {k: v for k, v in given.items() if not (k in IO_PARAMETERS and v is None)}
    ran = dict(given)
    if records is not None:
        case_params = {k: v for k, v in given.items() if k in planned.case.parameters}
        ran.update(planned.case.params_as_run(case_params, records))
    return _Executed(nb, verdict, given, ran, environment, problems)


def _publish(batch: Batch, index: int, planned: PlannedCase, outcome: ExecutionOutcome) -> CaseOutcome:
    """Write ``out_dir/<case>/`` from a finished execution: results, report, summary, notebook, log.

    All of it or none: every file is composed first and written under a
    temporary name, then all are renamed into place and the results folder
    swapped in (:func:`~ddplab.artifacts.atomic_write_files`). A write that
    fails (a full or read-only disk) raises OSError and leaves the previous
    report of the case as it was.
    """
    case_dir = batch.case_dir(planned)
    done = _read_back(planned, case_dir)
    if done.problems:
        status = NotebookStatus.FAILED if outcome.ok else outcome.status
        outcome = dataclasses.replace(outcome, status=status,
                                      error="; ".join(filter(None, [outcome.error, *done.problems])))
    files, result = _compose(batch, planned, outcome, done)
    atomic_write_files({path: data.encode("utf-8") if isinstance(data, str) else data
                        for path, data in files.items()})
    _replace_dir(case_dir / _NEW_RESULTS, case_dir / "results")
    if result.key_figure is None:  # never leave an earlier run's figure beside this run's report
        (case_dir / "key-figure.png").unlink(missing_ok=True)
    _remove_scratch(case_dir)
    verdict = done.verdict
    where = f" (cell {outcome.failing_cell})" if outcome.failing_cell is not None and not outcome.ok else ""
    batch.say(index, f"{planned.name}: {outcome.status}{where} in {outcome.seconds:.1f} s"
              + (f" — {verdict.kind}: {verdict.headline_line}" if verdict else "")
              + (f" — {outcome.error}" if not outcome.ok else ""))
    return result


def _compose(batch: Batch, planned: PlannedCase, outcome: ExecutionOutcome,
             done: _Executed) -> tuple[dict[pathlib.Path, str | bytes], CaseOutcome]:
    """Every file of the case's report, in memory, and the case's entry in the index."""
    case, case_dir, nb = planned.case, batch.case_dir(planned), done.nb
    failing_source = None
    if outcome.failing_cell is not None and outcome.failing_cell < len(nb.cells) and batch.no_input:
        failing_source = nb.cells[outcome.failing_cell].source
    header = header_markdown(title=case.title, status=outcome.status, seconds=outcome.seconds,
                             verdict=done.verdict, params=done.ran, given=done.given,
                             environment=done.environment, failing_cell=outcome.failing_cell,
                             error=outcome.error, failing_source=failing_source)
    scrub = local_path_scrubber(case.notebook_path().parent)
    scrub_notebook(nb, scrub)
    files: dict[pathlib.Path, str | bytes] = {
        case_dir / "report.html": notebook_to_html(nb, header=scrub(header), no_input=batch.no_input)}
    png = _key_figure(nb)
    if png is not None:
        files[case_dir / "key-figure.png"] = png
    result = CaseOutcome(
        name=case.name, title=case.title, reproduces=case.reproduces, status=outcome.status,
        seconds=outcome.seconds, verdict=done.verdict, report=f"{case.name}/report.html",
        summary=f"{case.name}/summary.md", notebook=f"{case.name}/notebook.ipynb",
        key_figure=f"{case.name}/key-figure.png" if png is not None else None, error=outcome.error)
    files[case_dir / "summary.md"] = summary_markdown(
        result, params=done.ran, given=done.given, environment=done.environment,
        figure_name="key-figure.png" if png is not None else None,
        command=_reproduce_command(planned, done.given))
    if (case_dir / _EXECUTING).exists():
        nb.metadata.get("papermill", {}).pop("input_path", None)
        nb.metadata.get("papermill", {}).pop("output_path", None)
        files[case_dir / "notebook.ipynb"] = nbformat.writes(nb)
    log = case_dir / _LOG
    if log.exists():
        files[case_dir / "papermill.log"] = scrub(log.read_text(errors="replace"))
    return files, result


def _remove_scratch(case_dir: pathlib.Path) -> None:
    """Remove what a running case writes in its folder (the notebook being executed, its log, ...)."""
    for name in (_EXECUTING, _PROGRESS, _LOG):
        (case_dir / name).unlink(missing_ok=True)
    (case_dir / _EXECUTING).with_suffix(".params.yaml").unlink(missing_ok=True)
    shutil.rmtree(case_dir / _NEW_RESULTS, ignore_errors=True)
    for stale in case_dir.glob(".*.tmp"):  # a staged file a killed writer left (artifacts._stage)
        stale.unlink(missing_ok=True)


def _unpublished(batch: Batch, index: int, planned: PlannedCase, seconds: float, exc: OSError,
                 outcome: ExecutionOutcome | None) -> CaseOutcome:
    """The outcome of a case whose files could not be written: failed, saying why and where."""
    case_dir = batch.case_dir(planned)
    _remove_scratch(case_dir)
    where = f" ({exc.filename})" if exc.filename else ""
    error = (f"its report could not be written to {case_dir}: {exc.strerror or exc}{where} "
             f"(any earlier report there is unchanged)")
    if outcome is not None and not outcome.ok:
        error += f"; the notebook itself ended {outcome.status}: {outcome.error}"
    batch.say(index, f"{planned.name}: failed in {seconds:.1f} s — {error}")
    case = planned.case
    return CaseOutcome(
        name=case.name, title=case.title, reproduces=case.reproduces, status=NotebookStatus.FAILED,
        seconds=seconds, verdict=None, report=f"{case.name}/report.html", summary=f"{case.name}/summary.md",
        notebook=f"{case.name}/notebook.ipynb", error=error)


def _merge_with_previous(out_dir: pathlib.Path, outcomes: list[CaseOutcome]) -> list[CaseOutcome]:
    """Keep the index entries of cases not run this time (a partial re-run)."""
    path = out_dir / "index.json"
    ran = {o.name for o in outcomes}
    previous = []
    if path.exists():
        try:
            for data in json.loads(path.read_text()).get("cases", []):
                if data["name"] not in ran and (out_dir / data["report"]).exists():
                    data = dict(data)
                    data["verdict"] = Verdict.from_dict(data["verdict"]) if data.get("verdict") else None
                    previous.append(CaseOutcome(**data))
        except (ValueError, KeyError, TypeError):
            previous = []
    order = {name: i for i, name in enumerate(case_names())}
    merged = outcomes + previous
    return sorted(merged, key=lambda o: order.get(o.name, len(order)))


def _longest_first(planned: list[PlannedCase], out_dir: pathlib.Path) -> list[int]:
    """Indices of ``planned`` in the order a parallel batch starts them.

    Longest first, by the seconds each case took in the last batch written
    to ``out_dir`` (its index.json), so that no long case starts last and
    runs alone; cases without a previous time go first, in planned order.
    """
    seconds: dict[str, float] = {}
    try:
        for case in json.loads((out_dir / "index.json").read_text()).get("cases", []):
            seconds[case["name"]] = float(case["seconds"])
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return sorted(range(len(planned)), key=lambda i: (planned[i].name in seconds,
                                                      -seconds.get(planned[i].name, 0.0), i))


def run_batch(planned: list[PlannedCase], out_dir: str | os.PathLike, *,
              timeout: float = DEFAULT_TIMEOUT, no_input: bool = False,
              echo: Callable[[str], None] = print,
              stop: StopRequest | None = None, jobs: int = 1) -> list[CaseOutcome]:
    """Run every planned case, ``jobs`` at a time, write each report, then the index; return the outcomes.

    The outcomes come in planned order whatever order the cases ran in (with
    ``jobs > 1``, longest first: :func:`_longest_first`). SIGINT, SIGTERM and
    SIGHUP (or ``stop.request()``) stop the batch: every running notebook's
    whole process tree is killed, its report and the index are written with
    status "interrupted", and the cases not started are skipped (the index
    keeps their previous entries).
    """
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    batch = Batch(out_dir=pathlib.Path(out_dir), total=len(planned), timeout=timeout, no_input=no_input,
                  echo=echo, stop=stop or StopRequest(), interactive=jobs == 1 and sys.stdout.isatty())
    batch.out_dir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    results: dict[int, CaseOutcome] = {}

    def run(i: int) -> None:
        if not batch.stop.requested:
            results[i] = _run_one(batch, i + 1, planned[i])

    with batch.stop.catching():
        if jobs == 1:
            for i in range(len(planned)):
                run(i)
        else:
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ddplab-report") as pool:
                # result() re-raises what a case's thread raised; the others finish first.
                for future in [pool.submit(run, i) for i in _longest_first(planned, batch.out_dir)]:
                    future.result()
        outcomes = [results[i] for i in sorted(results)]
        total = time.perf_counter() - t0
        write_index(batch.out_dir, _merge_with_previous(batch.out_dir, outcomes), total_seconds=total)
    echo("")
    for o in outcomes:
        echo(f"  {o.name:<24} {o.status:<11} {o.seconds:7.1f} s")
    if batch.stop.requested:
        skipped = [p.name for i, p in enumerate(planned) if i not in results]
        echo(f"  stopped by {batch.stop.signal_name}" + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    echo(f"  {'total':<24} {'':<11} {total:7.1f} s   -> {batch.out_dir / 'index.html'}")
    return outcomes


def check_output_dir(out_dir: str | os.PathLike) -> None:
    """Raise ValueError unless ``out_dir`` exists or can be created, and takes a new file.

    Checked before any notebook runs, so a read-only place fails in a
    second with the reason, not after the batch ran. A disk that fills up
    later still fails each case that cannot be written (:func:`_run_one`).
    """
    path = pathlib.Path(out_dir)
    try:
        path.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(dir=path, prefix=".ddplab-write-check-")
        os.close(fd)
        os.unlink(probe)
    except OSError as exc:
        raise ValueError(f"cannot write to the output folder {out_dir}: {exc.strerror or exc}") from None



def run_report(*, cases: Iterable[str] = (), overrides: Iterable[tuple[str, str]] = (),
               params_file: str | os.PathLike | None = None, quick: bool = False,
               output: str | os.PathLike = "reports", no_input: bool = False,
               timeout: float = DEFAULT_TIMEOUT, jobs: int = 1) -> int:
    """The ``ddplab report`` command; returns its exit status (see :mod:`ddplab.cli` for the options).

    2: refused before anything ran (the reason on stderr); 1: some case did
    not end ok, or the index could not be written; 128 + N: stopped by signal N.
    """
    try:
        if isinstance(timeout, bool) or not isinstance(timeout, (int, float)) or not timeout > 0:
            raise ValueError(f"--timeout must be positive, got {timeout}")
        planned = plan_batch(cases, overrides=overrides, params_file=params_file, quick=quick,
                             timeout=timeout)
        check_output_dir(output)
    except ValueError as exc:
        print(f"ddplab report: {exc}", file=sys.stderr)
        return 2
    stop = StopRequest()
    try:
        outcomes = run_batch(planned, output, timeout=timeout, no_input=no_input, stop=stop, jobs=jobs)
    except OSError as exc:  # the index could not be written; each case said how it ended
        print(f"ddplab report: cannot write the index to {output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    if stop.requested:
        return 128 + stop.signum  # as a shell reports a command ended by that signal
    return 0 if all(o.status == NotebookStatus.OK for o in outcomes) else 1

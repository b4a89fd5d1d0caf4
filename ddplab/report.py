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
re-run -- or a disk that fills up -- never leaves a half-written report
behind; a case whose files cannot be written ends "failed", saying why.

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
from ddplab.html_report import header_markdown, notebook_to_html
from ddplab.index_page import CaseOutcome, summary_markdown, write_index
from ddplab.notebook_run import StopRequest, execute_notebook
from ddplab.parameters import ParameterSet
from ddplab.progress import PROGRESS_FILE_ENV, read_progress
from ddplab.notebook import IO_PARAMETERS
from ddplab.verdict import Verdict, verdicts_from_notebook

__all__ = ["CaseSpec", "case_specs", "check_output_dir", "plan_batch", "run_batch", "run_report",
           "DEFAULT_TIMEOUT", "IO_PARAMETERS"]

#: Seconds one notebook may run before it is stopped and reported as timed out.
DEFAULT_TIMEOUT = 900.0


@dataclasses.dataclass
class CaseSpec:
    """A notebook the batch can run, with the parameters it accepts (the report's view of a case)."""

    name: str
    title: str
    notebook: pathlib.Path
    parameters: ParameterSet
    quick: dict = dataclasses.field(default_factory=dict)
    #: The reproduced report's id (:mod:`ddplab.reproduced`), None for a case of one's own.
    reproduces: str | None = None
    #: Full validation (the case's check_params); defaults to ``parameters.validate``.
    check: Callable[[dict], dict] | None = None
    #: How the user names the case (a built-in name or a module path): used in commands.
    path: str | None = None
    #: The case's launch plan for given parameters (for progress and its estimate).
    plan: Callable[[dict], list] | None = None

    def __post_init__(self) -> None:
        check_case_name(self.name)  # it becomes a folder under --output

    def validate(self, values: dict) -> dict:
        return (self.check or self.parameters.validate)(values)

    def planned_steps(self, params: dict) -> dict[str, int]:
        """Steps each launch will report, by progress label (empty when unknown)."""
        if self.plan is None:
            return {}
        return {f"{self.name} {p.label}".strip(): p.steps for p in self.plan(params) if p.steps}

    @classmethod
    def of(cls, case: Case, path: str | None = None) -> "CaseSpec":
        notebook = case.notebook_path()
        if not notebook.exists():
            raise ValueError(f"case {case.name!r}: notebook {notebook} does not exist")
        return cls(name=case.name, title=case.title, notebook=notebook, parameters=case.parameters,
                   quick=dict(case.quick), reproduces=case.reproduces, check=case.check_params,
                   path=path or case.name, plan=case.launches)


def case_specs(names: Iterable[str] | None = None) -> list[CaseSpec]:
    """Specs of the named cases (built-in names or dotted paths), or of every built-in case."""
    return [CaseSpec.of(get_case(name), name) for name in (list(names) if names else case_names())]


def plan_batch(specs: list[CaseSpec], *, overrides: Iterable[tuple[str, str]] = (),
               params_file: str | os.PathLike | None = None, quick: bool = False) -> list[tuple[CaseSpec, dict]]:
    """Validated parameters per case: defaults < quick < params file < ``-p`` overrides.

    ``params_file`` is YAML: ``{case: {name: value}}`` per case, or a flat
    ``{name: value}`` applied like ``-p``. A ``-p``/flat name applies to every
    selected case that declares it and is an error if none does. Raises
    ValueError (naming the case and parameter) before anything runs.
    """
    names = {s.name for s in specs}
    per_case: dict[str, dict] = {s.name: {} for s in specs}
    shared: dict = {}
    if params_file is not None:
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
        for key, value in loaded.items():
            if key in case_names() or key in names:
                if key not in names:
                    continue  # a section for a case not selected this time
                if not isinstance(value, dict):
                    raise ValueError(f"parameters file {params_file}: section {key!r} must be a mapping")
                per_case[key].update(value)
            else:
                shared[key] = value
    shared.update(dict(overrides))
    for key in shared:
        if not any(key in s.parameters or key in IO_PARAMETERS for s in specs):
            accepted = "; ".join(f"{s.name}: {', '.join(s.parameters.names() + list(IO_PARAMETERS))}"
                                 for s in specs)
            raise ValueError(f"unknown parameter {key!r}: no selected case accepts it ({accepted})")
    planned = []
    for spec in specs:
        values = dict(spec.quick) if quick else {}
        values.update({k: v for k, v in shared.items() if k in spec.parameters or k in IO_PARAMETERS})
        values.update(per_case[spec.name])
        io = {k: values.pop(k) for k in list(values) if k in IO_PARAMETERS}
        if "results_dir" in io:
            raise ValueError("parameter 'results_dir' is set by ddplab report (reports/<case>/results)")
        try:
            params = spec.validate(values)
        except ValueError as exc:
            raise ValueError(f"case {spec.name!r}: {exc}") from None
        if io.get("run_dir") is not None and not pathlib.Path(io["run_dir"]).is_dir():
            raise ValueError(f"case {spec.name!r}: parameter 'run_dir': {io['run_dir']!r} is not a directory")
        params.update(io)
        planned.append((spec, params))
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


def _reproduce_command(spec: CaseSpec, shown_params: dict) -> str:
    defaults = spec.parameters.defaults()
    overrides = " ".join(f"-p {k} {shlex.quote(v if isinstance(v, str) else json.dumps(v))}"
                         for k, v in shown_params.items()
                         if (k in IO_PARAMETERS and v is not None) or (k in defaults and v != defaults[k]))
    return f"ddplab report {spec.path or spec.name} {overrides}".strip()


#: How a disk refuses a case's files: full, read-only, over quota, too large, not allowed, failing.
_WRITE_REFUSED = {errno.ENOSPC, errno.EROFS, errno.EDQUOT, errno.EFBIG, errno.EACCES, errno.EPERM,
                  errno.EIO}
#: Publishing (nbconvert, the files) takes a second; one case at a time keeps it simple.
_PUBLISH_LOCK = threading.Lock()
#: What a running case writes in its folder: renamed or removed once it is published.
_EXECUTING, _NEW_RESULTS, _PROGRESS, _LOG = (".notebook.executing.ipynb", ".results.new",
                                              ".progress.jsonl", ".papermill.log")


def _run_one(spec: CaseSpec, params: dict, out_dir: pathlib.Path, *, timeout: float,
             no_input: bool, index: int, total: int, echo: Callable[[str], None],
             stop: StopRequest | None = None, interactive: bool = False) -> CaseOutcome:
    """Run one case's notebook and publish it; a disk that refuses its files makes it "failed"."""
    t0 = time.perf_counter()
    try:
        return _execute_and_publish(spec, params, out_dir, timeout=timeout, no_input=no_input,
                                    index=index, total=total, echo=echo, stop=stop,
                                    interactive=interactive)
    except OSError as exc:
        if exc.errno not in _WRITE_REFUSED:
            raise
        # The disk, not the case: the other cases still run (and may fit).
        return _unpublished(spec, out_dir, time.perf_counter() - t0, exc, index=index, total=total,
                            echo=echo)


def _execute_and_publish(spec: CaseSpec, params: dict, out_dir: pathlib.Path, *, timeout: float,
                         no_input: bool, index: int, total: int, echo: Callable[[str], None],
                         stop: StopRequest | None, interactive: bool) -> CaseOutcome:
    case_dir = out_dir / spec.name
    case_dir.mkdir(parents=True, exist_ok=True)
    executing = case_dir / _EXECUTING
    new_results = case_dir / _NEW_RESULTS
    progress_file = case_dir / _PROGRESS
    shutil.rmtree(new_results, ignore_errors=True)
    progress_file.unlink(missing_ok=True)
    # The kernel runs where `ddplab report` runs, so the user's relative paths (run_dir, data_root)
    # mean what they meant, and the results folder is named relative to it: no machine path is
    # written into the published notebook.
    nb_params = {**params, "results_dir": os.path.relpath(new_results)}
    echo(f"[{index}/{total}] {spec.name}: started")
    outcome = execute_notebook(
        spec.notebook, executing, parameters=nb_params, timeout=timeout,
        cwd=os.getcwd(), log_path=case_dir / _LOG,
        env={"DDPLAB_BATCH": "1", "PYTHONUNBUFFERED": "1",
             PROGRESS_FILE_ENV: str(progress_file.resolve())},
        on_poll=_progress_printer(spec.name, index, total, echo, progress_file,
                                  spec.planned_steps(params), interactive=interactive),
        stop=stop)
    if interactive:
        sys.stdout.write("\n")
    progress_file.unlink(missing_ok=True)
    with _PUBLISH_LOCK:
        return _publish(spec, params, out_dir, outcome, no_input=no_input, index=index, total=total,
                        echo=echo)


def _publish(spec: CaseSpec, params: dict, out_dir: pathlib.Path, outcome, *, no_input: bool,
             index: int, total: int, echo: Callable[[str], None]) -> CaseOutcome:
    """Write ``out_dir/<case>/`` from a finished execution: results, report, summary, notebook, log.

    All of it or none: every file is composed first and written under a
    temporary name, then all are renamed into place and the results folder
    swapped in (:func:`~ddplab.artifacts.atomic_write_files`). A write that
    fails (a full or read-only disk) raises OSError and leaves the previous
    report of the case as it was.
    """
    case_dir = out_dir / spec.name
    executing = case_dir / _EXECUTING
    new_results = case_dir / _NEW_RESULTS

    nb = nbformat.read(executing, as_version=4) if executing.exists() else nbformat.read(spec.notebook, as_version=4)
    verdict: Verdict | None = None
    environment = None
    try:
        saved = load_results(new_results)
        verdict, environment = saved.verdict, saved.environment
        # What the notebook used (a run_dir brings its own parameters).
        params = {**params, **{k: v for k, v in saved.params.items() if k in spec.parameters}}
    except FileNotFoundError:
        pass
    if verdict is None:
        found = verdicts_from_notebook(nb.cells)
        verdict = found[-1] if found else None
    if environment is None:
        environment = {**environment_info(backend=spec.parameters.role_value(params, "backend")),
                       "note": "of the machine that ran the batch; the notebook saved none"}
    failing_source = None
    if outcome.failing_cell is not None and outcome.failing_cell < len(nb.cells) and no_input:
        failing_source = nb.cells[outcome.failing_cell].source
    shown_params = {k: v for k, v in params.items() if not (k in IO_PARAMETERS and v is None)}
    header = header_markdown(title=f"{spec.title}", status=outcome.status, seconds=outcome.seconds,
                             verdict=verdict, params=shown_params, environment=environment,
                             failing_cell=outcome.failing_cell, error=outcome.error,
                             failing_source=failing_source)
    scrub = local_path_scrubber(spec.notebook.parent)
    scrub_notebook(nb, scrub)
    files = {case_dir / "report.html": notebook_to_html(nb, header=scrub(header), no_input=no_input)}
    png = _key_figure(nb)
    figure_name = "key-figure.png" if png is not None else None
    if png is not None:
        files[case_dir / figure_name] = png
    result = CaseOutcome(
        name=spec.name, title=spec.title, reproduces=spec.reproduces, status=outcome.status,
        seconds=outcome.seconds, verdict=verdict, report=f"{spec.name}/report.html",
        summary=f"{spec.name}/summary.md", notebook=f"{spec.name}/notebook.ipynb",
        key_figure=f"{spec.name}/{figure_name}" if figure_name else None, error=outcome.error)
    files[case_dir / "summary.md"] = summary_markdown(
        result, params=shown_params, environment=environment, figure_name=figure_name,
        command=_reproduce_command(spec, shown_params))
    if executing.exists():
        nb.metadata.get("papermill", {}).pop("input_path", None)
        nb.metadata.get("papermill", {}).pop("output_path", None)
        files[case_dir / "notebook.ipynb"] = nbformat.writes(nb)
    log = case_dir / _LOG
    if log.exists():
        files[case_dir / "papermill.log"] = scrub(log.read_text(errors="replace"))
    atomic_write_files({path: data.encode("utf-8") if isinstance(data, str) else data
                        for path, data in files.items()})
    _replace_dir(new_results, case_dir / "results")
    if png is None:  # never leave an earlier run's figure beside this run's report
        (case_dir / "key-figure.png").unlink(missing_ok=True)
    _remove_scratch(case_dir)
    where = f" (cell {outcome.failing_cell})" if outcome.failing_cell is not None and not outcome.ok else ""
    echo(f"[{index}/{total}] {spec.name}: {outcome.status}{where} in {outcome.seconds:.1f} s"
         + (f" — {verdict.kind}: {verdict.headline}" if verdict else "")
         + (f" — {outcome.error}" if not outcome.ok else ""))
    return result


def _remove_scratch(case_dir: pathlib.Path) -> None:
    """Remove what a running case writes in its folder (the notebook being executed, its log, ...)."""
    for name in (_EXECUTING, _PROGRESS, _LOG):
        (case_dir / name).unlink(missing_ok=True)
    (case_dir / _EXECUTING).with_suffix(".params.yaml").unlink(missing_ok=True)
    shutil.rmtree(case_dir / _NEW_RESULTS, ignore_errors=True)


def _unpublished(spec: CaseSpec, out_dir: pathlib.Path, seconds: float, exc: OSError, *,
                 index: int, total: int, echo: Callable[[str], None]) -> CaseOutcome:
    """The outcome of a case whose files could not be written: failed, saying why and where."""
    _remove_scratch(out_dir / spec.name)
    where = f" ({exc.filename})" if exc.filename else ""
    error = (f"its report could not be written to {out_dir / spec.name}: {exc.strerror or exc}{where} "
             f"(any earlier report there is unchanged)")
    echo(f"[{index}/{total}] {spec.name}: failed in {seconds:.1f} s — {error}")
    return CaseOutcome(
        name=spec.name, title=spec.title, reproduces=spec.reproduces, status="failed", seconds=seconds,
        verdict=None, report=f"{spec.name}/report.html", summary=f"{spec.name}/summary.md",
        notebook=f"{spec.name}/notebook.ipynb", error=error)


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


def _longest_first(planned: list[tuple[CaseSpec, dict]], out_dir: pathlib.Path) -> list[int]:
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
    return sorted(range(len(planned)), key=lambda i: (planned[i][0].name in seconds,
                                                      -seconds.get(planned[i][0].name, 0.0), i))


def run_batch(planned: list[tuple[CaseSpec, dict]], out_dir: str | os.PathLike, *,
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
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    stop = stop or StopRequest()
    # One updating progress line needs the terminal to itself.
    interactive = jobs == 1 and sys.stdout.isatty()
    t0 = time.perf_counter()
    results: dict[int, CaseOutcome] = {}

    def run(i: int) -> None:
        if stop.requested:
            return
        spec, params = planned[i]
        results[i] = _run_one(spec, params, out_dir, timeout=timeout, no_input=no_input, index=i + 1,
                              total=len(planned), echo=echo, stop=stop, interactive=interactive)

    with stop.catching():
        if jobs == 1:
            for i in range(len(planned)):
                run(i)
        else:
            with ThreadPoolExecutor(max_workers=jobs, thread_name_prefix="ddplab-report") as pool:
                # result() re-raises what a case's thread raised; the others finish first.
                for future in [pool.submit(run, i) for i in _longest_first(planned, out_dir)]:
                    future.result()
        outcomes = [results[i] for i in sorted(results)]
        total = time.perf_counter() - t0
        write_index(out_dir, _merge_with_previous(out_dir, outcomes), total_seconds=total)
    echo("")
    for o in outcomes:
        echo(f"  {o.name:<24} {o.status:<11} {o.seconds:7.1f} s")
    if stop.requested:
        skipped = [spec.name for i, (spec, _) in enumerate(planned) if i not in results]
        echo(f"  stopped by {stop.signal_name}" + (f"; not run: {', '.join(skipped)}" if skipped else ""))
    echo(f"  {'total':<24} {'':<11} {total:7.1f} s   -> {out_dir / 'index.html'}")
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


def run_report(opts) -> int:
    """The ``ddplab report`` command (see :mod:`ddplab.cli` for the options)."""
    try:
        specs = case_specs(opts.cases or None)
        planned = plan_batch(specs, overrides=opts.param or (), params_file=opts.params,
                             quick=opts.quick)
        if opts.timeout <= 0:
            raise ValueError(f"--timeout must be positive, got {opts.timeout}")
        check_output_dir(opts.output)
    except ValueError as exc:
        print(f"ddplab report: {exc}", file=sys.stderr)
        return 2
    stop = StopRequest()
    try:
        outcomes = run_batch(planned, opts.output, timeout=opts.timeout, no_input=opts.no_input,
                             stop=stop, jobs=opts.jobs)
    except OSError as exc:  # the index could not be written; each case said how it ended
        print(f"ddplab report: cannot write the index to {opts.output}: {exc.strerror or exc}",
              file=sys.stderr)
        return 1
    if stop.requested:
        return 128 + stop.signum  # as a shell reports a command ended by that signal
    return 0 if all(o.status == "ok" for o in outcomes) else 1

"""The evidence measured against the reference runs, judged where they train.

Every source that reads the reference runs' captures is asked here, a step at a time
(:class:`ReferenceJudge`): the referee's distances of every rank from the float64 truth, the
band run and the reference (:func:`ddplab.compare.referee.distance_records`), the reference
runs' own distances from the truth, the localization of the first divergence
(:mod:`ddplab.compare.localization`), the float64 run's distance from the truth
(:mod:`ddplab.compare.float64_run`), and the first step where the reference holds a NaN or Inf.

Where it is asked:

* **in the reference process** (a large model, whose reference runs train beside each
  configuration): after training step ``s`` it reads the configuration's captures of ``s`` from
  the pass's scratch folder (memory-mapped: only gradients and parameters are touched), judges,
  sends the records and then :data:`JUDGED_STEP`. The reference runs' captures -- the float64
  truth alone is four model sizes a step -- never reach the disk, and the parent reads none of
  them: it takes the records (:class:`JudgedSteps`, :func:`judged_there`);
* **in the parent** (a small model, whose reference runs are written whole once and read again by
  every configuration): :func:`judge_here` asks the same judge with the captures on disk.

Both cut at the same step: the first where a rank's or the reference's gradient or parameter is
not finite (:func:`ddplab.compare.finite.nonfinite_at`, on the same captures). The parent deletes
a step's files only once the judge's marker for that step has arrived: its source comes first in
:func:`~ddplab.compare.captures.in_step`.
"""
from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable

import torch

from ddplab.compare import float64_run as _float64
from ddplab.compare import localization as _localization
from ddplab.compare import recorded as _recorded
from ddplab.compare import referee as _referee
from ddplab.compare.captures import RecentSteps, StepRecords, common_steps, has_step, read_capture, resolve_same_as
from ddplab.compare.configurations import Configuration
from ddplab.compare.finite import nonfinite_at, nonfinite_records
from ddplab.compare.runners import RunSpec, capture_path, precision_reference
from ddplab.compare.setup import Setup
from ddplab.compare.streaming import NEXT_STEP_READS
from ddplab.numerics import unit_roundoff
from ddplab.records import record

__all__ = ["JudgeSpec", "ReferenceJudge", "JudgedSteps", "JUDGED_STEP", "judged_there", "judge_here",
           "read_step", "detected_precision", "band_reference", "float64_precision"]

#: The record that closes a step's records from the reference process (value 1: the judge has nothing
#: more to say after it). Never part of a comparison's records.
JUDGED_STEP = "references_judged_step"
#: The longest the reference process sleeps between two looks for a configuration's capture, in seconds.
_POLL = 0.02


# --------------------------------------------------------------------------- what a pass asks


@dataclasses.dataclass(frozen=True)
class JudgeSpec:
    """What a pass asks of its reference runs' judge: ``config`` and its run ``run_id`` in the pass's
    scratch folder ``root`` (None: the pass runs only its float64 run, ``float64_id``); ``band``: the
    run whose own distance is the band (None: the reference in the precision the run's first step
    shows, :func:`detected_precision`); ``dtype``: the model's; ``done``: the reference runs' steps
    whose own distances an earlier pass judged, by label."""

    config: Configuration
    root: str
    run_id: str | None
    float64_id: str | None
    band: RunSpec | None
    dtype: torch.dtype
    done: dict = dataclasses.field(default_factory=dict)


def detected_precision(config: Configuration, first: dict, dtype: torch.dtype) -> tuple | None:
    """``(param_dtype, reduce_dtype)`` below the model's ``dtype`` that a run's first capture ``first``
    (rank 0's) showed but its configuration did not declare: modules that returned a lower precision
    (autocast), gradient reductions in a lower precision (a hook)."""
    if config.dtypes() != (None, None):
        return None

    def below(names):
        low = _float64.lowest_precision(names)
        return low if low is not None and unit_roundoff(low) > unit_roundoff(dtype) else None

    shown = below(first.get("forward_dtypes", [])), below(_recorded.reduction_dtypes([first]))
    return shown if shown != (None, None) else None


def band_reference(precision: tuple, runs: list[RunSpec]) -> RunSpec:
    """The single-process reference computing in ``precision`` = ``(param_dtype, reduce_dtype)`` among
    ``runs`` (``(None, None)``: the reference), or a new one (its run id unused among ``runs``)."""
    for spec in runs:
        if (spec.param_dtype, spec.reduce_dtype) == precision and spec.label != "truth" and not spec.promise:
            return spec
    shares = next((spec.shares for spec in runs if spec.label == "reference"), 1)
    return precision_reference(*precision, run_id=f"ref{len(runs)}", shares=shares)


def float64_precision(config: Configuration, first: dict) -> torch.dtype | None:
    """The lowest precision a float64 run still computed in: the configuration's own mixed precision,
    its compression hook, the dtypes its modules returned and its reductions ran in (``first``: its
    rank 0's first capture; the tolerance holds for every step)."""
    names = [str(d).replace("torch.", "") for d in config.dtypes() if d is not None]
    if _recorded.compression(config):
        names.append(_recorded.compression(config))
    names += sorted(_recorded.reduction_dtypes([first]))
    names += list(first.get("forward_dtypes", []))
    return _float64.lowest_precision(names)


# --------------------------------------------------------------------------- the sources


def _unit(spec: RunSpec, dtype: torch.dtype) -> float:
    """Unit roundoff of the dtype ``spec`` computes in (the model's ``dtype`` unless mixed precision)."""
    return unit_roundoff(spec.param_dtype or spec.dtype or dtype)


def _reference_steps(caps: dict, runs: list[RunSpec], dtype: torch.dtype, done: dict) -> StepRecords:
    """The referee's distances of each single-process run in ``runs`` (not the truth, not a promise:
    those are judged per configuration) from the truth, per step: of the steps from ``done[label]``
    on (the ones an earlier pass judged are in already)."""
    judged = [spec for spec in runs if spec.label != "truth" and not spec.promise]
    if not judged:
        return
    truth = caps["truth"]
    for step in common_steps(truth, *(caps[spec.run_id] for spec in judged)):
        recs = []
        for spec in judged:
            if step < done.get(spec.label, 0):
                continue
            done[spec.label] = step + 1
            cap = caps[spec.run_id][step]
            for quantity in _referee.QUANTITIES:
                key = quantity + "s"
                recs += _referee.distance_records(step, quantity, truth[step][key], cap[key], cap[key],
                                                  None, config=spec.label, band_label=spec.label,
                                                  unit_roundoff=_unit(spec, dtype))
        yield recs


def _config_steps(config: Configuration, ranks: list, caps: dict, band: RunSpec, dtype: torch.dtype,
                  seen: list[dict]) -> StepRecords:
    """The referee's distances of every rank from the truth, the band run and the reference, per step
    (also appended to ``seen``, which localization reads as the steps are judged)."""
    truth, ref, matched = caps["truth"], caps["reference"], caps[band.run_id]
    for step in common_steps(ranks[0], truth, ref, matched):
        recs = []
        others = {r: ranks[r][step] for r in range(1, config.world_size) if has_step(ranks[r], step)}
        for quantity in _referee.QUANTITIES:
            key = quantity + "s"
            recs += _referee.distance_records(step, quantity, truth[step][key], matched[step][key],
                                              ranks[0][step][key], ref[step][key], config=config.label,
                                              others={r: cap[key] for r, cap in others.items()},
                                              band_label=band.label, unit_roundoff=_unit(band, dtype))
        seen += recs
        yield recs


def _float64_steps(setup: Setup, config: Configuration, run, caps: dict) -> StepRecords:
    """The configuration's own code in float64 against the float64 truth (:mod:`ddplab.compare.float64_run`)."""
    if not has_step(run, 0):
        return
    low = float64_precision(config, run[0])
    tolerance = _float64.precision_tolerance(low, config.world_size)
    judged_at = str(low).replace("torch.", "") if low is not None else "float64"
    yield from _float64.distance_records("float64", setup, (config.world_size, config.k, config.pieces), run, caps,
                                         tolerance, config=config.label, judged_at=judged_at)


# --------------------------------------------------------------------------- the judge


class ReferenceJudge:
    """The sources that read the reference runs, asked a step at a time (:meth:`step`), then
    :meth:`finish`. ``runs``: the reference runs trained beside the pass (a promise among them is
    judged by :class:`~ddplab.compare.float64_run.PromiseJudge`, not here). :attr:`done`: nothing
    more to say -- the run ended, or judging was cut and the reference's first non-finite step is known."""

    def __init__(self, setup: Setup, spec: JudgeSpec, runs: list[RunSpec], steps: int):
        self.setup, self.spec, self.steps = setup, spec, steps
        self.runs = [run for run in runs if not run.promise]
        self.band = spec.band
        self.cut: int | None = None
        self.done = False
        self._reference_finite = True
        self._sources: list | None = None
        self._caps = {run.run_id: RecentSteps(steps) for run in self.runs}
        world = spec.config.world_size if spec.run_id is not None else 0
        self._ranks = [RecentSteps(steps, keep=1) for _ in range(world)]
        self._float64 = RecentSteps(steps, keep=1) if spec.float64_id is not None else None
        self._seen: list[dict] = []

    def step(self, step: int, refs: dict, read_ranks: Callable[[], list | None],
             read_float64: Callable[[], dict | None], train: Callable[[RunSpec], dict] | None = None) -> list[dict]:
        """The records of ``step``: ``refs`` holds each reference run's capture of it (by run id);
        ``read_ranks()`` the configuration's ranks' (None: rank 0 never wrote it; None in place of another
        rank that never did: judged without it, as rank 0 is what is measured), ``read_float64()``
        its float64 run's rank 0 (None likewise). ``train(spec)``: train the reference ``spec`` to this
        step and return its capture, for a band in the precision the run's first step shows."""
        out: list[dict] = []
        reference = refs.get("reference")
        if reference is not None and self._reference_finite:
            bad = nonfinite_at(reference)
            if bad is not None:
                self._reference_finite = False
                out.append(nonfinite_records(dict(bad, step=step), rank=0, run="reference",
                                             config=self.spec.config.label))
        if self.done:
            return out
        if self.cut is not None:   # past the cut only the reference's first non-finite step is sought
            self.done = not self._reference_finite or reference is None
            return out
        ranks = read_ranks() if self._ranks else []
        float64 = read_float64() if self._float64 is not None else None
        if ranks is None or (not self._ranks and float64 is None):
            return out + self.finish()
        if not self._reference_finite or any(nonfinite_at(cap) is not None for cap in ranks if cap is not None):
            self.cut = step
            out += self.finish()
            self.done = not self._reference_finite or reference is None
            return out
        if self._sources is None:
            self._start(refs, ranks, train)
        for run_id, window in self._caps.items():
            window.put(step, refs[run_id])
        for window, cap in zip(self._ranks, ranks):
            if cap is not None:   # a rank a crash or a stop left without the step is judged without it
                window.put(step, cap)
        if float64 is not None:
            self._float64.put(step, float64)
        out += self._advance()
        # Judged: only localization reads of it again, the truth's parameters at the next step.
        for run in self.runs:
            self._caps[run.run_id].judged(step, NEXT_STEP_READS["truth"] if run.label == "truth" else ())
        for window in self._ranks + ([self._float64] if self._float64 is not None else []):
            window.judged(step)
        return out

    def finish(self) -> list[dict]:
        """What the sources conclude once no step follows (each rank's largest distance from rank 0)."""
        if self._sources is None:
            self._sources = []
        out = self._advance()   # no window has the next step: every source ends
        self._sources = []
        self.done = True
        return out

    def _start(self, refs: dict, ranks: list[dict], train) -> None:
        spec, config = self.spec, self.spec.config
        if self.band is None and ranks:
            self.band = band_reference(detected_precision(config, ranks[0], spec.dtype) or (None, None), self.runs)
            if self.band not in self.runs:   # trained here from now on, beside the truth
                refs[self.band.run_id] = train(self.band)
                self.runs.append(self.band)
                self._caps[self.band.run_id] = RecentSteps(self.steps)
        self._sources = [_reference_steps(self._caps, self.runs, spec.dtype, spec.done)]
        if self._ranks:
            self._sources += [_config_steps(config, self._ranks, self._caps, self.band, spec.dtype, self._seen),
                              _localization.localize_steps(self.setup, config, self._caps, self._ranks, self._seen)]
        if self._float64 is not None:
            self._sources.append(_float64_steps(self.setup, config, self._float64, self._caps))

    def _advance(self) -> list[dict]:
        out: list[dict] = []
        for source in list(self._sources):
            try:
                out += next(source)
            except StopIteration:
                self._sources.remove(source)
        return out


# --------------------------------------------------------------------------- in the reference process


def _wait_for(path: str, ended: Callable[[], bool]) -> bool:
    """Wait until ``path`` exists (True) or ``ended()`` and it still does not (False)."""
    delay = 0.0005
    while True:
        gone = ended()   # read before the file: a file written just before the end counts
        if os.path.exists(path):
            return True
        if gone:
            return False
        time.sleep(delay)
        delay = min(_POLL, delay * 2)


def read_step(root: str, run_id: str, world_size: int, step: int) -> list[dict] | None:
    """Every rank's capture of ``step`` of ``run_id`` under ``root``, memory-mapped, each rank's references
    to rank 0's tensors resolved; waits until they are written or the run ended (its launch ended, or
    the parent released it: :func:`ddplab.compare.streaming.released`). None: rank 0's never came;
    None in place of another rank's that never came."""
    from ddplab.compare.streaming import ended

    caps: list[dict | None] = []
    for rank in range(world_size):
        path = capture_path(root, run_id, step, rank)
        try:
            cap = read_capture(path) if _wait_for(path, lambda: ended(root, run_id)) else None
        except FileNotFoundError:   # released meanwhile: the parent deletes what nobody judges
            cap = None
        if cap is None and rank == 0:
            return None
        caps.append(cap if rank == 0 or cap is None else resolve_same_as(cap, lambda: caps[0]))
    return caps


def judge_where_trained(setup: Setup, spec: JudgeSpec, runs: list[RunSpec], steps: int):
    """The judge of a reference process: ``judge(step, captured, train)`` after each step trained
    (``captured``: each run's capture by run id) returns its records and the marker that closes them."""
    judge = ReferenceJudge(setup, spec, runs, steps)
    world = spec.config.world_size

    def ranks(step):
        return lambda: read_step(spec.root, spec.run_id, world, step)

    def float64(step):
        return lambda: (read_step(spec.root, spec.float64_id, 1, step) or [None])[0]

    def ask(step: int, captured: dict, train) -> list[dict]:
        if judge.done:
            return []
        out = judge.step(step, captured, ranks(step), float64(step), train)
        if step == steps - 1 and not judge.done:
            out += judge.finish()
        return out + [record(JUDGED_STEP, int(judge.done), step=step)]

    return ask


# --------------------------------------------------------------------------- in the parent


class JudgedSteps:
    """The judge's records as they arrive from the reference process (:meth:`put`, from the thread that
    watches its launch), a step at a time: the records before each :data:`JUDGED_STEP` are that step's."""

    def __init__(self):
        self._cond = threading.Condition()
        self._pending: list[dict] = []
        self._steps: dict[int, tuple[list[dict], bool]] = {}
        self._ended = False

    def put(self, rec: dict) -> None:
        with self._cond:
            if rec["metric"] == JUDGED_STEP:
                self._steps[rec["step"]] = (self._pending, bool(rec["value"]))
                self._pending = []
                self._cond.notify_all()
            else:
                self._pending.append(rec)

    def end(self) -> None:
        """The reference process ended: no step follows the ones closed."""
        with self._cond:
            self._ended = True
            self._cond.notify_all()

    def take(self, step: int) -> tuple[list[dict], bool] | None:
        """``(records, last)`` of ``step`` once closed; None when the process ended without closing it."""
        with self._cond:
            while step not in self._steps and not self._ended:
                self._cond.wait(_POLL)
            return self._steps.pop(step, None)


def _cut_on_reference(recs: list[dict], step: int, cut: Callable[[int], None]) -> None:
    if any(r["metric"] == "nonfinite" and r.get("run") == "reference" for r in recs):
        cut(step)


def judged_there(steps: JudgedSteps, cut: Callable[[int], None],
                 took: Callable[[int], None] | None = None) -> StepRecords:
    """The reference process's records, a step at a time; ``cut(step)`` where the reference turned
    non-finite, ``took(step)`` once it judged a step (its float64 run's captures of it are read)."""
    step = 0
    while True:
        taken = steps.take(step)
        if taken is None:
            return
        recs, last = taken
        _cut_on_reference(recs, step, cut)
        if took is not None:
            took(step)
        yield recs
        if last:
            return
        step += 1


def judge_here(judge: ReferenceJudge, refs: dict, ranks: list | None, float64, cut: Callable[[int], None],
               took: Callable[[int], None] | None = None) -> StepRecords:
    """:class:`ReferenceJudge` asked in this process, a step at a time: ``refs`` (reference run id ->
    its captures), ``ranks`` (the configuration's, per rank; None: no run in the pass) and ``float64``
    (its float64 run's rank 0, or None) are sequences of steps (:func:`~ddplab.compare.captures.has_step`);
    ``took(step)`` once a step is judged."""
    step = 0
    while not judge.done:
        if not all(has_step(caps, step) for caps in refs.values()):
            yield judge.finish()
            return

        def read_ranks(step=step):
            return [r[step] if has_step(r, step) else None for r in ranks] if has_step(ranks[0], step) else None

        def read_float64(step=step):
            return float64[step] if float64 is not None and has_step(float64, step) else None

        recs = judge.step(step, {run_id: caps[step] for run_id, caps in refs.items()},
                          read_ranks if ranks is not None else lambda: [], read_float64)
        _cut_on_reference(recs, step, cut)
        if took is not None:
            took(step)
        yield recs
        step += 1

"""Run a comparison: each configuration beside its reference runs, judged as it trains.

:func:`run` checks the configurations here (a bad one raises ValueError
before any process starts), tries the setup and trains the first step of the
reference runs in one process (a bad setup raises :class:`SetupError` before
any configuration starts), states what the comparison needs of the machine
(:mod:`ddplab.compare.footprint`), then runs one *pass* per configuration
(:mod:`ddplab.compare.streaming`): its W ranks (real gloo process groups via
:class:`ddplab.launcher.Launch`), the reference runs it is judged against
in one process beside them and, where it needs them, its symmetric twin and
its float64 run (alongside for a small model, in a second pass otherwise).
Every step is judged as the runs write it: what is measured against the
reference runs -- the referee's distances from the float64 truth
(:mod:`ddplab.compare.referee`), the localization of the first divergence
(:mod:`ddplab.compare.localization`), the float64 run -- where they train
(:mod:`ddplab.compare.reference_judge`), and in the parent what the ranks
show alone -- the audits, the recorded collectives, the replay, the twin.
What no source reads again is deleted: the scratch folder holds a step of
each run and the parent's memory a few, whatever the number of steps. It
returns a :class:`Comparison`: the tidy records, one verdict per
configuration, the errors of the configurations that crashed or hung.

A configuration that crashes or hangs does not stop the others: its verdict
says so (rank, exception, traceback) and the steps it finished are still
compared. :func:`ddplab.launcher.stop_all` ends the running launch; the
comparison then keeps what was judged so far and runs nothing more.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import shutil
import tempfile
import threading
import time
from typing import Callable, Iterator

import psutil
import torch

from ddplab import launcher as _launcher
from ddplab import records as _records
from ddplab.compare import finite as _finite
from ddplab.compare import recorded as _recorded
from ddplab.compare.captures import CaptureCache, StepRecords, common_steps, has_step, in_step, initial_weights
from ddplab.compare.streaming import LAG, Pass
from ddplab.compare import data as _data
from ddplab.compare import footprint as _footprint
from ddplab.compare import mesh_evidence as _mesh_evidence
from ddplab.compare import meshes as _meshes
from ddplab.compare import replay as _replay
from ddplab.compare import stand_in as _stand_in
from ddplab.compare import streaming as _streaming
from ddplab.compare import twin as _twin
from ddplab.compare.configurations import Configuration, Custom, Fabric, FSDP2, check_configurations
from ddplab.compare.reference_judge import (JudgedSteps, JudgeSpec, ReferenceJudge, band_reference,
                                            detected_precision, judge_here, judged_there)
from ddplab.compare.runners import (DIFFERENT_MODEL, RunSpec, configuration_worker, reference_runs,
                                    reference_worker, STEP_METRICS, first_capture_sizes)
from ddplab.compare.setup import Setup, SetupError, check_setup, global_batches, model_digest
from ddplab.compare.verdicts import ConfigVerdict, comparison_verdict, judge, verdicts_markdown

__all__ = ["Comparison", "ReferenceFailed", "run", "DEFAULT_TIMEOUT"]

#: Seconds each launch (the reference runs, one configuration) may take before it counts as hung.
DEFAULT_TIMEOUT = 300.0
#: What one process of a comparison holds, in float64 copies of the model: parameters, gradients,
#: optimizer state, the step's capture and the activations (a generous count, for :attr:`_Session.alongside`).
MODEL_COPIES = 8
#: The largest model (in parameters) whose twin and float64 run start alongside its run.
ALONGSIDE_NUMEL = 1_000_000
#: The most bytes the reference runs' captures of every step may take to be written once and kept
#: for every configuration (:attr:`_Session.keep_references`).
KEEP_REFERENCES_BYTES = 64 * 2**20


class ReferenceFailed(RuntimeError):
    """The single-process reference itself failed: there is nothing to compare with."""


@dataclasses.dataclass
class Comparison:
    """What :func:`run` found: records, a verdict per configuration, and the failures."""

    setup_name: str
    steps: int
    configurations: list[Configuration]
    runs: list[RunSpec]
    records: "object"                      # the tidy DataFrame
    verdicts: dict[str, ConfigVerdict]
    errors: dict[str, BaseException]
    stopped: bool = False
    wall_time: float = 0.0
    footprint: _footprint.Footprint | None = None   # what it needed of the machine, at least

    def verdict(self, config: str | Configuration) -> ConfigVerdict:
        label = config.label if isinstance(config, Configuration) else config
        if label not in self.verdicts:
            raise KeyError(f"no configuration {label!r}; compared: {list(self.verdicts)}")
        return self.verdicts[label]

    @property
    def kinds(self) -> dict[str, str]:
        """Configuration -> verdict kind ("rounding", "bug", "undetermined", "crashed", "hung", ...)."""
        return {label: v.kind for label, v in self.verdicts.items()}

    def to_markdown(self) -> str:
        head = (f"**{self.setup_name}**, {self.steps} steps, against the single-process reference "
                f"and its float64 truth" + (" (stopped)" if self.stopped else ""))
        return head + "\n\n" + verdicts_markdown(self.records)

    def to_verdict(self, case: str = "your_training"):
        """The whole comparison as one :class:`ddplab.verdict.Verdict` (see
        :func:`~ddplab.compare.verdicts.comparison_verdict`)."""
        return comparison_verdict(self.records, case=case)

    def _repr_markdown_(self) -> str:
        return self.to_markdown()

    def __repr__(self) -> str:
        return f"Comparison({self.setup_name!r}, steps={self.steps}, kinds={self.kinds})"


# --------------------------------------------------------------------------- progress


class _Progress:
    """One bar per run label, and the user's callback: a step is done when every rank of the run
    (``world``: label -> world size; 1 where absent) has written it and sent its gradient norm."""

    def __init__(self, steps: int, show: bool, callback: Callable | None, world: dict[str, int]):
        self.steps, self.show, self.callback, self.world = steps, show, callback, world
        self.bars: dict[str, object] = {}
        self.done: dict[str, int] = {}
        self._ranks: dict[tuple, set] = {}   # (label, step) -> the ranks that finished it

    def __call__(self, rec: dict) -> None:
        if rec.get("metric") != "grad_norm" or rec.get("step") is None:
            return
        label = rec.get("config")
        finished = self._ranks.setdefault((label, rec["step"]), set())
        finished.add(rec.get("rank") or 0)
        if len(finished) < self.world.get(label, 1):
            return
        del self._ranks[(label, rec["step"])]
        done = rec["step"] + 1
        if done <= self.done.get(label, 0):
            return
        self.done[label] = done
        if self.show:
            if label not in self.bars:
                from ddplab.progress import progress_bar
                self.bars[label] = progress_bar(total=self.steps, desc=label)
            bar = self.bars[label]
            bar.update(done - bar.n)
        if self.callback is not None:
            self.callback(label, rec["step"], self.steps)

    def close(self) -> None:
        for bar in self.bars.values():
            bar.close()
        self.bars.clear()


# --------------------------------------------------------------------------- availability


def _unavailable(config: Configuration) -> str | None:
    """Why ``config`` cannot run here, or None."""
    if isinstance(config, Fabric):
        try:
            import lightning.fabric  # noqa: F401
        except Exception as exc:  # noqa: BLE001 - any import failure is a reason, said
            return f"Lightning Fabric is not importable ({type(exc).__name__}: {exc})"
    if isinstance(config, FSDP2):
        try:
            from torch.distributed.fsdp import fully_shard  # noqa: F401
        except Exception as exc:  # noqa: BLE001
            return f"torch.distributed.fsdp.fully_shard is not available ({exc})"
    return None


# --------------------------------------------------------------------------- analysis


def _promise_id(runs: list[RunSpec], config: Configuration) -> str | None:
    """The run id of the float64 promise of ``config``'s W and k, if one ran."""
    for spec in runs:
        if spec.world_size > 1 or spec.k > 1:
            if (spec.world_size, spec.k) == (config.shares, config.k) and not isinstance(config, Custom):
                return spec.run_id
    return None


def _reduction_steps(config: Configuration, ranks: list, shared: _replay.Reductions) -> StepRecords:
    """The referee's measure of every captured DDP bucket: its result against gloo's ring order
    applied to the W ranks' contributions (bit for bit), per step; nothing without captured buckets.
    A bucket whose bits the order reproduces is rounding by that evidence alone (its records: the
    bits' numbers, :func:`~ddplab.numerics.matches_order`); one whose bits differ is measured whole,
    against the exact sum and the bounds too. The order's result is kept in ``shared`` for the replay,
    which checks the same reduction."""
    from ddplab.numerics import error_records, matches_order, records_of
    from ddplab.numerics.contributions import Contributions
    from ddplab.numerics.orders import DDP_AVERAGING

    def measured(step: int) -> list[dict]:   # a function: nothing of the step outlives it
        out = []
        by_rank = [{b["index"]: b for b in ranks[r][step]["buckets"]} for r in range(config.world_size)]
        for index, bucket in sorted(by_rank[0].items()):
            if not all(index in other for other in by_rank):
                continue
            local = [other[index]["local"] for other in by_rank]
            contributions = Contributions.unstacked(local)   # read a column block at a time, never stacked
            how = dict(op="avg", averaging=DDP_AVERAGING)
            expected = shared.of(step, local, contributions)
            labels = dict(step=step, rank=0, bucket=index, config=config.label, params=bucket["params"],
                          collective="allreduce")
            bits = matches_order(bucket["result"], contributions, "gloo_ring", expected=expected, **how)
            out += (records_of(bits, bucket["result"], contributions, "gloo_ring", **how, **labels)
                    if bits is not None else   # measured whole: only a bucket whose bits differ
                    error_records(bucket["result"], torch.stack(local), "gloo_ring", expected=expected, **how,
                                  **labels))
        return out

    for step in common_steps(*ranks):
        if "buckets" not in ranks[0][step]:
            return
        yield measured(step)


def _status_record(config: Configuration, status: str, steps_done: int, error: BaseException | None,
                   **facts) -> dict:
    labels = dict(config=config.label, status=status, **{k: v for k, v in config.describe().items()
                                                          if k != "config" and v is not None})
    labels.update({k: v for k, v in facts.items() if v not in (None, "")})
    if error is not None:
        labels["error"] = f"{type(error).__name__}: {str(error).splitlines()[0][:300]}"
        rank = getattr(error, "rank", None)
        # A hang has no failing rank; the one that never entered the collective the others wait in is it.
        culprits = list(getattr(error, "not_in_collective", None) or [])
        if rank is None and culprits:
            rank = culprits[0]
            labels["not_in_collective"] = ",".join(map(str, culprits))
        if rank is not None:
            labels["failed_rank"] = int(rank)
    return _records.record("steps_completed", steps_done, **labels)


# --------------------------------------------------------------------------- the evidence runs


def own_evidence(setup: Setup, config: Configuration,
                 reads_process_group: Callable[[int], bool] | None = None) -> bool:
    """Does ``config`` need the evidence that asks no specification (the symmetric twin, its own code
    in float64)? Where the specification replay covers every phase it is the stronger evidence.
    ``reads_process_group(world_size)``: :func:`ddplab.compare.stand_in.reads_process_group` of the setup,
    when the caller already knows it."""
    if _replay.unavailable(setup, config) is not None or isinstance(config, FSDP2):
        return True
    if config.approximates() is not None:
        return True
    reads = reads_process_group or (lambda world: _stand_in.reads_process_group(setup, world))
    if reads(config.world_size):
        return True  # the float64 promise ran in one process: not what the ranks promise
    return _replay.reduction_emulation(getattr(config, "comm_hook", None)) is None


def _unavailable_record(config: Configuration, evidence: str, reason: str) -> dict:
    return _records.record("evidence_unavailable", 1, config=config.label, evidence=evidence, reason=reason)


# --------------------------------------------------------------------------- the entry point


class _ReferenceTrainingFailed(RuntimeError):
    """Raised in the first launch's rank when a reference run fails after the setup's check passed."""


def _first_worker(setup: Setup, steps: int | None, configs: list[Configuration]) -> dict:
    """Rank 0 of a comparison's first launch: try the setup (:func:`check_setup`), refuse what the
    configurations cannot run on it (a mesh plan, per-rank batches), then train the first step of
    every reference run that writes captures: their sizes (``capture_bytes``, by label; none written) are what
    :mod:`ddplab.compare.footprint` counts. One process for all of it: a launch's start and
    rendezvous are most of a small comparison's cost."""
    facts = check_setup(setup, steps=steps, divisors={c.label: c.pieces for c in configs})
    _meshes.check_plans(setup, configs)
    _data.check_rank_batches(setup, facts["steps"], configs)
    try:
        facts["capture_bytes"] = first_capture_sizes(setup, reference_runs(configs, promises=not facts["random"]))
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - told apart from the setup's check in the parent
        raise _ReferenceTrainingFailed(f"{type(exc).__name__}: {exc}") from exc
    return facts


def first_launch(setup: Setup, steps: int | None, configs: list[Configuration], timeout: float,
                 on_record: Callable | None = None) -> dict:
    """:func:`_first_worker` in a process of its own within ``timeout`` seconds: the setup's facts
    (:func:`check_setup`), with the sizes of the reference runs' first captures (``capture_bytes``).

    The user's callables (``model()``, the batches, the loss, the optimizer) run there first: one
    that hangs is stopped at the timeout and named by where it was; one that raises is a
    :class:`SetupError` with its message; a configuration the setup cannot run is a ValueError.
    No configuration has started. Then this process builds the model too: a model that another
    process builds otherwise (seeded from its pid or the clock) is refused before any configuration.
    Raises :class:`ReferenceFailed` when a reference run fails after the check passed.
    """
    import cloudpickle

    if not isinstance(setup, Setup):
        raise SetupError(f"expected a ddplab.compare.Setup, got {type(setup).__name__}")
    try:
        cloudpickle.dumps(setup)
    except Exception as exc:  # noqa: BLE001 - any pickling failure is the user's to fix, said
        raise SetupError(f"the setup must be picklable (cloudpickle) to reach the ranks: {exc}") from exc
    runner = _launcher.Launch(_first_worker, world_size=1, args=(setup, steps, configs), timeout=timeout,
                              on_record=on_record).start()
    try:
        _load_for_judging()   # this process would only wait for the launch meanwhile
    except BaseException:
        runner.stop()
        with contextlib.suppress(BaseException):
            runner.wait()
        raise
    try:
        result = runner.wait()
    except _launcher.LaunchTimeout as err:
        place = err.places.get(0)
        where = (f": it was in {place.frame.function} ({place.frame.file}:{place.frame.line})"
                 if place is not None else "")
        raise SetupError(f"trying the setup and training the reference did not finish within {timeout:g} s"
                         f"{where}; setup.model(), the batches, the loss or the optimizer does not return") from err
    except _launcher.RankFailed as err:
        text = (err.remote_traceback or str(err)).rstrip()
        said = text.rsplit(f"{err.exc_type}: ", 1)[-1] if f"{err.exc_type}: " in text else str(err).splitlines()[0]
        if err.exc_type == "_ReferenceTrainingFailed":
            raise ReferenceFailed(f"the single-process reference failed, so there is nothing to compare with: "
                                  f"{said}") from err
        if err.exc_type == "SetupError":
            raise SetupError(said) from err
        if err.exc_type == "ValueError":   # a configuration the setup cannot run (compare.meshes)
            raise ValueError(said) from err
        raise SetupError(f"trying the setup raised {err.exc_type}: {str(err).splitlines()[0]}") from err
    except _launcher.LaunchStopped:
        raise
    except _launcher.LaunchError as err:
        raise SetupError(f"trying the setup failed: {str(err).splitlines()[0]}") from err
    facts = result.returns[0]
    rng = torch.get_rng_state()   # the user's session keeps its random state
    try:
        with _stand_in.process_group(0, 1):
            model = setup.build_model()
        here = model_digest(model)
        setup.answer_from(model)   # what the comparison asks of the model's structure: no build of its own
        del model
    finally:
        torch.set_rng_state(rng)
    if here != facts["digest"]:
        raise SetupError(DIFFERENT_MODEL)
    return facts


@contextlib.contextmanager
def _one_thread() -> Iterator[None]:
    """Inside the block this process computes on one thread, and after it on as many as before. While a
    pass trains, its ranks hold every core (each a share of them, the reference process one): a second
    thread of the judge would wait for a core at every parallel region (measured at 50M parameters, W=2
    on 2 cores: 26.5-26.9 s a comparison against 29.5-30.0 s). Nothing judged depends on it: the
    replay runs each rank's computations on that rank's threads, and the emulations on any number."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _load_for_judging() -> None:
    """Load what the parent's first judged step would otherwise load on the comparison's critical path:
    torch's compiler (the eager stance the setup's probes run under; ~1.2 s to import) and the reduction
    kernels' compiled code for float32 (numba's on-disk cache; ~1 s). Called while the first launch
    trains in a process of its own; a comparison after the first finds both loaded."""
    import torch._dynamo  # noqa: F401 - imported for its side effect: loaded now, not while judging

    from ddplab.numerics.orders import DDP_AVERAGING, reduce

    reduce(torch.zeros(2, 64), "gloo_ring", op="avg", averaging=DDP_AVERAGING)


class _Session:
    """One comparison's passes inside its scratch folder ``root``: each configuration is trained and
    judged at once, a step at a time (:mod:`ddplab.compare.streaming`)."""

    def __init__(self, setup: Setup, configs: list[Configuration], facts: dict, runs: list[RunSpec],
                 root: str, timeout: float, on_record: Callable):
        self.setup, self.configs, self.facts, self.runs = setup, configs, facts, runs
        self.root, self.timeout, self.on_record = root, timeout, on_record
        self.steps = facts["steps"]
        self.statuses: dict[str, tuple[str, BaseException | None]] = {}
        self.stopped = False
        self._reads: dict[int, bool] = {}                  # world size -> the loss reads the process group
        self._judged: dict[str, int] = {}                  # reference run -> steps whose distances are in
        self._streamed: set[tuple] = set()                 # the reference runs' records streamed so far
        self._whole: set[str] = set()                      # reference runs kept whole on disk
        self._semantic: dict[str, dict] = {}               # promise label -> its records, judged where it trains
        self.reference_bytes: dict[str, int] = {}          # a step of each reference run, by label
        # What the evidence sources read at one step (:func:`in_step`): every rank's capture of it and of
        # the step before (the replay's start), the twin's ranks, the float64 run, the reference runs of
        # the pass. The parent holds these few, whatever the steps.
        world = max(c.world_size for c in configs)
        self.cache = CaptureCache(3 * world + 1 + len(runs) + 1)

    # -- one configuration ----------------------------------------------------------------------

    def configuration(self, index: int, config: Configuration) -> list[dict]:
        """Train and judge ``config`` as given and, where it needs them, its twin and its float64 run:
        alongside the run (:attr:`alongside`), or after it when it completed. Its records."""
        if self.stopped:
            self.statuses[config.label] = ("not run", None)
            return [self._status(config)]
        reason = _unavailable(config)
        if reason is not None:
            self.statuses[config.label] = ("unavailable", RuntimeError(reason))
            return [self._status(config)]
        variants = ("twin", "float64") if own_evidence(self.setup, config, self.reads_process_group) else ()
        together = variants if self.alongside else ()
        records, facts, cut = self._run_pass(index, config, together)
        later = [v for v in variants if v not in together]
        if later and self.statuses[config.label][0] == "completed" and not self.stopped and cut != 0:
            records += self._variants_pass(index, config, later, self.steps if cut is None else cut)
        return records + [self._status(config, **facts)]

    def _status(self, config: Configuration, done: int = 0, **facts) -> dict:
        status, error = self.statuses[config.label]
        return _status_record(config, status, done, error, no_replay=_replay.unavailable(self.setup, config),
                              random=self.facts["random"] or None, compression=_recorded.compression(config),
                              approximation=config.approximates(), **facts)

    def _start_configuration(self, streamed: Pass, config: Configuration, run_id: str, variant: str,
                             after=None) -> None:
        launch = _launcher.Launch(configuration_worker, world_size=config.world_size,
                                  args=(self.setup, config, streamed.steps, streamed.root, run_id,
                                        self.facts["digest"], variant, LAG),
                                  timeout=config.timeout or self.timeout,
                                  on_record=self.on_record if variant == "run" else None)
        streamed.start(run_id, launch, [run_id], after)

    def _start_references(self, streamed: Pass, runs: list[RunSpec], key: str = "references",
                          judge: JudgeSpec | None = None) -> JudgedSteps | None:
        """The reference runs ``runs`` beside the pass's configuration, each record streamed once.

        A small model's (:attr:`keep_references`) are written whole, those an earlier pass wrote are
        read again, and the parent judges against them (None is returned). A larger model's train in
        one process (launch ``key``) that writes none of them and judges ``judge`` there, after each
        step (:mod:`ddplab.compare.reference_judge`): the records it sends arrive in what is returned."""
        folder = os.path.join(self.root, "references") if self.keep_references else None
        if folder:
            for spec in _written(runs):
                streamed.add(spec.run_id, 1, reads_next="truth" if spec.label == "truth" else None, kept_in=folder,
                             written=spec.run_id in self._whole)
        train = [spec for spec in runs if spec.run_id not in self._whole]
        if folder and any(spec.label == "truth" for spec in train):
            # A promise is judged beside the truth as they train: kept whole, the truth trains once,
            # so every configuration's promise trains with it now.
            train += [spec for spec in self.runs if spec.promise and spec not in train]
        if not train:
            return None
        for spec in train if folder else ():   # what a stopped pass left of them is written anew
            shutil.rmtree(os.path.join(folder, spec.run_id), ignore_errors=True)
            os.makedirs(os.path.join(folder, spec.run_id))
        sent = JudgedSteps() if folder is None and judge is not None else None

        def on_record(rec: dict) -> None:
            metric = rec.get("metric", "")
            if metric.startswith("semantic_"):   # the promise, judged in the reference process
                key = (metric, rec.get("step"), rec.get("quantity"), rec.get("param"))
                self._semantic.setdefault(rec["config"], {})[key] = rec
            elif metric in STEP_METRICS:          # the reference runs' own losses and norms
                key = (rec.get("config"), metric, rec.get("step"), rec.get("rank"))
                if key not in self._streamed:
                    self._streamed.add(key)
                    self.on_record(rec)
            elif sent is not None:                # what it judged of the pass
                sent.put(rec)

        def after(outcome) -> None:
            if sent is not None:
                sent.end()
            if isinstance(outcome, BaseException) and not isinstance(outcome, _launcher.LaunchStopped):
                streamed.stop(streamed.launches())   # without the references nothing of the pass can be judged
            elif folder is not None and not isinstance(outcome, BaseException):
                self._whole.update(spec.run_id for spec in train)   # every step on disk, for a later pass

        # Kept whole, they need not wait for the parent; judging, they wait for the pass's captures.
        launch = _launcher.Launch(reference_worker, world_size=1,
                                  args=(self.setup, train, streamed.steps, folder or streamed.root,
                                        self.facts["digest"], judge if sent is not None else None),
                                  timeout=self.timeout, on_record=on_record, threads_per_rank=1)
        streamed.start(key, launch, [spec.run_id for spec in _written(train)] if folder else [], after)
        return sent

    @property
    def keep_references(self) -> bool:
        """Are the reference runs written whole once and read by every configuration? When every
        step of them fits :data:`KEEP_REFERENCES_BYTES` (measured by the first launch): a small
        model's comparison then trains them once, a larger one beside each configuration."""
        sizes = self.reference_bytes
        return bool(sizes) and self.steps * sum(sizes.values()) <= KEEP_REFERENCES_BYTES

    def _pass_references(self, config: Configuration, precision: tuple) -> tuple[list[RunSpec], RunSpec]:
        """The reference runs ``config`` is judged against: the truth, the reference, the one in its
        precision (declared, or shown by its first step: then added to :attr:`runs`) and its promise."""
        band = band_reference(precision, self.runs)
        if band not in self.runs:
            self.runs.append(band)
        wanted = {"truth", "reference", band.run_id, _promise_id(self.runs, config)}
        return [spec for spec in self.runs if spec.run_id in wanted], band

    def _against_references(self, streamed: Pass, sent: JudgedSteps | None, spec: JudgeSpec,
                            runs: list[RunSpec]) -> StepRecords:
        """What is judged against the reference runs ``runs``, a step at a time: the records the
        reference process sends (``sent``), or, with the references on disk, the same judge asked here."""
        # The float64 run is read by this judge alone: once it judged a step, that step's files can go.
        took = streamed.runs[spec.float64_id].free if spec.float64_id is not None else None
        if sent is not None:
            return judged_there(sent, streamed.cut_at, took)
        judge = ReferenceJudge(self.setup, dataclasses.replace(spec, done=self._judged), runs, streamed.steps)
        refs = {run.run_id: streamed.captures(run.run_id, past_cut=True) for run in _written(runs)}
        ranks = streamed.ranks(spec.run_id, past_cut=True) if spec.run_id is not None else None
        float64 = streamed.captures(spec.float64_id) if spec.float64_id is not None else None
        return judge_here(judge, refs, ranks, float64, streamed.cut_at, took)

    def _run_pass(self, index: int, config: Configuration, together: tuple) -> tuple[list[dict], dict, int | None]:
        """``config``'s run (with ``together``, its variants that run alongside) and its reference runs,
        judged as they train: the records, the facts of its status, and the step judging stopped at
        (a value turned non-finite there; None: every step)."""
        run_id = f"config{index}"
        streamed = Pass(os.path.join(self.root, run_id), self.cache, self.steps)
        streamed.add(run_id, config.world_size, reads_next="configuration")
        variant_ids = {variant: f"{run_id}-{variant}" for variant in together}
        for variant_id in variant_ids.values():
            streamed.add(variant_id, config.world_size)

        def after_run(outcome) -> None:   # what the variants would show has nothing to be compared with
            if isinstance(outcome, BaseException):
                streamed.stop(list(variant_ids.values()))

        try:
            runs, band = self._pass_references(config, config.dtypes())
            # Undeclared, the band's precision is what the run's first step shows (autocast, a hook).
            spec = JudgeSpec(config, streamed.root, run_id, variant_ids.get("float64"),
                             band if config.dtypes() != (None, None) else None, self.facts["dtype"], dict(self._judged))
            sent = self._start_references(streamed, runs, judge=spec)
            self._start_configuration(streamed, config, run_id, "run", after_run)
            for variant, variant_id in variant_ids.items():
                self._start_configuration(streamed, config, variant_id, variant)
            first = streamed.ranks(run_id)[0]
            shown = (detected_precision(config, first[0], self.facts["dtype"])
                     if spec.band is None and has_step(first, 0) else None)
            if shown:   # the judge there trains it beside the truth; on disk, it trains in a process of its own
                matched, band = self._pass_references(config, shown)
                extra = [run for run in matched if run not in runs]
                if extra and sent is None:
                    self._start_references(streamed, extra, "references-precision")
                runs += extra
            against = self._against_references(streamed, sent, dataclasses.replace(spec, band=band), runs)
            records, facts, own = self._judge(config, streamed, run_id, against, variant_ids)
        except BaseException:
            streamed.close()
            raise
        references = ["references", "references-precision"]
        # The run and its variants train on to their end; so do reference runs kept whole for later passes,
        # and those at their last step already (the promise's last records are on their way).
        judged_all = streamed.cut is None and min(streamed.runs[run_id].written) >= self.steps
        streamed.finish(stop=[] if self.keep_references or judged_all else references)
        self._keep_status(config, streamed.outcomes.get(run_id), run_id in streamed.stopped_here)
        if self._scratch_full(config, streamed):
            references = []   # stopped by the full disk, or failed for it: not the reference's own failure
        for key in references:
            failed = streamed.outcomes.get(key)
            if isinstance(failed, BaseException) and not isinstance(failed, _launcher.LaunchStopped):
                raise _reference_failure(failed)
            if isinstance(failed, _launcher.LaunchStopped) and key not in streamed.stopped_here:
                self.stopped = True
        if self.statuses[config.label][0] == "completed":
            records += self._own_records(config, streamed, variant_ids, own)
        facts.update(rank_steps=",".join(f"{r}:{streamed.runs[run_id].finished(r)}" for r in range(config.world_size)))
        facts["done"] = min(streamed.runs[run_id].finished(r) for r in range(config.world_size))
        judged = facts["done"] if streamed.cut is None else min(facts["done"], streamed.cut)
        records += self._semantic_records(config, judged)
        return records, facts, streamed.cut

    def _scratch_full(self, config: Configuration, streamed: Pass) -> bool:
        """Did the scratch folder's disk fill during ``config``'s pass (the parent could not write, or a
        launch failed for it)? Then ``config`` crashed for that reason and the comparison stops there,
        keeping what was judged: every later pass would need the same disk."""
        failure = streamed.failure or next((outcome for outcome in streamed.outcomes.values()
                                            if _streaming.disk_full(outcome)), None)
        if failure is None:
            return False
        if not isinstance(failure, _streaming.ScratchFull):
            failure = _streaming.ScratchFull(f"the scratch folder's disk filled: {str(failure).splitlines()[0]}")
        self.statuses[config.label] = ("crashed", failure)
        self.stopped = True
        return True

    def _initial_weights(self) -> torch.Tensor:
        """The model's initial weights as DDP broadcasts them (:func:`~ddplab.compare.captures.initial_weights`):
        built again where asked, never held -- the ranks write them as a marker, not as bytes."""
        return initial_weights(self.setup.build_model())

    def _judge(self, config: Configuration, streamed: Pass, run_id: str, against: StepRecords,
               variant_ids: dict) -> tuple[list[dict], dict, dict]:
        """Every source of ``config``'s evidence, a step at a time as the pass's runs write them: what is
        judged against the reference runs (``against``, first: the step's files stay until it has them),
        then the sources that read the ranks alone."""
        ranks = streamed.ranks(run_id)
        batches = global_batches(self.setup, self.steps)
        dtype = self.facts["dtype"]
        reads = self.reads_process_group(config.world_size)
        # From the first NaN or Inf on nothing is judged: the verdict rests on the steps before it.
        finite = _finite.nonfinite_steps(streamed.ranks(run_id, past_cut=True), streamed.cut_at)
        twin = {variant: self._twin_source(config, streamed, variant_id)
                for variant, variant_id in variant_ids.items() if variant == "twin"}
        shared = _replay.Reductions()   # each bucket's reduction, emulated once for the audit and the replay

        def judged(step: int) -> None:
            shared.clear()
            streamed.judged(step)

        references, found, reductions, collectives, mesh, replayed, *mine = in_step(
            against, finite, _reduction_steps(config, ranks, shared),
            _recorded.collective_records(config, ranks, dtype, shared, self._initial_weights),
            _mesh_evidence.mesh_records(config, ranks, dtype),
            _replay.replay_records(self.setup, config, ranks, batches, shared), *twin.values(), judged=judged)
        own = dict(zip(twin, mine))
        references, own["float64"] = self._note_judged(references)
        records = [dict(r, config=config.label) for r in found] + references
        records += _data.sample_records(self.setup, config, batches)
        records += reductions + collectives + mesh + replayed
        return records, dict(reads_process_group=reads or None), own

    def _note_judged(self, records: list[dict]) -> tuple[list[dict], list[dict]]:
        """``records`` judged against the reference runs, less the float64 run's (returned apart: its
        launch may have failed); the reference runs' own distances judged so far are noted, so that a
        later pass does not judge them again."""
        own = {spec.label for spec in self.runs if spec.label != "truth" and not spec.promise}
        for rec in records:
            if rec.get("config") in own and rec.get("step") is not None:
                self._judged[rec["config"]] = max(self._judged.get(rec["config"], 0), rec["step"] + 1)
        float64 = [rec for rec in records if rec["metric"].startswith("float64_")]
        return [rec for rec in records if not rec["metric"].startswith("float64_")], float64

    def _semantic_records(self, config: Configuration, steps: int) -> list[dict]:
        """The semantic question's records of ``config``'s steps before ``steps``: its float64 promise
        against the truth, judged in the reference process (:class:`~ddplab.compare.float64_run.PromiseJudge`).
        Nothing where the promise does not describe it: a model whose modules issue collectives
        (SyncBatchNorm) promises something else than every rank's share on its own, and so does a loss
        that reads the process group (the promise ran in a one-rank launch)."""
        spec = next((s for s in self.runs if s.run_id == _promise_id(self.runs, config)), None)
        if spec is None or _replay.unavailable(self.setup, config) is not None \
                or self.reads_process_group(config.world_size):
            return []
        return [dict(rec, config=config.label) for rec in self._semantic.get(spec.label, {}).values()
                if rec["step"] < steps]

    def _twin_source(self, config: Configuration, streamed: Pass, run_id: str) -> StepRecords:
        return _twin.twin_records(config.label, streamed.ranks(run_id), getattr(config, "twin_partner", None))

    def _own_records(self, config: Configuration, streamed: Pass, variant_ids: dict, own: dict) -> list[dict]:
        """The twin's and the float64 run's records, or why each is unavailable (its launch failed)."""
        out = []
        for variant, run_id in variant_ids.items():
            outcome = streamed.outcomes.get(run_id)
            if isinstance(outcome, _launcher.LaunchStopped) and run_id not in streamed.stopped_here:
                self.stopped = True
            elif isinstance(outcome, BaseException):
                first = str(outcome).strip().splitlines()[0] if str(outcome).strip() else type(outcome).__name__
                out.append(_unavailable_record(config, variant, f"the {variant} run failed: {first[:300]}"))
            else:
                out += own[variant]
        return out

    def _variants_pass(self, index: int, config: Configuration, variants: list[str], steps: int) -> list[dict]:
        """``config``'s twin and float64 run after its run (a model too large to train them alongside),
        over the ``steps`` its run was judged, with the float64 truth beside them when needed."""
        run_id = f"config{index}"
        streamed = Pass(os.path.join(self.root, f"{run_id}-own"), self.cache, steps)
        variant_ids = {variant: f"{run_id}-{variant}" for variant in variants}
        try:
            for variant, variant_id in variant_ids.items():
                streamed.add(variant_id, config.world_size)
                self._start_configuration(streamed, config, variant_id, variant)
            sources = {variant: self._twin_source(config, streamed, variant_id)
                       for variant, variant_id in variant_ids.items() if variant == "twin"}
            if "float64" in variant_ids:   # judged against the truth, which trains beside it
                truth = [spec for spec in self.runs if spec.label == "truth"]
                spec = JudgeSpec(config, streamed.root, None, variant_ids["float64"], None, self.facts["dtype"])
                sent = self._start_references(streamed, truth, judge=spec)
                sources["float64"] = self._against_references(streamed, sent, spec, truth)
            own = dict(zip(sources, in_step(*sources.values(), judged=streamed.judged)))
        except BaseException:
            streamed.close()
            raise
        streamed.finish(stop=[] if self.keep_references else ["references"])
        failed = streamed.outcomes.get("references")
        if streamed.failure is not None or _streaming.disk_full(failed):
            self.stopped = True   # the disk filled: what was judged stands, nothing more runs
        elif isinstance(failed, BaseException) and not isinstance(failed, _launcher.LaunchStopped):
            raise _reference_failure(failed)
        return self._own_records(config, streamed, variant_ids, own)

    def _keep_status(self, config: Configuration, outcome, stopped_here: bool) -> None:
        """How ``config``'s run ended: completed, stopped, hung or crashed."""
        if not isinstance(outcome, BaseException):
            self.statuses[config.label] = ("completed", None)
        elif isinstance(outcome, _launcher.LaunchStopped):
            self.stopped = self.stopped or not stopped_here
            self.statuses[config.label] = ("stopped", outcome)
        elif isinstance(outcome, _launcher.LaunchTimeout):
            self.statuses[config.label] = ("hung", outcome)
        elif isinstance(outcome, _launcher.LaunchError):
            self.statuses[config.label] = ("crashed", outcome)
        else:
            raise outcome

    # -- facts ----------------------------------------------------------------------------------

    def reads_process_group(self, world_size: int) -> bool:
        """:func:`ddplab.compare.stand_in.reads_process_group` of the setup, tried once per world size."""
        if world_size not in self._reads:
            self._reads[world_size] = _stand_in.reads_process_group(self.setup, world_size)
        return self._reads[world_size]

    @functools.cached_property
    def alongside(self) -> bool:
        """Do a configuration's run, twin and float64 run start together? For a model of at most
        :data:`ALONGSIDE_NUMEL` parameters whose processes all fit in half the memory available
        (counting each as :data:`MODEL_COPIES` float64 copies of the model); one after another
        otherwise. A larger model's launches compute more than they wait: side by side on the same
        cores they would only stretch each one towards its timeout."""
        if self.facts["numel"] > ALONGSIDE_NUMEL:
            return False
        processes = 3 * max(c.world_size for c in self.configs)
        need = processes * MODEL_COPIES * self.facts["numel"] * 8
        return need <= psutil.virtual_memory().available / 2

    def footprint(self) -> _footprint.Footprint | None:
        """What the configurations will need of the machine at least (:mod:`ddplab.compare.footprint`),
        from the sizes of the reference runs' first captures the first launch measured; None without them."""
        self.reference_bytes = sizes = dict(self.facts.get("capture_bytes", {}))
        if not {"reference", "truth"} <= sizes.keys():
            return None
        shapes = []
        for config in self.configs:
            if _unavailable(config) is None:
                own = bool(own_evidence(self.setup, config, self.reads_process_group))
                shapes.append((config.world_size, own, own))
        return _footprint.footprint(sizes, shapes, alongside=self.alongside, references_on_disk=self.keep_references)


def _written(runs: list[RunSpec]) -> list[RunSpec]:
    """The reference runs among ``runs`` that write captures: all but a float64 promise (judged where it trains)."""
    return [spec for spec in runs if not spec.promise]


def _reference_failure(error: BaseException) -> Exception:
    """What a failed reference launch means for the comparison: a setup another process cannot run
    (:class:`SetupError`), or nothing to compare with (:class:`ReferenceFailed`)."""
    if isinstance(error, _launcher.RankFailed) and error.exc_type == "SetupError":
        return SetupError(str(error).splitlines()[0].split("SetupError: ", 1)[-1])
    return ReferenceFailed(f"the single-process reference failed, so there is nothing to compare with:\n{error}")


def run(setup: Setup, configurations, *, steps: int | None = None, timeout: float = DEFAULT_TIMEOUT,
        progress: bool | Callable = True) -> Comparison:
    """Compare each configuration with the single-process reference, step by step and parameter by parameter.

    ``setup``: a :class:`~ddplab.compare.Setup`; ``configurations``: one or a
    list of :class:`~ddplab.compare.DDP`, :class:`~ddplab.compare.Accumulate`,
    :class:`~ddplab.compare.Fabric`, :class:`~ddplab.compare.FSDP2`,
    :class:`~ddplab.compare.Custom`; ``steps``: how many global batches
    (default: all); ``timeout``: seconds per launch before it counts as hung;
    ``progress``: True for one bar per run, False for none, or a callable
    ``fn(config, step, steps)`` called as each step finishes on every rank
    (from the thread that watches that launch, one call at a time).

    Raises ValueError before any process starts when a configuration is
    unusable, and before any configuration starts when the setup is (a
    :class:`SetupError`) or the machine cannot hold the comparison
    (:mod:`ddplab.compare.footprint`); :class:`ReferenceFailed` when the
    single-process reference itself fails (its first step is tried before any
    configuration; it trains again beside each one). A launch counts as hung
    when it runs ``timeout`` seconds beyond the time the parent spent judging
    its steps (its ranks wait for that). While the configurations train, this
    process computes on one thread (their ranks hold the cores); it has its
    thread count back when ``run`` returns.

    Example::

        >>> from ddplab import compare
        >>> result = compare.run(compare.examples.digits_setup(), [compare.DDP(2), compare.Accumulate(2, k=2)])
        >>> result.kinds
        {'ddp W=2': 'exact', 'accumulate W=2 k=2': 'exact'}
    """
    t0 = time.perf_counter()
    configs = check_configurations(configurations)
    if not (isinstance(progress, bool) or callable(progress)):
        raise ValueError(f"progress must be True, False or a callable (config, step, steps), got {progress!r}")
    _launcher.check_timeout(timeout)
    streamed: list[dict] = []   # what the ranks emit as they run: losses, gradient norms, audits
    lock = threading.Lock()
    bars = None
    try:
        with tempfile.TemporaryDirectory(prefix="ddplab-compare-") as root:
            facts = first_launch(setup, steps, configs, timeout)
            steps = facts["steps"]
            bars = _Progress(steps, progress is True, progress if callable(progress) else None,
                             {c.label: c.world_size for c in configs})

            def on_record(rec: dict) -> None:   # from the threads that watch a pass's launches
                with lock:
                    streamed.append(rec)
                    bars(rec)

            runs = reference_runs(configs, promises=not facts["random"])
            session = _Session(setup, configs, facts, runs, root, timeout, on_record)
            need = session.footprint()
            if need is not None:
                if progress is True:
                    from ddplab.progress import note
                    note(need.text())
                _footprint.check_fits(need, memory=psutil.virtual_memory().available,
                                      disk=shutil.disk_usage(root).free)
            records = []
            with _one_thread():
                for index, config in enumerate(configs):
                    records += session.configuration(index, config)
            records = streamed + (need.records() if need is not None else []) + records
    finally:
        if bars is not None:
            bars.close()
    errors = {label: error for label, (_, error) in session.statuses.items() if error is not None}
    frame = _records.to_frame(records)
    verdicts = {c.label: judge(frame, c.label, error=errors.get(c.label)) for c in configs}
    return Comparison(setup_name=setup.name, steps=steps, configurations=configs, runs=session.runs,
                      records=frame, verdicts=verdicts, errors=errors, stopped=session.stopped,
                      wall_time=time.perf_counter() - t0, footprint=need)

"""Run a comparison: the reference runs, then every configuration, then the referee.

:func:`run` checks the configurations here (a bad one raises ValueError
before any process starts), tries the setup and trains the reference runs in
one process (a bad setup raises :class:`SetupError` before any configuration
starts), states what the comparison needs of the machine
(:mod:`ddplab.compare.footprint`), trains each configuration on its W ranks
(real gloo process groups via :func:`ddplab.launch`; where it needs them, its
symmetric twin and its float64 run start alongside it for a small model), and
compares every captured step with the float64 truth
(:mod:`ddplab.compare.referee`), a step at a time, localizes the first divergence
(:mod:`ddplab.compare.localization`) and returns a :class:`Comparison`:
the tidy records, one verdict per configuration, the errors of the
configurations that crashed or hung.

A configuration that crashes or hangs does not stop the others: its verdict
says so (rank, exception, traceback) and the steps it finished are still
compared. :func:`ddplab.launcher.stop_all` ends the running launch; the
comparison then keeps what was captured so far and runs nothing more.
"""
from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import shutil
import tempfile
import threading
import time
from typing import Callable

import psutil
import torch

from ddplab import launcher as _launcher
from ddplab import records as _records
from ddplab.compare import finite as _finite
from ddplab.compare import recorded as _recorded
from ddplab.compare.captures import CaptureCache, Captures, StepRecords, in_step
from ddplab.compare import data as _data
from ddplab.compare import float64_run as _float64
from ddplab.compare import footprint as _footprint
from ddplab.compare import localization as _localization
from ddplab.compare import mesh_evidence as _mesh_evidence
from ddplab.compare import meshes as _meshes
from ddplab.compare import referee as _referee
from ddplab.compare import replay as _replay
from ddplab.compare import stand_in as _stand_in
from ddplab.compare import twin as _twin
from ddplab.compare.configurations import Configuration, Custom, Fabric, FSDP2, check_configurations
from ddplab.compare.runners import (DIFFERENT_MODEL, RunSpec, configuration_worker, precision_reference,
                                    reference_runs, reference_worker, train_references)
from ddplab.compare.setup import Setup, SetupError, check_setup, global_batches, model_digest
from ddplab.compare.verdicts import ConfigVerdict, comparison_verdict, judge, verdicts_markdown
from ddplab.numerics import unit_roundoff

__all__ = ["Comparison", "ReferenceFailed", "run", "DEFAULT_TIMEOUT"]

#: Seconds each launch (the reference runs, one configuration) may take before it counts as hung.
DEFAULT_TIMEOUT = 300.0
#: What one process of a comparison holds, in float64 copies of the model: parameters, gradients,
#: optimizer state, the step's capture and the activations (a generous count, for :attr:`_Session.alongside`).
MODEL_COPIES = 8
#: The largest model (in parameters) whose twin and float64 run start alongside its run.
ALONGSIDE_NUMEL = 1_000_000


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
    """One bar per run label, fed by rank 0's records; and the user's callback."""

    def __init__(self, steps: int, show: bool, callback: Callable | None):
        self.steps, self.show, self.callback = steps, show, callback
        self.bars: dict[str, object] = {}
        self.done: dict[str, int] = {}

    def __call__(self, rec: dict) -> None:
        if rec.get("metric") != "grad_norm" or rec.get("rank") not in (0, None) or rec.get("step") is None:
            return
        label = rec.get("config")
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


def _band_run(config: Configuration, runs: list[RunSpec], precision: tuple | None = None) -> RunSpec:
    param_dtype, reduce_dtype = precision or config.dtypes()
    for spec in runs:
        if spec.label == "truth":
            continue
        if (spec.param_dtype, spec.reduce_dtype) == (param_dtype, reduce_dtype):
            return spec
    raise AssertionError(f"no reference run for precision {(param_dtype, reduce_dtype)}")


def _compression(config: Configuration) -> str | None:
    """The low precision a configuration's comm hook reduces in, when it compresses."""
    from ddplab import comm_hooks

    hook = getattr(config, "comm_hook", None)
    if hook is None:
        return None
    dtype = comm_hooks.COMPRESSION_DTYPE.get(comm_hooks.gloo_equivalent(hook)[0])
    return str(dtype).replace("torch.", "") if dtype is not None else None


def _promise_id(runs: list[RunSpec], config: Configuration) -> str | None:
    """The run id of the float64 promise of ``config``'s W and k, if one ran."""
    for spec in runs:
        if spec.world_size > 1 or spec.k > 1:
            if (spec.world_size, spec.k) == (config.shares, config.k) and not isinstance(config, Custom):
                return spec.run_id
    return None


def _unit(spec: RunSpec, dtype: torch.dtype) -> float:
    """Unit roundoff of the dtype ``spec`` computes in (the model's ``dtype`` unless mixed precision)."""
    return unit_roundoff(spec.param_dtype or spec.dtype or dtype)


def _reference_records(cache: CaptureCache, root: str, runs: list[RunSpec], steps: int,
                       dtype: torch.dtype) -> tuple[list[dict], dict]:
    caps = {spec.run_id: Captures.on_disk(cache, root, spec.run_id, 0, steps) for spec in runs}
    truth = caps["truth"]
    recs = []
    for spec in runs:
        if spec.label == "truth" or spec.world_size > 1 or spec.k > 1:  # the promises are judged per configuration
            continue
        for step, cap in enumerate(caps[spec.run_id][:len(truth)]):
            for quantity in _referee.QUANTITIES:
                key = quantity + "s"
                recs += _referee.distance_records(step, quantity, truth[step][key], cap[key], cap[key],
                                                  None, config=spec.label, band_label=spec.label,
                                                  unit_roundoff=_unit(spec, dtype))
    return recs, caps


def _config_steps(config: Configuration, ranks: list[list[dict]], caps: dict,
                  band: RunSpec, dtype: torch.dtype) -> StepRecords:
    """The referee's distances of every rank from the truth, the band run and the reference, per step."""
    truth, ref, matched = caps["truth"], caps["reference"], caps[band.run_id]
    for step in range(min([len(ranks[0]), len(truth), len(ref), len(matched)])):
        recs = []
        for quantity in _referee.QUANTITIES:
            key = quantity + "s"
            others = {r: ranks[r][step][key] for r in range(1, config.world_size) if step < len(ranks[r])}
            recs += _referee.distance_records(step, quantity, truth[step][key], matched[step][key],
                                              ranks[0][step][key], ref[step][key], config=config.label,
                                              others=others, band_label=band.label,
                                              unit_roundoff=_unit(band, dtype))
        yield recs


def _reduction_steps(config: Configuration, ranks: list[list[dict]]) -> StepRecords:
    """The referee's measure of every captured DDP bucket: its result against gloo's ring order
    applied to the W ranks' contributions (bit for bit), per step; nothing without captured buckets."""
    from ddplab.numerics import error_records
    from ddplab.numerics.orders import DDP_AVERAGING

    for step in range(min(len(r) for r in ranks)):
        if "buckets" not in ranks[0][step]:
            return
        out = []
        by_rank = [{b["index"]: b for b in ranks[r][step]["buckets"]} for r in range(config.world_size)]
        for index, bucket in sorted(by_rank[0].items()):
            if not all(index in other for other in by_rank):
                continue
            contributions = torch.stack([other[index]["local"] for other in by_rank])
            out += error_records(bucket["result"], contributions, "gloo_ring", op="avg",
                                 averaging=DDP_AVERAGING, step=step, rank=0, bucket=index,
                                 config=config.label, params=bucket["params"], collective="allreduce")
        yield out


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


def _float64_precision(config: Configuration, run: list[dict]) -> torch.dtype | None:
    """The lowest precision the float64 run still computed in: the configuration's own mixed
    precision, its compression hook, the dtypes its modules returned and its reductions ran in."""
    names = [str(d).replace("torch.", "") for d in config.dtypes() if d is not None]
    if _compression(config):
        names.append(_compression(config))
    names += sorted(_recorded.reduction_dtypes(run))
    for cap in run:
        names += list(cap.get("forward_dtypes", []))
    return _float64.lowest_precision(names)


def _float64_records(setup: Setup, config: Configuration, run: list[dict], caps: dict) -> StepRecords:
    """The configuration's own code in float64 against the float64 truth (:mod:`ddplab.compare.float64_run`)."""
    low = _float64_precision(config, run)
    tolerance = _float64.precision_tolerance(low, config.world_size)
    judged_at = str(low).replace("torch.", "") if low is not None else "float64"
    return _float64.distance_records("float64", setup, config, run, caps, tolerance, judged_at=judged_at)


def _detected_precision(config: Configuration, ranks: list[list[dict]], dtype: torch.dtype) -> tuple | None:
    """``(param_dtype, reduce_dtype)`` below the model's that the run showed but did not declare: modules
    that returned a lower precision (autocast), gradient reductions in a lower precision (a hook)."""
    if config.dtypes() != (None, None) or not ranks or not ranks[0]:
        return None
    first = [ranks[0][0]]

    def below(names):
        low = _float64.lowest_precision(names)
        return low if low is not None and unit_roundoff(low) > unit_roundoff(dtype) else None

    shown = below(first[0].get("forward_dtypes", [])), below(_recorded.reduction_dtypes(first))
    return shown if shown != (None, None) else None


def _unavailable_record(config: Configuration, evidence: str, reason: str) -> dict:
    return _records.record("evidence_unavailable", 1, config=config.label, evidence=evidence, reason=reason)


# --------------------------------------------------------------------------- the entry point


class _ReferenceTrainingFailed(RuntimeError):
    """Raised in the first launch's rank when a reference run fails after the setup's check passed."""


def _first_worker(setup: Setup, steps: int | None, configs: list[Configuration], root: str) -> dict:
    """Rank 0 of a comparison's first launch: try the setup (:func:`check_setup`), refuse what the
    configurations cannot run on it (a mesh plan, per-rank batches), then train every reference run.
    One process for all of it: a launch's start and rendezvous are most of a small comparison's cost."""
    facts = check_setup(setup, steps=steps, divisors={c.label: c.pieces for c in configs})
    _meshes.check_plans(setup, configs)
    _data.check_rank_batches(setup, facts["steps"], configs)
    try:
        train_references(setup, reference_runs(configs, promises=not facts["random"]), facts["steps"], root)
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - told apart from the setup's check in the parent
        raise _ReferenceTrainingFailed(f"{type(exc).__name__}: {exc}") from exc
    return facts


def first_launch(setup: Setup, steps: int | None, configs: list[Configuration], root: str, timeout: float,
                 on_record: Callable | None = None) -> dict:
    """:func:`_first_worker` in a process of its own within ``timeout`` seconds: the setup's facts
    (:func:`check_setup`), with the reference runs' captures under ``root``.

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
    try:
        result = _launcher.launch(_first_worker, world_size=1, args=(setup, steps, configs, root),
                                  timeout=timeout, on_record=on_record)
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
            here = model_digest(setup.build_model())
    finally:
        torch.set_rng_state(rng)
    if here != facts["digest"]:
        raise SetupError(DIFFERENT_MODEL)
    return facts


#: A variant launch stopped with the comparison (not a failure of the variant).
_STOPPED = object()


class _Cancelled(Exception):
    """A launch of this comparison that was stopped before it started."""


class _Session:
    """One comparison's launches and analysis inside its scratch folder ``root``."""

    def __init__(self, setup: Setup, configs: list[Configuration], facts: dict, runs: list[RunSpec],
                 root: str, timeout: float, on_record: Callable):
        self.setup, self.configs, self.facts, self.runs = setup, configs, facts, runs
        self.root, self.timeout, self.on_record = root, timeout, on_record
        self.steps = facts["steps"]
        self.statuses: dict[str, tuple[str, BaseException | None]] = {}
        self.variants: dict[tuple[str, str], str | None] = {}   # (config, variant) -> why it failed, or None
        self.stopped = False
        self._lock = threading.Lock()
        self._running: dict[str, _launcher.Launch] = {}   # run id -> its launch, while it runs
        self._cancelled: set[str] = set()
        self._reads: dict[int, bool] = {}                  # world size -> the loss reads the process group
        # What the evidence sources read at one step (:func:`in_step`): every rank's capture of it and of
        # the step before (the replay's start), the twin's ranks, the float64 run, every reference run
        # (and one in a precision a configuration shows). The parent holds these few, whatever the steps.
        world = max(c.world_size for c in configs)
        self.cache = CaptureCache(3 * world + 1 + len(runs) + 1)

    def captures(self, run_id: str, rank: int, steps: int | None = None) -> Captures:
        """Rank ``rank``'s captures of ``run_id``, read when a step is needed."""
        return Captures.on_disk(self.cache, self.root, run_id, rank, self.steps if steps is None else steps)

    def references(self, runs: list[RunSpec]) -> None:
        """The single-process runs; a failure there leaves nothing to compare with."""
        try:
            _launcher.launch(reference_worker, world_size=1,
                             args=(self.setup, runs, self.steps, self.root, self.facts["digest"]),
                             timeout=self.timeout, on_record=self.on_record)
        except _launcher.LaunchStopped:
            self.stopped = True
        except _launcher.RankFailed as err:
            if err.exc_type == "SetupError":
                raise SetupError(str(err).splitlines()[0].split("SetupError: ", 1)[-1]) from err
            raise ReferenceFailed(f"the single-process reference failed, so there is nothing to "
                                  f"compare with:\n{err}") from err
        except _launcher.LaunchError as err:
            raise ReferenceFailed(f"the single-process reference failed, so there is nothing to "
                                  f"compare with:\n{err}") from err

    def _launch(self, config: Configuration, run_id: str, variant: str) -> None:
        runner = _launcher.Launch(configuration_worker, world_size=config.world_size,
                                  args=(self.setup, config, self.steps, self.root, run_id, self.facts["digest"],
                                        variant),
                                  timeout=config.timeout or self.timeout,
                                  on_record=self.on_record if variant == "run" else None)
        with self._lock:
            if run_id in self._cancelled:
                raise _Cancelled(run_id)
            self._running[run_id] = runner
        try:
            runner.start().wait()
        finally:
            with self._lock:
                self._running.pop(run_id, None)

    def _cancel(self, run_ids) -> None:
        """Stop these launches of this comparison, running or yet to start (and no other launch)."""
        with self._lock:
            self._cancelled.update(run_ids)
            running = [self._running[r] for r in run_ids if r in self._running]
        for runner in running:
            runner.stop()

    def configuration(self, index: int, config: Configuration) -> None:
        """Run ``config`` as given and, where it needs them, its twin and its float64 run: alongside the
        run (:attr:`alongside`), or after it when it completed."""
        if self.stopped:
            self.statuses[config.label] = ("not run", None)
            return
        reason = _unavailable(config)
        if reason is not None:
            self.statuses[config.label] = ("unavailable", RuntimeError(reason))
            return
        variants = ("twin", "float64") if own_evidence(self.setup, config, self.reads_process_group) else ()
        if not variants or not self.alongside:
            self._run(index, config)
            for variant in variants:
                if self.statuses[config.label][0] != "completed" or self.stopped:
                    break
                self._keep_variant(config, variant, self._variant(index, config, variant))
            return
        # The twin and the float64 run need nothing from the run: they start with it, in threads of
        # their own, so that one run's waits (forks, rendezvous) overlap the others' work.
        others = [f"config{index}-{variant}" for variant in variants]
        with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
            pending = {variant: pool.submit(self._variant, index, config, variant) for variant in variants}
            try:
                self._run(index, config)
                if self.statuses[config.label][0] != "completed":
                    self._cancel(others)  # what they would show has nothing to be compared with
                for variant, future in pending.items():
                    if self.statuses[config.label][0] == "completed":
                        self._keep_variant(config, variant, future.result())
                    else:
                        future.result()
            except BaseException:
                self._cancel(others)  # Ctrl-C in the parent: the variants' ranks go too
                raise

    def _run(self, index: int, config: Configuration) -> None:
        """Launch ``config`` as given; its status says how it ended."""
        try:
            self._launch(config, f"config{index}", "run")
            self.statuses[config.label] = ("completed", None)
        except _launcher.LaunchStopped as err:
            self.stopped = True
            self.statuses[config.label] = ("stopped", err)
        except _launcher.LaunchTimeout as err:
            self.statuses[config.label] = ("hung", err)
        except _launcher.LaunchError as err:
            self.statuses[config.label] = ("crashed", err)

    def _keep_variant(self, config: Configuration, variant: str, outcome) -> None:
        if outcome is _STOPPED:
            self.stopped = True
        else:
            self.variants[(config.label, variant)] = outcome

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

    def train(self) -> None:
        """Every configuration (:meth:`configuration`), then a reference in each precision a
        configuration showed. The reference runs finished before (:func:`first_launch`): a comparison
        stopped during a configuration still compares every step that configuration finished."""
        for index, config in enumerate(self.configs):
            self.configuration(index, config)
        self.detected_references()

    def footprint(self) -> _footprint.Footprint | None:
        """What the configurations will need of the machine at least (:mod:`ddplab.compare.footprint`),
        from the sizes of the reference runs' captures; None when they did not write one."""
        sizes = _footprint.capture_sizes(self.root, self.runs)
        if not {"reference", "truth"} <= sizes.keys():
            return None
        shapes = []
        for config in self.configs:
            if _unavailable(config) is None:
                own = bool(own_evidence(self.setup, config, self.reads_process_group))
                shapes.append((config.world_size, own, own))
        return _footprint.footprint(sizes, self.steps, shapes, alongside=self.alongside)

    def _variant(self, index: int, config: Configuration, variant: str):
        """Launch ``config``'s ``variant``: None when it ran, why it failed, or :data:`_STOPPED`."""
        try:
            self._launch(config, f"config{index}-{variant}", variant)
        except (_launcher.LaunchStopped, _Cancelled):
            return _STOPPED
        except _launcher.LaunchError as err:
            first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            return f"the {variant} run failed: {first[:300]}"
        return None

    def _precision(self, index: int, config: Configuration) -> tuple:
        """The precision ``config``'s band is measured in: declared, or shown by its modules' outputs."""
        shown = _detected_precision(config, [self.captures(f"config{index}", 0, 1)], self.facts["dtype"])
        return shown or config.dtypes()

    def detected_references(self) -> None:
        """A reference in each compute precision a configuration showed without declaring it."""
        extra: dict = {}
        for index, config in enumerate(self.configs):
            if self.statuses[config.label][0] in ("not run", "unavailable"):
                continue
            precision = self._precision(index, config)
            if precision == (None, None) or config.dtypes() != (None, None) or precision in extra:
                continue
            if not any((r.param_dtype, r.reduce_dtype) == precision and r.world_size == 1 and r.label != "truth"
                       for r in self.runs):
                extra[precision] = precision_reference(*precision, run_id=f"ref{len(self.runs) + len(extra)}")
        if extra and not self.stopped:
            self.references(list(extra.values()))
            self.runs += list(extra.values())

    def analyse(self, index: int, config: Configuration, caps: dict, batches: list) -> list[dict]:
        """Every record of ``config``: the band, the audits, the replay, the promise, the twin, float64."""
        status, error = self.statuses[config.label]
        records, done, facts, reads = [], 0, {}, False
        if status not in ("not run", "unavailable"):
            band = _band_run(config, self.runs, self._precision(index, config))
            ranks = [self.captures(f"config{index}", r) for r in range(config.world_size)]
            # Every rank's own count: a hang can leave rank 0 steps ahead of the others.
            done = min(len(r) for r in ranks)
            facts["rank_steps"] = ",".join(f"{r}:{len(caps_r)}" for r, caps_r in enumerate(ranks))
            # From the first NaN or Inf on nothing is judged: the verdict rests on the steps before it.
            finite, found = _finite.finite_steps(ranks, caps["reference"])
            records += [dict(r, config=config.label) for r in found]
            if finite is not None:
                ranks = [r[:finite] for r in ranks]
                caps = {key: value[:finite] for key, value in caps.items()}
            promise = caps.get(_promise_id(self.runs, config))
            # A model whose modules issue collectives (SyncBatchNorm) promises something else
            # than every rank's share on its own: the float64 promise does not describe it.
            # Nor does it where the loss reads the process group: the promise ran in a one-rank launch.
            reads = self.reads_process_group(config.world_size)
            semantic = (_replay.semantic_records(self.setup, config, promise, caps)
                        if promise is not None and _replay.unavailable(self.setup, config) is None and not reads
                        else iter(()))
            dtype = self.facts["dtype"]
            # Every source reads a step's captures while the cache holds them, then the next step's.
            recs, reductions, collectives, mesh, replayed, promised, *own = in_step(
                _config_steps(config, ranks, caps, band, dtype), _reduction_steps(config, ranks),
                _recorded.collective_records(config, ranks, dtype), _mesh_evidence.mesh_records(config, ranks, dtype),
                _replay.replay_records(self.setup, config, ranks, batches), semantic,
                *self._own_evidence(index, config, caps, finite))
            records += recs + _data.sample_records(self.setup, config, batches)
            records += reductions + collectives + mesh + replayed + promised
            records += _localization.localize(self.setup, config, caps, ranks, recs)
            records += [rec for source in own for rec in source]
        records.append(_status_record(config, status, done, error,
                                      no_replay=_replay.unavailable(self.setup, config),
                                      random=self.facts["random"] or None,
                                      compression=_compression(config),
                                      approximation=config.approximates(),
                                      reads_process_group=reads or None, **facts))
        return records

    def _own_evidence(self, index: int, config: Configuration, caps: dict, finite: int | None) -> list[StepRecords]:
        """The twin's and the float64 run's sources (or why each is unavailable), as they ran."""
        out = []
        for variant in ("twin", "float64"):
            if (config.label, variant) not in self.variants:
                continue
            failed = self.variants[(config.label, variant)]
            if failed is not None:
                out.append(iter([[_unavailable_record(config, variant, failed)]]))
                continue
            run_id = f"config{index}-{variant}"
            ranks = [self.captures(run_id, r, self.steps if finite is None else finite)
                     for r in range(config.world_size)]
            if variant == "twin":
                out.append(_twin.twin_records(config.label, ranks, getattr(config, "twin_partner", None)))
            else:
                out.append(_float64_records(self.setup, config, ranks[0], caps))
        return out


def run(setup: Setup, configurations, *, steps: int | None = None, timeout: float = DEFAULT_TIMEOUT,
        progress: bool | Callable = True) -> Comparison:
    """Compare each configuration with the single-process reference, step by step and parameter by parameter.

    ``setup``: a :class:`~ddplab.compare.Setup`; ``configurations``: one or a
    list of :class:`~ddplab.compare.DDP`, :class:`~ddplab.compare.Accumulate`,
    :class:`~ddplab.compare.Fabric`, :class:`~ddplab.compare.FSDP2`,
    :class:`~ddplab.compare.Custom`; ``steps``: how many global batches
    (default: all); ``timeout``: seconds per launch before it counts as hung;
    ``progress``: True for one bar per run, False for none, or a callable
    ``fn(config, step, steps)`` called as each step finishes.

    Raises ValueError before any process starts when a configuration is
    unusable, and before any configuration starts when the setup is (a
    :class:`SetupError`) or the machine cannot hold the comparison
    (:mod:`ddplab.compare.footprint`); :class:`ReferenceFailed` when the
    single-process reference itself fails.

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
    streamed: list[dict] = []
    bars = None
    try:
        with tempfile.TemporaryDirectory(prefix="ddplab-compare-") as root:
            # The reference runs' records are kept as they come; their bars, once the number of steps is known.
            facts = first_launch(setup, steps, configs, root, timeout, streamed.append)
            steps = facts["steps"]
            bars = _Progress(steps, progress is True, progress if callable(progress) else None)
            for rec in streamed:
                bars(rec)

            def on_record(rec: dict) -> None:
                streamed.append(rec)
                bars(rec)

            runs = reference_runs(configs, promises=not facts["random"])
            batches = global_batches(setup, steps)
            session = _Session(setup, configs, facts, runs, root, timeout, on_record)
            need = session.footprint()
            if need is not None:
                if progress is True:
                    from ddplab.progress import note
                    note(need.text())
                _footprint.check_fits(need, memory=psutil.virtual_memory().available,
                                      disk=shutil.disk_usage(root).free)
            session.train()
            records = list(streamed) + (need.records() if need is not None else [])
            ref_recs, caps = _reference_records(session.cache, root, session.runs, steps, facts["dtype"])
            records += ref_recs
            for index, config in enumerate(configs):
                records += session.analyse(index, config, caps, batches)
    finally:
        if bars is not None:
            bars.close()
    errors = {label: error for label, (_, error) in session.statuses.items() if error is not None}
    frame = _records.to_frame(records)
    verdicts = {c.label: judge(frame, c.label, error=errors.get(c.label)) for c in configs}
    return Comparison(setup_name=setup.name, steps=steps, configurations=configs, runs=session.runs,
                      records=frame, verdicts=verdicts, errors=errors, stopped=session.stopped,
                      wall_time=time.perf_counter() - t0, footprint=need)

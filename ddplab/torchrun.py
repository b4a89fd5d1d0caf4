"""Run a case (or any worker function) under torchrun, across machines.

``python -m ddplab run CASE --out DIR [-p NAME VALUE ...]`` is started by
torchrun on every node; each rank sets itself up from torchrun's environment
(:func:`ddplab.rank.context_from_env`), runs the *same* worker function the
notebook launcher runs, and appends its records to ``DIR/rank-<r>.jsonl`` as
they happen (so a crash keeps what was recorded). When every rank finished,
rank 0 gathers all records over the process group -- no shared file system
needed -- and writes the merged results directory: ``records.jsonl``,
``params.json``, ``environment.json`` and ``run.json`` (status "complete").
If any rank fails, torchrun stops the job and no ``run.json`` is written:
:func:`load_run` then refuses the folder instead of presenting a partial
table as complete.

Example (two nodes, two processes each)::

    torchrun --nnodes 2 --node-rank 0 --nproc-per-node 2 --rdzv-backend c10d \\
        --rdzv-endpoint HOST:29500 -m ddplab run backend_divergence --out runs/bd -p steps 5
"""
from __future__ import annotations

import importlib
import json
import os
import pathlib
import sys
import time
import traceback
from typing import Callable

from ddplab import records as _records
from ddplab.artifacts import atomic_write_text, load_results, read_jsonl
from ddplab.formatting import visible_controls

__all__ = ["run_rank", "load_run", "resolve_target", "RunIncomplete"]


class RunIncomplete(RuntimeError):
    """A run folder whose job did not finish on every rank."""


def resolve_target(target: str, overrides: dict, world_size: int | None = None) -> tuple[Callable, dict, str]:
    """``(worker, params, name)`` for a case (name or module path) or a ``module:function`` worker.

    Case parameters are validated (ValueError naming the parameter) and, with
    ``world_size``, set to describe a job of that many ranks
    (:meth:`~ddplab.cases.Case.for_world_size`); a ``module:function``
    worker receives the overrides as a dict, unparsed.
    """
    from ddplab.cases import Case, get_case

    if ":" in target:
        module_name, _, attr = target.partition(":")
        try:
            obj = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as exc:
            raise ValueError(f"cannot load {target!r}: {exc}") from None
        if not (isinstance(obj, Case) or (isinstance(obj, type) and issubclass(obj, Case))):
            if not callable(obj):
                raise ValueError(f"worker {target!r} is not callable")
            return obj, dict(overrides), target
    case = get_case(target)
    params = case.check_params(overrides)
    if world_size is not None:
        params = case.for_world_size(params, world_size, overrides)
    return case.worker, params, case.name


def _write_run_json(out_dir: pathlib.Path, data: dict) -> None:
    atomic_write_text(out_dir / "run.json", json.dumps(data, indent=2, default=str))


def run_rank(target: str, out_dir: str | os.PathLike, overrides: dict | None = None, *,
             backend: str = "gloo", timeout: float = 1800.0) -> int:
    """Body of ``python -m ddplab run`` on one torchrun rank; returns the exit code."""
    import torch.distributed as dist

    from ddplab.environment import environment_info
    from ddplab.rank import context_from_env, teardown_rank

    # Validate before joining the job: bad input fails on every rank at once, naming the parameter.
    resolve_target(target, overrides or {})
    out_dir = pathlib.Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    ctx = context_from_env(backend, timeout=timeout)
    worker, params, name = resolve_target(target, overrides or {}, ctx.world_size)
    rank_file = out_dir / f"rank-{ctx.rank}.jsonl"
    emitted: list[dict] = []
    with open(rank_file, "w", buffering=1) as fh:
        def sink(rec: dict) -> None:
            emitted.append(rec)
            fh.write(json.dumps(rec, allow_nan=True) + "\n")  # line-buffered: survives a crash

        _records.set_sink(sink)
        try:
            worker(params)
        except BaseException as exc:
            tb = traceback.format_exc()
            # The time tells the first failure (the cause) from the peers that
            # then failed in a collective because it had left.
            atomic_write_text(out_dir / f"rank-{ctx.rank}.error.json", json.dumps(
                {"rank": ctx.rank, "time": time.time(), "type": type(exc).__name__,
                 "message": str(exc), "traceback": tb}, indent=2))
            # The error file keeps the text as raised; the terminal gets it escaped.
            print(visible_controls(f"ddplab run: rank {ctx.rank} of {ctx.world_size} failed in {name}; "
                                   f"{len(emitted)} records kept in {rank_file}\n{tb}"),
                  file=sys.stderr, flush=True)
            return 1
        finally:
            _records.set_sink(None)
    # Every rank got here: gather over the process group (works without a shared disk).
    gathered = [None] * ctx.world_size if ctx.rank == 0 else None
    dist.gather_object(emitted, gathered, dst=0)
    if ctx.rank == 0:
        merged = [rec for per_rank in gathered for rec in per_rank]
        from ddplab.artifacts import save_results
        save_results(out_dir, records=merged, verdict=None, params=params,
                     environment=environment_info(backend=backend, world_sizes=[ctx.world_size]))
        _write_run_json(out_dir, {"status": "complete", "target": name, "world_size": ctx.world_size,
                                  "backend": backend, "records": len(merged)})
    dist.barrier()
    _leave_together(ctx.rank, ctx.world_size)
    teardown_rank()
    return 0


def _leave_together(rank: int, world_size: int) -> None:
    """Return once every rank has left its last collective, agreed through the store, not gloo.

    A rank that closes its gloo connections while a peer is still finishing the barrier makes
    that peer's gloo thread throw: the process aborts (SIGABRT, "terminate called without an
    active exception") after the work was done and saved.
    """
    import torch.distributed as dist

    store = dist.distributed_c10d._get_default_store()
    store.set(f"ddplab/left/{rank}", "1")
    store.wait([f"ddplab/left/{r}" for r in range(world_size)])


def load_run(path: str | os.PathLike, *, allow_incomplete: bool = False):
    """The tidy records of a finished run folder (a torchrun job or ``ddplab report``).

    Raises :class:`RunIncomplete` when the job did not complete on every rank,
    naming the ranks that failed; ``allow_incomplete=True`` instead returns
    whatever the ranks recorded before they stopped (for a post-mortem).
    """
    path = pathlib.Path(path)
    if not path.is_dir():
        raise FileNotFoundError(f"{path} is not a directory")
    run_json = path / "run.json"
    complete = run_json.exists() and json.loads(run_json.read_text()).get("status") == "complete"
    if not complete and not (path / "rank-0.jsonl").exists():
        # A results directory written by a notebook (no ranks files): complete by construction.
        return load_results(path).records
    if complete:
        return load_results(path).records
    errors = sorted((json.loads(p.read_text()) for p in path.glob("rank-*.error.json")),
                    key=lambda e: e["time"])
    ranks = sorted(int(p.stem.split("-")[1]) for p in path.glob("rank-*.jsonl"))
    if not allow_incomplete:
        if errors:
            first = errors[0]
            why = (f"first failure: rank {first['rank']} ({first['type']}: {first['message']})"
                   + (f"; then ranks {[e['rank'] for e in errors[1:]]} failed too"
                      if len(errors) > 1 else ""))
        else:
            why = "no rank reported a failure (killed, or still running?)"
        raise RunIncomplete(visible_controls(
            f"{path}: the run did not complete (no run.json); {why}; ranks with records: {ranks}. "
            "Pass allow_incomplete=True to read what was recorded."))
    recs = [rec for r in ranks for rec in read_jsonl(path / f"rank-{r}.jsonl")]
    return _records.to_frame(recs)

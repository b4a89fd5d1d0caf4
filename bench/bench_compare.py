"""ddplab.compare: overhead, false alarms on correct code, planted bugs named, and the margins' calibration.

* Overhead: wall time of ``compare.run(setup, [DDP(2)])`` on the digits
  example against the sum of the bare runs it compares -- DDP over 2 ranks,
  the single-process reference and its float64 shadow, each one plain
  launch training the same steps without any capture. Rounds interleave
  the two (``_common.interleaved``); prints the median ratio of adjacent
  pairs with its range, the ratio of best times and the load average.
  Target ≤ 1.5×.
* False alarms: the correct example over ``--seeds`` seeds under every
  built-in configuration, and correct Custom steps (accumulation with and
  without no_sync, a hand-written all-reduce, autocast, hand-written fp16/bf16
  hooks) and a correct Custom step on DDP compiled with torch.compile (``--only
  compiled`` alone); counts configurations not judged as expected. Target 0.
* Planted bugs: every planted example over ``--seeds`` seeds; counts those
  named with the right verdict and finding (and factor / missing pieces). Target 100%.
* ``--sensitivity``: quiet faults of every size down to one ulp, planted in the
  built-in configurations and written inside a Custom step; detected and placed.
* ``--calibrate``: the largest deviation on correct code over seeds × models
  (MLP, deeper MLP, GroupNorm CNN) × optimizers (SGD with momentum, Adam) ×
  batch sizes (48, and one sample per rank) × configurations -- the number
  :data:`ddplab.compare.referee.MEASURED_MAX` records.

Asserts nothing (machines are noisy); prints numbers.

    python bench/bench_compare.py [--rounds 5] [--seeds 20] [--only overhead|alarms|compiled|planted] [--calibrate]
    python bench/bench_compare.py --sensitivity [--seeds 3]
"""
from __future__ import annotations

import argparse
import contextlib
import os

import torch
from _common import interleaved, load_average, machine_line, ratio_table

from ddplab import compare, launch
from ddplab.compare import examples
from ddplab.compare.configurations import DDP
from ddplab.compare.runners import _builtin_step, _ddp
from ddplab.compare.setup import cast_batch, forward_loss, global_batches, split


# --------------------------------------------------------------------------- the bare runs


def bare_single(setup, steps: int, dtype) -> None:
    """One process, the whole global batch, no capture: what a user runs as the reference."""
    model = setup.build_model(dtype)
    optimizer = setup.optimizer(model.parameters())
    for batch in global_batches(setup, steps):
        optimizer.zero_grad(set_to_none=True)
        forward_loss(model, setup.loss, cast_batch(batch, dtype)).backward()
        optimizer.step()


def bare_ddp(setup, steps: int) -> None:
    """DDP over the launch's ranks, each its share, no capture: the user's distributed run."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = _ddp(setup.build_model(), setup, DDP(world))
    for batch in global_batches(setup, steps):
        _builtin_step(trainer, setup, split(batch, world)[rank:rank + 1])


def bare_custom(setup, config, steps: int) -> None:
    """The user's own Custom step on the launch's ranks, its wrap, no capture: the user's run."""
    import torch.distributed as dist

    from ddplab.compare.configurations import StepContext
    from ddplab.compare.runners import _custom_model

    rank, world = dist.get_rank(), dist.get_world_size()
    model, _ = _custom_model(setup.build_model(), config)
    optimizer = setup.optimizer(model.parameters())
    for step, batch in enumerate(global_batches(setup, steps)):
        micro = split(batch, world * config.k)[rank * config.k:(rank + 1) * config.k]
        shard = tuple(torch.cat(parts) for parts in zip(*micro))
        config.train_step(StepContext(model=model, optimizer=optimizer, loss=setup.loss, batch=batch, shard=shard,
                                      micro_batches=micro, step=step, rank=rank, world_size=world, k=config.k))


def overhead(rounds: int, steps: int) -> None:
    setup = examples.digits_setup(0, steps=steps)
    bare = lambda: (launch(bare_ddp, world_size=2, args=(setup, steps)),          # noqa: E731
                    launch(bare_single, world_size=1, args=(setup, steps, None)),
                    launch(bare_single, world_size=1, args=(setup, steps, torch.float64)))
    full = lambda: compare.run(setup, [DDP(2)], progress=False)                   # noqa: E731
    bare(), full()  # warm: forkserver, imports
    print(f"overhead: compare.run(DDP W=2) on the digits MLP, {steps} steps, against the bare runs "
          f"(DDP + reference + float64 shadow), {rounds} interleaved rounds")
    ratios = interleaved({"compare.run DDP W=2": full}, bare, rounds)
    # The replay re-executes every rank's step in the parent: the target is 2x the bare runs.
    print(ratio_table(ratios, {"compare.run DDP W=2": 2.0}, baseline_name="bare"))
    # A Custom step: every evidence source that needs no specification (the twin, the float64 run,
    # the recorded collectives) against the user's bare run and the bare reference runs.
    custom = compare.Custom(2, k=2, train_step=examples.accumulate_correctly)
    bare_user = lambda: (launch(bare_custom, world_size=2, args=(setup, custom, steps)),   # noqa: E731
                         launch(bare_single, world_size=1, args=(setup, steps, None)),
                         launch(bare_single, world_size=1, args=(setup, steps, torch.float64)))
    full_user = lambda: compare.run(setup, [custom], progress=False)                       # noqa: E731
    bare_user(), full_user()
    print(f"overhead: compare.run(Custom accumulation W=2 k=2), {steps} steps, against the bare runs "
          f"(the Custom step + reference + float64 shadow), {rounds} interleaved rounds")
    ratios = interleaved({"compare.run Custom W=2": full_user}, bare_user, rounds)
    print(ratio_table(ratios, {"compare.run Custom W=2": 2.0}, baseline_name="bare"))


# --------------------------------------------------------------------------- false alarms and planted bugs


def false_alarms(seeds: int, steps: int, only: str | None = None) -> None:
    """Every configuration of the correct example over ``seeds`` seeds (``only``: labels containing it)."""
    alarms, total, worst = [], 0, 0.0
    for seed in range(seeds):
        example = examples.correct(seed, steps=steps)
        configs = [c for c in example.configurations if only is None or only in c.label]
        result = compare.run(example.setup, configs, progress=False)
        for label, verdict in result.verdicts.items():
            total += 1
            worst = max(worst, verdict.max_deviation or 0.0)
            if verdict.kind != example.expected[label].verdict:
                alarms.append((seed, label, verdict.kind, verdict.headline))
    print(f"false alarms on the correct example: {len(alarms)} of {total} configuration runs "
          f"({seeds} seeds{'; configurations ' + repr(only) if only else ''}), largest deviation {worst:.3g}, "
          f"load average {load_average()[0]:.2f}   (target 0)")
    for alarm in alarms:
        print("   ", alarm)


def _named(verdict, expected) -> bool:
    if verdict.kind != expected.verdict or verdict.difference != expected.finding:
        return False
    values = verdict.finding_values(expected.finding) if expected.finding else {}
    if expected.factor is not None and abs(values["factor"] / expected.factor - 1) > 1e-3:
        return False
    if expected.missing is not None and tuple(map(tuple, values["missing_pieces"])) != expected.missing:
        return False
    return True


def planted(seeds: int, steps: int) -> None:
    named, total, misses = 0, 0, []
    for seed in range(seeds):
        for example in examples.planted(seed, steps=steps):
            result = compare.run(example.setup, example.configurations, progress=False)
            for label, expected in example.expected.items():
                total += 1
                verdict = result.verdict(label)
                if _named(verdict, expected):
                    named += 1
                else:
                    misses.append((seed, example.name, verdict.kind, verdict.difference, verdict.headline))
    print(f"planted bugs named with the right kind: {named} of {total} ({100 * named / total:.0f}%), "
          f"{seeds} seeds × {len(examples.PLANTED)} bugs, load average {load_average()[0]:.2f}   (target 100%)")
    for miss in misses:
        print("   ", miss)


# --------------------------------------------------------------------------- quiet faults of every size


def sensitivity(seeds: int, steps: int) -> None:
    """Every planted quiet fault (:mod:`ddplab.compare.faults`) at every magnitude down to one ulp,
    float32 DDP/accumulation and bfloat16 FSDP2: detected (bug) and placed (step, rank, phase)."""
    from ddplab.compare import faults

    rows = []
    cases = [(kind, m, False) for kind in faults.KINDS for m in faults.MAGNITUDES
             if not (kind in ("skipped_micro_batch", "duplicated_micro_batch", "low_precision_bucket")
                     and m != faults.MAGNITUDES[0])]
    # A bfloat16 output scaled by less than its unit roundoff (2^-8) rounds back to the same bits:
    # no fault is planted, so only 1e-2 and one ulp are swept there.
    cases += [(kind, m, True) for kind in faults.FSDP_KINDS for m in faults.MAGNITUDES
              if kind != "forward_output" or m in (1e-2, "ulp")]
    for kind, magnitude, fsdp in cases:
        detected = placed = 0
        for seed in range(seeds):
            fault = faults.plant(kind, magnitude, seed=seed, steps=steps, fsdp=fsdp)
            verdict = compare.run(fault.setup, [fault.config], progress=False).verdict(fault.config.label)
            detected += verdict.kind == "bug"
            placed += fault.placed(verdict)
        rows.append((("fsdp2 bf16 " if fsdp else "") + kind, magnitude, detected, placed))
    print(f"quiet faults on rank 1, {seeds} seed(s) each, {steps} steps, load average {load_average()[0]:.2f} "
          f"(target: every one bug and placed)")
    print(f"{'fault':34s}{'magnitude':>10s}{'detected':>10s}{'placed':>8s}")
    for name, magnitude, detected, placed in rows:
        print(f"{name:34s}{str(magnitude):>10s}{detected:>7d}/{seeds}{placed:>5d}/{seeds}")


def custom_sensitivity(seeds: int, steps: int) -> None:
    """Faults written inside a Custom step (:func:`ddplab.compare.faults.plant_custom`), every kind at
    every size down to one ulp (faults every rank commits: 1e-2 to 1e-6; float64 cannot see an ulp of
    float32), all configurations of one size in one comparison."""
    from ddplab.compare import faults

    rows = []
    for magnitude in faults.MAGNITUDES:
        kinds = [k for k in faults.CUSTOM_KINDS if not (k.startswith("every_rank") and magnitude == "ulp")]
        counts = {k: [0, 0] for k in kinds}
        for seed in range(seeds):
            plants = [faults.plant_custom(k, magnitude, seed=seed, steps=steps) for k in kinds]
            grad_fault = [p for p in plants if p.kind == "local_gradient"]   # its own model: its own run
            rest = [p for p in plants if p.kind != "local_gradient"]
            for group in (rest, grad_fault):
                result = compare.run(group[0].setup, [p.config for p in group], progress=False)
                for fault in group:
                    verdict = result.verdict(fault.config)
                    counts[fault.kind][0] += verdict.kind == "bug"
                    counts[fault.kind][1] += fault.placed(verdict)
        rows += [(kind, magnitude, *counts[kind]) for kind in kinds]
    print(f"faults in a Custom step (rank 1; every_rank_*: all ranks), {seeds} seed(s) each, {steps} steps, "
          f"load average {load_average()[0]:.2f} (target: every one bug and placed)")
    print(f"{'fault':34s}{'magnitude':>10s}{'detected':>10s}{'placed':>8s}")
    for name, magnitude, detected, placed in rows:
        print(f"{name:34s}{str(magnitude):>10s}{detected:>7d}/{seeds}{placed:>5d}/{seeds}")


def custom_false_alarms(seeds: int, steps: int) -> None:
    """Correct Custom steps (:func:`ddplab.compare.examples.correct_custom_steps`) over seeds: never bug."""
    kinds, alarms = {}, []
    for seed in range(seeds):
        result = compare.run(examples.digits_setup(seed, steps=steps), examples.correct_custom_steps(),
                             progress=False)
        for label, verdict in result.verdicts.items():
            kinds.setdefault(label, []).append(f"{verdict.kind}/{verdict.evidence}")
            if verdict.kind not in ("rounding", "exact", "approximation"):
                alarms.append((seed, label, verdict.kind, verdict.headline))
    total = sum(len(v) for v in kinds.values())
    print(f"false alarms on correct Custom steps: {len(alarms)} of {total} configuration runs ({seeds} seeds), "
          f"load average {load_average()[0]:.2f}   (target 0)")
    for label, seen in kinds.items():
        print(f"    {label:45s} {', '.join(sorted(set(seen)))}")
    for alarm in alarms:
        print("   ", alarm)


def compiled_false_alarms(seeds: int, steps: int) -> None:
    """A correct Custom step on DDP compiled with torch.compile (inductor, its defaults) over seeds:
    never bug. Its twin and float64 run compile too."""
    kinds, alarms = [], []
    config = compare.Custom(2, train_step=examples.plain_step, wrap=examples.compiled_ddp, name="compiled DDP step")
    for seed in range(seeds):
        verdict = compare.run(examples.digits_setup(seed, steps=steps), config, progress=False).verdict(config)
        kinds.append(f"{verdict.kind}/{verdict.evidence}")
        if verdict.kind not in ("rounding", "exact", "approximation"):
            alarms.append((seed, verdict.kind, verdict.headline))
    print(f"false alarms on a correct compiled Custom step: {len(alarms)} of {seeds} runs ({seeds} seeds), "
          f"load average {load_average()[0]:.2f}   (target 0)")
    print(f"    {config.label:45s} {', '.join(sorted(set(kinds)))}")
    for alarm in alarms:
        print("   ", alarm)


# --------------------------------------------------------------------------- calibration of the margins


def calibrate(seeds: int, steps: int) -> None:
    from ddplab.compare import FSDP2, Accumulate, Fabric

    worst: dict[str, tuple[float, str]] = {}
    for seed in range(seeds):
        for model in examples.MODELS:
            optimizer = ("sgd", "adam")[seed % 2]
            for batch_size, configs in (
                    (48, [DDP(2), DDP(3), DDP(4), Accumulate(2, k=2), Accumulate(2, k=4), FSDP2(2),
                          FSDP2(2, param_dtype=torch.bfloat16)] + ([Fabric(2)] if seed < 2 else [])),
                    (4, [DDP(2), DDP(4), Accumulate(2, k=2), FSDP2(4, param_dtype=torch.bfloat16)])):
                setup = examples.digits_setup(seed, model=model, steps=steps, batch_size=batch_size,
                                              optimizer=optimizer)
                result = compare.run(setup, configs, progress=False)
                for label, verdict in result.verdicts.items():
                    key = f"{label} (batch {batch_size})"
                    where = f"seed {seed} {model} {optimizer}"
                    if verdict.max_deviation > worst.get(key, (-1.0, ""))[0]:
                        worst[key] = (verdict.max_deviation, where)
            print(f"  seed {seed} {model}: largest so far {max(v for v, _ in worst.values()):.3g}", flush=True)
    print(f"largest deviation on correct code, {seeds} seeds × {len(examples.MODELS)} models × "
          f"2 batch sizes × {steps} steps, per configuration:")
    for key, (value, where) in sorted(worst.items(), key=lambda kv: -kv[1][0]):
        print(f"  {value:8.3g}  {key:42s} {where}")
    print(f"MEASURED_MAX = {max(v for v, _ in worst.values()):.3g}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--only", choices=("overhead", "alarms", "compiled", "planted"))
    parser.add_argument("--alarm-configs", help="false alarms: only configurations whose label contains this")
    parser.add_argument("--calibrate", action="store_true")
    parser.add_argument("--sensitivity", action="store_true",
                        help="planted quiet faults of every size: detection and localization")
    args = parser.parse_args()
    os.environ.setdefault("TQDM_DISABLE", "1")
    print(machine_line())
    if args.calibrate:
        calibrate(args.seeds, args.steps)
        return
    if args.sensitivity:
        sensitivity(args.seeds, min(args.steps, 3))
        custom_sensitivity(args.seeds, min(args.steps, 3))
        return
    if args.only in (None, "overhead"):
        overhead(args.rounds, args.steps)
    if args.only in (None, "alarms"):
        false_alarms(args.seeds, args.steps, args.alarm_configs)
        custom_false_alarms(args.seeds, args.steps)
    if args.only in (None, "alarms", "compiled"):
        compiled_false_alarms(args.seeds, args.steps)
    if args.only in (None, "planted"):
        planted(args.seeds, min(args.steps, 4))
    print(machine_line())


if __name__ == "__main__":
    with contextlib.suppress(KeyboardInterrupt):
        main()

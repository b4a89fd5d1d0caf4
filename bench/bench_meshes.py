"""ddplab.compare on device meshes: planted-fault sensitivity, false alarms, overhead.

* ``--only sensitivity``: every sized mesh fault (:mod:`ddplab.compare.mesh_faults`) at every size
  down to one ulp, over ``--seeds`` seeds: read bug by the expected evidence, on the expected axis,
  at the expected step and rank? (``partial_sums``: sizes are micro-batches; with 2, bfloat16
  partial sums are bitwise the float32 sum rounded once: no difference to find.) Then the four
  size-less planted faults (:func:`ddplab.compare.mesh_examples.planted`): bug with their axis and
  collective or parameter?
* ``--only alarms``: the correct mesh configurations
  (:func:`~ddplab.compare.mesh_examples.correct_configurations`, ``--alarm-configs`` a subset by
  label) over ``--seeds`` seeds: how many read anything but rounding or exact. Target 0.
* ``--only overhead``: ``compare.run`` of one mesh configuration against the bare runs it compares
  (the mesh run without capture or recording, the single-process reference and its float64
  shadow, three plain launches), interleaved rounds: median of adjacent pairs with its range, best
  over best, and the load average.

Asserts nothing (machines are noisy); prints numbers.

    python bench/bench_meshes.py [--only sensitivity|alarms|overhead] [--seeds 20] [--steps 2] [--rounds 5]
"""
from __future__ import annotations

import argparse
import time

import torch
from _common import interleaved, load_average, machine_line, ratio_table

from ddplab import compare, launch
from ddplab.compare import mesh_examples, mesh_faults, mesh_training
from ddplab.compare.runners import _builtin_step
from ddplab.compare.setup import global_batches, split


def _load() -> str:
    return f"load {load_average()[0]:.1f}"


# --------------------------------------------------------------------------- sensitivity


def _found(verdict, fault) -> bool:
    values = verdict.values
    return (verdict.kind == "bug" and verdict.evidence == fault.evidence and values.get("axis") == fault.axis
            and verdict.first_divergence == fault.step and (fault.rank < 0 or values.get("first_rank") == fault.rank))


def sensitivity(seeds: int, steps: int) -> None:
    print(f"sensitivity: sized mesh faults, {seeds} seed(s), {steps} steps")
    print(f"{'fault':20s}{'size':>8s}{'found':>8s}  read as (first seed)")
    for kind, sizes in mesh_faults.MAGNITUDES.items():
        for size in sizes:
            found, first = 0, None
            for seed in range(seeds):
                fault = mesh_faults.plant(kind, size, seed=seed, steps=steps)
                v = compare.run(fault.setup, [fault.config], progress=False).verdict(fault.config)
                found += _found(v, fault)
                first = first or f"{v.kind} ({v.evidence}, axis {v.values.get('axis', '-')})"
            print(f"{kind:20s}{size!s:>8s}{found:>5d}/{seeds:<2d}  {first}  [{_load()}]")
    print("size-less planted faults (compare.mesh_examples.planted)")
    named, total = 0, 0
    for seed in range(seeds):
        for example in mesh_examples.planted(seed, steps=steps):
            result = compare.run(example.setup, example.configurations, progress=False)
            for config in example.configurations:
                v, want = result.verdict(config), example.expected[config.label]
                ok = (v.kind, v.evidence, v.values.get("axis")) == (want.verdict, want.evidence, want.axis) and (
                    want.param is None or v.values.get("first_param") == want.param)
                named, total = named + ok, total + 1
                if not ok:
                    print(f"  seed {seed} {example.name}: {v.kind} {v.evidence}: {v.headline[:200]}")
    print(f"named with evidence, axis and parameter: {named} of {total} [{_load()}]")


# --------------------------------------------------------------------------- false alarms


def false_alarms(seeds: int, steps: int, only: str | None) -> None:
    configs = [c for c in mesh_examples.correct_configurations() if only is None or only in c.label]
    alarms, total, worst, t0 = [], 0, 0.0, time.perf_counter()
    for seed in range(seeds):
        example = mesh_examples.correct(seed, steps=steps, configurations=configs)
        result = compare.run(example.setup, example.configurations, progress=False)
        for config in configs:
            v = result.verdict(config)
            total += 1
            worst = max(worst, v.max_deviation or 0.0)
            if v.kind not in ("rounding", "exact"):
                alarms.append((seed, config.label, v.headline[:200]))
        print(f"  seed {seed}: {total} runs, {len(alarms)} alarms so far [{_load()}]", flush=True)
    print(f"false alarms: {len(alarms)} of {total} configuration runs ({seeds} seeds x {len(configs)} configurations, "
          f"{steps} steps), largest deviation {worst:.3g}x the band, {time.perf_counter() - t0:.0f} s [{_load()}]")
    for alarm in alarms:
        print("  ", *alarm)


# --------------------------------------------------------------------------- overhead


def bare_mesh(setup, config, steps: int) -> None:
    """The mesh configuration on the launch's ranks, each its share, no capture and no recording."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    trainer = mesh_training.wrap(setup.build_model(), setup, config)
    share = config.share_of(rank, world)
    for batch in global_batches(setup, steps):
        pieces = split(batch, config.shares * config.k)
        _builtin_step(trainer, setup, pieces[share * config.k:(share + 1) * config.k])


def bare_single(setup, steps: int, dtype) -> None:
    model = setup.build_model(dtype)
    optimizer = setup.optimizer(model.parameters())
    for batch in global_batches(setup, steps):
        optimizer.zero_grad(set_to_none=True)
        setup.loss(model(batch[0]), batch[1]).backward()
        optimizer.step()


def overhead(rounds: int, steps: int) -> None:
    setup = mesh_examples.token_setup(0, steps=steps)
    configs = {"HSDP 2x2 k=4": compare.HSDP(k=4),
               "FSDP2TP SP": compare.FSDP2TP(plan=mesh_examples.sequence_parallel_plan)}
    for name, config in configs.items():
        def bare(config=config):
            launch(bare_mesh, world_size=config.world_size, args=(setup, config, steps))
            launch(bare_single, world_size=1, args=(setup, steps, None))
            launch(bare_single, world_size=1, args=(setup, steps, torch.float64))

        def full(config=config):
            compare.run(setup, [config], progress=False)

        bare(), full()  # warm: forkserver, imports
        print(f"overhead: compare.run({name}) on the tiny LM, {steps} steps, against the bare runs "
              f"(the mesh run + reference + float64 shadow), {rounds} interleaved rounds")
        print(ratio_table(interleaved({f"compare.run {name}": full}, bare, rounds), {}, baseline_name="bare"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", choices=("sensitivity", "alarms", "overhead"))
    parser.add_argument("--seeds", type=int, default=20)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--alarm-configs", default=None, help="only the correct configurations whose label holds this")
    args = parser.parse_args()
    print(machine_line())
    if args.only in (None, "sensitivity"):
        sensitivity(1 if args.only is None else args.seeds, args.steps)
    if args.only in (None, "alarms"):
        false_alarms(args.seeds, args.steps, args.alarm_configs)
    if args.only in (None, "overhead"):
        overhead(args.rounds, args.steps)


if __name__ == "__main__":
    main()

"""What a comparison needs of the machine, at least, and a refusal before any configuration runs
when the machine lacks it.

Every run writes one capture per step and rank (:mod:`ddplab.compare.captures`), and the parent
judges them as they come (:mod:`ddplab.compare.streaming`). The comparison's first launch trains
the first step of every reference run: the sizes of those captures are measured, not guessed. A
configuration's rank 0 captures, each step, at least what the reference run in the model's dtype
captures -- full copies of its parameters, gradients and optimizer state -- and its float64 run's
rank 0 at least what the float64 truth captures; its other ranks write only what differs from rank
0's (:class:`ddplab.compare.captures.SameAs`): DDP's, their bucket contributions; a step whose ranks
hold the same bits, nothing. The figures count only that: what the comparison really uses is larger
(recorded reductions, DDP's buckets, the analysis's float64 copies, the models themselves;
``bench/bench_compare_scale.py`` prints both).

A *pass* trains a configuration's run beside the truth and the reference (and, alongside, its twin
and its float64 run; or those in a second pass, beside the truth). Its step is what every run of it
captures at one step.

* **scratch**: a step of the largest pass -- its files are given up once every reader took them, and
  only then do its runs write the next one -- whatever the number of steps. A large model's reference runs
  write nothing: they judge where they train (:mod:`ddplab.compare.reference_judge`);
* **parent**: the analysis holds, while it judges a step, that step's captures of every run of the
  pass that writes them;
* **ranks**: every rank of a pass builds its step's capture in memory before writing it.
"""
from __future__ import annotations

import dataclasses

from ddplab.records import record

__all__ = ["Footprint", "footprint", "check_fits", "size_text"]

GiB = 2**30


def size_text(n: int) -> str:
    """Bytes as people read them: KiB, MiB or GiB."""
    for unit, scale in (("GiB", GiB), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale:
            return f"{n / scale:.1f} {unit}"
    return f"{n} B"


@dataclasses.dataclass(frozen=True)
class Footprint:
    """Bytes a comparison needs at least: its parent's analysis, its ranks running at once, its scratch."""

    parent_bytes: int
    ranks_bytes: int
    scratch_bytes: int

    @property
    def memory_bytes(self) -> int:
        """The larger of the two phases: the ranks train, then the parent analyses."""
        return max(self.parent_bytes, self.ranks_bytes)

    def records(self) -> list[dict]:
        return [record("expected_parent_bytes", self.parent_bytes), record("expected_ranks_bytes", self.ranks_bytes),
                record("expected_scratch_bytes", self.scratch_bytes)]

    def text(self) -> str:
        return (f"compare: needs at least {size_text(self.memory_bytes)} of memory (the analysis "
                f"{size_text(self.parent_bytes)}, the ranks {size_text(self.ranks_bytes)}) and "
                f"{size_text(self.scratch_bytes)} of scratch disk")


def footprint(capture_bytes: dict[str, int], configs: list[tuple[int, bool, bool]], *,
              alongside: bool, references_on_disk: bool = False) -> Footprint:
    """The lower bounds, whatever the number of steps. ``capture_bytes``: each reference run's step capture, by
    label (``"reference"``, the model's dtype, and ``"truth"``, float64, among them); ``configs``: per
    configuration ``(world_size, twin, float64)``, whether it runs its twin and its float64 run;
    ``alongside``: whether those start together with the run (one pass) or after it (a second pass);
    ``references_on_disk``: whether the reference runs write their captures for the parent to judge
    (a small model's, kept for every configuration) or judge where they train and write none."""
    rank, wide = capture_bytes["reference"], capture_bytes["truth"]
    references = (wide + rank) if references_on_disk else 0
    scratch = parent = ranks = 0
    for world, twin, float64 in configs:
        own = rank * twin + wide * float64          # the twin's and the float64 run's rank 0
        passes = [rank + references + (own if alongside else 0)]
        if not alongside and (twin or float64):
            passes.append(own + (wide if references_on_disk else 0) * float64)
        parent = max(parent, *passes)
        scratch = max(scratch, max(passes))
        launches = [rank] + [rank] * twin + [wide] * float64
        ranks = max(ranks, world * (sum(launches) if alongside else max(launches)) + wide)
    return Footprint(parent_bytes=parent, ranks_bytes=ranks, scratch_bytes=scratch)


def check_fits(need: Footprint, *, memory: int, disk: int) -> None:
    """Raise ValueError, with the figures, when ``need`` exceeds the ``memory`` available or the scratch
    folder's free ``disk``."""
    problems = []
    if need.memory_bytes > memory:
        problems.append(f"at least {size_text(need.memory_bytes)} of memory (the analysis "
                        f"{size_text(need.parent_bytes)}, the ranks {size_text(need.ranks_bytes)}), and "
                        f"{size_text(memory)} are available")
    if need.scratch_bytes > disk:
        problems.append(f"at least {size_text(need.scratch_bytes)} of scratch disk, and {size_text(disk)} are free")
    if problems:
        raise ValueError("this comparison does not fit the machine: it needs " + "; ".join(problems)
                         + ". Compare a smaller model, or free memory or disk (a comparison holds about a step of "
                         "every run of a configuration at once, whatever the number of steps).")

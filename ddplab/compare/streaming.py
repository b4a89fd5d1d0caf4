"""A comparison's runs judged while they train, their captures given up once judged.

Every run of a *pass* (a configuration's run, its twin and its float64 run) writes one capture
per step and rank; the reference runs that train beside them write none: they judge each step where
they train, once its captures are written (:mod:`ddplab.compare.reference_judge`), and the parent
deletes a step's files only after that. The parent judges a step of every run of the pass together
(:func:`ddplab.compare.captures.in_step`), then marks it judged and forgets it (:meth:`Pass.judged`);
what the next step reads of it stays in the parent's memory (:data:`NEXT_STEP_READS`: the replay
starts step ``s`` from the state step ``s - 1`` left). A step's files are given up as soon as every
reader took them -- the parent holds every rank's (:meth:`LiveRun.read`), the reference process
judged it -- and at the latest when it is judged: each is kept for its rank to write a later step
over (:func:`~ddplab.compare.captures.recycle_capture`), its pages in memory already, and deleted
when the pass ends. After writing step ``s`` a rank waits
(:func:`wait_for_parent`) until step ``s - LAG + 1`` is freed that way: it trains the next step while
the parent judges this one, and a run's captures on disk are at most ``LAG`` steps, whatever the
number of steps. A run *kept* in a folder of its own
(:meth:`Pass.add`: a small model's reference runs, judged by the parent and read again by later
passes) neither waits nor is deleted. A launch that ended says so on disk too (:func:`ended`), for
the reference process waiting for its steps.

:class:`LiveCaptures` is one rank's steps of a run that may still be training: asking for a step
waits until its file exists or the run has ended. Sources walk steps with
:func:`ddplab.compare.captures.common_steps`, which stops at the first step some sequence will
never have: one that a crash, a hang or a stop left unwritten, or one past :attr:`Pass.cut` (the
first step where a value turned non-finite).
"""
from __future__ import annotations

import contextlib
import errno
import os
import threading
import time

from ddplab.compare.captures import CaptureCache, Captures, recycle_capture, remove_recycled
from ddplab.compare.memory import release_freed_memory

__all__ = ["LAG", "NEXT_STEP_READS", "wait_for_parent", "released", "ended", "judged_path", "freed_path", "LiveRun",
           "LiveCaptures", "Pass", "ScratchFull", "disk_full"]

#: Steps of a run on disk at once: a rank writes step ``s + LAG`` once every reader has taken step ``s``
#: and its files are gone (:meth:`LiveRun.free`), or step ``s`` is judged. One: the ranks train the next
#: step while the parent judges this one, and the scratch folder holds about a step of each run.
LAG = 1
#: The longest a rank sleeps between two looks at the parent's progress, in seconds.
_POLL = 0.02
#: What the sources read of a step once it is judged, by run: the next step's replay starts from
#: a configuration's parameters and optimizer state; localization, from the truth's parameters.
NEXT_STEP_READS = {"configuration": ("params", "optimizer"), "truth": ("params",)}
#: The file that says a run's launch ended, for the processes that wait for its steps.
_ENDED = "ended"
#: The judged step that lets a rank run to its end: nothing judges its steps any more.
_NEVER_WAIT = 2**62


class ScratchFull(RuntimeError):
    """The scratch folder's disk filled while a comparison ran: its pass ends, and nothing more runs."""


def disk_full(error: BaseException | None) -> bool:
    """Is ``error`` a full disk (ENOSPC or EDQUOT): raised here, or by a rank (a launch's ``RankFailed``)?"""
    if isinstance(error, ScratchFull):
        return True
    if isinstance(error, OSError):
        return error.errno in (errno.ENOSPC, errno.EDQUOT)
    said = f"{getattr(error, 'remote_traceback', '') or ''}\n{error}"
    return getattr(error, "exc_type", None) == "OSError" and any(
        f"[Errno {code}]" in said for code in (errno.ENOSPC, errno.EDQUOT))


def judged_path(root: str, run_id: str) -> str:
    """The file holding the last step of ``run_id`` the parent judged (absent: none yet)."""
    return os.path.join(root, run_id, "judged")


def _read_judged(path: str) -> int:
    try:
        with open(path) as f:
            return int(f.read() or -1)
    except (FileNotFoundError, ValueError):
        return -1


def released(root: str, run_id: str) -> bool:
    """Has the parent released ``run_id`` (:meth:`Pass.finish`)? It judges none of its steps any more."""
    return _read_judged(judged_path(root, run_id)) >= _NEVER_WAIT


def ended(root: str, run_id: str) -> bool:
    """Will no step of ``run_id`` come any more? Its launch ended (:meth:`LiveRun.end`), or the parent
    released it (it deletes what its ranks write from then on)."""
    return os.path.exists(os.path.join(root, run_id, _ENDED)) or released(root, run_id)


def freed_path(root: str, run_id: str) -> str:
    """The file holding the last step of ``run_id`` every reader took and the parent deleted (absent: none yet)."""
    return os.path.join(root, run_id, "freed")


def wait_for_parent(root: str, run_id: str, step: int, lag: int = LAG) -> None:
    """In a rank, after writing ``step``: wait until step ``step - lag + 1`` is freed (every reader took
    it, :meth:`LiveRun.free`) or judged. The launch's own timeout and stop still end the rank; the
    parent moves the deadline by the time it judged."""
    freed, judged, delay = freed_path(root, run_id), judged_path(root, run_id), 0.0005
    while _read_judged(freed) < step - lag + 1 and _read_judged(judged) < step - lag + 1:
        time.sleep(delay)
        delay = min(_POLL, delay * 2)


class LiveRun:
    """One run of a pass as the parent sees it: whether its launch has ended, and how many steps each
    rank is known to have written (files that existed, judged and deleted ones included)."""

    def __init__(self, root: str, run_id: str, world_size: int, kept: tuple = (), deleted: bool = True):
        self.root, self.run_id, self.world_size, self.kept = root, run_id, world_size, kept
        self.deleted = deleted   # False: its captures stay for a later pass (a small model's reference runs)
        self.ended = threading.Event()
        self.written = [0] * world_size
        self.waited = 0.0       # seconds the parent spent waiting for this run's files
        self._read: dict[int, set[int]] = {}   # step -> the ranks whose capture of it the parent holds
        os.makedirs(os.path.join(root, run_id), exist_ok=True)

    def end(self) -> None:
        """Its launch ended: no step will come. Said on disk too, for a reference process that judges
        its steps (:func:`ended`); raises the OSError of a disk too full to say it."""
        self.ended.set()
        with open(os.path.join(self.root, self.run_id, _ENDED), "w"):
            pass

    def path(self, step: int, rank: int) -> str:
        from ddplab.compare.runners import capture_path

        return capture_path(self.root, self.run_id, step, rank)

    def has(self, step: int, rank: int) -> bool:
        """Will rank ``rank`` ever have step ``step``? Waits until its file exists or the run ended."""
        delay, started = 0.0005, time.perf_counter()
        try:
            while True:
                if step < self.written[rank]:
                    return True
                ended = self.ended.is_set()    # read before the file: a file written just before the end counts
                if os.path.exists(self.path(step, rank)):
                    self.written[rank] = max(self.written[rank], step + 1)
                    return True
                if ended:
                    return False
                time.sleep(delay)
                delay = min(_POLL, delay * 2)
        finally:
            self.waited += time.perf_counter() - started

    def read(self, step: int, rank: int, cache: CaptureCache) -> None:
        """The parent read rank ``rank``'s capture of ``step`` into ``cache``: it stays there until judged
        (:meth:`CaptureCache.pin`), and once every rank's is read the step is freed (:meth:`free`) -- the
        ranks then write the next step while it is judged, and the scratch folder holds one step.
        (Not before: a rank writes a step after reading rank 0's, :class:`~ddplab.compare.captures.SameAs`.)"""
        cache.pin(self.root, self.run_id, rank, step)
        if not self.deleted:
            return
        ranks = self._read.setdefault(step, set())
        ranks.add(rank)
        if len(ranks) < self.world_size:
            return
        del self._read[step]
        self.free(step)

    def free(self, step: int) -> None:
        """Every reader took ``step`` (the parent holds it, a reference process judged it): delete its files
        and say so, so that the ranks write the next step (:func:`wait_for_parent`). A marker the disk has
        no room for is left unsaid: the ranks then wait for the step to be judged."""
        if not self.deleted:
            return
        self._delete(step)
        tmp = freed_path(self.root, self.run_id) + ".tmp"
        try:
            with open(tmp, "w") as f:
                f.write(str(step))
            os.replace(tmp, freed_path(self.root, self.run_id))
        except OSError:
            with contextlib.suppress(OSError):
                os.remove(tmp)

    def _delete(self, step: int) -> None:
        """Nobody reads ``step`` any more: its files are kept for their ranks to write a later step over
        (:func:`~ddplab.compare.captures.recycle_capture`), which the scratch folder counts as one step."""
        from ddplab.compare.runners import capture_kind

        for rank in range(self.world_size):
            path = self.path(step, rank)
            if os.path.exists(path):
                self.written[rank] = max(self.written[rank], step + 1)   # a rank writes its steps in order
                recycle_capture(path, capture_kind(rank))

    def finished(self, rank: int) -> int:
        """How many consecutive steps rank ``rank`` wrote (after the run ended)."""
        done = self.written[rank]
        while os.path.exists(self.path(done, rank)):
            done += 1
        self.written[rank] = done
        return done

    def delete_all(self, cache: CaptureCache) -> None:
        """Delete (and forget) every capture written so far, counting it in :attr:`written`."""
        from ddplab.compare.runners import captured_files

        cache.forget(self.run_id)
        remove_recycled(os.path.join(self.root, self.run_id))
        for step, rank, path in captured_files(self.root, self.run_id):
            if not self.deleted:
                self.written[rank] = max(self.written[rank], step + 1)
                continue
            self.written[rank] = max(self.written[rank], step + 1)   # a rank writes its steps in order
            try:
                os.remove(path)
            except FileNotFoundError:
                pass

    def judged(self, step: int, cache: CaptureCache, delete: bool = True) -> None:
        """The parent judged ``step``: say so to the ranks; delete its captures, keeping in memory what the
        next step reads of them (:data:`NEXT_STEP_READS`), and forget every step before it."""
        if not self.deleted:
            cache.forget(self.run_id, before=step)   # on disk for a later pass; out of memory now
            return
        if delete:   # first: on a full disk, the marker below needs the room they free
            cache.keep_only(self.run_id, step, self.kept)
            cache.forget(self.run_id, before=step)
            self._read.pop(step, None)
            self._delete(step)   # what no source read whole (the float64 run's ranks beyond rank 0)
        tmp = judged_path(self.root, self.run_id) + ".tmp"
        with open(tmp, "w") as f:
            f.write(str(step))
        os.replace(tmp, judged_path(self.root, self.run_id))


class LiveCaptures(Captures):
    """Rank ``rank``'s captures of a :class:`LiveRun`: step ``s`` is read when the rank wrote it;
    :meth:`has` waits to know. ``len()`` is the steps planned; a step the run never wrote, or one at
    or past the pass's cut (unless ``past_cut``), raises IndexError."""

    def __init__(self, cache: CaptureCache, run: LiveRun, rank: int, steps: int, owner: "Pass",
                 past_cut: bool = False):
        super().__init__(cache, run.root, run.run_id, rank, steps)
        self.run, self.owner, self.past_cut = run, owner, past_cut

    def has(self, step: int) -> bool:
        cut = None if self.past_cut else self.owner.cut
        if step >= len(self) or (cut is not None and step >= cut):
            return False
        return self.run.has(step, self.rank)

    def __getitem__(self, index):
        if isinstance(index, slice):
            raise IndexError("live captures are walked a step at a time (captures.common_steps)")
        if index < 0:
            raise IndexError("live captures are indexed from step 0")
        if not self.has(index):
            raise IndexError(f"{self.run_id} rank {self.rank} has no step {index}")
        capture = self.cache.get(self.root, self.run_id, self.rank, index)
        self.run.read(index, self.rank, self.cache)
        return capture

    def __repr__(self) -> str:
        return f"LiveCaptures({self.run_id!r}, rank={self.rank}, planned={len(self)})"


class Pass:
    """The runs judged together, their launches (each in a thread of its own) and one cache to read
    them through. ``cut``: the first step no source judges (a value turned non-finite there), None
    while every step is judged. ``outcomes[key]``: how each launch ended (its result, or the
    exception it raised); ``stopped_here``: the launches the pass itself stopped, not a failure of theirs."""

    def __init__(self, root: str, cache: CaptureCache, steps: int):
        self.root, self.cache, self.steps = root, cache, steps
        self.runs: dict[str, LiveRun] = {}
        self.cut: int | None = None
        self.outcomes: dict[str, object] = {}
        self.stopped_here: set[str] = set()
        self._launches: dict[str, object] = {}
        self._threads: list[threading.Thread] = []
        self._lock = threading.Lock()
        self._round_started = time.perf_counter()
        self._waited = 0.0      # the runs' ``waited`` at the start of the round
        self.failure: ScratchFull | None = None   # the disk filled: every launch of the pass was stopped

    def start(self, key: str, launch, run_ids: list[str], after=None) -> None:
        """Run ``launch`` (a :class:`ddplab.launcher.Launch`) in a thread: the runs ``run_ids`` end when it
        ends; ``after(outcome)`` is then called in that thread."""
        with self._lock:
            self._launches[key] = launch

        def go():
            try:
                outcome = launch.start().wait()
            except BaseException as exc:  # noqa: BLE001 - kept: the comparison says how each launch ended
                outcome = exc
            self.outcomes[key] = outcome
            for run_id in run_ids:
                try:
                    self.runs[run_id].end()
                except OSError as exc:   # a judge waiting for its steps would never learn: stop them all
                    if disk_full(exc):
                        self._filled(exc, f" when {run_id} ended")
            if after is not None:
                after(outcome)

        thread = threading.Thread(target=go, name=f"ddplab-compare-{key}", daemon=True)
        self._threads.append(thread)
        thread.start()

    def launches(self) -> list[str]:
        """The keys of the launches started."""
        with self._lock:
            return list(self._launches)

    def stop(self, keys) -> None:
        """Stop these launches (safe from any thread): the pass no longer needs them."""
        with self._lock:
            running = [(k, self._launches[k]) for k in keys if k in self._launches and k not in self.outcomes]
            self.stopped_here.update(k for k, _ in running)
        for _, launch in running:
            launch.stop()

    def _filled(self, exc: OSError, when: str) -> None:
        """A marker could not be written: a full disk ends the pass (:attr:`failure`); anything else is raised."""
        if not disk_full(exc):
            raise exc
        self.failure = self.failure or ScratchFull(f"the scratch folder's disk filled{when} ({exc.strerror})")
        self.stop(self.launches())

    def finish(self, stop=()) -> None:
        """Every step that can be judged was: stop the launches ``stop`` (inputs nobody reads any more),
        let the others train to their end without waiting for the parent, and wait for them all. Their
        captures are deleted as they appear: nothing reads them."""
        self.stop(list(stop))
        for run in self.runs.values():
            try:
                run.judged(_NEVER_WAIT, self.cache, delete=False)
            except OSError as exc:
                self._filled(exc, "")
        for thread in self._threads:
            while thread.is_alive():
                thread.join(0.02)
                self._delete_all()
        self.close()

    def close(self) -> None:
        """Stop every launch still running, wait for them all, and delete the pass's captures."""
        self.stop(self.launches())
        for thread in self._threads:
            thread.join()
        self._delete_all()

    def _delete_all(self) -> None:
        for run in self.runs.values():
            run.delete_all(self.cache)

    def add(self, run_id: str, world_size: int, reads_next: str | None = None, kept_in: str | None = None,
            written: bool = False) -> LiveRun:
        """A run of the pass; ``reads_next``: which of :data:`NEXT_STEP_READS` a source reads of its
        step once judged (None: nothing); ``kept_in``: a folder where its captures are written and
        kept for a later pass (``written``: they are there already, every step)."""
        run = LiveRun(kept_in or self.root, run_id, world_size, NEXT_STEP_READS.get(reads_next, ()),
                      deleted=kept_in is None)
        if written:
            run.ended.set()
        self.runs[run_id] = run
        return run

    def captures(self, run_id: str, rank: int = 0, past_cut: bool = False) -> LiveCaptures:
        return LiveCaptures(self.cache, self.runs[run_id], rank, self.steps, self, past_cut)

    def ranks(self, run_id: str, past_cut: bool = False) -> list[LiveCaptures]:
        return [self.captures(run_id, r, past_cut) for r in range(self.runs[run_id].world_size)]

    def cut_at(self, step: int) -> None:
        """No source judges ``step`` or a step after it (a value turned non-finite there)."""
        self.cut = step if self.cut is None else min(self.cut, step)

    def judged(self, step: int) -> None:
        """Every source judged ``step`` (:func:`ddplab.compare.captures.in_step`): release the ranks, delete
        what no source reads again, and move each launch's deadline by the time the step took to judge --
        time its ranks may have spent waiting for the parent, not hanging. A disk too full to say so
        ends the pass (:attr:`failure`): its ranks could never go on."""
        try:
            for run in self.runs.values():
                run.judged(step, self.cache)
        except OSError as exc:
            self._filled(exc, f" after step {step} was judged")
        release_freed_memory()
        now, waited = time.perf_counter(), sum(run.waited for run in self.runs.values())
        judging = max(0.0, (now - self._round_started) - (waited - self._waited))
        with self._lock:
            launches = list(self._launches.values())
        for launch in launches:
            launch.extend(judging)
        self._round_started, self._waited = now, waited

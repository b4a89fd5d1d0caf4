"""The launcher's diagnosis as pure functions, and its argument limits: no process is started here.

The stack texts are faulthandler dumps as ranks write them at a timeout
(paths shortened), for ranks in a collective, in backward, in FSDP's
forward, and outside any collective.
"""
from __future__ import annotations

import math

import psutil
import pytest

from ddplab.launcher import (MAX_TIMEOUT, MAX_WORLD_SIZE_ENV, FailureKind, RankFailure,
                             check_timeout, check_world_size, root_cause, world_size_limit)
from ddplab.launcher.diagnosis import (Frame, Hang, RankPlace, death_text, failure_message,
                                       failure_text, in_collective, last_dump, main_thread,
                                       not_in_collective, place_of, stack_from_dump)
from ddplab.launcher.rank_side import PARENT_GONE_EXIT

TORCH = "/venv/lib/python3.11/site-packages/torch"
STDLIB = "/usr/lib/python3.11"
ENTRY = f'''  File "/src/ddplab/launcher/rank_side.py", line 215 in rank_main
  File "{STDLIB}/multiprocessing/process.py", line 108 in run
  File "{STDLIB}/multiprocessing/process.py", line 314 in _bootstrap
  File "{STDLIB}/multiprocessing/forkserver.py", line 274 in main
  File "<string>", line 1 in <module>
'''
LIFELINE = f'''Thread 0x00007f668efff6c0 (most recent call first):
  File "{STDLIB}/multiprocessing/connection.py", line 395 in _recv
  File "{STDLIB}/multiprocessing/connection.py", line 250 in recv
  File "/src/ddplab/launcher/rank_side.py", line 133 in _watch_parent
  File "{STDLIB}/threading.py", line 982 in run
  File "{STDLIB}/threading.py", line 1002 in _bootstrap
'''


def dump(*innermost: str, current: bool = True, entry: str = ENTRY) -> str:
    """A rank's dump: the lifeline thread, then the main thread with ``innermost`` frames above the entry."""
    header = "Current thread" if current else "Thread"
    return (LIFELINE + f"\n{header} 0x00007f66ad7ebb80 (most recent call first):\n"
            + "".join(f"  {line}\n" for line in innermost) + entry + "\n")


IN_ALL_REDUCE = dump(f'File "{TORCH}/distributed/distributed_c10d.py", line 3252 in all_reduce',
                     f'File "{TORCH}/distributed/c10d_logger.py", line 83 in wrapper',
                     'File "<dynamic-code>", line 8 in train')
SLEEPING = dump('File "<dynamic-code>", line 7 in train')
IN_DDP_BACKWARD = dump(f'File "{TORCH}/autograd/graph.py", line 979 in _engine_run_backward',
                       f'File "{TORCH}/autograd/__init__.py", line 395 in backward',
                       f'File "{TORCH}/_tensor.py", line 623 in backward',
                       'File "/home/me/train.py", line 16 in step')
IN_FSDP_FORWARD = dump(
    f'File "{TORCH}/distributed/distributed_c10d.py", line 4394 in all_gather_single',
    f'File "{TORCH}/distributed/c10d_logger.py", line 83 in wrapper',
    f'File "{TORCH}/distributed/fsdp/_fully_shard/_fsdp_collectives.py", line 364 in foreach_all_gather',
    f'File "{TORCH}/utils/_contextlib.py", line 124 in decorate_context',
    f'File "{TORCH}/distributed/fsdp/_fully_shard/_fsdp_state.py", line 314 in _pre_forward',
    f'File "{TORCH}/nn/modules/module.py", line 1884 in _call_impl',
    'File "/home/me/train.py", line 26 in step')
IN_FUNCTIONAL_WAIT = dump(
    f'File "{TORCH}/_ops.py", line 1255 in __call__',
    f'File "{TORCH}/distributed/_functional_collectives.py", line 144 in wait_tensor',
    'File "/home/me/train.py", line 30 in step')
#: A comm hook of the user's, called from inside DDP's reducer, stuck in its own code.
IN_USER_HOOK = dump('File "/home/me/hooks.py", line 12 in slow_hook',
                    f'File "{TORCH}/autograd/graph.py", line 979 in _engine_run_backward',
                    'File "/home/me/train.py", line 16 in step')
COMPUTING = dump(f'File "{TORCH}/nn/functional.py", line 2500 in linear',
                 'File "/home/me/train.py", line 40 in step')


@pytest.fixture(autouse=True)
def starts_no_process():
    before = psutil.Process().children(recursive=True)
    yield
    assert psutil.Process().children(recursive=True) == before


# ---------------------------------------------------------------- reading a dump


def test_a_dump_is_read_thread_by_thread_with_its_frames():
    threads = last_dump("some output\n" + IN_ALL_REDUCE)
    assert [t.current for t in threads] == [False, True]
    main = threads[1].frames
    assert main[0] == Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce")
    assert main[2] == Frame("<dynamic-code>", 8, "train")
    assert len(main) == 3 + ENTRY.count("\n")


def test_the_last_dump_counts_and_output_that_only_looks_like_one_does_not():
    fake = "Thread 0x \x1b[2J\nThread 0xzz (most recent call first):\n"
    assert last_dump(fake) == []
    text = IN_ALL_REDUCE + "the rank printed this\n" + fake + SLEEPING
    assert main_thread(last_dump(text)).frames[0].function == "train"
    assert main_thread(last_dump(text)).frames[0].line == 7
    # Output after a dump ends it; the dump before stays the last one.
    assert main_thread(last_dump(SLEEPING + "later output\n")).frames[0].line == 7
    assert last_dump("no dump at all\n") == []


def test_the_main_thread_is_the_one_running_the_rank_else_the_one_that_took_the_signal():
    assert main_thread(last_dump(SLEEPING)).frames[0] == Frame("<dynamic-code>", 7, "train")
    # Deeper than faulthandler's 100 frames: the outermost, the entry among them, are cut.
    truncated = dump('File "/home/me/deep.py", line 3 in recurse', entry="  ...\n")
    assert main_thread(last_dump(truncated)).frames[0].function == "recurse"
    lost = dump('File "/home/me/deep.py", line 3 in recurse', entry="  ...\n", current=False)
    assert main_thread(last_dump(lost)) is None
    assert place_of(lost) is None


@pytest.mark.parametrize("text, waits", [
    (IN_ALL_REDUCE, True), (IN_DDP_BACKWARD, True), (IN_FSDP_FORWARD, True),
    (IN_FUNCTIONAL_WAIT, True), (SLEEPING, False), (IN_USER_HOOK, False), (COMPUTING, False),
])
def test_a_rank_waits_in_a_collective_when_its_innermost_torch_frames_are_a_wait(text, waits):
    assert in_collective(main_thread(last_dump(text)).frames) is waits


def test_the_place_names_the_innermost_frame_and_the_wait():
    assert place_of(IN_ALL_REDUCE) == RankPlace(
        Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"),
        Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"))
    assert place_of(IN_FUNCTIONAL_WAIT).waits_in.function == "wait_tensor"
    assert place_of(IN_DDP_BACKWARD).waits_in.function == "_engine_run_backward"
    assert place_of(SLEEPING) == RankPlace(Frame("<dynamic-code>", 7, "train"), None)
    assert place_of("") is None


def test_a_wait_inside_ddplabs_collective_recorder_is_a_wait_in_the_collective():
    frames = (Frame("/usr/lib/python3.11/threading.py", 331, "wait"),
              Frame("/x/ddplab/collectives/recorder.py", 97, "wait"),
              Frame("/x/ddplab/collectives/interception.py", 60, "kernel"),
              Frame(f"{TORCH}/_ops.py", 800, "__call__"),
              Frame(f"{TORCH}/distributed/distributed_c10d.py", 3252, "all_reduce"),
              Frame("<dynamic-code>", 8, "train"))
    assert in_collective(frames)
    # the recorder alone, called from the user's own code, is no wait
    assert not in_collective(frames[:2] + frames[-1:])


def test_windows_paths_are_matched_too():
    frames = (Frame(r"C:\py\Lib\site-packages\torch\distributed\distributed_c10d.py", 1, "barrier"),)
    assert in_collective(frames)


# ---------------------------------------------------------------- the rank that hangs the others


def places(**texts):
    return {int(k[1:]): place_of(v) for k, v in texts.items()}


def test_the_rank_outside_the_collective_the_others_wait_in_is_singled_out():
    assert not_in_collective(places(r0=IN_ALL_REDUCE, r1=SLEEPING), returned=[]) == [1]
    assert not_in_collective(places(r0=IN_DDP_BACKWARD, r1=IN_DDP_BACKWARD, r2=COMPUTING),
                             returned=[]) == [2]
    # A rank that returned is outside the collective too.
    assert not_in_collective(places(r1=IN_FSDP_FORWARD), returned=[0, 2]) == [0, 2]


def test_nobody_is_singled_out_when_no_rank_waits_in_a_collective_or_all_do():
    assert not_in_collective(places(r1=SLEEPING), returned=[0, 2]) == []
    assert not_in_collective(places(r0=IN_ALL_REDUCE, r1=IN_ALL_REDUCE), returned=[]) == []
    assert not_in_collective({0: None, 1: None}, returned=[]) == []
    # A rank without a dump is not blamed: nothing says where it was.
    assert not_in_collective({**places(r0=IN_ALL_REDUCE), 1: None}, returned=[]) == []


def test_a_hang_gathers_stacks_places_and_the_culprit_from_the_ranks_stderr():
    stderr = ["warming up\n" + IN_ALL_REDUCE, "loss 1.0\n" + SLEEPING, ""]
    hang = Hang.from_outputs(returned=[], pending=[0, 1, 2], last_records={1: {"metric": "loss"}},
                             stderr=stderr)
    assert hang.not_in_collective == [1]
    assert hang.places[1].frame == Frame("<dynamic-code>", 7, "train")
    assert hang.places[0].in_collective and hang.places[2] is None
    assert hang.last_records == {0: None, 1: {"metric": "loss"}, 2: None}
    assert hang.stacks[0] == stack_from_dump(stderr[0]) and hang.stacks[2] == ""
    message = hang.message("train", 3.0, 3, "gloo")
    assert str(hang.places[1].frame) in message


# ---------------------------------------------------------------- the root cause of failures


def error(rank, at, dead=()):
    return RankFailure(FailureKind.ERROR, rank, at, exc_type="RuntimeError",
                       message=f"failed on {rank}\nsecond line", traceback="Traceback ...\n",
                       dead_peers=tuple(dead))


def death(rank, at, code=-9):
    return RankFailure(FailureKind.DEATH, rank, at, exitcode=code)


def test_the_earliest_failure_is_the_cause_and_the_others_follow_in_time():
    failures = [error(2, 5.0), error(0, 3.0), death(1, 4.0)]
    cause, others = root_cause(failures)
    assert cause is failures[1]
    assert others == [failures[2], failures[0]]


def test_an_error_raised_after_a_failed_peer_was_dead_ranks_after_the_death():
    # The peer's error is dated a hair before the death was seen: clocks cannot order them.
    failures = [error(0, 1.000, dead=[1]), death(1, 1.001)]
    assert root_cause(failures)[0] is failures[1]
    # A dead peer that did not fail itself does not excuse the error.
    alone = [error(0, 1.0, dead=[3]), death(1, 2.0)]
    assert root_cause(alone)[0] is alone[0]
    # Everyone blames someone: the earliest still answers.
    circular = [error(0, 2.0, dead=[1]), error(1, 1.0, dead=[0])]
    assert root_cause(circular)[0] is circular[1]


def test_an_unpicklable_return_value_is_a_failure_like_the_others():
    unpickle = RankFailure(FailureKind.UNPICKLE, 1, 0.5, exc_type="RuntimeError", message="no")
    assert root_cause([error(0, 1.0), unpickle]) == (unpickle, [error(0, 1.0)])


def test_root_cause_needs_a_failure():
    with pytest.raises(ValueError):
        root_cause([])


def test_what_each_failure_was():
    assert "SIGKILL" in death_text(-9)
    assert death_text(PARENT_GONE_EXIT) != death_text(1)
    assert death_text(1, started=False) != death_text(1, started=True)
    assert failure_text(death(1, 0.0, code=-15)) == death_text(-15)
    assert failure_text(error(0, 0.0)).endswith("failed on 0\nsecond line")
    assert failure_text(error(0, 0.0), brief=True).endswith("failed on 0")
    exit_ = RankFailure(FailureKind.ERROR, 0, 0.0, exc_type="SystemExit", message="sys.exit(2)")
    assert failure_text(exit_).endswith("sys.exit(2)") and "SystemExit" not in failure_text(exit_)


def test_the_failure_message_escapes_what_the_rank_wrote_and_lists_the_consequences():
    cause = RankFailure(FailureKind.ERROR, 1, 1.0, exc_type="ValueError", message="bad \x1b[2J",
                        traceback="Traceback\nValueError: bad \x1b[2J\n")
    text = failure_message(cause, [death(0, 2.0, code=3)], 2, True, "stderr \x1b]0;t\x07\n")
    assert "\x1b" not in text and "\x07" not in text
    assert text.count("\\x1b[2J") == 2 and "\\x1b]0;t\\x07" in text
    assert text.rstrip().endswith(failure_text(death(0, 2.0, code=3), brief=True))


# ---------------------------------------------------------------- limits, checked before any work


def test_world_sizes_up_to_the_limit_are_accepted(monkeypatch):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, "3")
    assert world_size_limit() == (3, f"set by {MAX_WORLD_SIZE_ENV}")
    for world_size in (1, 2, 3):
        check_world_size(world_size)


@pytest.mark.parametrize("world_size", [0, -1, True, 2.0, "2", None])
def test_world_sizes_that_are_not_positive_ints_are_refused(world_size):
    with pytest.raises(ValueError, match="world_size"):
        check_world_size(world_size)


def test_a_world_size_past_the_machines_limit_is_refused_with_the_limit(monkeypatch):
    monkeypatch.delenv(MAX_WORLD_SIZE_ENV, raising=False)
    limit, why = world_size_limit()
    check_world_size(limit)
    with pytest.raises(ValueError) as info:
        check_world_size(limit + 1)
    assert str(limit) in str(info.value) and why in str(info.value)


@pytest.mark.parametrize("timeout", [0.001, 1, 2.5, MAX_TIMEOUT])
def test_finite_positive_timeouts_up_to_the_limit_are_accepted(timeout):
    check_timeout(timeout)


@pytest.mark.parametrize("timeout", [math.nan, math.inf, -math.inf, 0, -1, True, False, "5", None,
                                     MAX_TIMEOUT * 2])
def test_other_timeouts_are_refused_with_the_limit(timeout):
    with pytest.raises(ValueError) as info:
        check_timeout(timeout)
    assert f"{MAX_TIMEOUT:g}" in str(info.value)

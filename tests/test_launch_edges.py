"""The launcher at its edges: what ranks print and start, exposure, leftovers, blame, odd values, bad input, odd mains."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import inspect
import ipaddress
import math
import os
import re
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import psutil
import pytest
import torch
import torch.distributed as dist

import ddplab
from ddplab import launcher
from ddplab.launcher import (MAX_WORLD_SIZE_ENV, Launch, LaunchStopped, LaunchTimeout, RankDied,
                             RankFailed, launch)

from processes import all_gone, start_reading_pids

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _values(frame, metric):
    return [int(v) for v in frame.query("metric == @metric")["value"]]


# ---------------------------------------------------------------- the rendezvous store


def _non_loopback_addresses() -> list[str]:
    found = []
    for addrs in psutil.net_if_addrs().values():
        for a in addrs:
            if a.family not in (socket.AF_INET, socket.AF_INET6):
                continue
            ip = ipaddress.ip_address(a.address.split("%")[0])
            if not ip.is_loopback and not ip.is_link_local:
                found.append(str(ip))
    return found


def wait_for_stop():
    ddplab.emit("pid", os.getpid())
    time.sleep(60)


def _listening(proc: psutil.Process) -> set[tuple[str, int]]:
    return {(c.laddr.ip, c.laddr.port) for c in proc.net_connections(kind="inet")
            if c.status == psutil.CONN_LISTEN}


def test_store_accepts_loopback_only(no_leftovers):
    addresses = _non_loopback_addresses()
    if not addresses:
        pytest.skip("this machine has no non-loopback address to connect through")
    me = psutil.Process()
    before = _listening(me)
    runner = Launch(wait_for_stop, world_size=2, timeout=60).start()
    try:
        opened = _listening(me) - before
        assert opened, "the launch's store opened no listening socket in this process"
        assert all(ipaddress.ip_address(ip).is_loopback for ip, _ in opened), opened
        for _, port in opened:
            for address in addresses:
                with pytest.raises(OSError):  # refused: nothing listens there
                    socket.create_connection((address, port), timeout=3).close()
    finally:
        runner.stop()
        with pytest.raises(LaunchStopped):
            runner.wait()


# ---------------------------------------------------------------- what ranks print

#: What a terminal would act on: NUL, clear-screen, a window title with BEL, CR, C1's CSI.
CONTROLS = "NUL\x00 ESC\x1b[2J OSC\x1b]0;title\x07 CR\r CSI\x9b1m"
#: A control character other than newline and tab.
RAW_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def print_and_fail_with_controls(how):
    print("stdout " + CONTROLS, flush=True)
    print("stderr " + CONTROLS, file=sys.stderr, flush=True)
    dist.barrier()
    if dist.get_rank() == 1:
        if how == "die":
            os._exit(5)
        raise RuntimeError("message " + CONTROLS)
    dist.barrier()  # rank 0 fails too, as a consequence


@pytest.mark.parametrize("how, error", [("raise", RankFailed), ("die", RankDied)])
def test_control_characters_from_a_rank_are_shown_escaped_and_kept(no_leftovers, how, error):
    with pytest.raises(error) as info:
        launch(print_and_fail_with_controls, world_size=2, args=(how,), timeout=60)
    err = info.value
    text = str(err)
    assert not RAW_CONTROL.findall(text), RAW_CONTROL.findall(text)
    shown = "NUL\\x00 ESC\\x1b[2J OSC\\x1b]0;title\\x07 CR\\x0d CSI\\x9b1m"
    assert f"stderr {shown}" in text  # the stderr tail
    if how == "raise":
        assert f"RuntimeError: message {shown}" in text  # the message and the remote traceback
        assert f"message {CONTROLS}" in err.remote_traceback  # kept as raised
    for rank in (0, 1):  # the captured output keeps every character
        assert err.result.stdout[rank] == f"stdout {CONTROLS}\n"
        assert f"stderr {CONTROLS}\n" in err.result.stderr[rank]


def hang_after_printing_controls():
    ddplab.emit("phase\x1b[2J", 1, note="label \x1b]0;title\x07")
    print("Thread 0x " + CONTROLS, file=sys.stderr, flush=True)  # looks like a stack dump's start
    time.sleep(60)


def test_a_hang_diagnosis_shows_control_characters_escaped(no_leftovers):
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_after_printing_controls, world_size=1, timeout=2)
    err = info.value
    text = str(err)
    assert not RAW_CONTROL.findall(text), RAW_CONTROL.findall(text)
    assert "ESC\\x1b[2J" in text and "phase\\x1b[2J" in text  # the stack tail, the last record
    assert err.last_records[0]["metric"] == "phase\x1b[2J"  # the record as emitted
    assert CONTROLS in err.stacks[0] and CONTROLS in err.result.stderr[0]


# ---------------------------------------------------------------- what ranks start


def start_child_then_fail(how):
    child = subprocess.Popen(["sleep", "300"])
    ddplab.emit("grandchild_pid", child.pid)
    ddplab.emit("pid", os.getpid())
    dist.barrier()  # the record is out before anything fails
    if dist.get_rank() == 1:
        if how == "raise":
            raise RuntimeError("planted failure after starting a child")
        os._exit(3)
    time.sleep(60)


@pytest.mark.parametrize("how, error", [("raise", RankFailed), ("exit", RankDied)])
def test_children_of_a_failed_rank_are_stopped(no_leftovers, how, error):
    with pytest.raises(error) as info:
        launch(start_child_then_fail, world_size=2, args=(how,), timeout=60)
    assert info.value.rank == 1
    frame = info.value.records
    assert len(_values(frame, "grandchild_pid")) == 2
    assert all_gone(_values(frame, "grandchild_pid") + _values(frame, "pid"))


#: A daemon the classic way: fork, setsid, fork again; the first two exit, the last sleeps.
DAEMON = """
import os, sys, time
if os.fork():
    sys.exit(0)
os.setsid()
if os.fork():
    os._exit(0)
print(os.getpid(), flush=True)
time.sleep(300)
"""


def start_daemons_then(how):
    # Leaves the rank's process group and session; its parent is still the rank.
    session = subprocess.Popen(["sleep", "300"], start_new_session=True)
    # Orphaned at once: its parents exit, so no process of the rank's is its parent.
    starter = subprocess.Popen([sys.executable, "-c", DAEMON], stdout=subprocess.PIPE, text=True)
    daemon = int(starter.stdout.readline())
    starter.wait()
    starter.stdout.close()
    ddplab.emit("daemon_pid", session.pid)
    ddplab.emit("daemon_pid", daemon)
    ddplab.emit("pid", os.getpid())
    if how == "raise":
        raise RuntimeError("planted failure after starting daemons")
    if how == "exit":
        os._exit(3)  # no cleanup in the rank at all
    if how == "hang":
        time.sleep(60)
    return "returned"


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper is Linux-only")
@pytest.mark.parametrize("how, error", [("return", None), ("raise", RankFailed), ("exit", RankDied),
                                        ("hang", LaunchTimeout)])
def test_daemons_a_rank_starts_are_stopped_too(no_leftovers, how, error):
    if error is None:
        frame = launch(start_daemons_then, world_size=1, args=(how,), timeout=60).records
    else:
        with pytest.raises(error) as info:
            launch(start_daemons_then, world_size=1, args=(how,), timeout=3 if how == "hang" else 60)
        frame = info.value.records
    daemons = _values(frame, "daemon_pid")
    assert len(daemons) == 2
    assert all_gone(daemons + _values(frame, "pid"))


def daemon_then_wait():
    daemon = subprocess.Popen(["sleep", "300"], start_new_session=True)
    ddplab.emit("daemon_pid", daemon.pid)
    ddplab.emit("pid", os.getpid())
    time.sleep(60)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the subreaper is Linux-only")
def test_stopping_leftovers_spares_the_ranks_and_daemons_of_a_running_launch(no_leftovers):
    seen, ended = [], []
    running = Launch(daemon_then_wait, world_size=2, timeout=60, on_record=seen.append).start()
    waiter = threading.Thread(target=lambda: ended.append(pytest.raises(LaunchStopped, running.wait)))
    waiter.start()  # as the explorer does: records arrive while wait() runs
    try:
        deadline = time.monotonic() + 30
        while len([r for r in seen if r["metric"] == "daemon_pid"]) < 2:
            assert time.monotonic() < deadline, seen
            time.sleep(0.05)
        theirs = [int(r["value"]) for r in seen if r["metric"] in ("daemon_pid", "pid")]
        for how in ("return", "exit"):  # each teardown stops the leftovers below the forkserver
            with contextlib.suppress(RankDied):
                launch(start_daemons_then, world_size=1, args=(how,), timeout=60)
        assert all(psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in theirs)
    finally:
        running.stop()
        waiter.join(30)
    assert ended, "the running launch did not end as stopped"
    assert all_gone(theirs)


SIGTERM_PROOF = """
import signal, sys, time
import torch.distributed as dist
from ddplab.launcher import launch

def stubborn():
    import ddplab, os
    signal.signal(signal.SIGTERM, lambda *_: None)   # survives terminate()
    ddplab.emit("pid", os.getpid())
    while True:
        time.sleep(0.05)

if __name__ == "__main__":
    try:
        launch(stubborn, world_size=2, timeout=120,
               on_record=lambda rec: print("PID", int(rec["value"]), flush=True))
    except KeyboardInterrupt as exc:
        sys.last_traceback = exc.__traceback__   # kept, as IPython keeps it (and the launch with it)
        print("INTERRUPTED", flush=True)
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    sys.stdin.read()   # stays alive, as a notebook kernel does, until the test is done
"""


def test_second_ctrl_c_still_kills_ranks_that_handle_sigterm(tmp_path):
    script = tmp_path / "stubborn.py"
    script.write_text(SIGTERM_PROOF)
    proc, pids = start_reading_pids([PY, str(script)], 2, stdin=subprocess.PIPE, cwd=tmp_path)
    try:
        proc.send_signal(signal.SIGINT)
        time.sleep(0.3)  # inside the SIGTERM grace period
        proc.send_signal(signal.SIGINT)
        assert proc.stdout.readline().strip() == "INTERRUPTED"
        assert proc.poll() is None  # the "kernel" lives on ...
        assert all_gone(pids)  # ... its ranks do not
    finally:
        proc.kill()
        proc.communicate(timeout=30)


# ---------------------------------------------------------------- blame


def raise_then_peers_exit():
    dist.barrier()
    if dist.get_rank() == 0:
        raise ValueError("the real failure on rank 0")
    try:
        dist.barrier()
    except RuntimeError:
        os._exit(3)  # as NCCL's async error handling tears a rank down


def test_the_first_failure_is_blamed_not_a_peer_that_exited(no_leftovers):
    with pytest.raises(RankFailed) as info:
        launch(raise_then_peers_exit, world_size=3, timeout=60)
    err = info.value
    assert err.rank == 0 and err.exc_type == "ValueError", str(err)
    text = str(err)
    assert text.startswith("rank 0 of 3 raised ValueError: the real failure on rank 0")
    consequences = text.split("--- then, as a consequence ---")[1]
    assert "rank 1 exited with code 3" in consequences and "rank 2 exited with code 3" in consequences


def sleep_instead_of_all_reduce():
    if dist.get_rank() == 1:
        time.sleep(60)  # never enters the all-reduce rank 0 waits in
    dist.all_reduce(torch.ones(1))


def test_a_timeout_singles_out_the_rank_that_never_entered_the_collective(no_leftovers):
    with pytest.raises(LaunchTimeout) as info:
        launch(sleep_instead_of_all_reduce, world_size=2, timeout=5)
    err = info.value
    assert err.pending == [0, 1]
    assert err.not_in_collective == [1]
    assert err.places[1].frame.function == "sleep_instead_of_all_reduce"
    assert err.places[1].frame.file == __file__
    assert err.places[0].waits_in.function == "all_reduce"
    assert str(err.places[1].frame) in str(err)


# ---------------------------------------------------------------- odd values and exceptions


def _explode():
    raise RuntimeError("this value cannot be rebuilt here")


class Unrebuildable:
    def __reduce__(self):
        return (_explode, ())


class BadStr(Exception):
    def __str__(self):
        raise RuntimeError("no text for you")


def odd_ending(kind):
    ddplab.emit("before", 1.0)
    dist.barrier()
    if dist.get_rank() != 1:
        return "fine"
    if kind == "unpicklable":
        return Unrebuildable()
    if kind == "bad_str":
        raise BadStr()
    sys.exit()


@pytest.mark.parametrize("kind, exc_type, text", [
    ("unpicklable", "RuntimeError",
     "rank 1 of 2 returned a value this process cannot unpickle (RuntimeError: this value cannot be rebuilt here)"),
    ("bad_str", "BadStr", "rank 1 of 2 raised BadStr: <its __str__ raised RuntimeError>"),
    ("exit", "SystemExit", "rank 1 of 2 called sys.exit(None)"),
])
def test_odd_endings_are_launch_errors_naming_the_rank(no_leftovers, kind, exc_type, text):
    with pytest.raises(RankFailed) as info:
        launch(odd_ending, world_size=2, args=(kind,), timeout=60)
    err = info.value
    assert err.rank == 1 and err.exc_type == exc_type
    assert str(err).startswith(text), str(err)
    assert len(err.records.query("metric == 'before'")) == 2  # the records are kept
    assert err.result.returns[0] == "fine"


def test_a_module_the_rank_cannot_import_is_explained(no_leftovers, tmp_path, monkeypatch):
    path = tmp_path / "only_here.py"
    path.write_text("def value():\n    return 7\n")
    spec = importlib.util.spec_from_file_location("only_here", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    monkeypatch.setitem(sys.modules, "only_here", module)  # imported, but not by name from sys.path
    with pytest.raises(RankFailed, match="register_pickle_by_value") as info:
        launch(module.value, world_size=1, timeout=60)
    assert "No module named 'only_here'" in str(info.value)


# ---------------------------------------------------------------- bad input


@pytest.mark.parametrize("kwargs, match", [
    (dict(kwargs={1: 2}), "kwargs keys must be strings"),
    (dict(threads_per_rank=-1), "threads_per_rank must be an int >= 1"),
    (dict(threads_per_rank=0), "threads_per_rank must be an int >= 1"),
    (dict(env={"A=B": "1"}), "not an environment variable name"),
    (dict(env={1: "1"}), "not an environment variable name"),
    (dict(env={"A": None}), r"env\['A'\] must be a string"),
    (dict(env={"A": "x\0y"}), "NUL"),
    (dict(env="A=1"), "env must be a dict"),
    (dict(world_size=10_000), f"at most .* ranks .*{MAX_WORLD_SIZE_ENV}"),
    (dict(timeout=math.nan), "timeout must be a positive number of seconds, finite"),
    (dict(timeout=math.inf), "timeout must be a positive number of seconds, finite"),
    (dict(timeout=1e300), "at most"),
    (dict(on_record=5), "on_record must be callable"),
])
def test_bad_input_is_refused_before_any_process(nothing_starts, kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(lambda: 1, **{"world_size": 2, **kwargs})


@pytest.fixture
def nothing_starts(no_leftovers, monkeypatch):
    """Fail the test if the launch creates its store or a rank process, or any process appears.

    Structural, not timed: a refused launch never gets that far.
    """
    started = []

    def refuse(what):
        def spy(*args, **kw):
            started.append(what)
            raise AssertionError(f"{what} started before the bad input was refused")
        return spy

    monkeypatch.setattr(launcher._RankProcess, "start", refuse("a rank process"))
    monkeypatch.setattr(launcher.lifecycle, "_loopback_store", refuse("the rendezvous store"))
    before = psutil.Process().children(recursive=True)
    yield
    assert started == []
    assert psutil.Process().children(recursive=True) == before


def takes_lr(lr, *, momentum=0.9):
    return lr * momentum


@pytest.mark.parametrize("fn, args, kwargs, match", [
    (takes_lr, (0.1,), {"momentun": 0.5}, "unexpected keyword argument 'momentun'"),
    (takes_lr, (), {"lrr": 0.1}, "missing a required argument: 'lr'"),
    (takes_lr, (0.1, 0.5), {}, "too many positional arguments"),
    (takes_lr, (0.1,), {"lr": 0.2}, "multiple values for argument 'lr'"),
    (lambda: 1, (), {"x": 1}, "<lambda>.. cannot be called .*unexpected keyword argument 'x'"),
    (functools.partial(takes_lr, 0.1), (), {"lr": 0.3}, "partial.*takes_lr.*argument 'lr'"),
])
def test_arguments_the_function_does_not_take_are_refused_before_any_process(
        nothing_starts, fn, args, kwargs, match):
    with pytest.raises(ValueError, match=match):
        launch(fn, world_size=2, args=args, kwargs=kwargs)


class Scaled:
    def __call__(self, x, **extra):
        return x * (dist.get_rank() + 1) + len(extra)


def test_what_the_signature_accepts_launches(no_leftovers):
    assert launch(takes_lr, world_size=1, args=(2.0,), kwargs={"momentum": 0.5}).returns == [1.0]
    assert launch(Scaled(), world_size=2, args=(3,), kwargs={"anything": 1}).returns == [4, 7]
    # A builtin whose signature cannot be read is not checked here; it runs in the ranks.
    with pytest.raises(ValueError):
        inspect.signature(max)
    assert launch(max, world_size=1, args=(3, 4)).returns == [4]


def test_world_size_limit_can_be_raised_or_lowered(no_leftovers, monkeypatch):
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, "1")
    with pytest.raises(ValueError, match=f"at most 1 ranks \\(set by {MAX_WORLD_SIZE_ENV}\\)"):
        launch(lambda: 1, world_size=2)
    assert launch(lambda: dist.get_world_size(), world_size=1).returns == [1]
    monkeypatch.setenv(MAX_WORLD_SIZE_ENV, "lots")
    with pytest.raises(ValueError, match=f"{MAX_WORLD_SIZE_ENV} must be a positive integer"):
        launch(lambda: 1, world_size=1)


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0"])
def test_cli_timeouts_must_be_finite_and_positive(value, capsys):
    from ddplab.cli import build_parser

    for command in (["report"], ["run", "half_precision", "--out", "x"]):
        with pytest.raises(SystemExit) as info:
            build_parser().parse_args(command + ["--timeout", value])
        assert info.value.code == 2
        assert "finite number of seconds > 0" in capsys.readouterr().err


# ---------------------------------------------------------------- launching from odd mains


PROGRAM = textwrap.dedent("""
    import torch, torch.distributed as dist
    from ddplab import launch
    a = torch.randn(500, 500); a @ a   # the parent ran torch ops first
    def total(k):
        t = torch.tensor([float(k)])
        dist.all_reduce(t)
        return t.item()
    print("RESULT", launch(total, world_size=2, args=(3,), timeout=120).returns)
""")


BAD_KEYWORD_PROGRAM = textwrap.dedent("""
    import psutil
    from ddplab import launch
    def train(lr, steps=3):
        return lr * steps
    try:
        launch(train, world_size=2, args=(0.1,), kwargs={"step": 5})
    except ValueError as exc:
        print("REFUSED", exc)
    print("CHILDREN", len(psutil.Process().children(recursive=True)))
""")


def test_a_bad_keyword_from_python_dash_c_is_refused_before_any_process(tmp_path):
    # A function of `python -c` has no source file; its signature is read all the same.
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    proc = subprocess.run([PY, "-c", BAD_KEYWORD_PROGRAM], capture_output=True, text=True,
                          cwd=tmp_path, env=env, timeout=120)
    assert "REFUSED train(lr, steps=3) cannot be called" in proc.stdout, proc.stderr[-3000:]
    assert "unexpected keyword argument 'step'" in proc.stdout
    assert "CHILDREN 0" in proc.stdout  # not even the forkserver was started


@pytest.mark.slow  # three fresh interpreters import torch side by side: about 30 s on 2 cores
def test_launch_from_stdin_dash_c_and_an_unguarded_script(tmp_path):
    script = tmp_path / "unguarded.py"
    script.write_text(PROGRAM)  # no `if __name__ == "__main__":`
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([REPO, os.environ.get("PYTHONPATH", "")])}
    runs = {
        "stdin": subprocess.Popen([PY, "-"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, cwd=tmp_path, env=env),
        "-c": subprocess.Popen([PY, "-c", PROGRAM], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                               text=True, cwd=tmp_path, env=env),
        "script": subprocess.Popen([PY, str(script)], stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                   text=True, cwd=tmp_path, env=env),
    }
    outputs = {name: proc.communicate(PROGRAM if name == "stdin" else None, timeout=180)
               for name, proc in runs.items()}
    for name, (out, err) in outputs.items():
        assert "RESULT [6.0, 6.0]" in out, f"{name}: {err[-3000:]}"

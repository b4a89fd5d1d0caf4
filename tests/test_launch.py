"""The notebook launcher, with real gloo process groups (no mocks)."""
from __future__ import annotations

import os
import signal
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
from ddplab.launcher import (Launch, LaunchStopped, LaunchTimeout, RankDied, RankFailed,
                           launch)

from processes import all_gone, start_reading_pids

PY = sys.executable
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


# ---------------------------------------------------------------- worker functions


def rank_sum(offset):
    t = torch.tensor([float(offset + dist.get_rank())])
    dist.all_reduce(t)
    print(f"out {dist.get_rank()}")
    print(f"err {dist.get_rank()}", file=sys.stderr)
    return t.item()


def emit_then_fail(fail_rank):
    rank = dist.get_rank()
    ddplab.emit("pid", os.getpid())
    for step in range(3):
        ddplab.emit("loss", 1.0 / (step + 1), step=step)
    dist.barrier()
    if rank == fail_rank:
        ddplab.emit("raised_at", time.time())
        raise ValueError(f"planted failure on rank {rank}")
    dist.barrier()  # the others wait here for a peer that never comes
    return rank


def hang_without_collective(stuck_rank):
    rank = dist.get_rank()
    ddplab.emit("pid", os.getpid())
    ddplab.emit("phase", 1, step=7)
    if rank == stuck_rank:
        child = subprocess.Popen(["sleep", "300"])
        ddplab.emit("grandchild_pid", child.pid)
        time.sleep(300)
    return rank


def all_stuck_in_collective():
    ddplab.emit("pid", os.getpid())
    if dist.get_rank() == 0:
        time.sleep(300)
    dist.all_reduce(torch.ones(1))


def die_by_signal(victim):
    ddplab.emit("pid", os.getpid())
    dist.barrier()
    if dist.get_rank() == victim:
        ddplab.emit("killed_at", time.time())
        os.kill(os.getpid(), signal.SIGKILL)
    dist.barrier()


def long_running():
    ddplab.emit("pid", os.getpid())
    for step in range(10_000):
        dist.all_reduce(torch.ones(4))
        time.sleep(0.01)
        ddplab.emit("tick", step, step=step)


def unpicklable_return():
    return threading.Lock()


def read_env(name):
    return os.environ.get(name)


def steps(n):
    for step in range(n):
        ddplab.emit("loss", float(n - step), step=step)
    return n


# ---------------------------------------------------------------- success paths


def test_returns_outputs_and_wall_time(no_leftovers):
    res = launch(rank_sum, world_size=4, args=(1,))
    assert res.returns == [10.0] * 4
    assert [s.strip() for s in res.stdout] == [f"out {r}" for r in range(4)]
    assert all(f"err {r}" in res.stderr[r] for r in range(4))
    assert res.wall_time > 0
    assert res.exitcodes == [0] * 4


def test_world_size_one(no_leftovers):
    assert launch(rank_sum, world_size=1, args=(5,)).returns == [5.0]


def test_lambdas_and_closures_pickle_by_value(no_leftovers):
    scale = 3.0

    def closure():
        t = torch.tensor([scale * (dist.get_rank() + 1)])
        dist.all_reduce(t)
        return t.item()

    assert launch(closure, world_size=2).returns == [9.0, 9.0]
    assert launch(lambda k: dist.get_rank() * k, world_size=3, args=(2,)).returns == [0, 2, 4]


def test_records_stream_into_one_tidy_table(no_leftovers):
    seen = []
    res = launch(steps, world_size=2, args=(4,), on_record=seen.append)
    assert len(seen) == 8  # streamed to the parent one by one
    frame = res.records
    assert list(frame.columns[:5]) == list(ddplab.RECORD_COLUMNS)
    assert sorted(frame["rank"].unique().tolist()) == [0, 1]
    assert frame.query("rank == 1 and step == 3")["value"].item() == 1.0


def test_env_reaches_ranks_including_later_parent_changes(no_leftovers, monkeypatch):
    monkeypatch.setenv("DDPLAB_TEST_LATE_VAR", "set-after-forkserver-start")
    res = launch(read_env, world_size=2, args=("DDPLAB_TEST_LATE_VAR",))
    assert res.returns == ["set-after-forkserver-start"] * 2
    res = launch(read_env, world_size=1, args=("NCCL_ALGO",), env={"NCCL_ALGO": "Tree"})
    assert res.returns == ["Tree"]


def test_progress_in_batch_mode_goes_to_the_progress_file_not_stderr(no_leftovers, monkeypatch,
                                                                     capfd, tmp_path):
    from ddplab.progress import read_progress

    monkeypatch.setenv("DDPLAB_BATCH", "1")
    monkeypatch.setenv("TQDM_DISABLE", "0")
    monkeypatch.setenv("DDPLAB_PROGRESS_FILE", str(tmp_path / "progress.jsonl"))
    launch(steps, world_size=2, args=(5,), progress=5, progress_desc="train")
    assert "train" not in capfd.readouterr().err   # a report would style stderr as an error
    bars = read_progress(tmp_path / "progress.jsonl")
    assert bars["train"]["n"] == bars["train"]["total"] == 5


# ---------------------------------------------------------------- failures


def _pids(frame, metric="pid"):
    return [int(v) for v in frame.query("metric == @metric")["value"]]


def test_exception_stops_all_ranks_fast_and_keeps_records(no_leftovers):
    with pytest.raises(RankFailed) as info:
        launch(emit_then_fail, world_size=4, args=(2,), timeout=60)
    caught_at = time.time()
    err = info.value
    assert err.rank == 2 and err.exc_type == "ValueError"
    assert "rank 2 of 4 raised ValueError: planted failure on rank 2" in str(err)
    assert "emit_then_fail" in err.remote_traceback  # the remote traceback is shown
    frame = err.records
    assert len(frame.query("metric == 'loss'")) == 12  # 3 steps x 4 ranks, before the failure
    raised_at = frame.query("metric == 'raised_at'")["value"].item()
    assert caught_at - raised_at < 3.0
    assert all_gone(_pids(frame))


def test_death_by_signal_is_reported_fast(no_leftovers):
    with pytest.raises(RankDied) as info:
        launch(die_by_signal, world_size=3, args=(1,), timeout=60)
    caught_at = time.time()
    assert info.value.rank == 1 and "SIGKILL" in str(info.value)
    frame = info.value.records
    assert caught_at - frame.query("metric == 'killed_at'")["value"].item() < 3.0
    assert all_gone(_pids(frame))


def test_hang_is_diagnosed_and_everything_stopped(no_leftovers):
    t0 = time.monotonic()
    with pytest.raises(LaunchTimeout) as info:
        launch(hang_without_collective, world_size=3, args=(1,), timeout=4)
    assert time.monotonic() - t0 < 15
    err = info.value
    assert err.returned == [0, 2] and err.pending == [1]
    msg = str(err)
    assert "did not return: [1]" in msg
    assert "rank 1: last record" in msg and "grandchild_pid" in msg
    assert "hang_without_collective" in err.stacks[1]  # where it was stuck
    frame = err.records
    pids = _pids(frame) + _pids(frame, "grandchild_pid")
    assert all_gone(pids)  # the rank's own child process too


def test_ranks_stuck_in_a_collective_time_out(no_leftovers):
    with pytest.raises(LaunchTimeout) as info:
        launch(all_stuck_in_collective, world_size=2, timeout=3)
    assert info.value.pending == [0, 1]
    assert all_gone(_pids(info.value.records))


def test_unpicklable_return_value_is_a_clear_error(no_leftovers):
    with pytest.raises(RankFailed, match="return value could not be pickled"):
        launch(unpicklable_return, world_size=2)


def test_stop_from_another_thread(no_leftovers):
    runner = Launch(long_running, world_size=2, timeout=60)
    runner.start()
    threading.Timer(1.5, runner.stop).start()
    with pytest.raises(LaunchStopped) as info:
        runner.wait()
    frame = info.value.records
    assert len(frame.query("metric == 'tick'")) > 0
    assert all_gone(_pids(frame))


@pytest.mark.parametrize("kwargs, match", [
    (dict(world_size=0), "world_size must be an int >= 1"),
    (dict(world_size=2.0), "world_size must be an int >= 1"),
    (dict(world_size=True), "world_size must be an int >= 1"),
    (dict(backend="mpi"), "unknown backend 'mpi'"),
    (dict(backend="nccl"), "needs CUDA GPUs"),
    (dict(timeout=0), "timeout must be a positive number"),
    (dict(args=5), "args must be a tuple or list"),
])
def test_bad_arguments_raise_before_any_process(no_leftovers, kwargs, match):
    if kwargs.get("backend") == "nccl" and torch.cuda.is_available():
        pytest.skip("this machine has GPUs")
    before = psutil.Process().children(recursive=True)
    with pytest.raises(ValueError, match=match):
        launch(rank_sum, **kwargs)
    assert psutil.Process().children(recursive=True) == before


def test_non_callable_is_rejected(no_leftovers):
    with pytest.raises(ValueError, match="fn must be callable"):
        launch(42, world_size=2)


# ---------------------------------------------------------------- whole programs


MAIN_SCRIPT = """
import sys, torch, torch.distributed as dist
from ddplab.launcher import launch

def main_fn(k):
    t = torch.tensor([float(k)])
    dist.all_reduce(t)
    return t.item()

if __name__ == "__main__":
    a = torch.randn(1500, 1500); a @ a   # the parent ran torch ops first
    r = launch(main_fn, world_size=2, args=(int(sys.argv[1]),))
    r2 = launch(lambda: (torch.randn(300, 300) @ torch.randn(300, 300)).shape[0], world_size=2)
    print("RESULT", r.returns, r2.returns)
"""


def test_functions_defined_in_main_and_concurrent_launches(tmp_path):
    script = tmp_path / "prog.py"
    script.write_text(MAIN_SCRIPT)
    procs = [subprocess.Popen([PY, str(script), str(k)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, cwd=tmp_path)
             for k in (3, 5)]
    outs = [p.communicate(timeout=120) for p in procs]
    for (out, err), k in zip(outs, (3, 5)):
        assert f"RESULT [{2.0 * k}, {2.0 * k}] [300, 300]" in out, err


INTERRUPT_SCRIPT = """
import sys, time, torch, torch.distributed as dist
from ddplab.launcher import launch

def forever():
    import ddplab, os
    ddplab.emit("pid", os.getpid())
    while True:
        dist.all_reduce(torch.ones(1)); time.sleep(0.01)

if __name__ == "__main__":
    def show(rec):
        print("PID", int(rec["value"]), flush=True)
    try:
        launch(forever, world_size=2, on_record=show, timeout=120)
    except KeyboardInterrupt:
        print("INTERRUPTED", flush=True)
"""


def test_keyboard_interrupt_stops_every_rank(tmp_path):
    script = tmp_path / "interrupt.py"
    script.write_text(INTERRUPT_SCRIPT)
    proc, pids = start_reading_pids([PY, str(script)], 2, cwd=tmp_path)
    proc.send_signal(signal.SIGINT)
    out, err = proc.communicate(timeout=30)
    assert "INTERRUPTED" in out, err
    assert all_gone(pids)


NOTEBOOK_CELLS = [
    "import torch, torch.distributed as dist\n"
    "a = torch.randn(2000, 2000); b = a @ a  # torch already ran in the kernel",
    "def cell_fn(n):\n"
    "    x = torch.randn(400, 400) @ torch.randn(400, 400)\n"
    "    t = torch.tensor([float(n)]); dist.all_reduce(t)\n"
    "    return t.item()\n"
    "from ddplab import launch\n"
    "res = launch(cell_fn, world_size=2, args=(4,), timeout=60)\n"
    "assert res.returns == [8.0, 8.0], res\n"
    "res2 = launch(lambda: dist.get_world_size(), world_size=3)\n"
    "print('OK', res.returns, res2.returns)",
]


@pytest.mark.slow
def test_launch_from_a_jupyter_kernel(tmp_path):
    import nbformat
    from nbclient import NotebookClient

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in NOTEBOOK_CELLS]
    NotebookClient(nb, timeout=120, kernel_name="python3",
                   resources={"metadata": {"path": str(tmp_path)}}).execute()
    text = "".join(o.get("text", "") for o in nb.cells[1].outputs)
    assert "OK [8.0, 8.0] [3, 3, 3]" in text


def test_observers_and_stop_all_reach_indirect_launches(no_leftovers):
    from ddplab.launcher import observe, stop_all

    seen = []
    outcome = {}

    def background():
        try:
            launch(long_running, world_size=2, timeout=60)
        except LaunchStopped as exc:
            outcome["stopped"] = exc

    def on_record(runner, rec):
        seen.append((runner.world_size, rec["metric"]))
        if len(seen) == 10:
            threading.Thread(target=stop_all).start()  # as the explorer's Stop button does

    with observe(on_record):
        worker = threading.Thread(target=background)
        worker.start()
        worker.join(60)
    assert "stopped" in outcome and len(seen) >= 10
    assert seen[0][0] == 2
    assert all_gone(_pids(outcome["stopped"].records))

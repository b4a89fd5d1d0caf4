"""The same worker functions under torchrun, two 'nodes' on 127.0.0.1 (real c10d rendezvous)."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys

import pytest

from ddplab import launch
from ddplab.torchrun import RunIncomplete, load_run

TESTS = pathlib.Path(__file__).resolve().parent


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_two_nodes(target: str, out: pathlib.Path, params: dict, timeout: float = 240):
    """Start two torchrun agents (node ranks 0 and 1, 2 processes each) and wait for both."""
    port = _free_port()
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(TESTS), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    extra = [x for k, v in params.items() for x in ("-p", k, str(v))]
    procs = []
    for node in (0, 1):
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "2", "--node-rank", str(node),
               "--nproc-per-node", "2", "--rdzv-backend", "c10d",
               "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id", f"ddplab-test-{port}",
               "--local-addr", "127.0.0.1", "--max-restarts", "0",
               "-m", "ddplab", "run", target, "--out", str(out), "--timeout", "120", *extra]
        procs.append(subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                      text=True))
    outputs = []
    for p in procs:
        try:
            outputs.append(p.communicate(timeout=timeout)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            raise
    return [p.returncode for p in procs], "\n".join(outputs)


@pytest.mark.slow
def test_two_nodes_merge_equals_the_notebook_launcher(tmp_path):
    import torchrun_workers

    codes, log = torchrun_two_nodes("torchrun_workers:allreduce_steps", tmp_path / "run", {"steps": 4})
    assert codes == [0, 0], log
    merged = load_run(tmp_path / "run")
    local = launch(torchrun_workers.allreduce_steps, world_size=4, args=({"steps": 4},)).records
    assert len(merged) == 16
    assert merged.equals(local)  # bitwise: values, labels, order


@pytest.mark.slow
def test_a_failing_rank_leaves_no_complete_table(tmp_path):
    codes, log = torchrun_two_nodes("torchrun_workers:fail_on_rank_one", tmp_path / "run", {})
    assert codes != [0, 0]
    assert "rank 1 of 4 failed" in log and "planted failure under torchrun" in log
    assert not (tmp_path / "run" / "run.json").exists()
    with pytest.raises(RunIncomplete, match=r"did not complete.*first failure: rank 1 \(RuntimeError: planted failure"):
        load_run(tmp_path / "run")
    partial = load_run(tmp_path / "run", allow_incomplete=True)
    assert set(partial.query("metric == 'started'")["rank"]) == {0, 1, 2, 3}


def _canonical(frame):
    # The parent's own timing record is wall-clock, not a measurement of the ranks.
    from ddplab.records import canonical

    kept = frame[frame["metric"] != "launch_seconds"].dropna(axis=1, how="all")
    # Comm-hook futures emit in completion order, which varies: compare as sets of rows.
    return canonical(kept)


@pytest.fixture(scope="module")
def case01_run(tmp_path_factory):
    """Case 01 with small parameters on two torchrun 'nodes' of 2 ranks each."""
    run = tmp_path_factory.mktemp("case01") / "run"
    codes, log = torchrun_two_nodes("backend_divergence", run, {"steps": 2})
    assert codes == [0, 0], log[-3000:]
    return run


@pytest.mark.slow
def test_case_01_under_torchrun_equals_the_notebook_launcher(case01_run):
    from ddplab.cases import get_case

    case = get_case("backend_divergence")
    merged = load_run(case01_run)
    params = case.check_params({"world_sizes": [4], "steps": 2})
    local = case.run(params, progress=False)
    assert json_params(case01_run)["world_sizes"] == [4]
    left, right = _canonical(merged), _canonical(local)
    assert len(left) > 100
    assert list(left.columns) == list(right.columns)
    assert left.equals(right)  # bitwise: every value, label and row (in canonical order)


def json_params(path):
    import json
    return json.loads((path / "params.json").read_text())


@pytest.mark.slow
def test_a_cluster_run_becomes_the_same_html_report(case01_run, tmp_path):
    from ddplab.report import plan_batch, run_batch

    planned = plan_batch(["backend_divergence"], overrides=[("run_dir", str(case01_run))])
    [outcome] = run_batch(planned, tmp_path / "reports", timeout=300, echo=lambda _: None)
    assert outcome.status == "ok" and outcome.verdict.kind == "rounding"
    assert outcome.verdict.finding("two_ranks_bitwise").holds is None  # W=2 was not in this run
    assert outcome.verdict.holds("same_order_reproducible")
    summary = (tmp_path / "reports" / "backend_divergence" / "summary.md").read_text()
    from ddplab import markup
    # The run's parameters, not the defaults.
    assert f"| {markup.text('world_sizes')} | {markup.code([4])} |" in summary

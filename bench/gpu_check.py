"""Prepared GPU checks: the nccl paths that CPU machines (and CI) cannot run.

Runs in a few minutes on a GPU machine and prints one table; every row is
computed, a row that cannot run here says why. Nothing here is a test (CI has
no GPU); run it by hand where GPUs are lent:

    python bench/gpu_check.py            # or: make gpu-check

Checks, by the number of GPUs G:
  G >= 1  launch: nccl all_reduce on G ranks (one GPU each), result and latency
  G >= 1  case 02: the CUDA float16 norm of the report's weights (rank 0's GPU)
  G >= 2  case 01: live NCCL with NCCL_ALGO=Ring and Tree as extra orders, verdict
  G >= 2  case 03: the report's own .cpu() -> .cuda() round trip, detector and fix
"""
from __future__ import annotations

import time
import traceback

import torch
import torch.distributed as dist

from ddplab import launch

ROWS: list[tuple[str, str, str, float]] = []


def check(name: str, needs_gpus: int, gpus: int):
    def wrap(fn):
        t0 = time.perf_counter()
        if gpus < needs_gpus:
            ROWS.append((name, "skipped", f"needs {needs_gpus} GPU(s), this machine has {gpus}", 0.0))
            return fn
        try:
            ROWS.append((name, "ok", fn(gpus), time.perf_counter() - t0))
        except Exception as exc:  # noqa: BLE001 - reported in the table
            ROWS.append((name, "FAILED", f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}",
                         time.perf_counter() - t0))
            traceback.print_exc()
        return fn
    return wrap


def _nccl_sum():
    t = torch.full((1 << 20,), float(dist.get_rank() + 1), device=f"cuda:{dist.get_rank()}")
    dist.all_reduce(t)
    torch.cuda.synchronize()
    return t[0].item()


def _run_case(name: str, overrides: dict):
    """Run a registered case through its Case interface: ``(records, verdict)``."""
    from ddplab.cases import get_case

    case = get_case(name)
    params = case.check_params(overrides)
    records = case.run(params, progress=False)
    return records, case.verdict(records, params)


def _verdict_line(verdict) -> str:
    """The verdict's kind, its key numbers and whether each finding holds, on one line."""
    numbers = ", ".join(f"{label} {value}" for label, value in verdict.key_table())
    return (f"{verdict.kind}; {numbers}; "
            + ", ".join(f"{f.key}={f.holds}" for f in verdict.findings))


def main() -> None:
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, GPUs: {gpus} "
          + ", ".join(torch.cuda.get_device_name(i) for i in range(gpus)))

    @check("launch: nccl all_reduce", 1, gpus)
    def _(g):
        launch(_nccl_sum, world_size=g, backend="nccl")  # warm-up
        t0 = time.perf_counter()
        got = launch(_nccl_sum, world_size=g, backend="nccl").returns
        expected = g * (g + 1) / 2
        assert got == [expected] * g, got
        return f"{g} rank(s), sum {got[0]:g} = {expected:g}, repeat launch {1e3 * (time.perf_counter() - t0):.0f} ms"

    @check("case 02: CUDA fp16 norm", 1, gpus)
    def _(g):
        records, verdict = _run_case("half_precision", {"world_size": 1, "dtypes": ["float16"]})
        cuda = records[(records["metric"] == "norm") & (records.get("device") == "cuda")]
        norm = f"CUDA norm {cuda['value'].iloc[0]:.6g}" if len(cuda) else "no CUDA norm recorded"
        return f"{norm}; {_verdict_line(verdict)}"

    @check("case 01: live NCCL Ring/Tree", 2, gpus)
    def _(g):
        return _verdict_line(_run_case("backend_divergence", {
            "world_sizes": sorted({2, min(g, 4)}), "backend": "nccl", "steps": 5,
            "orders": ["gloo", "nccl_ring", "nccl_tree", "exact", "nccl_live_ring", "nccl_live_tree"]})[1])

    @check("case 03: .cpu()/.cuda() round trip", 2, gpus)
    def _(g):
        return _verdict_line(_run_case("device_roundtrip", {
            "roundtrip": ["none", "device"], "framework": ["ddp"], "steps": 8})[1])

    width = max(len(r[0]) for r in ROWS)
    print(f"\n{'check':<{width}}  {'status':<8} {'seconds':>8}  result")
    for name, status, detail, seconds in ROWS:
        print(f"{name:<{width}}  {status:<8} {seconds:8.1f}  {detail}")


if __name__ == "__main__":
    main()

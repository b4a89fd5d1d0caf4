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
        from ddplab.cases import half_precision as case
        params = case.PARAMETERS.validate({"world_size": 1, "dtypes": ["float16"]})
        records = case.run(params, progress=False)
        cuda = records[(records["metric"] == "norm") & (records.get("device") == "cuda")]
        verdict = case.verdict(records, params)
        return f"CUDA norm {cuda['value'].iloc[0]:.6g}; verdict {verdict.kind}" if len(cuda) else \
            f"no CUDA norm recorded; verdict {verdict.kind}"

    @check("case 01: live NCCL Ring/Tree", 2, gpus)
    def _(g):
        from ddplab.cases import get_case
        case = get_case("backend_divergence")
        params = case.check_params({
            "world_sizes": sorted({2, min(g, 4)}), "backend": "nccl", "steps": 5,
            "orders": ["gloo", "nccl_ring", "nccl_tree", "exact", "nccl_live_ring", "nccl_live_tree"]})
        verdict = case.verdict(case.run(params, progress=False), params)
        return (f"{verdict.kind} ({verdict.values['evidence']} evidence for live gloo): "
                + ", ".join(f"{f.key}={f.holds}" for f in verdict.findings))

    @check("case 03: .cpu()/.cuda() round trip", 2, gpus)
    def _(g):
        from ddplab.cases import get_case
        case = get_case("device_roundtrip")
        params = case.check_params({"roundtrip": ["none", "device"], "framework": ["ddp"],
                                    "steps": 8})
        verdict = case.verdict(case.run(params, progress=False), params)
        return (f"{verdict.kind}, buckets per backward after the round trip "
                f"{verdict.values['buckets_after']}: "
                + ", ".join(f"{f.key}={f.holds}" for f in verdict.findings))

    width = max(len(r[0]) for r in ROWS)
    print(f"\n{'check':<{width}}  {'status':<8} {'seconds':>8}  result")
    for name, status, detail, seconds in ROWS:
        print(f"{name:<{width}}  {status:<8} {seconds:8.1f}  {detail}")


if __name__ == "__main__":
    main()

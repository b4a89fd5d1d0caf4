"""The symmetric twin: the user's own step, every rank given the same data and the same RNG state.

Under the data-parallel promise a rank's computation depends on its data
and its RNG draws, never on its rank. The twin runs the configuration as
written (its step, wrap, hooks) with the global batch replaced by W copies
of rank 0's share and every rank's RNG seeded alike at every step
(:data:`ddplab.compare.runners.VARIANTS`). Then every rank's forward
outputs, its inputs to every collective, its gradients at
``optimizer.step()`` and its parameters after it must be bitwise equal to
rank 0's (for collectives: the inputs of every all-reduce and reduce-scatter). A difference of any size -- one ulp -- is computation that depends
on the rank: a bug, named at the first (step, rank, what, module) where it
starts. This needs no specification of what the step promises, so it holds
for Custom steps, SyncBatchNorm models, FSDP2's backward and unknown hooks.

Records: ``twin_differing`` per step, rank (1..W-1), quantity (``forward``,
``collective``, ``grad``, ``param``) and parameter or collective, value the
number of differing elements (calls, for forward outputs), with ``max_ulp``
where tensors differ; ``twin_module`` at the first forward difference.
"""
from __future__ import annotations

from ddplab.records import record

__all__ = ["twin_records", "first_asymmetry", "QUANTITIES"]

#: What the twin compares, in the order a step computes it.
QUANTITIES = ("forward", "collective", "grad", "param")


def _forward(out: list, labels: dict, step: int, rank: int, mine: list, first: list) -> None:
    differing = sum(a != b for a, b in zip(mine, first)) + abs(len(mine) - len(first))
    out.append(record("twin_differing", differing, step=step, rank=rank, quantity="forward",
                      param="(forward outputs)", **labels))
    if differing:
        module = next((a[0] for a, b in zip(mine, first) if a != b), "(model)")
        out.append(record("twin_module", 1, step=step, rank=rank, module=module, **labels))


def _tensors(out: list, labels: dict, step: int, rank: int, quantity: str, mine: dict, first: dict) -> None:
    from ddplab.compare.replay import compare_bits

    for name, tensor in first.items():
        if name not in mine:
            continue
        c = compare_bits(mine[name], tensor)
        extra = dict(max_ulp=c["max_ulp"], max_relative=c["max_relative"]) if c["differing"] else {}
        out.append(record("twin_differing", c["differing"], step=step, rank=rank, quantity=quantity,
                          param=name, **labels, **extra))


def _collectives(out: list, labels: dict, step: int, rank: int, mine: list, first: list) -> None:
    """The inputs of the rank's recorded collectives, in issue order, against rank 0's (by digest)."""
    # Only reductions: their inputs are each rank's whole contribution. An all-gather's input is the
    # rank's own shard and a broadcast's the receiving buffer, different by design.
    mine = [c for c in mine if c.get("type") == "CollectiveRecord" and c.get("op") in ("allreduce", "reduce_scatter")]
    first = [c for c in first if c.get("type") == "CollectiveRecord" and c.get("op") in ("allreduce", "reduce_scatter")]
    for index, (a, b) in enumerate(zip(mine, first)):
        differing = sum(x != y for x, y in zip(a["input_digests"], b["input_digests"]))
        out.append(record("twin_differing", differing, step=step, rank=rank, quantity="collective",
                          param=f"#{index} {a['op']}" + (f" (bucket {a['bucket']})" if a.get("bucket") is not None
                                                          else ""), **labels))
    if len(mine) != len(first):
        out.append(record("twin_differing", abs(len(mine) - len(first)), step=step, rank=rank,
                          quantity="collective", param="(number of collectives)", **labels))


def _bucket_inputs(capture: dict) -> dict:
    """Bucket name -> this rank's input to it; every reduction of a step (accumulation that syncs
    each micro-batch reduces a bucket k times) under its own name."""
    return {f"bucket {b['index']}" + (f" reduction {b['round']}" if b.get("round") else ""): b["local"]
            for b in capture.get("buckets", [])}


def twin_records(label: str, ranks: list[list[dict]]) -> list[dict]:
    """Compare every rank of the twin with rank 0, step by step.

    ``ranks[r][step]`` is rank r's capture of the twin (:class:`ddplab.compare.runners.Capture`),
    with its recorded collectives (``collectives``: their input digests, in issue order).
    """
    labels = dict(config=label)
    out: list[dict] = []
    steps = min(len(r) for r in ranks)
    for step in range(steps):
        first = ranks[0][step]
        for rank in range(1, len(ranks)):
            mine = ranks[rank][step]
            _forward(out, labels, step, rank, mine.get("forward", []), first.get("forward", []))
            if first.get("collectives"):
                _collectives(out, labels, step, rank, mine.get("collectives", []), first["collectives"])
            elif "buckets" in first:  # DDP's bucket inputs, kept around each of its reductions
                _tensors(out, labels, step, rank, "collective", _bucket_inputs(mine), _bucket_inputs(first))
            _tensors(out, labels, step, rank, "grad", mine["grads"], first["grads"])
            _tensors(out, labels, step, rank, "param", mine["params"], first["params"])
    return out


def first_asymmetry(frame, config: str) -> dict | None:
    """The first (step, quantity, rank, what) where a rank computed otherwise than rank 0, as values."""
    if "metric" not in frame.columns:
        return None
    found = frame[(frame["metric"] == "twin_differing") & (frame["config"] == config) & (frame["value"] > 0)]
    if found.empty:
        return None
    order = {q: i for i, q in enumerate(QUANTITIES)}
    row = found.assign(_q=found["quantity"].map(order)).sort_values(["step", "_q", "rank"], kind="stable").iloc[0]
    modules = frame[(frame["metric"] == "twin_module") & (frame["config"] == config)]
    module = str(modules.sort_values(["step", "rank"]).iloc[0]["module"]) if not modules.empty else ""
    max_ulp = row.get("max_ulp") if hasattr(row, "get") else None
    return dict(step=int(row["step"]), rank=int(row["rank"]), quantity=str(row["quantity"]),
                param=str(row["param"]), differing=int(row["value"]),
                max_ulp=float(max_ulp) if max_ulp is not None and max_ulp == max_ulp else float("nan"),
                module=module if row["quantity"] == "forward" else "")

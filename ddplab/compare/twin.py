"""The symmetric twin: the user's own step, every rank given the same data and the same RNG state.

Under the data-parallel promise a rank's computation depends on its data
and its RNG draws, never on its rank. The twin runs the configuration as
written (its step, wrap, hooks) with the global batch replaced by W copies
of rank 0's share and every rank's RNG seeded alike at every step
(:data:`ddplab.compare.runners.VARIANTS`). Then every rank's forward
outputs, its inputs to every collective, its gradients at
``optimizer.step()`` and its parameters after it must be bitwise equal to
rank 0's (for collectives: the inputs of every reduction). A difference of
any size -- one ulp -- is computation that depends on the rank: a bug,
named at the first (step, rank, what, module) where it starts. This needs
no specification of what the step promises, so it holds for Custom steps,
SyncBatchNorm models, FSDP2's backward and unknown hooks. On a device mesh
only the data-parallel axes are symmetric: each rank is compared with its
*partner*, the rank with the same tensor-parallel coordinates (and, for a
reduction of a shard, the same shard).

Records: ``twin_differing`` per step, rank, quantity (``forward``,
``collective``, ``grad``, ``param``) and parameter or collective, value the
number of differing elements (calls, for forward outputs), with ``max_ulp``
where tensors differ and ``partner`` the rank compared with; ``twin_module``
at the first forward difference.
"""
from __future__ import annotations

from ddplab.collectives import REDUCTIONS
from ddplab.compare.captures import StepRecords, common_steps
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


def _reductions(collectives: list) -> list:
    # Only reductions: their inputs are each rank's whole contribution. An all-gather's input is the
    # rank's own shard and a broadcast's the receiving buffer, different by design.
    return [c for c in collectives if c.get("type") == "CollectiveRecord" and c.get("op") in REDUCTIONS]


def _collectives(out: list, labels: dict, step: int, rank: int, caps: list, partner) -> None:
    """The inputs of the rank's recorded reductions, in issue order, against its partner's (by digest)."""
    mine = _reductions(caps[rank].get("collectives", []))
    for index, a in enumerate(mine):
        other = partner(rank, a.get("group_ranks"))
        if other == rank:
            continue
        theirs = _reductions(caps[other].get("collectives", []))
        if index >= len(theirs):
            break
        differing = sum(x != y for x, y in zip(a["input_digests"], theirs[index]["input_digests"]))
        out.append(record("twin_differing", differing, step=step, rank=rank, quantity="collective",
                          param=f"#{index} {a['op']}" + (f" (bucket {a['bucket']})" if a.get("bucket") is not None
                                                          else ""), partner=other, **labels))
    other = partner(rank, None)
    count = len(_reductions(caps[other].get("collectives", [])))
    if other != rank and len(mine) != count:
        out.append(record("twin_differing", abs(len(mine) - count), step=step, rank=rank,
                          quantity="collective", param="(number of collectives)", partner=other, **labels))


def _bucket_inputs(capture: dict) -> dict:
    """Bucket name -> this rank's input to it; every reduction of a step (accumulation that syncs
    each micro-batch reduces a bucket k times) under its own name."""
    return {f"bucket {b['index']}" + (f" reduction {b['round']}" if b.get("round") else ""): b["local"]
            for b in capture.get("buckets", [])}


def _rank_zero(rank: int, group=None) -> int:
    return 0


def twin_records(label: str, ranks: list[list[dict]], partner=None) -> StepRecords:
    """Compare every rank of the twin with its partner (rank 0 unless ``partner`` says), step by step.

    ``ranks[r][step]`` is rank r's capture of the twin (:class:`ddplab.compare.runners.Capture`),
    with its recorded collectives (``collectives``: their input digests, in issue order).
    ``partner(rank, group)`` names the rank whose computation ``rank``'s must equal: for a
    collective's inputs (``group``: its ranks) or, with ``group`` None, for forward outputs,
    gradients and parameters -- on a mesh, tensor-parallel ranks compute different shards by design
    (:meth:`ddplab.compare.meshes.MeshConfiguration.twin_partner`).
    """
    partner = partner or _rank_zero
    for step in common_steps(*ranks):
        out: list[dict] = []
        caps = [r[step] for r in ranks]
        for rank in range(len(ranks)):
            mine, other = caps[rank], partner(rank, None)
            labels = dict(config=label, partner=other)
            if caps[other].get("collectives"):
                _collectives(out, dict(config=label), step, rank, caps, partner)
            if other == rank:
                continue
            first = caps[other]
            _forward(out, labels, step, rank, mine.get("forward", []), first.get("forward", []))
            if not first.get("collectives") and "buckets" in first:  # DDP's bucket inputs, kept around its reduction
                _tensors(out, labels, step, rank, "collective", _bucket_inputs(mine), _bucket_inputs(first))
            _tensors(out, labels, step, rank, "grad", mine["grads"], first["grads"])
            _tensors(out, labels, step, rank, "param", mine["params"], first["params"])
        yield out


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
    partner = row.get("partner") if hasattr(row, "get") else None
    return dict(step=int(row["step"]), rank=int(row["rank"]), quantity=str(row["quantity"]),
                partner=int(partner) if partner is not None and partner == partner else 0,
                param=str(row["param"]), differing=int(row["value"]),
                max_ulp=float(max_ulp) if max_ulp is not None and max_ulp == max_ulp else float("nan"),
                module=module if row["quantity"] == "forward" else "")

"""Every collective the ranks issued, verified bit for bit and held to the precision declared.

Each rank records every collective it issues (:mod:`ddplab.collectives`:
DDP's reducer, comm hooks, FSDP2, SyncBatchNorm, DTensor, the user's own
``dist.*`` calls) and each step's records leave with that step's capture.
Here, a step at a time, every collective's output is compared with the
emulation of every rank's recorded inputs (gloo's ring for all-reduce and
reduce-scatter in the dtype it ran in; exact copies for all-gather and
broadcast) -- a **reduction** phase for any step, hook or model. A
gradient reduction in another dtype than the configuration declares (a
``reduce_dtype`` that is not applied, DDP reducing a float32 model in
bfloat16 without a compression hook) is a bug whatever its size.

Records: :func:`ddplab.collectives.verify`'s rows (``collective_elements_differing``,
``collective_max_ulp``, ``collective_unverified``), labelled with the configuration,
and ``collective_dtype`` (value 1; labels ``op``, ``dtype``, ``declared``) for
each (step, reduction op, dtype) seen.
"""
from __future__ import annotations

import functools

import torch

# The collectives that reduce (the ones a reduce dtype governs): every form the recorder names,
# FSDP2's ``reduce_scatter_single`` included.
from ddplab.collectives.ops import REDUCTIONS
from ddplab.compare.captures import StepRecords, common_steps
from ddplab.compare.configurations import DDP, FSDP2, Configuration, Custom
from ddplab.records import record

__all__ = ["REDUCTIONS", "step_collectives", "known_reductions", "collective_records", "compression",
           "declared_reduce_dtype", "reduction_dtypes"]



def step_collectives(captures: list[dict], known: dict | None = None, initial=None) -> list[list]:
    """Each rank's recorded collectives of one step (its captures), as records, in issue order; those
    ``known`` names by ``(group, sequence)`` without their inputs (:func:`known_reductions`).
    ``initial()``: the model's initial weights (what DDP broadcasts, written as
    :class:`~ddplab.compare.captures.InitialWeights`)."""
    from ddplab.compare.runners import collective_record

    known = known or {}
    return [[collective_record(state, inputs=(state.get("group"), state.get("sequence")) not in known,
                               initial=initial) for state in cap.get("collectives", [])] for cap in captures]


def known_reductions(captures: list[dict], step: int, shared) -> dict:
    """``(group, sequence) -> outputs`` of the step's DDP bucket all-reduces that the bucket audit has
    emulated (``shared``, a :class:`ddplab.compare.replay.Reductions`), for
    :func:`ddplab.collectives.verify`: every rank's input is its bucket's contribution times 1/W
    (:class:`~ddplab.compare.captures.Scaled`), and gloo's ring over those is what the audit computed
    from the contributions with DDP's averaging, bit for bit (``tests/test_compare_recorded.py``)."""
    from ddplab.compare.captures import Scaled

    groups: dict[tuple, dict[int, tuple]] = {}
    for cap in captures:
        for state in cap.get("collectives", []):
            inputs = (state.get("tensors") or {}).get("inputs") or []
            members = state.get("group_ranks") or ()
            if (state.get("type", "CollectiveRecord") != "CollectiveRecord" or state.get("op") != "allreduce"
                    or state.get("reduce_op") != "sum" or state.get("bucket") is None or len(inputs) != 1
                    or not isinstance(inputs[0], Scaled) or inputs[0].factor != 1.0 / max(1, len(members))):
                continue
            shape = tuple(state["output_shapes"][0]) if state.get("output_shapes") else None
            groups.setdefault((state["group"], state["sequence"]), {})[state["group_rank"]] = (inputs[0].base, shape)
    known = {}
    for key, by_rank in groups.items():
        if sorted(by_rank) != list(range(len(captures))):
            continue   # the audit's contributions are every rank's, in rank order
        expected = shared.peek(step, [by_rank[r][0] for r in range(len(captures))])
        if expected is not None:
            known[key] = [[expected.view(by_rank[r][1] or expected.shape)] for r in range(len(captures))]
    return known


def _marked_alike(captures: list[dict]) -> int:
    """Where every collective of the step that holds an :class:`~ddplab.compare.captures.InitialWeights`
    marker holds, on every rank, nothing but markers of one range (DDP's broadcast of the weights as
    the ranks wrote it): the elements of the initial weights those markers span; 0 where none holds
    one, or where one holds anything else (a tensor written whole, a range of its own), which only the
    weights themselves can be compared with. Each rank compared its marked bits with the weights, and
    every process builds the same weights (a digest checked before any step): markers of one range are
    the same bits on every rank, which is what a verification of them has to show."""
    from ddplab.compare.captures import InitialWeights

    ranges: dict[tuple, set] = {}
    ranks: dict[tuple, int] = {}
    for cap in captures:
        for state in cap.get("collectives", []):
            tensors = [t for kept in (state.get("tensors") or {}).values() for t in kept]
            if not any(isinstance(t, InitialWeights) for t in tensors):
                continue
            key = (state.get("group"), state.get("sequence"))
            ranks[key] = ranks.get(key, 0) + 1
            ranges.setdefault(key, set()).update(
                (t.offset, t.numel) if isinstance(t, InitialWeights) else None for t in tensors)
    if not ranges or any(len(spans) != 1 or None in spans or ranks[key] != len(captures)
                         for key, spans in ranges.items()):
        return 0
    return max(offset + numel for spans in ranges.values() for offset, numel in spans)


def _dtype_name(dtype) -> str | None:
    return None if dtype is None else str(dtype).replace("torch.", "")


def compression(config: Configuration) -> str | None:
    """The low precision a configuration's comm hook reduces in, when it compresses (torch's and
    ddplab's compression hooks); None otherwise."""
    from ddplab import comm_hooks

    hook = getattr(config, "comm_hook", None)
    if hook is None:
        return None
    return _dtype_name(comm_hooks.COMPRESSION_DTYPE.get(comm_hooks.gloo_equivalent(hook)[0]))


def declared_reduce_dtype(config: Configuration, model_dtype: torch.dtype) -> str | None:
    """The dtype ``config`` promises its gradient reductions run in; None where it promises none
    (a Custom step, a comm hook of the user's own)."""
    if isinstance(config, Custom) or hasattr(config, "declared_precision"):
        return None  # a mesh declares a dtype per kind of reduction, checked per axis (compare.mesh_evidence)
    if isinstance(config, FSDP2):
        return _dtype_name(config.dtypes()[1] or model_dtype)
    if isinstance(config, DDP) and config.comm_hook is not None:
        return compression(config)  # torch's and ddplab's compression hooks: their precision
    return _dtype_name(model_dtype)


def reduction_dtypes(captures: list[dict]) -> set[str]:
    """The floating dtypes the gradient reductions of these captures ran in."""
    return {state["dtype"] for cap in captures for state in cap.get("collectives", [])
            if state.get("type") == "CollectiveRecord" and state.get("op") in REDUCTIONS
            and state.get("dtype") and getattr(torch, state["dtype"]).is_floating_point}


def collective_records(config: Configuration, ranks: list, model_dtype: torch.dtype, shared=None,
                       initial=None) -> StepRecords:
    """Verify every step's collectives of every rank (``ranks[r][step]``) and check their dtypes; a DDP
    bucket's all-reduce against the bucket audit's emulation of it where ``shared`` holds one
    (:func:`known_reductions`), not emulated again. ``initial()`` builds the model's initial weights
    (:func:`~ddplab.compare.captures.initial_weights`), which the first step's broadcast is written as;
    it is called at most once a step."""
    from ddplab.collectives import verify

    declared = declared_reduce_dtype(config, model_dtype)
    labels = dict(config=config.label)
    axis_of = getattr(config, "axis_of", None)  # a mesh's collectives are named by the axis they span

    def verified(step: int) -> list[dict]:   # a function: the step's records and tensors die with it
        captures = [r[step] for r in ranks]
        known = known_reductions(captures, step, shared) if shared is not None else {}
        size = _marked_alike(captures)
        if size:   # equal markers stand for equal bits: any one tensor shows it, no model is built for it
            weights = functools.cache(lambda: torch.zeros(size, dtype=model_dtype))
        else:
            weights = functools.cache(initial) if initial is not None else None   # built once, for this step only
        recs = step_collectives(captures, known, weights)
        if not any(recs):
            return []
        result = verify(recs, known)
        # Collectives issued before the first step (DDP's broadcast of the weights) belong to step 0.
        out = [dict(row, step=step if row.get("step") is None else row["step"], **labels,
                    **({"axis": axis_of(row.get("group", "?"))} if axis_of else {})) for row in result.records]
        seen = {(state["op"], state["dtype"]) for rank in recs for state in
                ({"op": r.op, "dtype": r.dtype} for r in rank if getattr(r, "op", None) in REDUCTIONS)}
        for op, dtype in sorted(seen, key=str):
            if dtype is None or not getattr(torch, dtype).is_floating_point:
                continue
            out.append(record("collective_dtype", 1, step=step, op=op, dtype=dtype,
                              declared=declared or "", **labels))
        return out

    for step in common_steps(*ranks):
        yield verified(step)

"""Evidence per mesh axis: replicas along each axis, each reduction's dtype, HSDP's partial sums.

For a :class:`~ddplab.compare.meshes.MeshConfiguration` each step's captures
hold every rank's local shards and their placements
(:func:`ddplab.compare.mesh_training.local_state`) and its recorded
collectives, the gradient reductions labelled with their parameters
(:func:`~ddplab.compare.mesh_training.label_gradient_reductions`). Three
questions, each answered bit for bit:

* **replicas per axis** -- whatever an axis replicates (a ``Replicate``
  placement along it, or no DTensor along it: a norm outside the
  tensor-parallel plan, every parameter along HSDP's ``replicate``) must be
  bitwise equal, local shard against local shard, between ranks that differ
  only along that axis: after every step, the parameters and their
  gradients (``mesh_replica_differing``, per step, axis, quantity,
  parameter, rank and ``partner``: the rank at coordinate 0 of that axis);
* **declared precision** -- every reduction on every axis runs in the dtype
  the policy declares for its kind: a gradient's in ``reduce_dtype`` (else
  ``param_dtype``, else the model's), an activation's in the compute dtype
  (``mesh_reduction_dtype``, per step, axis, op, kind, dtype, declared,
  parameter; value the number of records);
* **partial sums** -- HSDP with ``set_requires_all_reduce(False)``
  reduce-scatters every micro-batch and all-reduces along ``replicate`` on
  the last: each all-reduce's input must equal its k reduce-scatter outputs
  added up in the gradients' dtype (the model's), cast to the reduce dtype
  (``partial_sum_differing``, per step, rank and FSDP unit). Held in a lower
  reduce dtype, the partial sums round k-1 more times.

:data:`EVIDENCE` declares the three sources for
:data:`ddplab.compare.evidence.EVIDENCE`; :func:`place` adds to a verdict
on a mesh the coordinate of the rank where the difference starts and the
axis it concerns.
"""
from __future__ import annotations

import math

import torch

from ddplab.collectives import REDUCTIONS
from ddplab.compare.captures import StepRecords, common_steps
from ddplab.compare.meshes import HSDP, MeshConfiguration, MeshLayout
from ddplab.records import record

__all__ = ["mesh_records", "replica_records", "precision_records", "partial_sum_records", "place",
           "REPLICATED"]

#: Placements along an axis under which every rank of the axis holds the same local tensor.
REPLICATED = ("R", "-")


def _reductions(cap: dict) -> list[dict]:
    return [c for c in cap.get("collectives", []) if c.get("type") == "CollectiveRecord"
            and c.get("op") in REDUCTIONS and not c.get("error")]


# --------------------------------------------------------------------------- replicas per axis


def replica_records(config: MeshConfiguration, step: int, caps: list[dict]) -> list[dict]:
    """Local shards of what each axis replicates, each rank against the rank at coordinate 0 of that axis."""
    from ddplab.compare.replay import compare_bits

    layout = config.layout()
    out = []
    if not all("mesh_local" in cap for cap in caps):
        return out
    for axis in layout.names:
        for rank in range(layout.world):
            partner = layout.peers(rank, axis)[0]
            if partner == rank:
                continue
            mine, theirs = caps[rank]["mesh_local"], caps[partner]["mesh_local"]
            for quantity, placements in (("grad", "grad_placements"), ("param", "placements")):
                for name, tensor in mine[quantity + "s"].items():
                    if name not in theirs[quantity + "s"]:
                        continue
                    if (mine[placements][name][axis] not in REPLICATED
                            or theirs[placements][name][axis] not in REPLICATED):
                        continue
                    c = compare_bits(tensor, theirs[quantity + "s"][name])
                    extra = dict(max_ulp=c["max_ulp"]) if c["differing"] else {}
                    out.append(record("mesh_replica_differing", c["differing"], step=step, axis=axis,
                                      quantity=quantity, param=name, rank=rank, partner=partner,
                                      config=config.label, **extra))
    return out


# --------------------------------------------------------------------------- declared precision


def _kind(config: MeshConfiguration, state: dict, axis: str, labelled: bool) -> str:
    """A reduction's kind: ``gradient`` when FSDP2 labelled it so; unlabelled, FSDP2's own reductions
    (reduce-scatters along the sharding axis, all-reduces along HSDP's replicate) are gradients too."""
    if state.get("extra", {}).get("grad_of"):
        return "gradient"
    if not labelled and config.sharding_axis is not None:
        if (axis == config.sharding_axis and state["op"].startswith("reduce_scatter")) or (
                isinstance(config, HSDP) and axis == "replicate" and state["op"] == "allreduce"):
            return "gradient"
    return "activation"


def precision_records(config: MeshConfiguration, step: int, caps: list[dict], model_dtype: torch.dtype) -> list[dict]:
    """Each (axis, op, kind, dtype, parameters) of the step's reductions, with the dtype declared for it."""
    declared = config.declared_precision(model_dtype)
    labelled = any(state.get("extra", {}).get("grad_of") for cap in caps for state in _reductions(cap))
    seen: dict[tuple, list] = {}
    for rank, cap in enumerate(caps):
        for state in _reductions(cap):
            if not state.get("dtype") or not getattr(torch, state["dtype"]).is_floating_point:
                continue
            axis = config.axis_of(state.get("group_ranks") or "?")
            kind = _kind(config, state, axis, labelled)
            params = state.get("extra", {}).get("grad_of", "")
            key = (axis, state["op"], kind, state["dtype"], params, state.get("extra", {}).get("unit", ""))
            seen.setdefault(key, []).append(rank)
    out = []
    for (axis, op, kind, dtype, params, unit), ranks in seen.items():  # in rank 0's issue order
        out.append(record("mesh_reduction_dtype", len(ranks), step=step, axis=axis, op=op, kind=kind, dtype=dtype,
                          declared=declared[kind], param=params.split(",")[0], params=params, unit=unit,
                          rank=min(ranks), attributed=labelled, config=config.label))
    return out


# --------------------------------------------------------------------------- HSDP's partial sums


def _by_unit(states: list[dict], config: MeshConfiguration, axis: str, prefix: str) -> dict[str, list]:
    out: dict[str, list] = {}
    for state in states:
        if state["op"].startswith(prefix) and config.axis_of(state.get("group_ranks") or "?") == axis:
            out.setdefault(state.get("extra", {}).get("unit", ""), []).append(state)
    return out


def partial_sum_records(config: MeshConfiguration, step: int, caps: list[dict], model_dtype: torch.dtype) -> list[dict]:
    """Every replicate all-reduce's input against its k reduce-scatter outputs summed in ``model_dtype``."""
    from ddplab.compare.replay import compare_bits

    if not isinstance(config, HSDP) or config.k < 2 or config.no_sync != "all_reduce":
        return []
    out = []
    for rank, cap in enumerate(caps):
        states = _reductions(cap)
        scatters = _by_unit(states, config, "shard", "reduce_scatter")
        for unit, reduces in _by_unit(states, config, "replicate", "allreduce").items():
            labels = dict(step=step, rank=rank, axis="replicate", op="allreduce", unit=unit, config=config.label,
                          params=reduces[0].get("extra", {}).get("grad_of", ""))
            pieces = scatters.get(unit, [])
            if not unit or len(pieces) != config.k or len(reduces) != 1:
                out.append(record("partial_sum_unverified", 1, reason=(
                    f"{len(pieces)} reduce-scatter(s) and {len(reduces)} all-reduce(s) of unit {unit or '?'} "
                    f"for {config.k} micro-batches"), **labels))
                continue
            total = pieces[0]["tensors"]["outputs"][0].to(model_dtype)
            for piece in pieces[1:]:
                total = piece["tensors"]["outputs"][0].to(model_dtype) + total
            live = reduces[0]["tensors"]["inputs"][0]
            c = compare_bits(live, total.to(live.dtype))
            out.append(record("partial_sum_differing", c["differing"], dtype=reduces[0]["dtype"],
                              accumulated_in=str(model_dtype).replace("torch.", ""),
                              **labels, **(dict(max_ulp=c["max_ulp"]) if c["differing"] else {})))
    return out


def mesh_records(config, ranks: list, model_dtype: torch.dtype) -> StepRecords:
    """Every step's evidence per axis of a mesh configuration (``ranks[r][step]``); nothing for any other."""
    if not isinstance(config, MeshConfiguration):
        return
    for step in common_steps(*ranks):
        caps = [r[step] for r in ranks]
        yield (replica_records(config, step, caps) + precision_records(config, step, caps, model_dtype)
               + partial_sum_records(config, step, caps, model_dtype))


# --------------------------------------------------------------------------- the evidence sources


def _layout(ctx) -> MeshLayout | None:
    mesh = ctx.fact("mesh")
    return MeshLayout.parse(mesh) if mesh else None


def _first(found, order: list[str]):
    bad = found[found["value"] > 0]
    return None if bad.empty else bad.sort_values(order, kind="stable").iloc[0]


def read_replicas(ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    found = _ev.rows(ctx.frame, "mesh_replica_differing", ctx.config)
    if found.empty:
        return None
    layout = _layout(ctx)
    first = _first(found.assign(_q=(found["quantity"] == "param").astype(int)), ["step", "_q", "rank"])
    values = dict(compared=int(len(found)), axes=sorted({str(a) for a in found["axis"]}), replica_step=-1,
                  replica_axis="", replica_param="", replica_quantity="", replica_rank=-1, replica_partner=-1,
                  replica_differing=0, replica_max_ulp=math.nan, replica_where="", partner_where="")
    if first is not None:
        values.update(replica_step=int(first["step"]), replica_axis=str(first["axis"]),
                      replica_param=str(first["param"]), replica_quantity=str(first["quantity"]),
                      replica_rank=int(first["rank"]), replica_partner=int(first["partner"]),
                      replica_differing=int(first["value"]),
                      replica_max_ulp=float(_ev.label(first, "max_ulp", math.nan)),
                      replica_where=layout.where(int(first["rank"])), partner_where=layout.where(int(first["partner"])))
    return _ev.Finding(key="mesh_replicas",
                       claim="Whatever a mesh axis replicates is bitwise equal along it after every step, "
                             "local shard against local shard",
                       holds=first is None,
                       template="{compared} local shards compared along the axes {axes}", values=values)


def proves_replicas(finding, ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    if finding.holds is not False:
        return None
    rv = finding.values
    return _ev.Decision("bug", "mesh_replicas", finding="axis_desync", first_divergence=rv["replica_step"],
                        values=dict(rv, axis=rv["replica_axis"], first_rank=rv["replica_rank"],
                                    first_param=rv["replica_param"]),
                        summary=("bug: the replicas along axis {replica_axis} drift apart: at step {replica_step} "
                                 "rank {replica_rank} ({replica_where}) holds a {replica_quantity} of "
                                 "{replica_param} other than rank {replica_partner}'s ({partner_where}) in "
                                 "{replica_differing} element(s), up to {replica_max_ulp} ulp, though the axis "
                                 "replicates it: nothing keeps it synchronized along {replica_axis}"))


def read_precision(ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    found = _ev.rows(ctx.frame, "mesh_reduction_dtype", ctx.config)
    if found.empty:
        return None
    wrong = found[found["dtype"] != found["declared"]]
    # Unlabelled, a tensor-parallel gradient's reduction reads as an activation's: that matters only
    # where the two kinds are declared different dtypes.
    attributed = bool(found["attributed"].astype(bool).all()) or found["declared"].nunique() == 1
    seen = sorted({f"{r['axis']} {r['op']} {r['kind']} {r['dtype']}" for _, r in found.iterrows()})
    values = dict(reductions=seen, attributed="yes" if attributed else "no", precision_step=-1, precision_axis="",
                  precision_op="", precision_kind="", precision_dtype="", precision_declared="",
                  precision_param="", precision_unit="", precision_rank=-1)
    if not wrong.empty:
        w = wrong.assign(_k=(wrong["kind"] != "gradient").astype(int)).sort_values(["step", "_k", "axis"],
                                                                                    kind="stable").iloc[0]
        values.update(precision_step=int(w["step"]), precision_axis=str(w["axis"]), precision_op=str(w["op"]),
                      precision_kind=str(w["kind"]), precision_dtype=str(w["dtype"]),
                      precision_declared=str(w["declared"]), precision_param=str(w["param"]),
                      precision_unit=str(w["unit"]), precision_rank=int(w["rank"]))
    return _ev.Finding(key="mesh_precision",
                       claim="Every reduction on every mesh axis runs in the dtype the policy declares for it: a "
                             "gradient's in the reduce dtype, an activation's in the compute dtype",
                       holds=False if not wrong.empty else (True if attributed else None),
                       template=("reductions seen (axis, op, kind, dtype): {reductions}; every gradient reduction "
                                 "told apart from an activation's where it matters: {attributed}"),
                       values=values)


def proves_precision(finding, ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    if finding.holds is not False:
        return None
    pv = finding.values
    what = ("of the gradient of {precision_param} (in FSDP unit {precision_unit})"
            if pv["precision_kind"] == "gradient" else "of an activation or its gradient")
    return _ev.Decision("bug", "mesh_precision", finding="precision", first_divergence=pv["precision_step"],
                        values=dict(pv, axis=pv["precision_axis"], first_rank=pv["precision_rank"],
                                    first_param=pv["precision_param"] or pv["precision_op"]),
                        summary=("bug: at step {precision_step} the {precision_op} along axis {precision_axis} "
                                 + what + " runs in {precision_dtype}, where the policy declares "
                                 "{precision_declared} for it: the reduce dtype is not applied on that axis, "
                                 "whatever the size of the difference"))


def read_partial_sums(ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    found = _ev.rows(ctx.frame, "partial_sum_differing", ctx.config)
    unverified = _ev.rows(ctx.frame, "partial_sum_unverified", ctx.config)
    if found.empty and unverified.empty:
        return None
    layout = _layout(ctx)
    first = _first(found, ["step", "rank"]) if not found.empty else None
    values = dict(compared=int(len(found)), unverified=sorted({str(r) for r in unverified.get("reason", [])}) or
                  ["none"], partial_step=-1, partial_rank=-1, partial_where="", partial_unit="", partial_params="",
                  partial_dtype="", partial_accumulated_in="", partial_differing=0, partial_max_ulp=math.nan)
    if first is not None:
        values.update(partial_step=int(first["step"]), partial_rank=int(first["rank"]),
                      partial_where=layout.where(int(first["rank"])), partial_unit=str(first["unit"]),
                      partial_params=str(first["params"]), partial_dtype=str(first["dtype"]),
                      partial_accumulated_in=str(first["accumulated_in"]), partial_differing=int(first["value"]),
                      partial_max_ulp=float(_ev.label(first, "max_ulp", math.nan)))
    return _ev.Finding(key="partial_sums",
                       claim="Each replicate all-reduce starts from its micro-batches' reduce-scatter outputs "
                             "added up in the gradients' dtype",
                       holds=(first is None) if not found.empty else None,
                       template="{compared} all-reduce inputs compared; not verified: {unverified}", values=values)


def proves_partial_sums(finding, ctx):
    from ddplab.compare import evidence as _ev  # it imports this module's SOURCES

    if finding.holds is not False:
        return None
    pv = finding.values
    return _ev.Decision("bug", "partial_sums", finding="partial_sums", first_divergence=pv["partial_step"],
                        values=dict(pv, axis="replicate", first_rank=pv["partial_rank"],
                                    first_param=pv["partial_params"].split(",")[0]),
                        summary=("bug: at step {partial_step} rank {partial_rank} ({partial_where}) all-reduces "
                                 "along axis replicate the gradients of unit {partial_unit} ({partial_params}) "
                                 "from partial sums held in {partial_dtype}: its input differs in "
                                 "{partial_differing} element(s), up to {partial_max_ulp} ulp, from its "
                                 "micro-batches' reduce-scatter outputs added up in {partial_accumulated_in}, the "
                                 "gradients' dtype"))


def place(values: dict, ctx) -> dict:
    """For a bug on a mesh: the coordinate of the rank where it starts (``first_coordinate``) and, where the
    deciding source named none, the axis (``axis``): the one a replica or twin differs along, a collective's,
    or the data axes for a computation that is not one process's; ``place_text`` says it for the headline."""
    layout = _layout(ctx)
    if layout is None:
        return {}
    rank = values.get("first_rank", -1)
    out = dict(place_text="")
    if isinstance(rank, int) and 0 <= rank < layout.world:
        out["first_coordinate"] = layout.where(rank)
    if values.get("axis"):
        return out
    evidence = values.get("evidence")
    if evidence == "collectives" and values.get("collective_group"):
        axis = layout.axis_of(values["collective_group"])
    elif evidence in ("twin", "replicas") and isinstance(rank, int) and 0 <= rank < layout.world:
        partner = values.get("twin_partner", 0) if evidence == "twin" else 0
        mine, theirs = layout.coordinate(rank), layout.coordinate(int(partner))
        axis = "+".join(n for n in layout.names if mine[n] != theirs[n])
    else:
        axis = str(ctx.fact("data_axes", "") or "").replace(",", "+")
    out["axis"] = axis
    where = f", first at rank {rank} ({out['first_coordinate']})" if "first_coordinate" in out else ""
    out["place_text"] = f"; on the mesh: axis {axis or '(none)'}{where}"
    return out


#: ``(name, reader, prover, verdict rows)`` of the three sources, for :data:`ddplab.compare.evidence.EVIDENCE`.
SOURCES = (
    ("mesh_replicas", read_replicas, proves_replicas, (
        ("bug", "on a device mesh, whatever an axis replicates (a `Replicate` placement, a norm outside the "
                "tensor-parallel plan, every parameter along HSDP's `replicate`) differs between two ranks of "
                "that axis in any bit, local shard against local shard, after a step: the axis, the parameter "
                "and both ranks' mesh coordinates"),)),
    ("mesh_precision", read_precision, proves_precision, (
        ("bug", "on a device mesh, a reduction runs in another dtype than the policy declares for it -- a "
                "gradient's in `reduce_dtype`, an activation's in the compute dtype -- whatever the size of the "
                "difference: the axis, the op and the parameter (a `reduce_dtype` that the tensor-parallel "
                "all-reduce does not apply)"),)),
    ("partial_sums", read_partial_sums, proves_partial_sums, (
        ("bug", "HSDP with `set_requires_all_reduce(False)`: an all-reduce along `replicate` whose input is not "
                "its micro-batches' reduce-scatter outputs added up in the gradients' dtype, bit for bit "
                "(partial sums held in a lower reduce dtype): the step, the rank's coordinate and the unit"),)),
)

"""Case 02, inside a rank: the report's model, its fingerprints per stage, and the norm's numerics.

Every rank builds the report's ``nn.Linear(in, out, bias=False, dtype)``
after ``torch.manual_seed``, fingerprints its parameters (sha256 of the
bytes) before wrapping, after the report's ``torch.compile`` step and after
DDP's constructor, and compares them with its own initial weights and with
rank 0's. Rank 0 also measures how the norm of its initial weights comes
out of each way of accumulating it (:func:`weight_numerics`).
"""
from __future__ import annotations

import math

import torch

__all__ = ["STAGES", "TRACE_POINTS", "build_linear", "compile_step", "weight_numerics", "worker"]

#: The moments at which every rank looks at its weights, in order.
STAGES = ("before", "compile", "ddp")

#: Points of the running-sum trace (log-spaced over the elements, plus the last one).
TRACE_POINTS = 160


def build_linear(params: dict, dtype: str, rank: int) -> torch.nn.Linear:
    """The report's model: ``nn.Linear(in, out, bias=False, dtype=dtype)`` after a seed.

    The seed is ``params["seed"]`` on every rank with ``same_init``; otherwise
    rank ``r`` uses ``seed + r`` (what happens when users forget to seed).
    """
    seed = params["seed"] + (0 if params["same_init"] else rank)
    torch.manual_seed(seed)
    return torch.nn.Linear(params["in_features"], params["out_features"], bias=False,
                           dtype=getattr(torch, dtype))


def compile_step(model: torch.nn.Module) -> tuple[torch.nn.Module, dict]:
    """The report's ``torch.compile(model)``, guarded: ``(module to wrap, facts)``.

    ``torch.compile`` is lazy: it returns an ``OptimizedModule`` that holds
    the *same* module and compiles only at the first forward call, which the
    report never makes. ``facts`` says whether it succeeded (``ok``; on
    failure ``error`` and the original model are returned, so the run goes
    on), how many Python frames dynamo processed (``frames``: 0 means nothing
    was compiled) and whether the parameters are the same objects.
    """
    try:
        from torch._dynamo.utils import counters

        frames_before = counters["frames"]["total"]
        compiled = torch.compile(model)
        frames = counters["frames"]["total"] - frames_before
        same = _same_parameters(compiled, model)
    except Exception as exc:  # noqa: BLE001 - a compile failure is a finding, not a crash
        return model, {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300],
                       "frames": 0, "same_objects": True}
    return compiled, {"ok": True, "error": None, "frames": frames, "same_objects": same}


def _same_parameters(wrapper: torch.nn.Module, model: torch.nn.Module) -> bool:
    """Whether ``wrapper`` exposes exactly ``model``'s Parameter objects, in order."""
    mine = list(model.parameters())
    theirs = list(wrapper.parameters())
    return len(mine) == len(theirs) and all(a is b for a, b in zip(mine, theirs))


def _torch_norms(model: torch.nn.Module, stage: str, device: str = "cpu") -> None:
    """Emit what the report printed, ``torch.norm(w)``, and ``torch.linalg.vector_norm(w)``."""
    from ddplab.records import emit

    for name, p in model.named_parameters():
        w = p.detach().to(device)
        for method, fn in (("torch.norm", torch.norm), ("torch.linalg.vector_norm",
                                                        torch.linalg.vector_norm)):
            emit("norm", float(fn(w)), param=name, stage=stage, method=method, device=device,
                 torch_version=torch.__version__)


def _emit_fingerprints(model, stage: str, own_before: dict, rank0_before: dict) -> None:
    """Per tensor: changed against this rank's initial print, and equal to rank 0's initial."""
    from ddplab.probes import diff_fingerprints, fingerprint
    from ddplab.records import emit

    now = fingerprint(model)
    changed = {rec["param"] for rec in diff_fingerprints(own_before, now)}
    differs_from_rank0 = {rec["param"] for rec in diff_fingerprints(rank0_before, now)}
    for name, tensor_print in now.items():
        emit("fingerprint_changed", int(name in changed), param=name, kind=tensor_print.kind,
             stage=stage, sha256=tensor_print.sha256[:16])
        emit("matches_rank0_initial", int(name not in differs_from_rank0), param=name,
             kind=tensor_print.kind, stage=stage)


def _trace_steps(n: int, must: tuple[int, ...] = ()) -> list[int]:
    """Log-spaced element counts 1..n (plus ``must``): the running sum's plotted points."""
    import numpy as np

    steps = set(np.unique(np.round(np.geomspace(1, n, TRACE_POINTS)).astype(int)).tolist())
    steps.update(s for s in must if 1 <= s <= n)
    steps.add(n)
    return sorted(steps)


def weight_numerics(weight: torch.Tensor, lanes: list[int]) -> None:
    """Emit the norms of ``weight`` the kernels and the models compute, and the running sums.

    * ``norm`` with ``method`` ``"exact"`` (sqrt of the correctly rounded
      float64 sum of the squares, which are exact in float64 for 16- and 32-bit
      weights), ``"float64 accumulation"`` and ``"float32 accumulation"``
      (torch's norm of the upcast weights), and ``"lanes"`` (the K-lane model
      in the weights' dtype, :func:`ddplab.numerics.accumulators.lane_norm`,
      one record per K with labels ``lanes`` and ``accumulator``);
    * ``lane_sum_of_squares``: every lane's final sum for each K (label ``lane``);
    * ``running_sum_of_squares`` of one accumulator in the weights' dtype and
      in float32 (``step`` = elements accumulated, log-spaced points) and
      ``stall_element``: the element after which the dtype's sum never moves
      (16-bit weights only).
    """
    from ddplab.numerics.accumulators import lane_norm, lane_partials, running_sum_of_squares
    from ddplab.numerics.exact import exact_sum
    from ddplab.records import emit

    dtype = weight.dtype
    name = str(dtype).replace("torch.", "")
    flat = weight.detach().reshape(-1)
    if dtype != torch.float64:
        squares = flat.double().square().reshape(-1, 1)  # exact: 2p <= 53 for p <= 24
        emit("norm", math.sqrt(float(exact_sum(squares)[0])), method="exact", stage="before",
             accumulator="exact")
    emit("norm", float(flat.double().norm()), method="float64 accumulation", stage="before",
         accumulator="float64", device="cpu", torch_version=torch.__version__)
    if weight.element_size() <= 4:  # float32 holds 16- and 32-bit weights exactly
        emit("norm", float(flat.float().norm()), method="float32 accumulation", stage="before",
             accumulator="float32", device="cpu", torch_version=torch.__version__)
    for k in lanes:
        emit("norm", float(lane_norm(flat, dtype, lanes=k)), method="lanes", lanes=k,
             accumulator=name, stage="before")
        for lane, value in enumerate(lane_partials(flat, dtype, lanes=k, square=True).tolist()):
            emit("lane_sum_of_squares", value, lanes=k, lane=lane, accumulator=name)

    if dtype not in (torch.float16, torch.bfloat16):
        return  # the stall is a 16-bit story; float32 sums of these squares do not stall
    own = running_sum_of_squares(flat, dtype, lanes=1)[:, 0].double()
    wide = running_sum_of_squares(flat, torch.float32, lanes=1)[:, 0].double()
    moved = torch.nonzero(own[1:] != own[:-1]).reshape(-1)
    # Element count (1-based) at which the sum reached its final value.
    stall = int(moved[-1]) + 2 if len(moved) else 1
    emit("stall_element", stall, accumulator=name, lanes=1)
    for step in _trace_steps(flat.numel(), (stall - 1, stall)):
        for acc, trace in ((name, own), ("float32", wide)):
            emit("running_sum_of_squares", float(trace[step - 1]), step=step, accumulator=acc,
                 lanes=1)


def _one_model(params: dict, dtype: str, rank: int) -> None:
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    from ddplab.probes import fingerprint
    from ddplab.records import emit

    model = build_linear(params, dtype, rank)
    own_before = fingerprint(model)
    # Rank 0's initial print travels to every rank before DDP exists, so that
    # "replaced by rank 0's weights" is measured, not inferred.
    box = [own_before if rank == 0 else None]
    dist.broadcast_object_list(box, src=0)
    rank0_before = box[0]

    _emit_fingerprints(model, "before", own_before, rank0_before)
    _torch_norms(model, "before")
    if rank == 0:
        weight_numerics(model.weight.detach(), params["lanes"])
        if torch.cuda.is_available():
            # The report's "after" norm ran on cuda:rank; measure that kernel on the same bits.
            try:
                _torch_norms(model, "before", device="cuda")
            except Exception as exc:  # noqa: BLE001 - the GPU norm is an extra, never fatal
                emit("cuda_norm_ok", 0, error=f"{type(exc).__name__}: {exc}"[:300])

    wrapped, facts = compile_step(model)
    emit("compile_ok", int(facts["ok"]), stage="compile", error=facts["error"])
    emit("compiled_frames", facts["frames"], stage="compile")
    emit("same_parameter_objects", int(facts["same_objects"]), stage="compile")
    _emit_fingerprints(model, "compile", own_before, rank0_before)
    _torch_norms(model, "compile")

    # As the report does: wrap what torch.compile returned. On CPU there is no
    # .to(rank) and no device_ids; the constructor broadcasts rank 0's state.
    ddp = DistributedDataParallel(wrapped)
    emit("same_parameter_objects", int(_same_parameters(ddp, model)), stage="ddp")
    _emit_fingerprints(model, "ddp", own_before, rank0_before)
    _torch_norms(model, "ddp")
    del ddp


def worker(params: dict) -> None:
    """What every rank runs: per dtype, fingerprints and norms at each stage.

    Rank 0 also measures the numerics of its initial weights (the report's
    weights): reference norms, the K-lane accumulator model, the running sums.
    Everything is reported through :func:`ddplab.emit`.
    """
    import torch.distributed as dist

    from ddplab.records import labels

    rank = dist.get_rank()
    for dtype in params["dtypes"]:
        with labels(dtype=dtype):
            _one_model(params, dtype, rank)

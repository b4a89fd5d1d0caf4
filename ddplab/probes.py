"""Probes that run inside a rank: what the weights are, whether the gradients
agree across ranks, and whether DDP's reducer still sees the parameters.

* :func:`fingerprint` hashes every parameter and buffer bit for bit (name,
  dtype, shape, device, sha256 of the bytes); :func:`diff_fingerprints` lists
  what changed between two fingerprints. "DDP changed my weights" (seed 001)
  is settled by an empty diff.
* :func:`grads_in_sync` compares every parameter's gradient across ranks:
  bitwise equal or not, and the largest absolute difference.
* :class:`ReducerGuard` detects a *detached reducer* (seed 003) and
  :func:`move_ddp_model` moves a wrapped model the way that keeps it reducing.

The detached reducer (read in ``torch/csrc/distributed/c10d/reducer.cpp`` and
``torch/csrc/autograd/variable.cpp``; measured on torch 2.13 CPU/gloo):

1. When DDP is constructed, its C++ ``Reducer`` calls
   ``autograd::impl::grad_accumulator(param)`` for every parameter. That
   creates the parameter's ``AccumulateGrad`` node (the autograd node that
   writes ``param.grad``), which the parameter caches only as a *weak*
   pointer in its autograd metadata. The reducer adds a post-hook to that node
   (``autograd_hook(index)``, which copies the gradient into its bucket and
   launches the bucket's allreduce when the bucket is full) and keeps the node
   alive with a shared pointer.
2. ``module.double()``, ``.float()``, ``.cpu()``, ``.cuda()`` and ``.to()``
   run ``Module._apply``, which by default keeps each ``Parameter`` object and
   assigns ``param.data = converted``. ``VariableHooks::set_data`` then
   *resets* the cached accumulator whenever the new data's type (dtype or
   device type) or device differs from the old accumulator's input metadata.
3. The next forward reaches the parameter through ``gradient_edge(param)``,
   which finds the cache empty and creates a fresh ``AccumulateGrad`` with no
   reducer hook. Backward accumulates each rank's *local* gradient into
   ``param.grad``; the reducer's hooks sit on the old nodes, which no graph
   reaches any more, so ``mark_variable_ready`` never runs, no bucket is
   reduced, and ``require_finalize_`` stays false, so not even the
   "Expected to have finished reduction" check fires. Training continues on
   W diverging replicas without an error or a warning. A round trip
   (``.double()`` then ``.float()``) restores the dtype but not the hooks;
   a one-way move is just as silent (with no hook, the reducer's bucket dtype
   check never runs). ``find_unused_parameters=True`` does not help either:
   the old nodes are "unused" but are only marked ready when some hook fires.
   A same-dtype, same-device ``.data`` assignment keeps the accumulator.

Detection compares node identities: :class:`ReducerGuard` records each
parameter's ``AccumulateGrad`` node when it is created (right after wrapping,
when they are the reducer's) and checks before every forward that the
parameter still leads to the same node; a moved parameter leads to a new one.
A guard created after the move cannot know the old nodes, so it also checks,
after the first ``sync_checks`` backwards, that the gradients agree bitwise
across ranks (one all_gather of the gradients): either way the detachment is
reported at the latest at the first backward that fails to reduce. The fix
is to wrap again: a new ``DistributedDataParallel`` builds a new reducer that
hooks the current nodes (:func:`rewrap`, :func:`move_ddp_model`).
"""
from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Iterable

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

from ddplab import records as _records

__all__ = [
    "TensorPrint",
    "fingerprint",
    "diff_fingerprints",
    "GradSync",
    "grads_in_sync",
    "all_gather_flat",
    "DetachedReducerError",
    "ReducerGuard",
    "guard_reducer",
    "rewrap",
    "move_ddp_model",
]

#: What a detected detachment tells the user to do.
FIX_HINT = (
    "Fix: wrap the module again after moving it, e.g. "
    "`ddp_model = ddplab.probes.move_ddp_model(ddp_model, device=..., dtype=...)` "
    "or `DistributedDataParallel(ddp_model.module, ...)`; better, move the bare module "
    "before wrapping it."
)

CAUSE_HINT = (
    "Cause: the parameters' data changed dtype or device after the model was wrapped "
    "(.double()/.float()/.half(), .cpu()/.cuda(), .to(...)). torch then gives each moved "
    "parameter a new gradient accumulator, while DDP's reducer keeps its hooks on the old "
    "ones, so their gradients are no longer reduced, silently."
)


def _unwrap(model: torch.nn.Module) -> torch.nn.Module:
    return model.module if isinstance(model, DistributedDataParallel) else model


# --------------------------------------------------------------------------- fingerprints


@dataclasses.dataclass(frozen=True)
class TensorPrint:
    """One tensor's bitwise identity: equal prints mean equal bits (up to sha256)."""

    kind: str  # "parameter" or "buffer"
    dtype: str
    shape: tuple[int, ...]
    device: str
    sha256: str


def _tensor_sha256(t: torch.Tensor) -> str:
    data = t.detach()
    if data.device.type != "cpu":
        data = data.cpu()
    data = data.contiguous()
    # Hash the raw bytes (a uint8 view works for every dtype, bf16 included).
    raw = data.reshape(-1).view(torch.uint8) if data.numel() else data.new_empty(0, dtype=torch.uint8)
    return hashlib.sha256(raw.numpy()).hexdigest()   # the buffer itself: no copy of it


def fingerprint(model: torch.nn.Module) -> dict[str, TensorPrint]:
    """Hash every parameter and buffer of ``model`` bit for bit.

    Returns ``{name: TensorPrint}`` in ``named_parameters`` then
    ``named_buffers`` order. A DDP wrapper is looked through (names are
    the wrapped module's), so a model's print before and after wrapping
    compare directly.

    Example::

        >>> before = fingerprint(model)
        >>> ddp = DistributedDataParallel(model)
        >>> diff_fingerprints(before, fingerprint(ddp))   # rank 0: nothing changed
        []
    """
    module = _unwrap(model)
    prints: dict[str, TensorPrint] = {}
    for kind, named in (("parameter", module.named_parameters()), ("buffer", module.named_buffers())):
        for name, tensor in named:
            prints[name] = TensorPrint(kind=kind, dtype=str(tensor.dtype).replace("torch.", ""),
                                       shape=tuple(tensor.shape), device=str(tensor.device),
                                       sha256=_tensor_sha256(tensor))
    return prints


def diff_fingerprints(before: dict[str, TensorPrint], after: dict[str, TensorPrint],
                      **labels: Any) -> list[dict]:
    """List what changed from ``before`` to ``after``, as records.

    One record per changed tensor: metric ``"tensor_changed"``, value 1, and
    labels ``param`` (the name), ``kind``, ``change`` (``added``, ``removed``,
    ``dtype``, ``shape``, ``device`` or ``bytes``; metadata changes win over
    ``bytes``), ``before`` and ``after`` (what the change was). An empty list
    means every bit is the same.
    """
    changes: list[dict] = []
    for name in list(before) + [n for n in after if n not in before]:
        a, b = before.get(name), after.get(name)
        if a is None or b is None:
            change = "added" if a is None else "removed"
            desc_a = "" if a is None else f"{a.dtype}{list(a.shape)}"
            desc_b = "" if b is None else f"{b.dtype}{list(b.shape)}"
        elif a == b:
            continue
        else:
            for change, desc_a, desc_b in (("dtype", a.dtype, b.dtype),
                                           ("shape", str(list(a.shape)), str(list(b.shape))),
                                           ("device", a.device, b.device),
                                           ("bytes", a.sha256[:12], b.sha256[:12])):
                if desc_a != desc_b:
                    break
        kind = (a or b).kind
        changes.append(_records.record("tensor_changed", 1, param=name, kind=kind, change=change,
                                       before=desc_a, after=desc_b, **labels))
    return changes


# --------------------------------------------------------------------------- gradient sync


@dataclasses.dataclass
class GradSync:
    """Result of :func:`grads_in_sync`: the same on every rank.

    ``mismatched`` names the parameters whose gradient differs on some rank
    from rank 0's; ``max_abs_diff`` gives, per parameter, the largest
    ``|g_r - g_0|`` over ranks and elements (``inf`` where a gradient is
    missing on some ranks only); ``records`` are this rank's records.
    """

    mismatched: list[str]
    max_abs_diff: dict[str, float]
    records: list[dict]

    @property
    def in_sync(self) -> bool:
        return not self.mismatched

    def frame(self):
        return _records.to_frame(self.records)


_INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    # Compare bit patterns, not values: NaN == NaN and -0.0 != 0.0 here.
    return t.view(_INT_VIEW[t.element_size()])


def _trainable(model: torch.nn.Module) -> list[tuple[str, torch.nn.Parameter]]:
    seen: set[int] = set()
    out = []
    for name, p in _unwrap(model).named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((name, p))
    return out


def grads_in_sync(model: torch.nn.Module, *, group: dist.ProcessGroup | None = None,
                  step: int | None = None, emit: bool = True, **labels: Any) -> GradSync:
    """Compare every parameter's gradient across the ranks of ``group``.

    A collective: every rank of the group must call it. Gradients are
    all_gathered (one all_gather per dtype, plus one for which gradients
    exist) and compared with rank 0's bit for bit. Each rank emits, per
    parameter, ``grad_bitwise_equal`` (1 or 0: its gradient against rank 0's)
    and ``grad_max_abs_diff`` (``max |g_rank - g_0|``), labelled ``param`` and
    ``dtype``; the returned :class:`GradSync` holds the verdict over all ranks.
    """
    world = dist.get_world_size(group)
    my_rank = dist.get_rank(group)
    named = _trainable(model)
    if not named:
        raise ValueError("grads_in_sync: the model has no parameter that requires a gradient")
    device = named[0][1].device

    present = torch.tensor([p.grad is not None for _, p in named], dtype=torch.int32, device=device)
    all_present = all_gather_flat(present, group=group).cpu()

    # One flat buffer per dtype keeps the number of collectives small.
    by_dtype: dict[torch.dtype, list[int]] = {}
    for i, (_, p) in enumerate(named):
        by_dtype.setdefault(p.dtype, []).append(i)
    gathered: dict[int, torch.Tensor] = {}
    for dtype, idx in by_dtype.items():
        flat = torch.cat([(named[i][1].grad if named[i][1].grad is not None
                           else torch.zeros_like(named[i][1])).detach().reshape(-1) for i in idx])
        out = all_gather_flat(flat, group=group)
        offset = 0
        for i in idx:
            n = named[i][1].numel()
            gathered[i] = out[:, offset:offset + n]
            offset += n

    mismatched: list[str] = []
    max_diff: dict[str, float] = {}
    recs: list[dict] = []
    for i, (name, p) in enumerate(named):
        g = gathered[i]
        has = all_present[:, i].bool()
        if not has.any():  # unused everywhere: nothing to compare
            equal = torch.ones(world, dtype=torch.bool)
            diff = torch.zeros(world, dtype=torch.float64)
        else:
            equal = (_bits(g) == _bits(g[0:1])).all(dim=1).cpu() & (has == has[0])
            diff = (g.double() - g[0:1].double()).abs().amax(dim=1).cpu()
            diff = torch.where(has == has[0], diff, torch.full_like(diff, math.inf))
        if not bool(equal.all()):
            mismatched.append(name)
        max_diff[name] = float(diff.max())
        common = dict(step=step, rank=dist.get_rank(), param=name,
                      dtype=str(p.dtype).replace("torch.", ""), **labels)
        recs.append(_records.record("grad_bitwise_equal", int(equal[my_rank]), **common))
        recs.append(_records.record("grad_max_abs_diff", float(diff[my_rank]), **common))
    if emit:
        for rec in recs:
            _emit_record(rec)
    return GradSync(mismatched=mismatched, max_abs_diff=max_diff, records=recs)


def all_gather_flat(tensor: torch.Tensor, *, group: dist.ProcessGroup | None = None,
                    async_op: bool = False):
    """All-gather a 1-d ``tensor`` into a ``[W, N]`` tensor (one collective).

    With ``async_op=True`` returns ``(out, work)``; ``out`` is valid once
    ``work`` completes.
    """
    world = dist.get_world_size(group)
    flat = torch.empty(world * tensor.numel(), dtype=tensor.dtype, device=tensor.device)
    # all_gather_single is the 2.13 name of all_gather_into_tensor.
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    work = gather(flat, tensor.contiguous(), group=group, async_op=async_op)
    out = flat.view(world, tensor.numel())
    return (out, work) if async_op else out


def _emit_record(rec: dict) -> None:
    fields = {k: v for k, v in rec.items() if k not in ("metric", "value", "step", "rank", "bucket")}
    _records.emit(rec["metric"], rec["value"], step=rec["step"], bucket=rec["bucket"],
                  rank=rec["rank"], **fields)


# --------------------------------------------------------------------------- detached reducer


class DetachedReducerError(RuntimeError):
    """DDP's reducer no longer reduces some parameters' gradients.

    ``params`` names them; the message says why and how to fix it.
    """

    def __init__(self, message: str, params: list[str]):
        super().__init__(message)
        self.params = params

    def __reduce__(self):  # picklable, so it crosses process boundaries intact
        return (type(self), (str(self), self.params))


def _accumulator(p: torch.Tensor):
    # The node autograd will route p's gradient to: creating the view is what
    # gradient_edge() does for a leaf, so this returns the node the *next*
    # forward will use (and creates it if the cache was reset).
    with torch.enable_grad():
        return p.view_as(p).grad_fn.next_functions[0][0]


def _describe(dtype: torch.dtype, device: torch.device) -> str:
    return f"{str(dtype).replace('torch.', '')} on {device}"


class ReducerGuard:
    """Watch a DDP model for a detached reducer; raise :class:`DetachedReducerError`.

    Create it right after wrapping: it records every parameter's gradient
    accumulator node, which then is the one DDP's reducer hooked. Before each
    forward it checks that every parameter still routes its gradient to that
    node (a dtype or device change of the parameter's data replaces the node;
    see the module docstring). After each of the first ``sync_checks``
    backwards (outside ``no_sync()``) it also checks that the gradients agree
    bitwise across ranks, which catches a detachment that happened before the
    guard was created. Both checks emit a ``reducer_detached_params`` record
    (the number of affected parameters) before raising.

    ``check()`` can be called by hand; ``close()`` removes the hooks.

    Example::

        >>> ddp = DistributedDataParallel(model)
        >>> guard = ReducerGuard(ddp)
        >>> ddp.double(); ddp.float()          # silently detaches the reducer
        >>> ddp(x)                             # raises DetachedReducerError
    """

    def __init__(self, ddp_model: DistributedDataParallel, *, sync_checks: int = 1,
                 check_before_forward: bool = True):
        if isinstance(sync_checks, bool) or not isinstance(sync_checks, int) or sync_checks < 0:
            raise ValueError(f"sync_checks must be an int >= 0, got {sync_checks!r}")
        if not isinstance(ddp_model, DistributedDataParallel):
            raise ValueError(f"ReducerGuard watches a DistributedDataParallel model, "
                             f"got {type(ddp_model).__name__}")
        self.ddp = ddp_model
        self.sync_checks_left = sync_checks
        self.forwards = 0
        self._named = [(n, p) for n, p in _trainable(ddp_model)
                       if n not in ddp_model.parameters_to_ignore]
        self._nodes = [_accumulator(p) for _, p in self._named]
        self._meta = [(p.dtype, p.device) for _, p in self._named]
        self._handles = []
        self._check_buckets()
        if check_before_forward:
            self._handles.append(ddp_model.register_forward_pre_hook(self._before_forward))
        self._handles.append(ddp_model.register_forward_hook(self._after_forward))

    # -- checks -----------------------------------------------------------------------

    def _check_buckets(self) -> None:
        # A one-way move done before the guard existed still shows: the
        # reducer's buckets keep the dtype and device of wrapping time.
        bucket_meta: dict[int, tuple[torch.dtype, torch.device]] = {}
        for bucket in self.ddp.reducer._get_zeros_like_grad_buckets():
            buf = bucket.buffer()
            for p in bucket.parameters():
                bucket_meta[id(p)] = (buf.dtype, buf.device)
        mixed = getattr(self.ddp, "mixed_precision", None)
        moved = []
        for name, p in self._named:
            meta = bucket_meta.get(id(p))
            if meta is None:
                continue
            dtype, device = meta
            if (mixed is None and p.dtype != dtype) or p.device != device:
                moved.append((name, f"reducer bucket holds {_describe(dtype, device)}, "
                                    f"parameter is {_describe(p.dtype, p.device)}"))
        if moved:
            self._fail(moved, when="when the guard was created")

    def check(self) -> None:
        """Raise :class:`DetachedReducerError` if some parameter left the reducer."""
        detached = []
        for (name, p), node, (dtype, device) in zip(self._named, self._nodes, self._meta):
            if _accumulator(p) is not node:
                if (p.dtype, p.device) != (dtype, device):
                    how = f"{_describe(dtype, device)} -> {_describe(p.dtype, p.device)}"
                else:
                    how = (f"still {_describe(p.dtype, p.device)}, but its gradient accumulator "
                           f"was replaced (a round trip through another dtype or device)")
                detached.append((name, how))
        if detached:
            self._fail(detached, when=f"before forward {self.forwards}")

    def _fail(self, detached: list[tuple[str, str]], when: str) -> None:
        names = [n for n, _ in detached]
        _records.emit("reducer_detached_params", len(names), step=self.forwards,
                      first_param=names[0])
        shown = "\n".join(f"  {n}: {how}" for n, how in detached[:10])
        more = f"\n  ... and {len(detached) - 10} more" if len(detached) > 10 else ""
        raise DetachedReducerError(
            f"DDP's reducer is detached from {len(names)} parameter(s) ({when}); their "
            f"gradients are not averaged across ranks:\n{shown}{more}\n{CAUSE_HINT}\n{FIX_HINT}",
            names)

    def _sync_check(self) -> None:
        result = grads_in_sync(self.ddp, group=self.ddp.process_group, step=self.forwards - 1,
                               emit=False)
        if not result.in_sync:
            detached = [(n, f"gradient differs across ranks after backward "
                            f"(max |g_r - g_0| = {result.max_abs_diff[n]:.3g})")
                        for n in result.mismatched]
            self._fail(detached, when=f"after backward {self.forwards - 1}")

    # -- hooks ------------------------------------------------------------------------

    def _before_forward(self, module, args):
        # Inference mode builds no autograd graph, so it cannot show the accumulators.
        if not torch.is_inference_mode_enabled():
            self.check()
        self.forwards += 1

    def _after_forward(self, module, args, output):
        if not self.sync_checks_left or not torch.is_grad_enabled():
            return None
        if not self.ddp.require_backward_grad_sync:  # inside no_sync(): unreduced on purpose
            return None
        tensors = [t for t in _leaves(output) if isinstance(t, torch.Tensor) and t.requires_grad]
        if not tensors:
            return None
        fired = []

        def on_output_grad(grad):
            if fired:
                return grad
            fired.append(True)
            engine = torch.autograd.Variable._execution_engine
            # Queued now, this runs at the end of backward but *before* the
            # reducer's finalize (queued later, when the last bucket is
            # ready); queuing once more from there runs after it, when the
            # reduced gradients have been written back.
            engine.queue_callback(lambda: engine.queue_callback(self._after_backward))
            return grad

        for t in tensors:
            t.register_hook(on_output_grad)
        return None

    def _after_backward(self) -> None:
        if self.sync_checks_left > 0:
            self.sync_checks_left -= 1
            self._sync_check()

    def close(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles = []

    def __enter__(self) -> "ReducerGuard":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _leaves(obj) -> Iterable:
    if isinstance(obj, torch.Tensor):
        yield obj
    elif isinstance(obj, (list, tuple)):
        for x in obj:
            yield from _leaves(x)
    elif isinstance(obj, dict):
        for x in obj.values():
            yield from _leaves(x)


def guard_reducer(ddp_model: DistributedDataParallel, *, sync_checks: int = 1) -> ReducerGuard:
    """Attach a :class:`ReducerGuard` to ``ddp_model`` and return it."""
    return ReducerGuard(ddp_model, sync_checks=sync_checks)


# --------------------------------------------------------------------------- re-wrapping


def _ddp_settings(ddp: DistributedDataParallel) -> dict[str, Any]:
    settings = dict(process_group=ddp.process_group, dim=ddp.dim,
                    find_unused_parameters=ddp.find_unused_parameters,
                    gradient_as_bucket_view=ddp.gradient_as_bucket_view,
                    static_graph=ddp.static_graph,
                    bucket_cap_mb=ddp.bucket_bytes_cap / (1024 * 1024))
    if hasattr(ddp, "forward_sync_buffers"):
        settings["forward_sync_buffers"] = ddp.forward_sync_buffers
    if getattr(ddp, "mixed_precision", None) is not None:
        settings["mixed_precision"] = ddp.mixed_precision
    if getattr(ddp, "skip_all_reduce_unused_params", False):
        settings["skip_all_reduce_unused_params"] = True
    return settings


def rewrap(ddp_model: DistributedDataParallel, *, comm_hooks: bool = True,
           **ddp_kwargs: Any) -> DistributedDataParallel:
    """Wrap ``ddp_model.module`` in a new DDP with the same settings; return it.

    A collective (DDP's constructor is): call it on every rank. The new
    reducer hooks the parameters' current gradient accumulators, so a model
    moved after wrapping reduces again. Settings (process group, bucket size,
    find_unused_parameters, gradient_as_bucket_view, static_graph, ...) are
    carried over unless overridden by ``ddp_kwargs``, and so are the
    registered communication hooks (``comm_hooks=False`` drops them).
    ``device_ids`` follows the module's device (CUDA index, or none on CPU).
    The Parameter objects are kept, so an optimizer built on them still
    updates them; its state tensors (momentum, ...) are not moved.
    """
    if not isinstance(ddp_model, DistributedDataParallel):
        raise ValueError(f"rewrap takes a DistributedDataParallel model, got {type(ddp_model).__name__}")
    module = ddp_model.module
    settings = _ddp_settings(ddp_model)
    device = next(module.parameters()).device
    settings["device_ids"] = [device.index] if device.type == "cuda" else None
    settings.update(ddp_kwargs)
    new = DistributedDataParallel(module, **settings)
    if comm_hooks:
        for hook, state in getattr(ddp_model, "_comm_hooks", []):
            new.register_comm_hook(state, hook)
    # The old wrapper's reducer must not fire again: drop its hooks now rather
    # than whenever the old object is collected (private API, hence the check).
    if hasattr(ddp_model.reducer, "_remove_autograd_hooks"):
        ddp_model.reducer._remove_autograd_hooks()
    return new


def move_ddp_model(ddp_model: DistributedDataParallel, device: torch.device | str | None = None,
                   dtype: torch.dtype | None = None, **ddp_kwargs: Any) -> DistributedDataParallel:
    """Move a wrapped model to ``device`` and/or ``dtype`` and re-wrap it.

    Moving the wrapper (``ddp_model.to(...)``) detaches DDP's reducer and
    silently stops gradient averaging; this moves the bare module and builds a
    new DDP around it (:func:`rewrap`), so gradients are reduced again.
    A collective: call it on every rank.

    Example::

        >>> ddp = move_ddp_model(ddp, device="cpu")       # free the GPU a while
        >>> ddp = move_ddp_model(ddp, device="cuda:0")    # and back, still reducing
    """
    if device is None and dtype is None:
        raise ValueError("move_ddp_model: give a device, a dtype or both")
    if dtype is not None and not (isinstance(dtype, torch.dtype) and dtype.is_floating_point):
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    module = ddp_model.module
    if device is not None:
        module.to(device=torch.device(device))
    if dtype is not None:
        module.to(dtype=dtype)
    return rewrap(ddp_model, **ddp_kwargs)

"""What the ranks run: the reference runs in one process, each configuration on its W ranks.

Every run captures the same two things per step, whatever trains the model:
the gradient each parameter holds when ``optimizer.step()`` is called (for
DDP, Fabric and FSDP2 that is the *reduced* gradient) and the parameters
after it. Optimizer step hooks see both without touching the training loop,
so a user's own step function is observed exactly like ddplab's loops.
FSDP2's sharded gradients and parameters are gathered to full tensors there
(a collective every rank reaches, as all call ``optimizer.step()``).

Each rank writes one file per step (:func:`capture_path`, written to a
temporary name and renamed, so a file that exists is complete): what was
captured survives a crash, a hang or a stop, and the parent compares the
steps that finished. Each rank also emits ``loss``, ``grad_norm`` and
``optimizer_steps`` records, labelled ``config``, which stream back while
it runs (progress).

For the specification replay (:mod:`ddplab.compare.replay`) every step's
file also holds the rank's state *before* the step -- torch's RNG state,
the model's buffers, the thread count -- and the optimizer's state after
it (the next step's state before; a sharded optimizer's own shard only,
:mod:`ddplab.compare.sharded_optimizers`), plus a digest of every module's
forward output outside compiled regions (:class:`ForwardDigests`), so that the
parent can re-execute each rank's step on its own and name the first module
that computed otherwise. A ``Custom`` step's capture watches every optimizer
that steps the model's parameters, the setup's or one the step built itself.
DDP (and Fabric's DDP) reduces through :func:`_capture_hook`, which keeps
each bucket's parameters, local contribution and result around DDP's own
reduction (bitwise what DDP does without a hook) or the user's comm hook.
FSDP2's reduce-scatters are audited in the ranks by
:func:`ddplab.fsdp.attach_audit`, whose records stream back.

The reference runs (:func:`reference_worker`) train the whole global batch
in one process: in the model's dtype (``reference``), in float64 (``truth``,
the batches' floating tensors converted too), and for a mixed-precision
configuration with the forward and backward passes in its ``param_dtype``
and the gradient rounded to its ``reduce_dtype`` (the same rounding a
single process would see).
"""
from __future__ import annotations

import contextlib
import dataclasses
import math
import os
import time
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from ddplab import records as _records
from ddplab.compare import sharded_optimizers
from ddplab.compare.captures import InitialWeights, initial_weights
from ddplab.compare.compiled import compile_wrapped, eager, outside_compile, plain_name
from ddplab.compare.configurations import DDP, FSDP2, Configuration, Custom, Fabric, StepContext
from ddplab.compare.memory import BACKWARD_HEAP
from ddplab.compare.data import batch_pieces, rank_micro_batches, reference_parts, shares_world
from ddplab.compare.setup import (Setup, SetupError, apply_before_step, cast_batch, forward_loss,
                                  global_batches, model_digest, named_trainable)

__all__ = ["RunSpec", "Capture", "BucketCapture", "ForwardDigests", "optimizer_state", "tensor_digest",
           "capture_path", "captured_files", "reference_worker", "train_references", "DIFFERENT_MODEL", "VARIANTS",
           "collective_state", "collective_record", "precision_reference", "TRAINERS", "register_trainer",
           "configuration_worker", "reference_runs", "STEP_METRICS", "first_capture_sizes"]


# --------------------------------------------------------------------------- where captures live


def capture_path(root: str, run_id: str, step: int, rank: int) -> str:
    return os.path.join(root, run_id, f"s{step:06d}-r{rank:04d}.pt")


def capture_kind(rank: int) -> str:
    """What a rank's captures are, for writing one over another (:func:`ddplab.compare.captures.recycle_capture`):
    a rank writes about as many bytes each step, and other ranks other amounts."""
    return f"r{rank:04d}"


def captured_files(root: str, run_id: str) -> list[tuple[int, int, str]]:
    """``(step, rank, path)`` of every capture of ``run_id`` under ``root`` (the names :func:`capture_path` gives)."""
    folder = os.path.join(root, run_id)
    out = []
    for name in os.listdir(folder) if os.path.isdir(folder) else ():
        if name.startswith("s") and name.endswith(".pt") and "-r" in name:
            step, rank = name[1:-3].split("-r")
            out.append((int(step), int(rank), os.path.join(folder, name)))
    return out


def _full(t: torch.Tensor, copy: bool = True) -> torch.Tensor:
    """``t`` whole, on the CPU, as a tensor of its own (``copy``) or the tensor itself where it is one."""
    # FSDP2 holds DTensors sharded over the ranks; full_tensor() gathers them.
    if hasattr(t, "full_tensor"):
        return t.full_tensor().detach().cpu().clone()   # a replicated one may hand back its local tensor
    t = t.detach().cpu()
    return t.clone() if copy else t


def leaves_gradients_alone(optimizer) -> bool:
    """Is ``optimizer`` one of torch.optim's own? None of them writes into ``.grad`` (maximize and
    weight decay make new tensors; ``tests/test_compare_captures.py`` steps each one to check), so what
    its step read is still in the gradients when the step is over."""
    module = type(optimizer).__module__
    return module == "torch.optim" or module.startswith("torch.optim.")


#: Elements per partial sum of :func:`gradient_norm`: each is a float32 dot product (a few SIMD lanes
#: of 2^16/lanes terms, ~1e-8 relative measured on 25M normal values), summed in float64.
_NORM_CHUNK = 1 << 16


def gradient_norm(grads) -> float:
    """‖g‖₂ of all ``grads`` together: sums of squares of 2^16 elements at a time in the tensor's precision
    (float32 at least), added in float64.

    One float32 sum over a whole large tensor drifts (``vector_norm``: 1e-3 relative on 25M elements),
    and asking it for a float64 result casts element by element (20× slower); the partial sums are as
    fast as the first and within ~1e-7 of the exact norm. A partial sum that overflows float32 is taken
    again in float64."""
    total = 0.0
    for g in grads:
        flat = g.detach().reshape(-1)
        if flat.is_complex():
            flat = torch.view_as_real(flat).reshape(-1)
        for chunk in flat.split(_NORM_CHUNK):
            if chunk.dtype not in (torch.float32, torch.float64):
                chunk = chunk.float()
            part = float(torch.dot(chunk, chunk))
            if not math.isfinite(part):
                part = float(torch.dot(chunk.double(), chunk.double()))
            total += part
    return math.sqrt(total)


class BucketCapture:
    """State of :func:`_capture_hook`: the buckets of the current step, named by their parameters.

    ``hook``/``hook_state`` is the user's comm hook the capture wraps (None:
    DDP's own reduction, :func:`ddplab.comm_hooks.ddp_default_hook`).
    """

    def __init__(self, named: list, hook: Callable | None = None, hook_state: Any = None):
        self.names = {id(p): n for n, p in named}
        self.buckets: list[dict] = []
        self.hook, self.hook_state = hook, hook_state

    def take(self) -> list[dict]:
        out, self.buckets = self.buckets, []
        return out


def _capture_hook(state, bucket):
    # No annotations: DDP compares them with dist.GradBucket as objects, and this
    # module's are strings (from __future__ import annotations).
    """The bucket's reduction -- the user's hook, or DDP's own (bitwise what DDP does without
    a hook) -- keeping this rank's contribution, the reduced result and the bucket's parameters."""
    from ddplab.collectives import active_recorder
    from ddplab.comm_hooks import ddp_default_hook

    local = bucket.buffer().detach().clone()  # before the in-place reduction
    index = bucket.index()
    names = [state.names.get(id(p), "?") for p in bucket.parameters()]
    # Which reduction of this bucket in the step (accumulation that syncs every micro-batch has k).
    round_ = sum(b["index"] == index for b in state.buckets)

    def keep(fut: torch.futures.Future) -> torch.Tensor:
        value = fut.value()
        result = value[0] if isinstance(value, (list, tuple)) else value
        # The recording copied the reduced bucket as its all-reduce's output: that copy, not one more.
        recorder = active_recorder()
        held = recorder.held_copy(result) if recorder is not None else None
        state.buckets.append(dict(index=index, params=",".join(names), names=names, local=local,
                                  result=held if held is not None else result.detach().clone(), round=round_))
        return value

    recorder = active_recorder()
    # The all-reduce's input is this contribution times 1/W (DDP's own averaging): the recording keeps
    # it as that product of the copy above, not as one more copy (a model size less in the rank).
    with recorder.inputs_held_as(_contribution_times(local)) if recorder is not None else contextlib.nullcontext():
        fut = ddp_default_hook(None, bucket) if state.hook is None else state.hook(state.hook_state, bucket)
    return fut.then(keep)


def _contribution_times(local: torch.Tensor) -> Callable:
    """A recording's stand-in (:meth:`~ddplab.collectives.Recorder.inputs_held_as`) for a collective
    input whose bits are ``local`` × 1/(group size): a :class:`~ddplab.compare.captures.Scaled` of it."""
    from ddplab.compare.captures import Scaled

    def stand_in(t: torch.Tensor, rec) -> "Scaled | None":
        return Scaled.of(t, local, 1.0 / len(rec.group_ranks)) if rec.group_ranks else None

    return stand_in


def tensor_digest(t: torch.Tensor) -> str:
    """BLAKE2b of a tensor's dtype, shape and bytes: equal iff bitwise equal."""
    import hashlib

    t = t.detach().cpu().contiguous()
    h = hashlib.blake2b(f"{t.dtype}:{tuple(t.shape)}".encode(), digest_size=16)
    if t.numel():
        h.update(t.reshape(-1).view(torch.uint8).numpy())   # the buffer itself: no copy of it
    return h.hexdigest()


class ForwardDigests:
    """Forward hooks that keep ``(module name, digest of its output)`` per call, in call order.

    The replay runs the same hooks on its own model copy: the first call
    whose digest differs names the module that computed otherwise -- with
    every earlier module's output equal, its input was the same.
    """

    def __init__(self, module: torch.nn.Module):
        self.calls: list[tuple[str, str]] = []
        self.dtypes: set[str] = set()   # the floating dtypes modules computed in (autocast shows here)
        self.handles = [m.register_forward_hook(self._hook(plain_name(name) or "(model)"))
                        for name, m in module.named_modules()]

    def _hook(self, name: str):
        @outside_compile  # inside a compiled region it does nothing: the user's graph stays whole
        def hook(module, args, output):
            t = output[0] if isinstance(output, (list, tuple)) and output else output
            if isinstance(t, torch.Tensor):
                if hasattr(t, "full_tensor"):  # a DTensor output stays local; digest the local part
                    t = t.to_local()
                self.calls.append((name, tensor_digest(t)))
                if t.is_floating_point():
                    self.dtypes.add(str(t.dtype).replace("torch.", ""))
        return hook

    def take(self) -> list[tuple[str, str]]:
        out, self.calls = self.calls, []
        return out

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def optimizer_state(optimizer: torch.optim.Optimizer) -> dict:
    """``optimizer.state_dict()`` with every tensor cloned (FSDP2's sharded ones gathered to full)."""
    sd = optimizer.state_dict()
    state = {key: {name: _full(v) if isinstance(v, torch.Tensor) else v for name, v in entry.items()}
             for key, entry in sd["state"].items()}
    import copy
    return dict(state=state, param_groups=copy.deepcopy(sd["param_groups"]))


#: The records every run emits after each step (:meth:`Capture.finish`), beside its capture.
STEP_METRICS = ("loss", "grad_norm", "optimizer_steps")
#: The longest a rank waits for rank 0's capture of the same step to write what they share once, in seconds.
SAME_AS_WAIT = 30.0


class Capture:
    """Optimizer step hooks that record the gradients before and the parameters after ``step()``.

    ``named`` is the ``(name, parameter)`` list to capture (the names of the
    unwrapped model); ``buckets``, a :class:`BucketCapture` whose buckets go
    into the step's file too; ``module``, the unwrapped model, whose buffers
    and forward digests (:class:`ForwardDigests`) are kept for the replay;
    ``keep()``, whatever else the step's file holds (a mesh's local shards).
    :meth:`begin` notes the state before a step (RNG, buffers, threads),
    :meth:`finish` writes the step's file and emits its records.

    ``follows_step``: :meth:`finish` comes right after the optimizer's step (ddplab's own loop, not a
    Custom step's code). Its parameters are then taken as they are, not copied, unless ``hold_params``
    (something reads them after the run's next step); so are its gradients, where the optimizer is
    torch's (:func:`leaves_gradients_alone`). A DDP rank's gradients that hold their reduced bucket's
    bits are views of it; only the others are copied.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, named: list, *, root: str, run_id: str,
                 label: str, rank: int, buckets: BucketCapture | None = None,
                 module: torch.nn.Module | None = None, any_optimizer: bool = False,
                 recorder: Any = None, keep: Callable[[], dict] | None = None, lag: int | None = None,
                 write: bool = True, follows_step: bool = False, hold_params: bool = False,
                 initial: torch.Tensor | None = None):
        self.named = named
        self.initial = initial   # the model's initial weights until the first step's collectives are written
        self.copy_params = not follows_step or hold_params
        self.copy_grads = not (follows_step and leaves_gradients_alone(optimizer))
        self.lag = lag   # not None: after writing a step, wait for the parent (ddplab.compare.streaming)
        self.write = write   # False: the step is judged in this process (finish() returns it), never written
        self.optimizer = optimizer
        self.root, self.run_id, self.label, self.rank = root, run_id, label, rank
        self.grads: dict[str, torch.Tensor] | None = None
        self.params: dict[str, torch.Tensor] | None = None
        self.optim: dict | None = None
        self.calls = 0
        self.buckets = buckets
        self.module = module
        self.digests = ForwardDigests(module) if module is not None else None
        self.before: dict = {}
        self.recorder = recorder
        self.any_optimizer = any_optimizer
        self.handles: list = []
        self._stepping: torch.optim.Optimizer | None = None  # the optimizer whose step() is running
        self.keep = keep
        if write:
            os.makedirs(os.path.join(root, run_id), exist_ok=True)
        # Never traced: a compiled optimizer step runs them eagerly, as a graph break.
        before, after = torch._dynamo.disable(self._before), torch._dynamo.disable(self._after)
        optimizer.register_step_pre_hook(before)
        optimizer.register_step_post_hook(after)
        if any_optimizer:  # a Custom step may step an optimizer of its own over the model's parameters
            from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook
            ids = {id(p) for _, p in named}

            def steps_ours(opt) -> bool:
                return opt is not optimizer and any(id(p) in ids for g in opt.param_groups for p in g["params"])

            self.handles = [
                register_optimizer_step_pre_hook(lambda opt, a, k: before(opt, a, k) if steps_ours(opt) else None),
                register_optimizer_step_post_hook(lambda opt, a, k: after(opt, a, k) if steps_ours(opt) else None)]

    def close(self) -> None:
        """Remove the hooks that watch every optimizer of the process."""
        for handle in self.handles:
            handle.remove()
        self.handles = []

    def begin(self, step: int | None = None) -> None:
        """Note the rank's state before a step: what the replay starts that step from."""
        if self.recorder is not None and step is not None:
            self.recorder.set_step(step)
        self.before = dict(rng=torch.get_rng_state(), threads=torch.get_num_threads())
        if self.module is not None:
            self.before["buffers"] = {n: _full(b) for n, b in self.module.named_buffers()}
        if self.digests is not None:
            self.digests.take()

    def _before(self, optimizer, args, kwargs) -> None:
        if self._stepping is not None:
            return  # an optimizer stepped inside another's step() (ZeRO's local one): the outer one counts
        self._stepping = optimizer
        self.calls += 1
        if self.grads is None:  # the first step() of a training step is the one compared
            self.grads = self._gradients()

    def _gradients(self) -> dict[str, torch.Tensor]:
        """The gradients the optimizer is about to read (see the class docstring for which are copied)."""
        live = {n: p.grad for n, p in self.named if p.grad is not None}
        plain = {n: g.detach() for n, g in live.items() if not hasattr(g, "full_tensor")}
        # DDP copied each reduced bucket into the gradients; the bucket's capture is a tensor of its own.
        views = _views_of_buckets(plain, self.buckets.buckets) if self.buckets is not None else plain
        return {n: views[n] if n in plain and views[n] is not plain[n] else _full(g, self.copy_grads)
                for n, g in live.items()}

    def _after(self, optimizer, args, kwargs) -> None:
        if optimizer is not self._stepping:
            return
        self._stepping = None
        self.params = {n: _full(p, self.copy_params) for n, p in self.named}
        if self.calls == 1:
            # A sharded optimizer's own shard: its state_dict() would be a collective.
            self.optim = sharded_optimizers.capture_state(optimizer, self.named) or optimizer_state(optimizer)

    def finish(self, step: int, loss: float | None) -> dict:
        """Write the step's capture (unless ``write`` is False), emit its records, and return the capture."""
        if self.calls == 0 and self.any_optimizer:
            raise RuntimeError(f"{self.label}: no optimizer stepped the model's parameters in step {step}: call "
                               "ctx.optimizer.step() (the setup's optimizer) or step an optimizer of your own "
                               "over ctx.model's parameters")
        if self.calls == 0:
            raise RuntimeError(f"{self.label}: optimizer.step() was not called in step {step}")
        grads = self.grads
        norm = gradient_norm(grads.values())
        data = dict(grads=grads, params=self.params, loss=loss, optimizer_steps=self.calls,
                    optimizer=self.optim, **self.before)
        if self.buckets is not None:
            data["buckets"] = self.buckets.take()
        if self.digests is not None:
            data["forward"] = self.digests.take()
            data["forward_dtypes"] = sorted(self.digests.dtypes)
        if self.recorder is not None:
            data["collectives"] = [collective_state(r) for r in self.recorder.take()]
            if self.initial is not None:   # DDP's broadcast of the weights: the parent builds them too
                InitialWeights.mark(data["collectives"], self.initial)
        self.initial = None
        if self.keep is not None:
            data.update(self.keep())
        if self.write:
            from ddplab.compare.captures import save_capture

            written = self._same_as_rank_zero(data, step) if self.rank > 0 else data
            save_capture(written, capture_path(self.root, self.run_id, step, self.rank), kind=capture_kind(self.rank))
        labels = dict(config=self.label)
        if loss is not None:
            _records.emit("loss", loss, step=step, rank=self.rank, **labels)
        _records.emit("grad_norm", norm, step=step, rank=self.rank, **labels)
        _records.emit("optimizer_steps", self.calls, step=step, rank=self.rank, **labels)
        self.grads = self.params = self.optim = None
        self.before = {}
        self.calls = 0
        if self.lag is not None and self.write:
            from ddplab.compare.streaming import wait_for_parent
            wait_for_parent(self.root, self.run_id, step, self.lag)
        return data

    def _same_as_rank_zero(self, data: dict, step: int) -> dict:
        """``data`` with what holds rank 0's bits written as a reference to rank 0's capture of this step
        (:func:`~ddplab.compare.captures.same_as`), once rank 0 wrote it: the ranks finish a step
        together and write at once, so waiting for rank 0's file costs about the writing it saves. A
        rank 0 that has not written within :data:`SAME_AS_WAIT` seconds leaves this rank's capture whole, and so
        does a run the parent released (:meth:`ddplab.compare.streaming.Pass.finish`): it deletes rank 0's
        captures as they appear, and reads none."""
        from ddplab.compare.captures import large_tensors, read_capture, same_as
        from ddplab.compare.streaming import released

        if not large_tensors(data):
            return data   # a small model's capture is packed whole: nothing to share, no reason to wait
        path = capture_path(self.root, self.run_id, step, 0)
        deadline, delay = time.monotonic() + SAME_AS_WAIT, 0.001
        while not os.path.exists(path):
            if time.monotonic() > deadline or (self.lag is not None and released(self.root, self.run_id)):
                return data
            time.sleep(delay)
            delay = min(0.02, 2 * delay)
        try:
            return same_as(data, read_capture(path))   # memory-mapped: only the tensors compared are read
        except FileNotFoundError:   # released meanwhile: deleted before it was read
            return data


def _views_of_buckets(grads: dict | None, buckets: list[dict]) -> dict | None:
    """``grads`` with every gradient whose bits are its slice of its bucket's reduced result replaced
    by that slice: DDP copies each bucket's result into the gradients, and a capture then writes
    those bytes once (a bucket's result holds its parameters' gradients one after another)."""
    from ddplab.compare.captures import same_bits

    if not grads:
        return grads
    out = dict(grads)
    for bucket in buckets:   # a later reduction of a bucket (accumulation that syncs each micro-batch) last
        flat, offset = bucket["result"].reshape(-1), 0
        for name in bucket["names"]:
            grad = grads.get(name)
            if grad is None or offset + grad.numel() > flat.numel():
                break
            piece = flat[offset:offset + grad.numel()].view(grad.shape)
            if same_bits(piece, grad):
                out[name] = piece
            offset += grad.numel()
    return out


def collective_state(record) -> dict:
    """A recorded collective or comm-hook result as plain data (what ``torch.load(weights_only=True)`` reads)."""
    state = {f.name: getattr(record, f.name) for f in dataclasses.fields(record)}
    state["type"] = type(record).__name__
    return state


def collective_record(state: dict, inputs: bool = True, initial: Callable[[], torch.Tensor] | None = None):
    """The :class:`ddplab.collectives.CollectiveRecord` or ``HookResult`` :func:`collective_state` wrote
    (without its input tensors unless ``inputs``); ``initial()``: the model's initial weights, which an
    :class:`~ddplab.compare.captures.InitialWeights` stands for."""
    from ddplab.collectives import CollectiveRecord, HookResult
    from ddplab.compare.captures import Scaled

    def value(t):   # a Scaled input is computed here, for as long as the record lives
        if isinstance(t, Scaled):
            return t.value()
        if isinstance(t, InitialWeights):
            if initial is None:
                raise ValueError("a capture holding the initial weights is read without them")
            return t.value(initial())
        return t

    state = dict(state)
    if state.get("tensors"):
        state["tensors"] = {key: [value(t) for t in tensors]
                            for key, tensors in state["tensors"].items() if inputs or key != "inputs"}
    cls = {"CollectiveRecord": CollectiveRecord, "HookResult": HookResult}[state.pop("type")]
    return cls(**state)


def _loss_value(value) -> float | None:
    if value is None:
        return None
    if isinstance(value, torch.Tensor):
        return float(value.detach().double().sum()) if value.numel() == 1 else None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


# --------------------------------------------------------------------------- the reference runs


@dataclasses.dataclass(frozen=True)
class RunSpec:
    """One single-process reference run: its label, the master dtype and the compute precision."""

    label: str
    run_id: str
    dtype: torch.dtype | None = None          # None: the model's own dtype
    param_dtype: torch.dtype | None = None    # compute dtype of forward/backward (mixed precision)
    reduce_dtype: torch.dtype | None = None   # the gradient is rounded to it
    world_size: int = 1                       # > 1: the data-parallel promise, executed in one process
    k: int = 1                                # micro-batches per rank of that promise
    shares: int = 1                           # the W whose uneven per-rank shares the loss averages over

    @property
    def promise(self) -> bool:
        """Is this the float64 data-parallel promise? It is judged where it trains, never written."""
        return self.world_size > 1 or self.k > 1


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


def promise_label(world_size: int, k: int) -> str:
    """The run id of the float64 data-parallel promise for W ranks and k micro-batches."""
    return f"promise W={world_size} k={k}"


def precision_reference(param_dtype: torch.dtype | None, reduce_dtype: torch.dtype | None, *, run_id: str,
                        **fields) -> RunSpec:
    """The single-process reference computing in ``param_dtype`` with gradients rounded to ``reduce_dtype``
    (``fields``: the other :class:`RunSpec` fields, e.g. ``shares``)."""
    parts = [p for p in (param_dtype and _dtype_name(param_dtype),
                         reduce_dtype and reduce_dtype != param_dtype and f"reduce {_dtype_name(reduce_dtype)}")
             if p]
    return RunSpec("reference " + "/".join(parts), run_id, param_dtype=param_dtype, reduce_dtype=reduce_dtype,
                   **fields)


def reference_runs(configurations: list[Configuration], *, promises: bool = True) -> list[RunSpec]:
    """The reference, the float64 truth, one precision-matched reference per mixed precision, and
    (``promises``) the float64 data-parallel promise of every (W, k) a built-in configuration uses."""
    shares = shares_world(configurations)
    runs = [RunSpec("reference", "reference", shares=shares),
            RunSpec("truth", "truth", dtype=torch.float64, shares=shares)]
    seen = set()
    for c in configurations:
        precision = c.dtypes()
        if precision == (None, None) or precision in seen:
            continue
        seen.add(precision)
        runs.append(precision_reference(*precision, run_id=f"ref{len(runs)}", shares=shares))
    shapes = dict.fromkeys((c.shares, c.k) for c in configurations
                           if not isinstance(c, Custom) and (c.shares, c.k) != (1, 1))
    if promises:
        for world, k in shapes:
            label = promise_label(world, k)
            runs.append(RunSpec(label, f"promise{len(runs)}", dtype=torch.float64, world_size=world, k=k))
    return runs


def _promise_backward(model, setup: Setup, batch: tuple, step: int, world: int, k: int,
                      dtype: torch.dtype | None) -> float:
    """What DDP/FSDP promise for one step, in one process: every rank's k micro-batch losses, each
    divided by k, backpropagated on the same weights, and the sum of the ranks' gradients divided by W
    (the mean of per-rank means, whatever each rank's share)."""
    total = 0.0
    for piece in batch_pieces(setup, batch, step, world, k, dtype):
        loss = forward_loss(model, setup.loss, piece)
        if k > 1:
            loss = loss / k
        with BACKWARD_HEAP():
            loss.backward()
        total += float(loss.detach())
    for p in model.parameters():
        if p.grad is not None:
            p.grad.div_(world)
    return total / world


def _reference_loss(model, named: list, setup: Setup, spec: RunSpec, batch: tuple) -> torch.Tensor:
    """One process's loss on ``batch``, computed in ``spec``'s precision."""
    if spec.param_dtype is None:
        return forward_loss(model, setup.loss, batch)
    # Compute in param_dtype from the master weights, as FSDP2's MixedPrecisionPolicy does; the
    # cast's backward returns the gradient to the master dtype.
    low = {n: p.to(spec.param_dtype) for n, p in named}
    inputs = cast_batch(batch, spec.param_dtype, target=False)
    out = torch.func.functional_call(model, low, inputs[:-1])
    return setup.loss(out, inputs[-1])


def _reference_steps(setup: Setup, spec: RunSpec, batches: list, root: str, write: bool = True,
                     built: torch.nn.Module | None = None) -> Iterator[dict]:
    """Train ``spec`` a step at a time: each ``next()`` trains and captures one step, and returns its
    capture (written under ``root`` when ``write``, except a promise's). ``built``: a fresh build of the
    setup's model to train (converted to the run's dtype), where the caller has one; built here otherwise."""
    model = setup.build_model(spec.dtype) if built is None else (built if spec.dtype is None else built.to(spec.dtype))
    named = named_trainable(model)
    optimizer = setup.optimizer(model.parameters())
    # The judge reads a step's tensors before the run trains on, but the truth's parameters one step later
    # too (localization starts its pieces from them).
    capture = Capture(optimizer, named, root=root, run_id=spec.run_id, label=spec.label, rank=0,
                      write=write and not spec.promise, follows_step=True, hold_params=spec.label == "truth")
    if spec.reduce_dtype is not None:
        master = named[0][1].dtype
        for _, p in named:  # the gradient as a reduction in reduce_dtype would leave it
            p.register_hook(lambda g, rd=spec.reduce_dtype: g.to(rd).to(master))
    for step, batch in enumerate(batches):
        batch = cast_batch(batch, spec.dtype)
        optimizer.zero_grad(set_to_none=True)
        if spec.promise:
            loss = _promise_backward(model, setup, batch, step, spec.world_size, spec.k, spec.dtype)
        else:
            # Uneven per-rank shares weigh as DDP weighs them: the mean of the shares' mean losses.
            parts = reference_parts(setup, batch, step, spec.shares, spec.dtype)
            losses = [_reference_loss(model, named, setup, spec, part) for part in parts]
            loss = losses[0] if len(losses) == 1 else sum(losses) / len(losses)
        if isinstance(loss, torch.Tensor):
            with BACKWARD_HEAP():
                loss.backward()
        apply_before_step(setup, model)
        optimizer.step()
        yield capture.finish(step, _loss_value(loss))


#: Why a model that another process builds otherwise cannot be compared.
DIFFERENT_MODEL = ("setup.model() builds different initial weights in another process than in this one, so "
                   "ranks would start from different models: seed it with a constant (torch.manual_seed(0)), "
                   "not from the process or the clock")


def train_references(setup: Setup, runs: list[RunSpec], steps: int, root: str, judge=None,
                     built: torch.nn.Module | None = None) -> None:
    """Every reference run in this process, a step of each in turn, never waiting for the parent
    (the first one trains ``built``, a fresh build of the setup's model, where given).
    Without ``judge`` each writes its captures under ``root``, for the parent to judge. With ``judge``
    (a :class:`ddplab.compare.reference_judge.JudgeSpec`) none is written: after each step the
    configuration's captures of it are judged against them here, and only the records leave the
    process. A float64 promise is never written either: it is judged against the truth here, after each
    step (:class:`ddplab.compare.float64_run.PromiseJudge`)."""
    from ddplab.compare.float64_run import PromiseJudge
    from ddplab.compare.reference_judge import judge_where_trained

    batches = global_batches(setup, steps)
    truth = next((spec for spec in runs if spec.label == "truth"), None)
    judges = {spec.run_id: PromiseJudge(setup, spec.label, spec.world_size, spec.k, len(batches))
              for spec in runs if spec.promise and truth is not None}
    ask = judge_where_trained(setup, judge, runs, len(batches)) if judge is not None else None
    with eager():  # one process's rounding, which compiling would not change in size
        trainers = {spec.run_id: _reference_steps(setup, spec, batches, root, write=judge is None,
                                                  built=built if i == 0 else None)
                    for i, spec in enumerate(runs)}
        del built
        for step in range(len(batches)):
            captured = {run_id: next(trainer) for run_id, trainer in trainers.items()}
            for run_id, promise in judges.items():
                for rec in promise(step, captured[truth.run_id], captured[run_id]):
                    _records.send(rec)
            if ask is None:
                continue

            def train(spec: RunSpec, step: int = step) -> dict:
                """A reference the judge asks for now (the precision a run showed): trained up to ``step``."""
                trainers[spec.run_id] = trainer = _reference_steps(setup, spec, batches, root, write=False)
                for _ in range(step + 1):
                    capture = next(trainer)
                return capture

            for rec in ask(step, captured, train):
                _records.send(rec)


def first_capture_sizes(setup: Setup, runs: list[RunSpec]) -> dict[str, int]:
    """Train the first step of every reference run in ``runs`` that writes captures, one after another,
    and return the bytes each one's capture takes on disk, by label
    (:func:`~ddplab.compare.captures.capture_size`: counted, none written). A promise is never written:
    it is neither counted nor trained here."""
    from ddplab.compare.captures import capture_size

    batches = global_batches(setup, 1)
    with eager():
        return {spec.label: capture_size(next(_reference_steps(setup, spec, batches, "", write=False)))
                for spec in runs if not spec.promise}


def reference_worker(setup: Setup, runs: list[RunSpec], steps: int, root: str, digest: str,
                     judge=None) -> None:
    """Rank 0 of a 1-rank launch: :func:`train_references`, in a process that first checks it builds
    the model whose weights have ``digest`` (a model seeded from the process, its pid or the clock,
    would start every rank elsewhere). The model it checks is the first run's. Its backward passes
    allocate where the last ones freed (:data:`ddplab.compare.memory.BACKWARD_HEAP`)."""
    BACKWARD_HEAP.keep()
    model = setup.build_model()
    if model_digest(model) != digest:
        raise SetupError(DIFFERENT_MODEL)
    train_references(setup, runs, steps, root, judge, built=model)


# --------------------------------------------------------------------------- the configurations


@dataclasses.dataclass
class _Trainer:
    """A wrapped model ready to train: how to run backward and how to skip gradient sync."""

    model: torch.nn.Module
    optimizer: Any               # what the loop calls step()/zero_grad() on (Fabric wraps it)
    raw_optimizer: torch.optim.Optimizer
    backward: Callable
    no_sync: Callable[[], contextlib.AbstractContextManager]
    buckets: BucketCapture | None = None
    keep: Callable[[], dict] | None = None   # more of each step for its capture file (a mesh's local shards)


def _ddp(raw: torch.nn.Module, setup: Setup, config: DDP) -> _Trainer:
    from torch.nn.parallel import DistributedDataParallel

    kwargs = config.ddp_kwargs()
    if config.sync_batchnorm:  # in place: the same parameters, the same names
        from ddplab.sync_batchnorm import convert_sync_batchnorm
        raw = convert_sync_batchnorm(raw)
    model = DistributedDataParallel(raw, **kwargs)
    # Every bucket is kept for the replay, around DDP's own reduction or the user's hook
    # (torch's default hooks become ddplab's on gloo: the same math, and they run there).
    hook, hook_state = config.comm_hook, None
    if hook is not None:
        hook_state = config.hook_state() if config.hook_state is not None else None
        from ddplab.comm_hooks import gloo_equivalent
        hook = gloo_equivalent(hook)[0] if dist.get_backend() == "gloo" else hook
    buckets = BucketCapture(named_trainable(raw), hook, hook_state)
    model.register_comm_hook(buckets, _capture_hook)
    optimizer = setup.optimizer(model.parameters())
    return _Trainer(compile_wrapped(model, config), optimizer, optimizer, lambda loss: loss.backward(),
                    model.no_sync, buckets)


def _fabric(raw: torch.nn.Module, setup: Setup, config: Fabric) -> _Trainer:
    from ddplab.fabric import ddp_of, make_fabric

    fabric = make_fabric("cpu")
    optimizer = setup.optimizer(raw.parameters())
    model, wrapped = fabric.setup(raw, optimizer)
    buckets = BucketCapture(named_trainable(raw))
    ddp_of(model).register_comm_hook(buckets, _capture_hook)
    return _Trainer(model, wrapped, optimizer, fabric.backward,
                    lambda: fabric.no_backward_sync(model, enabled=True), buckets)


def _fsdp2(raw: torch.nn.Module, setup: Setup, config: FSDP2) -> _Trainer:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mesh = init_device_mesh("cpu", (dist.get_world_size(),))
    param_dtype, reduce_dtype = config.dtypes()
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)
    kwargs = dict(mesh=mesh, mp_policy=policy, reshard_after_forward=config.reshard_after_forward)
    # One FSDP unit per module owning parameters, then the root: the usual layout.
    for module in list(raw.modules())[1:]:
        if any(True for _ in module.parameters(recurse=False)):
            fully_shard(module, **kwargs)
    fully_shard(raw, **kwargs)
    # Every reduce-scatter measured against gloo's ring, bit for bit; records labelled like ours.
    from ddplab.fsdp import attach_audit
    attach_audit(raw, labels={"config": config.label})
    optimizer = setup.optimizer(raw.parameters())

    @contextlib.contextmanager
    def no_sync():
        raw.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            raw.set_requires_gradient_sync(True)

    return _Trainer(raw, optimizer, optimizer, lambda loss: loss.backward(), no_sync)


def _custom_model(raw: torch.nn.Module, config: Custom) -> tuple[torch.nn.Module, BucketCapture | None]:
    """The Custom step's model, and for ``wrap="ddp"`` the capture of DDP's buckets."""
    if config.wrap == "ddp":
        from torch.nn.parallel import DistributedDataParallel
        model = DistributedDataParallel(raw)
        buckets = BucketCapture(named_trainable(raw))
        model.register_comm_hook(buckets, _capture_hook)
        return model, buckets
    if config.wrap is None:
        return raw, None
    return config.wrap(raw), None


def _builtin_step(trainer: _Trainer, setup: Setup, micro_batches: list, no_sync: bool = True) -> float:
    """Zero the gradients, k forward/backward passes (all but the last without sync, unless
    ``no_sync`` is False: then every one synchronizes), one step."""
    k = len(micro_batches)
    trainer.optimizer.zero_grad(set_to_none=True)
    total = 0.0
    for m, micro in enumerate(micro_batches):
        with (contextlib.nullcontext() if m == k - 1 or not no_sync else trainer.no_sync()):
            loss = forward_loss(trainer.model, setup.loss, micro)
            if k > 1:
                loss = loss / k
            trainer.backward(loss)
        total += float(loss.detach())
    apply_before_step(setup, trainer.model)
    trainer.optimizer.step()
    return total


#: The launches of one configuration: as given (``run``); its symmetric twin (``twin``: every rank
#: trains rank 0's share from the same RNG state, so every rank must compute bitwise alike); and
#: the user's own code in float64 (``float64``: model and batches converted, compared with the truth).
VARIANTS = ("run", "twin", "float64")


def _seed_alike(step: int) -> None:
    """The same RNG state on every rank for ``step`` (torch, Python's random, NumPy)."""
    import random

    import numpy as np
    seed = 0x5EED + step
    torch.manual_seed(seed)
    random.seed(seed)
    np.random.seed(seed)


#: How each built-in configuration wraps the model: configuration type -> ``fn(raw, setup, config)``
#: returning a :class:`_Trainer`. A new configuration registers its wrapper here
#: (:func:`register_trainer`); the most derived registered type wins.
TRAINERS: dict[type, Callable] = {}


def register_trainer(config_type: type, wrap: Callable) -> None:
    """Train configurations of ``config_type`` with ``wrap(raw, setup, config) -> _Trainer``."""
    TRAINERS[config_type] = wrap


register_trainer(DDP, lambda raw, setup, config: _ddp(raw, setup, config))
register_trainer(Fabric, lambda raw, setup, config: _fabric(raw, setup, config))
register_trainer(FSDP2, lambda raw, setup, config: _fsdp2(raw, setup, config))


def _trainer(raw: torch.nn.Module, setup: Setup, config: Configuration) -> _Trainer | None:
    """The wrapped model of a built-in configuration (None for a Custom step)."""
    if isinstance(config, Custom):
        return None
    for cls in type(config).__mro__:
        if cls in TRAINERS:
            return TRAINERS[cls](raw, setup, config)
    raise ValueError(f"no runner for configuration {type(config).__name__}")


def configuration_worker(setup: Setup, config: Configuration, steps: int, root: str, run_id: str,
                         digest: str, variant: str = "run", lag: int | None = None) -> int:
    """Every rank of a configuration's launch: build, check, wrap, train ``steps`` steps, capture.

    ``variant`` is one of :data:`VARIANTS`; ``lag``: wait for the parent after each step
    (:mod:`ddplab.compare.streaming`). Returns the number of steps trained.
    Raises :class:`SetupError` when this rank's model does not start from the
    reference's initial weights.
    """
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    from ddplab import collectives

    # Every collective the ranks issue -- DDP's reducer, hooks, FSDP2, the user's own dist.* calls --
    # is recorded; each step's records leave with the step's capture. The twin compares its ranks'
    # collectives by digest and the float64 run reads their dtypes: their tensors stay out. The run's
    # collectives are verified from their tensors: no digest of them is taken.
    run = variant == "run"
    with collectives.recording(keep_tensors=run, digests=not run) as recorder:
        return _train(setup, config, steps, root, run_id, digest, variant, recorder, lag)


def _train(setup: Setup, config: Configuration, steps: int, root: str, run_id: str, digest: str,
           variant: str, recorder, lag: int | None) -> int:
    rank, world = dist.get_rank(), dist.get_world_size()
    # Every record of this launch -- a user comm hook's too -- names the configuration.
    _records.set_labels(config=config.label)
    dtype = torch.float64 if variant == "float64" else None
    batches = [cast_batch(b, dtype) for b in global_batches(setup, steps)]
    raw = setup.build_model(dtype)
    if model_digest(raw) != digest and variant != "float64":
        raise SetupError(f"rank {rank} built a model whose initial weights differ from the reference's: "
                         "setup.model() must build the same weights in every process")
    # What DDP broadcasts when it wraps the model: the parent builds it too, so the run's first capture
    # need not hold it. (A sharding wrap broadcasts nothing, and holds no whole copy of the model.)
    initial = initial_weights(raw) if variant == "run" and isinstance(config, (DDP, Fabric, Custom)) else None
    trainer = _trainer(raw, setup, config)
    if trainer is None:
        model, buckets = _custom_model(raw, config)
        optimizer = setup.optimizer(model.parameters())
    else:
        optimizer, buckets = trainer.raw_optimizer, trainer.buckets
    # The names of the unwrapped model; FSDP2 replaced its parameters in place, so read them now.
    capture = Capture(optimizer, named_trainable(raw), root=root, run_id=run_id, label=config.label,
                      rank=rank, buckets=buckets, module=raw, any_optimizer=trainer is None,
                      recorder=recorder, keep=trainer.keep if trainer is not None else None, lag=lag,
                      follows_step=trainer is not None, initial=initial)
    del initial
    kept: dict = {}  # a Custom step's own state across its steps (ctx.state)
    # Ranks that share a data-parallel coordinate (a mesh's tensor-parallel group) train the same share.
    shares, share = config.shares, config.share_of(rank, world)
    for step, batch in enumerate(batches):
        if variant == "twin":
            # Every rank trains the first share; the global batch becomes copies of it.
            micro = rank_micro_batches(setup, batch, step, 0, shares, config.k, dtype)
            batch = tuple(torch.cat([t] * shares) for t in (torch.cat(parts) for parts in zip(*micro)))
            _seed_alike(step)
        else:
            micro = rank_micro_batches(setup, batch, step, share, shares, config.k, dtype)
        capture.begin(step)
        if trainer is None:
            shard = tuple(torch.cat(parts) for parts in zip(*micro))
            ctx = StepContext(model=model, optimizer=optimizer, loss=setup.loss, batch=batch, shard=shard,
                              micro_batches=micro, step=step, rank=rank, world_size=world, k=config.k,
                              before_step=setup.before_step, state=kept)
            loss = _loss_value(config.train_step(ctx))
        else:
            loss = _builtin_step(trainer, setup, micro, getattr(config, "no_sync", True))
        capture.finish(step, loss)
    capture.close()
    return len(batches)

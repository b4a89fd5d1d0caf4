"""What the user trains: the model, the per-step global batches, the loss and the optimizer.

A :class:`Setup` is four small callables (or a list of batches), picklable so
that every rank rebuilds the same training from it:

* ``model()`` returns a fresh ``nn.Module`` with the same weights on every
  call (seed inside it);
* ``batches`` is a sequence of global batches, one per step, or a callable
  returning one. A batch is a tuple ``(inputs..., target)`` of tensors with
  the samples along dim 0: the model is called on the inputs, the loss on
  ``(output, target)``;
* ``loss(output, target)`` returns a 0-dim tensor;
* ``optimizer(params)`` returns a ``torch.optim.Optimizer`` over ``params``;
* ``before_step(model)`` (optional) runs after the gradients are reduced and
  before ``optimizer.step()``, in the reference and in every built-in
  configuration alike: the place for ``clip_grad_norm_`` or any other
  change to the reduced gradient that the training does;
* ``rank_batches(rank, world_size, step)`` (optional) returns the batch rank
  ``rank`` of ``world_size`` trains at ``step`` (a per-rank loader, a
  ``DistributedSampler``; it must read its rank and world size from its
  arguments), beside ``batches``, the global batches one process trains on
  (:mod:`ddplab.compare.data`). Without it rank r trains the r-th of W equal
  shares of each global batch.

:func:`check_setup` tries all of it once in this process, before any rank
starts, and raises a :class:`SetupError` (a ValueError) that names what is
wrong. :func:`split` cuts a global batch into the equal, contiguous pieces
that ranks and micro-batches train on; :func:`cast_batch` converts its
floating tensors (the float64 truth, mixed-precision inputs).
"""
from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Callable, Sequence

import torch
import torch.nn as nn

from ddplab.compare.compiled import is_compiled, plain_name

__all__ = ["Setup", "SetupError", "check_setup", "split", "cast_batch", "model_digest",
           "named_trainable", "global_batches", "apply_before_step", "forward_loss"]


class SetupError(ValueError):
    """The setup cannot be compared: it raises, has the wrong shapes or is not reproducible."""

    def __reduce__(self):  # crosses process boundaries intact
        return (type(self), self.args)


@dataclasses.dataclass
class Setup:
    """The training to compare: how to build the model, the batches, the loss and the optimizer.

    Example::

        >>> setup = Setup(model=lambda: (torch.manual_seed(0), nn.Linear(4, 2))[1],
        ...               batches=[(torch.randn(8, 4), torch.randint(0, 2, (8,)))] * 3,
        ...               loss=nn.functional.cross_entropy,
        ...               optimizer=lambda params: torch.optim.SGD(params, lr=0.1),
        ...               before_step=lambda model: nn.utils.clip_grad_norm_(model.parameters(), 1.0))
    """

    model: Callable[[], nn.Module]
    batches: Sequence | Callable[[], Sequence]
    loss: Callable[[torch.Tensor, torch.Tensor], torch.Tensor]
    optimizer: Callable[[Any], torch.optim.Optimizer]
    name: str = "setup"
    before_step: Callable[[nn.Module], Any] | None = None
    rank_batches: Callable[[int, int, int], Sequence] | None = None

    def build_model(self, dtype: torch.dtype | None = None) -> nn.Module:
        """A fresh model, converted to ``dtype`` when given (the float64 truth)."""
        model = self.model()
        return model if dtype is None else model.to(dtype)

    def inspect(self, question: Callable[[nn.Module], Any]) -> Any:
        """``question(model)`` of a model built for it, asked once per question and ``model`` factory: what a
        comparison asks of the model's structure many times (does it compile, do its modules issue
        collectives), where building a large model takes seconds. One build answers every
        :func:`structure_question` at once."""
        key = (question, id(self.model))
        answers = self.__dict__.get("_answers", {})
        if key not in answers:
            self.answer_from(self.build_model(), question)
        return self.__dict__["_answers"][key]

    def answer_from(self, model: nn.Module, *questions: Callable[[nn.Module], Any]) -> None:
        """Answer ``questions`` and every :func:`structure_question` of ``model``, a fresh build of this
        setup's model that the caller built anyway: :meth:`inspect` then builds none for them."""
        answers = self.__dict__.setdefault("_answers", {})
        for question in dict.fromkeys((*questions, *STRUCTURE_QUESTIONS)):
            answers.setdefault((question, id(self.model)), question(model))


#: What :meth:`Setup.inspect` answers of one build together (:func:`structure_question`).
STRUCTURE_QUESTIONS: list[Callable[[nn.Module], Any]] = []


def structure_question(question: Callable[[nn.Module], Any]) -> Callable[[nn.Module], Any]:
    """Declare ``question(model)`` a question about the model's structure that a comparison asks through
    :meth:`Setup.inspect`: every build made for one of them answers them all."""
    STRUCTURE_QUESTIONS.append(question)
    return question


structure_question(is_compiled)   # declared in compiled, which this module imports


def global_batches(setup: Setup, steps: int | None = None) -> list:
    """The first ``steps`` global batches (all of them when None), as a list of tuples."""
    batches = setup.batches() if callable(setup.batches) else setup.batches
    batches = list(batches)
    return batches if steps is None else batches[:steps]


def named_trainable(module: nn.Module) -> list[tuple[str, nn.Parameter]]:
    """``(name, parameter)`` of every parameter that requires a gradient, each once, in module order
    (names without ``torch.compile``'s ``_orig_mod.``)."""
    seen: set[int] = set()
    out = []
    for name, p in module.named_parameters():
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            out.append((plain_name(name), p))  # a compiled model names them as the eager one
    return out


def model_digest(module: nn.Module) -> str:
    """SHA-256 of every trainable parameter's name, dtype, shape and bytes: equal iff bitwise equal."""
    h = hashlib.sha256()
    for name, p in named_trainable(module):
        t = p.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy() if t.numel() else b"")   # the buffer itself: no copy of it
    return h.hexdigest()


def split(batch: tuple, pieces: int) -> list[tuple]:
    """Cut every tensor of ``batch`` along dim 0 into ``pieces`` equal contiguous parts.

    Piece ``j`` holds samples ``[j*n, (j+1)*n)`` with ``n = B / pieces``;
    rank ``r`` of W with k micro-batches trains pieces ``r*k .. r*k+k-1``
    of ``split(batch, W*k)``, so the pieces together are the global batch.
    """
    size = batch[0].shape[0]
    if size % pieces:
        raise SetupError(f"a global batch of {size} samples does not split into {pieces} equal pieces")
    n = size // pieces
    return [tuple(t[j * n:(j + 1) * n] for t in batch) for j in range(pieces)]


def cast_batch(batch: tuple, dtype: torch.dtype | None, *, target: bool = True) -> tuple:
    """``batch`` with its floating tensors converted to ``dtype`` (the target too unless ``target=False``)."""
    if dtype is None:
        return batch
    last = len(batch) - 1
    return tuple(t.to(dtype) if t.is_floating_point() and (target or i < last) else t
                 for i, t in enumerate(batch))


def apply_before_step(setup: Setup, model: nn.Module) -> None:
    """``setup.before_step(model)`` when the setup has one (after the reduction, before ``step()``)."""
    if setup.before_step is not None:
        setup.before_step(model)


def forward_loss(model: nn.Module, loss_fn: Callable, batch: tuple) -> torch.Tensor:
    """``loss_fn(model(*inputs), target)`` for a batch ``(inputs..., target)``."""
    return loss_fn(model(*batch[:-1]), batch[-1])


# --------------------------------------------------------------------------- checks before anything runs


def _call(what: str, fn: Callable, *args):
    try:
        return fn(*args)
    except SetupError:
        raise
    except Exception as exc:  # noqa: BLE001 - any failure of user code is named and re-raised
        raise SetupError(f"{what} raised {type(exc).__name__}: {exc}") from exc


def _first_difference(a: nn.Module, b: nn.Module) -> str | None:
    pa, pb = dict(named_trainable(a)), dict(named_trainable(b))
    if list(pa) != list(pb):
        return f"different parameter names ({list(pa)[:4]}... vs {list(pb)[:4]}...)"
    for name in pa:
        x, y = pa[name].detach(), pb[name].detach()
        if x.shape != y.shape or x.dtype != y.dtype:
            return f"{name}: {x.dtype}{list(x.shape)} vs {y.dtype}{list(y.shape)}"
        if not torch.equal(x.view(torch.uint8) if x.numel() else x, y.view(torch.uint8) if y.numel() else y):
            return f"{name} (max |difference| {float((x.double() - y.double()).abs().max()):.3g})"
    return None


def _check_model(setup: Setup) -> tuple[nn.Module, nn.Module]:
    """Two builds of the setup's model, checked: the first for the setup's passes, the second untouched."""
    if not callable(setup.model):
        raise SetupError(f"setup.model must be a callable returning an nn.Module, got {type(setup.model).__name__}")
    model = _call("setup.model()", setup.model)
    if not isinstance(model, nn.Module):
        raise SetupError(f"setup.model() must return a torch.nn.Module, got {type(model).__name__}")
    named = named_trainable(model)
    if not named:
        raise SetupError("setup.model() returned a model with no parameter that requires a gradient")
    dtypes = {p.dtype for _, p in named}
    if len(dtypes) != 1 or not next(iter(dtypes)).is_floating_point:
        raise SetupError(f"the model's parameters must share one floating dtype, got {sorted(map(str, dtypes))}")
    if any(p.device.type != "cpu" for _, p in named):
        raise SetupError("setup.model() must build the model on the CPU (ranks place it themselves)")
    again = _call("setup.model() (second call)", setup.model)
    diff = _first_difference(model, again)
    if diff is not None:
        raise SetupError(
            "setup.model() builds different weights on each call, so every rank would start from "
            f"a different model: {diff}. Seed inside model(), e.g. torch.manual_seed(0) before "
            "building the layers")
    return model, again


def _check_batches(setup: Setup, steps: int | None, divisors: dict[str, int]) -> list:
    if not (callable(setup.batches) or isinstance(setup.batches, Sequence)):
        raise SetupError(f"setup.batches must be a sequence of batches or a callable returning one, "
                         f"got {type(setup.batches).__name__}")
    batches = _call("setup.batches()", global_batches, setup, None)
    if not batches:
        raise SetupError("setup.batches is empty: give at least one global batch")
    if steps is not None:
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise SetupError(f"steps must be an int >= 1, got {steps!r}")
        if steps > len(batches):
            raise SetupError(f"steps={steps} but setup.batches has only {len(batches)} batches")
        batches = batches[:steps]
    first_shapes = None
    for s, batch in enumerate(batches):
        if not isinstance(batch, (tuple, list)) or len(batch) < 2:
            raise SetupError(f"batch {s} must be a tuple (inputs..., target) of at least two tensors, "
                             f"got {type(batch).__name__}")
        if not all(isinstance(t, torch.Tensor) for t in batch):
            kinds = [type(t).__name__ for t in batch]
            raise SetupError(f"batch {s} must hold tensors only, got {kinds}")
        sizes = {t.shape[0] if t.ndim else None for t in batch}
        if len(sizes) != 1 or None in sizes:
            raise SetupError(f"batch {s}: every tensor must have the samples along dim 0 with one batch "
                             f"size, got shapes {[tuple(t.shape) for t in batch]}")
        shapes = [(tuple(t.shape[1:]), t.dtype) for t in batch]
        if first_shapes is None:
            first_shapes = shapes
        elif shapes != first_shapes:
            raise SetupError(f"batch {s} has per-sample shapes/dtypes {shapes}, batch 0 has {first_shapes}")
        size = batch[0].shape[0]
        for config, pieces in divisors.items() if setup.rank_batches is None else ():  # ranks' own batches
            if size % pieces:
                raise SetupError(f"batch {s} has {size} samples, which configuration {config!r} cannot "
                                 f"split into {pieces} equal pieces (ranks × micro-batches)")
    return [tuple(b) for b in batches]


def check_setup(setup: Setup, *, steps: int | None = None,
                divisors: dict[str, int] | None = None) -> dict:
    """Try the whole setup once here; raise :class:`SetupError` naming the first problem
    (:func:`_check_setup`). It runs eagerly (a compiled model is not compiled here) and, in a
    process without one, under a one-rank stand-in process group, as the reference runs."""
    from ddplab.compare import compiled, stand_in

    with compiled.eager(), stand_in.process_group(0, 1):
        return _check_setup(setup, steps=steps, divisors=divisors)


def _check_setup(setup: Setup, *, steps: int | None, divisors: dict[str, int] | None) -> dict:
    """Try the whole setup once here; raise :class:`SetupError` naming the first problem.

    Checks: the model builds, reproducibly (two calls give bitwise the same
    weights, so every rank starts from the same model), on the CPU in one
    floating dtype; every batch is ``(inputs..., target)`` with one batch
    size, the same per-sample shapes at every step, and splits into the
    pieces each configuration needs (``divisors``: name -> ranks ×
    micro-batches); the loss of batch 0 is a finite 0-dim tensor with a
    gradient, and the forward pass is deterministic given torch's
    random-number state (two passes from the same state agree bitwise:
    dropout is fine, randomness from elsewhere is not); the optimizer
    builds; the float64 copy runs; the setup pickles. Returns facts the
    comparison needs: ``dtype``, ``steps``, ``digest`` (of the initial
    weights), ``params`` (names), ``numel``, ``random`` (the forward pass
    draws random numbers).
    """
    import cloudpickle

    if not isinstance(setup, Setup):
        raise SetupError(f"expected a ddplab.compare.Setup, got {type(setup).__name__}")
    for field in ("loss", "optimizer"):
        if not callable(getattr(setup, field)):
            raise SetupError(f"setup.{field} must be callable, got {type(getattr(setup, field)).__name__}")
    if setup.before_step is not None and not callable(setup.before_step):
        raise SetupError(f"setup.before_step must be None or a callable taking the model, "
                         f"got {type(setup.before_step).__name__}")
    model, untouched = _check_model(setup)
    batches = _check_batches(setup, steps, divisors or {})
    batch = batches[0]
    # The replay referee restores each rank's RNG state, so a forward pass that
    # draws random numbers (dropout) is fine as long as the same state gives the
    # same output; randomness from elsewhere (the clock, threads) is not.
    rng = torch.get_rng_state()
    out = _call("the model's forward pass on batch 0", lambda: model(*batch[:-1]))
    random = not torch.equal(rng, torch.get_rng_state())
    if not isinstance(out, torch.Tensor):
        raise SetupError(f"the model must return a tensor, got {type(out).__name__}")
    loss = _call("setup.loss(output, target) on batch 0", setup.loss, out, batch[-1])
    if not isinstance(loss, torch.Tensor) or loss.ndim != 0:
        shape = tuple(loss.shape) if isinstance(loss, torch.Tensor) else type(loss).__name__
        raise SetupError(f"setup.loss must return a 0-dim tensor (reduce the batch, e.g. mean), got {shape} "
                         f"for output {tuple(out.shape)} and target {tuple(batch[-1].shape)}")
    if not loss.requires_grad:
        raise SetupError("setup.loss returned a tensor without a gradient (is the output detached?)")
    if not torch.isfinite(loss):
        raise SetupError(f"setup.loss is {loss.item()} on batch 0 at the initial weights")
    after = torch.get_rng_state()
    torch.set_rng_state(rng)
    again = model(*batch[:-1])
    torch.set_rng_state(after)
    if not torch.equal(out.detach(), again.detach()):
        raise SetupError("the model's forward pass is not deterministic: two passes on batch 0 from the "
                         "same random-number state differ (randomness outside torch's generator, or a "
                         "nondeterministic kernel). Remove it; the comparison needs the same function on "
                         "every rank and in the replay")
    _call("loss.backward() on batch 0", loss.backward)
    opt = _call("setup.optimizer(model.parameters())", setup.optimizer, model.parameters())
    if not isinstance(opt, torch.optim.Optimizer):
        raise SetupError(f"setup.optimizer must return a torch.optim.Optimizer, got {type(opt).__name__}")
    # The second build is untouched (no pass ran through it): its weights are the initial ones, and
    # converted, it is setup.model() in float64. (Building a large model again takes seconds.)
    named = named_trainable(untouched)
    facts = dict(dtype=named[0][1].dtype, steps=len(batches), digest=model_digest(untouched),
                 params=[n for n, _ in named], numel=sum(p.numel() for _, p in named), random=random)
    wide = _call("setup.model() converted to float64 (the truth)", untouched.to, torch.float64)
    _call("the float64 model's forward pass on batch 0",
          lambda: forward_loss(wide, setup.loss, cast_batch(batch, torch.float64)))
    try:
        cloudpickle.dumps(setup)
    except Exception as exc:  # noqa: BLE001
        raise SetupError(f"the setup must be picklable (cloudpickle) to reach the ranks: {exc}") from exc
    return facts

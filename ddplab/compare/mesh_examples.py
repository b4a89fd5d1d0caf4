"""A small language model for the mesh configurations, its tensor-parallel plans, and planted faults.

:class:`TinyLM` is an embedding, one pre-norm causal attention block, one
pre-norm feed-forward block and a head, trained on short token sequences
whose ends are padding (:func:`token_setup`: targets ``-100`` there, a
different number of valid tokens in every sequence). Its plans:

* :func:`tensor_parallel_plan` (its ``tp_plan()``, the default) -- q, k, v and
  the feed-forward's first layer column-wise, the output projections
  row-wise; the norms run on the full sequence on every rank;
* :func:`sequence_parallel_plan` -- the same, with the sequence sharded
  between the blocks' tensor-parallel layers: the norms run on each rank's
  part of the sequence as ``SequenceParallel`` (their weights replicated,
  their gradients partial sums that are all-reduced along ``tp``);
* :func:`unsynchronized_norm_plan` -- the sequence sharded as above but the
  norms left as plain modules: each rank's norm weights get the gradient of
  its own part of the sequence only, and nothing synchronizes them (a planted
  fault).

:func:`correct` compares the correct mesh configurations; each
:data:`PLANTED` example is a fault users meet on meshes, with the axis and
the collective or parameter the comparison must name (:class:`MeshExpected`).
"""
from __future__ import annotations

import dataclasses
import functools

import torch
import torch.nn as nn
import torch.nn.functional as F

from ddplab.compare.examples import Example, Expected
from ddplab.compare.meshes import FSDP2TP, HSDP, TP
from ddplab.compare.setup import Setup

__all__ = ["TinyLM", "tensor_parallel_plan", "sequence_parallel_plan", "unsynchronized_norm_plan",
           "token_setup", "LOSSES", "MeshExpected", "correct_configurations", "correct", "PLANTED",
           "planted_example", "planted"]

#: Targets of padded positions (``F.cross_entropy``'s ``ignore_index``).
PAD = -100


class Attention(nn.Module):
    """Pre-norm causal self-attention with a residual: ``x + o(attend(q, k, v of norm(x)))``."""

    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.q, self.v, self.o = (nn.Linear(width, width) for _ in range(3))
        # No key bias: softmax is invariant to it, so its exact gradient is zero and any computed
        # one is rounding noise, which a per-parameter distance in low precision reads as a difference.
        self.k = nn.Linear(width, width, bias=False)
        self.head_width = width // heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(x)
        # Heads from the projection's own width: a column-wise shard holds whole heads.
        q, k, v = (proj(h).unflatten(-1, (-1, self.head_width)).transpose(1, 2) for proj in (self.q, self.k, self.v))
        scores = q @ k.transpose(-2, -1) / self.head_width ** 0.5
        length = scores.shape[-1]
        future = torch.ones(length, length, dtype=torch.bool, device=scores.device).triu(1)
        attended = scores.masked_fill(future, float("-inf")).softmax(-1) @ v
        return x + self.o(attended.transpose(1, 2).flatten(2))


class FeedForward(nn.Module):
    """Pre-norm two-layer perceptron with a residual."""

    def __init__(self, width: int, hidden: int):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.up, self.down = nn.Linear(width, hidden), nn.Linear(hidden, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.tanh(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, attention block, feed-forward block, head: logits ``(batch, sequence, vocabulary)``."""

    def __init__(self, vocabulary: int = 16, width: int = 16, heads: int = 2, hidden: int = 32):
        super().__init__()
        self.embed = nn.Embedding(vocabulary, width)
        self.attn = Attention(width, heads)
        self.ffn = FeedForward(width, hidden)
        self.head = nn.Linear(width, vocabulary)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(self.ffn(self.attn(self.embed(tokens))))

    def tp_plan(self) -> dict:
        return tensor_parallel_plan(self)


def tensor_parallel_plan(model: nn.Module) -> dict:
    """Megatron's layout: q, k, v and ``ffn.up`` column-wise, ``attn.o`` and ``ffn.down`` row-wise."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    return {"attn.q": ColwiseParallel(), "attn.k": ColwiseParallel(), "attn.v": ColwiseParallel(),
            "attn.o": RowwiseParallel(), "ffn.up": ColwiseParallel(), "ffn.down": RowwiseParallel()}


def _sequence_sharded(norms: bool) -> dict:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (ColwiseParallel, PrepareModuleInput, PrepareModuleOutput,
                                                   RowwiseParallel, SequenceParallel)

    plan = {"attn": PrepareModuleInput(input_layouts=(Replicate(),), desired_input_layouts=(Shard(1),),
                                       use_local_output=True),
            "attn.q": ColwiseParallel(input_layouts=Shard(1)), "attn.k": ColwiseParallel(input_layouts=Shard(1)),
            "attn.v": ColwiseParallel(input_layouts=Shard(1)), "attn.o": RowwiseParallel(output_layouts=Shard(1)),
            "ffn.up": ColwiseParallel(input_layouts=Shard(1)), "ffn.down": RowwiseParallel(output_layouts=Shard(1)),
            "ffn": PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),),
                                       use_local_output=True)}
    if norms:
        plan.update({"attn.norm": SequenceParallel(use_local_output=True),
                     "ffn.norm": SequenceParallel(use_local_output=True)})
    return plan


def sequence_parallel_plan(model: nn.Module) -> dict:
    """The sequence sharded between the tensor-parallel layers; the norms as ``SequenceParallel``."""
    return _sequence_sharded(norms=True)


def unsynchronized_norm_plan(model: nn.Module) -> dict:
    """Planted fault: the sequence sharded, the norms left plain: their weights' gradients are each rank's
    part of the sequence only, and no collective synchronizes them along ``tp``."""
    return _sequence_sharded(norms=False)


# --------------------------------------------------------------------------- the setup


def _build(seed: int) -> TinyLM:
    torch.manual_seed(seed)
    return TinyLM()


def _token_batches(seed: int, steps: int, batch_size: int, length: int, vocabulary: int = 16) -> list:
    """Sequences of random tokens whose next-token targets end in padding: each sequence keeps between
    a quarter and all of its ``length`` targets, so every share holds a different number of them."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(steps):
        tokens = torch.randint(0, vocabulary, (batch_size, length + 1), generator=gen)
        targets = tokens[:, 1:].clone()
        kept = torch.randint(max(1, length // 4), length + 1, (batch_size, 1), generator=gen)
        targets[torch.arange(length).expand(batch_size, -1) >= kept] = PAD
        out.append((tokens[:, :-1].contiguous(), targets))
    return out


def per_slot_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Cross-entropy summed over the valid tokens, divided by the token slots (padding included): every
    share has as many slots, so the mean over ranks of each share's loss is the global batch's."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD, reduction="sum") / targets.numel()


def per_valid_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Planted fault: the mean over this batch's valid tokens. Over the global batch that is the mean one
    process computes; each rank divides by its own share's count, and averaging those means over ranks
    weights every share alike whatever its number of tokens."""
    return F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=PAD)


#: ``loss`` names of :func:`token_setup`.
LOSSES = {"per_slot": per_slot_loss, "per_valid_token": per_valid_token_loss}


def token_setup(seed: int = 0, *, steps: int = 3, batch_size: int = 16, length: int = 8,
                loss: str = "per_slot", lr: float = 0.05) -> Setup:
    """:class:`TinyLM` seeded with ``seed`` on ``steps`` batches of ``batch_size`` sequences of ``length``
    tokens, SGD with momentum; ``loss`` one of :data:`LOSSES`."""
    if loss not in LOSSES:
        raise ValueError(f"loss must be one of {', '.join(LOSSES)}, got {loss!r}")
    return Setup(model=functools.partial(_build, seed),
                 batches=functools.partial(_token_batches, seed, steps, batch_size, length),
                 loss=LOSSES[loss],
                 optimizer=functools.partial(torch.optim.SGD, lr=lr, momentum=0.9),
                 name=f"tiny LM seed={seed}" + (f" ({loss} loss)" if loss != "per_slot" else ""))


# --------------------------------------------------------------------------- examples


@dataclasses.dataclass(frozen=True)
class MeshExpected(Expected):
    """What the comparison must conclude about a mesh configuration: the verdict, the evidence that
    decides, the axis, and the parameter or collective op it names (None: not asserted)."""

    evidence: str | None = None
    axis: str | None = None
    param: str | None = None
    op: str | None = None


def _policy(param_dtype=None, reduce_dtype=None):
    from torch.distributed.fsdp import MixedPrecisionPolicy

    return MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype)


def correct_configurations() -> list:
    """Mesh configurations written correctly: each must read exact or rounding."""
    bf16, f32 = torch.bfloat16, torch.float32
    return [HSDP(), HSDP(k=4), HSDP(k=2, no_sync="gradient_sync"),
            HSDP(k=4, mp_policy=_policy(bf16, f32)),
            TP(2), TP(2, plan=sequence_parallel_plan),
            FSDP2TP(), FSDP2TP(plan=sequence_parallel_plan),
            FSDP2TP(mp_policy=_policy(bf16, bf16), plan=sequence_parallel_plan)]


def correct(seed: int = 0, *, steps: int = 3, configurations: list | None = None) -> Example:
    """The tiny LM against the correct mesh configurations (``configurations``: a subset of them)."""
    configs = correct_configurations() if configurations is None else configurations
    return Example(name="meshes correct", setup=token_setup(seed, steps=steps), configurations=configs,
                   expected={c.label: MeshExpected("rounding") for c in configs},
                   story="HSDP, tensor parallel with and without sequence parallelism, and FSDP2 over tensor "
                         "parallel, written correctly: rounding only.")


def _tp_reduce_dtype(seed, steps):
    config = FSDP2TP(mp_policy=_policy(torch.bfloat16, torch.float32), plan=sequence_parallel_plan)
    return Example(
        name="tp_reduce_dtype", setup=token_setup(seed, steps=steps), configurations=[config],
        expected={config.label: MeshExpected("bug", evidence="mesh_precision", axis="tp", param="ffn.norm.weight",
                                             op="allreduce")},
        story="MixedPrecisionPolicy(param_dtype=bfloat16, reduce_dtype=float32) with sequence parallelism: FSDP2 "
              "reduce-scatters in float32, but the norms' partial gradients are all-reduced along tp first, in "
              "bfloat16 -- what torch 2.13's fully_shard does.")


def _hsdp_partial_sums(seed, steps):
    config = HSDP(k=4, mp_policy=_policy(reduce_dtype=torch.bfloat16))
    return Example(
        name="hsdp_bf16_partial_sums", setup=token_setup(seed, steps=steps), configurations=[config],
        expected={config.label: MeshExpected("bug", evidence="partial_sums", axis="replicate", op="allreduce")},
        story="HSDP with reduce_dtype=bfloat16 and set_requires_all_reduce(False) for 3 of 4 micro-batches: the "
              "reduce-scattered partial sums are added up in bfloat16, not in the gradients' float32, before the "
              "replicate all-reduce -- what torch 2.13's fully_shard does; the error grows with the micro-batches.")


def _unsynchronized_norm(seed, steps):
    config = FSDP2TP(plan=unsynchronized_norm_plan)
    return Example(
        name="unsynchronized_norm", setup=token_setup(seed, steps=steps), configurations=[config],
        expected={config.label: MeshExpected("bug", evidence="mesh_replicas", axis="tp", param="attn.norm.weight")},
        story="The sequence sharded along tp with the norms left out of the plan: each tensor-parallel rank "
              "updates its norm weights with its own part of the sequence's gradient, and the replicas drift.")


def _local_token_mean(seed, steps):
    config = FSDP2TP()
    return Example(
        name="local_token_mean", setup=token_setup(seed, steps=steps, loss="per_valid_token"),
        configurations=[config],
        expected={config.label: MeshExpected("bug", evidence="float64", axis="dp")},
        story="The loss divided by each share's own count of valid tokens, where the global count is meant: "
              "shares with fewer tokens weigh more.")


#: Planted mesh fault name -> builder ``(seed, steps) -> Example``.
PLANTED = {"tp_reduce_dtype": _tp_reduce_dtype, "hsdp_bf16_partial_sums": _hsdp_partial_sums,
           "unsynchronized_norm": _unsynchronized_norm, "local_token_mean": _local_token_mean}


def planted_example(name: str, seed: int = 0, *, steps: int = 3) -> Example:
    """The planted mesh fault ``name`` (see :data:`PLANTED`)."""
    if name not in PLANTED:
        raise ValueError(f"unknown planted mesh example {name!r}; known: {', '.join(PLANTED)}")
    return PLANTED[name](seed, steps)


def planted(seed: int = 0, *, steps: int = 3) -> list[Example]:
    """Every planted mesh fault."""
    return [planted_example(name, seed, steps=steps) for name in PLANTED]

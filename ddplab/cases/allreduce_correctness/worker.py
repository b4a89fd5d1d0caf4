"""Case 04, inside a rank: the report's network, three ways of reducing its gradients, and the checks.

Every rank is one tower. Per mode and step it computes its gradients,
reduces them (:func:`reduce_fixed`, :func:`reduce_as_ready` or
:func:`reduce_race`) under a :class:`~ddplab.ledger.CollectiveLedger`, then
gathers every tower's gradients *by name* (so the check itself cannot
mispair) and measures each variable's result (:func:`measure_step`).
"""
from __future__ import annotations

import math
import time

import torch

__all__ = ["MODES", "VARIABLES", "WEIGHT_DECAY", "LEARNING_RATE", "BOUND_ORDER", "FULL_CHANNELS",
           "channels", "first_variable", "Tower", "make_batch", "losses", "reduce_fixed",
           "reduce_as_ready", "reduce_race", "offset_in_weight_decays", "holders", "measure_step",
           "worker"]

#: The ways of reducing the gradients (see the package docstring).
MODES = ("fixed", "as_ready", "race")
#: The report's variables, in its tower's order (also the agreed order: sorted by name).
VARIABLES = ("aaa/W", "bbb/W", "conv1/W", "conv2/W", "conv3/W", "conv4/W", "conv5/W")
#: The report's weight-decay factor: the cost adds 1e-3·Σw per variable, so an
#: unused variable's gradient is exactly 1e-3 everywhere.
WEIGHT_DECAY = 1e-3
LEARNING_RATE = 1e-3
BATCH_SIZE = 32
IMAGE_SHAPE = (3, 30, 30)
NUM_CLASSES = 10
#: ``tf.random.uniform([32], maxval=9, dtype=tf.int32)``: labels 0..8.
LABEL_MAXVAL = 9
#: The live reduction is gloo's ring; its rounding bound judges every result.
BOUND_ORDER = "gloo_ring"
#: An offset counts as k weight-decay gradients when every element is within
#: this fraction of 1e-3 of k·1e-3 (float32 rounding of values near 1e-3 is
#: about 1e-7 of 1e-3; a mispaired gradient varies from element to element
#: by far more).
SIGNATURE_RTOL = 1e-3
#: What each reduction records of :func:`ddplab.numerics.measure`'s answer (labelled with its
#: ``verdict`` and ``evidence``: bitwise equality with the emulated ring, else the bound).
MEASURED = ("max_abs_error", "max_bound_ratio", "within_bound", "frac_matches_order")
#: Longest wait for gloo to finish a race-mode collective before writing anyway.
RACE_POLL_SECONDS = 5.0
#: Full-size channel counts of the report's network, scaled by ``width``.
FULL_CHANNELS = (64, 1280)


# --------------------------------------------------------------------------- the network


def channels(width: float) -> tuple[int, int]:
    """(small, large) channel counts at ``width``: round(64·width), round(1280·width), at least 1."""
    return tuple(max(1, round(c * width)) for c in FULL_CHANNELS)


def first_variable(tower: int) -> str:
    """The variable tower ``tower`` convolves its input with: the report's ``v1 if idx == 0 else v2``."""
    return "aaa/W" if tower == 0 else "bbb/W"


def _glorot_uniform(shape: tuple[int, ...], generator: torch.Generator) -> torch.Tensor:
    # TensorFlow's default initializer for conv kernels: fans count the 3×3 receptive field.
    out_ch, in_ch, kh, kw = shape
    limit = math.sqrt(6.0 / ((in_ch + out_ch) * kh * kw))
    return (torch.rand(shape, generator=generator) * 2 - 1) * limit


class Tower(torch.nn.Module):
    """The report's network for tower ``tower``, its parameters named as TensorFlow's variables.

    Every tower holds all seven variables (``named_parameters()`` gives
    ``aaa/W``, ``bbb/W``, ``conv1/W`` ... ``conv5/W``) but convolves its input
    with :func:`first_variable` only; the other receives a gradient from the
    weight-decay term alone. Weights are the same for every tower (``seed``).
    """

    def __init__(self, tower: int, width: float = 1.0, seed: int = 0):
        super().__init__()
        small, large = channels(width)
        shapes = {"aaa/W": (small, 3, 3, 3), "bbb/W": (small, 3, 3, 3),
                  "conv1/W": (small, small, 3, 3), "conv2/W": (small, small, 3, 3),
                  "conv3/W": (large, small, 3, 3), "conv4/W": (large, large, 3, 3),
                  "conv5/W": (NUM_CLASSES, large, 3, 3)}
        generator = torch.Generator().manual_seed(seed)
        for name in VARIABLES:
            self.register_parameter(name, torch.nn.Parameter(_glorot_uniform(shapes[name], generator)))
        self.tower = tower
        self.first = first_variable(tower)

    def variable(self, name: str) -> torch.nn.Parameter:
        return self._parameters[name]

    def forward(self, images: torch.Tensor) -> torch.Tensor:
        import torch.nn.functional as F

        # padding=1 gives TensorFlow's SAME output sizes (30 → 15 → 8 with stride 2).
        x = F.conv2d(images, self.variable(self.first), padding=1)  # no activation, as the report
        for name, stride in (("conv1/W", 1), ("conv2/W", 1), ("conv3/W", 2), ("conv4/W", 2),
                             ("conv5/W", 1)):
            x = F.relu(F.conv2d(x, self.variable(name), stride=stride, padding=1))
        return x.mean(dim=(2, 3))


def make_batch(seed: int, step: int, tower: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The report's random batch for ``tower`` at ``step``: uniform images, labels 0..8."""
    # A distinct stream per (seed, step, tower): towers see different data, as the report's.
    generator = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + tower)
    images = torch.rand((BATCH_SIZE,) + IMAGE_SHAPE, generator=generator)
    labels = torch.randint(0, LABEL_MAXVAL, (BATCH_SIZE,), generator=generator)
    return images, labels


def losses(model: Tower, images: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, weight decay 1e-3·Σ_v Σ w): the report's cost is their sum."""
    import torch.nn.functional as F

    data = F.cross_entropy(model(images), labels)
    decay = torch.stack([WEIGHT_DECAY * p.sum() for p in model.parameters()]).sum()
    return data, decay


# --------------------------------------------------------------------------- the three reductions
# Each returns the gradients this rank meant to reduce ({name: tensor}, copies)
# and leaves what the collectives produced in p.grad. all_reduce is looked up
# on torch.distributed at call time, so the collective ledger sees every call.


def reduce_fixed(model: Tower, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """Backward, then one all_reduce (SUM) per gradient in the agreed order (sorted names)."""
    import torch.distributed as dist

    loss.backward()
    local = {}
    for name in sorted(VARIABLES):
        grad = model.variable(name).grad
        local[name] = grad.detach().clone()
        dist.all_reduce(grad, label=name)
    return local


def reduce_as_ready(model: Tower, loss: torch.Tensor) -> dict[str, torch.Tensor]:
    """One all_reduce (SUM) per gradient the moment autograd accumulates it: towers differ in order.

    The hook runs after AccumulateGrad has written the leaf's complete
    gradient (data and weight-decay terms), so nothing races here: only the
    issue order differs between towers.
    """
    import torch.distributed as dist

    local: dict[str, torch.Tensor] = {}
    names = {id(p): name for name, p in model.named_parameters()}

    def issue(param: torch.Tensor) -> None:
        name = names[id(param)]
        local[name] = param.grad.detach().clone()
        dist.all_reduce(param.grad, label=name)

    handles = [p.register_post_accumulate_grad_hook(issue) for p in model.parameters()]
    try:
        loss.backward()
    finally:
        for handle in handles:
            handle.remove()
    return local


def reduce_race(model: Tower, data_loss: torch.Tensor, decay: torch.Tensor) -> tuple[dict, dict]:
    """Async all_reduce of each data gradient (agreed order); the weight decay is added before ``wait()``.

    Returns (the gradients meant to be reduced: data + weight decay, added
    exactly as the in-place write adds them; per variable 1 if the collective
    had completed when the buffer was written again, else 0).
    """
    import torch.distributed as dist

    names = sorted(VARIABLES)
    params = [model.variable(name) for name in names]
    data_loss.backward(inputs=params)
    works, issued = [], []
    for name, p in zip(names, params):
        if p.grad is None:  # the unused variable: no data gradient, a zero buffer
            p.grad = torch.zeros_like(p)
        issued.append(p.grad.detach().clone())
        works.append(dist.all_reduce(p.grad, async_op=True, label=name))
    decay_grads = torch.autograd.grad(decay, params)
    # The losing interleaving, made reproducible: write once gloo says it is done, never wait() first.
    deadline = time.monotonic() + RACE_POLL_SECONDS
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(1e-4)
    completed = {}
    for name, p, work, extra in zip(names, params, works, decay_grads):
        completed[name] = int(work.is_completed())
        p.grad.add_(extra)  # the bug: the collective's buffer, written before wait()
    for work in works:
        work.wait()
    local = {name: g.add(extra) for name, g, extra in zip(names, issued, decay_grads)}
    return local, completed


# --------------------------------------------------------------------------- measuring a step


def offset_in_weight_decays(true_sum: torch.Tensor, reduced: torch.Tensor) -> int:
    """k if ``true_sum - reduced`` is k·1e-3 at every element (k ≠ 0), else 0.

    The report's 0.00100000016 is one weight-decay gradient: a constant offset
    means one or more towers' 1e-3 terms are missing (k > 0) or doubled (k < 0).
    """
    d = true_sum.double().reshape(-1) - reduced.double().reshape(-1)
    if d.numel() == 0:
        return 0
    k = round(float(d.median()) / WEIGHT_DECAY)
    if k == 0:
        return 0
    residual = float((d - k * WEIGHT_DECAY).abs().max())
    return k if residual <= SIGNATURE_RTOL * WEIGHT_DECAY else 0


def holders(results: torch.Tensor) -> list[list[int]]:
    """Ranks grouped by bitwise-equal rows of ``results`` ([W, N]), in rank order."""
    bits = results.view(torch.int32) if results.dtype == torch.float32 else results
    groups: list[list[int]] = []
    for r in range(results.shape[0]):
        for group in groups:
            if bool((bits[group[0]] == bits[r]).all()):
                group.append(r)
                break
        else:
            groups.append([r])
    return groups


def _pairing(report) -> tuple[dict[tuple[int, str], dict[int, str]], list[dict]]:
    """From a step's ledger report: for (rank, variable), the label every rank gave that
    collective; and one row per all_reduce (seq, rank 0's label, every rank's, problem)."""
    by_seq: dict[int, dict[int, str]] = {}
    for e in report.entries:
        if e.op == "all_reduce":
            by_seq.setdefault(e.seq, {})[e.rank] = e.label
    problems = {p.seq: p.kind for p in report.problems}
    pairs, rows = {}, []
    for seq in sorted(by_seq):
        labels = by_seq[seq]
        for r, label in labels.items():
            pairs[(r, label)] = labels
        rows.append(dict(seq=seq, variable=labels.get(0), problem=problems.get(seq),
                         combined=" + ".join(f"{r}:{labels[r]}" for r in sorted(labels))))
    return pairs, rows


def measure_step(model: Tower, local: dict, report, step: int, tolerance: float) -> None:
    """Gather every tower's gradients by name; emit the report's check, the bound, the signature.

    A result several ranks hold bit for bit is measured once, by one of them
    in rotation (label ``holders``: the ranks holding it), so ranks share the
    work; a rank whose result differs measures its own.
    """
    import torch.distributed as dist

    from ddplab.numerics import measure, reduce, rounding_bound
    from ddplab.probes import all_gather_flat
    from ddplab.records import emit

    rank, world = dist.get_rank(), dist.get_world_size()
    names = list(VARIABLES)
    sizes = [local[n].numel() for n in names]
    # One gather for what the towers meant to reduce, one for what they got.
    meant = dict(zip(names, all_gather_flat(torch.cat([local[n].reshape(-1) for n in names]))
                     .split(sizes, dim=1)))
    got = dict(zip(names, all_gather_flat(torch.cat([model.variable(n).grad.reshape(-1) for n in names]))
                   .split(sizes, dim=1)))
    pairs, rows = _pairing(report)
    if rank == 0:  # the ledger's report is the same on every rank: one copy
        for row in rows:
            emit("collective_mismatch", int(row["problem"] is not None), step=step, seq=row["seq"],
                 variable=row["variable"], combined=row["combined"], problem=row["problem"])
    for index, name in enumerate(names):
        groups = holders(got[name])
        if rank == groups[0][(step + index) % len(groups[0])]:
            emit("distinct_results", len(groups), step=step, variable=name)
        mine = next(g for g in groups if rank in g)
        if rank != mine[(step + index) % len(mine)]:
            continue
        contributions, reduced = meant[name].contiguous(), got[name][rank].contiguous()
        labels = dict(step=step, variable=name, holders=",".join(map(str, mine)))
        # The report's check: tf.add_n of the towers' gradients against the result, in float32.
        add_n = reduce(contributions, "sequential")
        diff = (add_n - reduced).abs()
        emit("report_max_diff", float(diff.max()), **labels)
        emit("report_check_pass", int(bool((diff < tolerance).all())), **labels)
        m = measure(reduced, contributions, BOUND_ORDER)
        for metric in MEASURED:
            emit(metric, m[metric], **labels, verdict=m["classification"], evidence=m["evidence"])
        emit("rounding_bound", float(rounding_bound(contributions, BOUND_ORDER).max()), **labels)
        emit("constant_offset_wd", offset_in_weight_decays(add_n, reduced), **labels)
        paired = pairs.get((rank, name), {})
        if paired and any(label != name for label in paired.values()):
            # Mispaired: is the result exactly the sum of what the ledger says was combined?
            combined = torch.stack([meant[paired.get(r, name)][r] for r in range(world)])
            m = measure(reduced, combined, BOUND_ORDER)
            emit("paired_bound_ratio", m["max_bound_ratio"], **labels, verdict=m["classification"],
                 evidence=m["evidence"], paired=" + ".join(f"{r}:{paired.get(r, name)}" for r in range(world)))


# --------------------------------------------------------------------------- inside a rank


def train(mode: str, params: dict) -> None:
    """One tower trained ``steps`` steps, its gradients reduced the ``mode`` way and measured."""
    import torch.distributed as dist

    from ddplab.ledger import CollectiveLedger
    from ddplab.records import emit

    rank = dist.get_rank()
    model = Tower(rank, params["width"], params["seed"])
    for step in range(params["steps"]):
        images, labels = make_batch(params["seed"], step, rank)
        for p in model.parameters():
            p.grad = None
        data_loss, decay = losses(model, images, labels)
        completed = {}
        with CollectiveLedger(emit=False) as ledger:
            if mode == "fixed":
                local = reduce_fixed(model, data_loss + decay)
            elif mode == "as_ready":
                local = reduce_as_ready(model, data_loss + decay)
            else:
                local, completed = reduce_race(model, data_loss, decay)
        measure_step(model, local, ledger.report, step, params["tolerance"])
        for name, flag in completed.items():
            emit("write_after_completion", flag, step=step, variable=name)
        emit("loss", float(data_loss.detach() + decay.detach()), step=step)
        # Plain SGD on the summed gradients, as the report's apply_gradients (torch.optim
        # would import torch._dynamo: seconds per rank for nothing this case uses).
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LEARNING_RATE)
    dist.barrier()


def worker(params: dict, mode: str | None = None) -> None:
    """Every rank: train one tower per mode (``mode``, or each of ``params["mode"]`` under torchrun).

    Every record carries the label ``mode``; ``mode_seconds`` says how long the rank took.
    """
    from ddplab.records import emit, labels

    for each in [mode] if mode else params["mode"]:
        with labels(mode=each):
            t0 = time.perf_counter()
            train(each, params)
            emit("mode_seconds", time.perf_counter() - t0)

"""Case 04: "nccl_ops.all_sum does not correctly reduce gradients" (seed 004_aa8fa98cfce03780.txt).

The report trains a toy network on two GPUs (one *tower* each), all-reduces
every gradient with TensorFlow's ``nccl_ops.all_sum`` and checks each result
against ``tf.add_n`` of the towers' gradients with a tolerance of 1e-4; the
check fails within 100 steps, printing a largest difference of
0.00100000016. The reporter suspects that the towers compute their gradients
in different orders while each all-reduce is scheduled as early as possible.

TensorFlow is not needed to test that mechanism: every collective library
pairs the n-th collective of one rank with the n-th collective of the others,
whatever tensor each rank meant by it. This case ports the report's network
to torch and runs it on real ``torch.distributed`` gloo ranks, one tower per
rank, reducing the gradients three ways (``mode``):

``fixed``
    after the backward pass, every rank all-reduces every gradient in one
    agreed order (sorted by variable name): the correct program.
``as_ready``
    one all-reduce per gradient the moment autograd produces it (a
    post-accumulate-grad hook), the report's hypothesis. Autograd produces a
    leaf's gradient once every path to it has been back-propagated. The
    variable a tower does *not* use gets its gradient from the weight-decay
    term alone, at the start of the backward pass; the one it uses for its
    first convolution needs the whole chain back through the network and
    comes last. Tower 0 uses ``aaa/W`` and the others ``bbb/W``, so tower 0
    issues ``bbb/W, conv5/W, ..., conv1/W, aaa/W`` and every other tower
    ``aaa/W, conv5/W, ..., bbb/W``: the first and the last collective of a
    step combine *different variables of the same shape*, silently.
    Autograd's CPU engine is single-threaded and orders ready nodes by
    creation, so the order is the same at every step and every run.
``race``
    the agreed order, but asynchronous (``async_op=True``), and the rank
    writes the gradient buffer again before ``wait()``: the data term's
    gradient is issued, the weight-decay term's gradient is added in place
    afterwards. gloo reads and overwrites the buffer on its own thread, so the
    outcome depends on timing. To make the losing interleaving reproducible
    on CPU, the rank writes once gloo reports the work completed
    (``Work.is_completed()``, polled for at most :data:`RACE_POLL_SECONDS`,
    never ``wait()``); each write records whether the collective had
    completed (``write_after_completion``), so a step in which the race did
    not trigger says so.

The network (the report's, in torch's NCHW layout): per tower the variables
``aaa/W`` and ``bbb/W`` (64×3×3×3 at full width), one of them convolving the
input without an activation, then 3×3 convolutions ``conv1..conv5`` to 64,
64, 1280 (stride 2), 1280 (stride 2) and 10 channels, each followed by ReLU,
the spatial mean as logits, cross-entropy on random ``32×3×30×30`` inputs
(uniform in [0, 1)) with random labels in 0..8 (the report's ``maxval=9``),
plus weight decay ``1e-3·Σ_v Σ w`` over all seven variables, and SGD with
learning rate 0.001 on the *summed* gradients (``all_sum``). ``width``
scales the channel counts (64·width and 1280·width, rounded, at least 1):
the default 1/16 runs on two CPU cores in seconds, ``width=1`` is the
report's full size. Every tower starts from the same Glorot-uniform weights
(TensorFlow's default initializer) so that only the reduction differs; the
report's towers initialized their variables independently, which changes
nothing here: the check compares each reduction with the sum of the
gradients the towers actually computed.

Per mode, step and variable every rank gathers all towers' gradients
(name by name, so this check cannot itself mispair) and records:

* the report's check: ``report_max_diff`` (max |add_n - reduced|, in float32
  as TensorFlow computes it) and ``report_check_pass`` (every element below
  ``tolerance``);
* ddplab's classification (:func:`ddplab.numerics.measure` against the exact
  sum, judged by :func:`ddplab.numerics.rounding_bound` of gloo's ring):
  ``max_abs_error``, ``max_bound_ratio``, ``within_bound``
  (1: "rounding", 0: "not rounding") and ``rounding_bound`` (the largest
  per-element bound);
* the error's signature: ``constant_offset_wd`` = k when add_n - reduced is
  the same multiple k ≠ 0 of the weight-decay gradient 1e-3 at every element
  (within :data:`SIGNATURE_RTOL` of 1e-3), else 0;
* ``paired_bound_ratio`` (only where the ledger found a mispaired
  collective): the reduced value measured against the sum of the tensors
  the ledger says were combined (label ``paired``); at most 1 means
  "exactly those tensors, up to rounding";
* ``distinct_results``: how many different results the ranks hold for the
  variable (1: every rank the same bits).

A result several ranks hold bit for bit is measured once, by one of them in
rotation (label ``holders``); a rank whose result differs measures its own.

Per collective, from :class:`ddplab.ledger.CollectiveLedger` (emitted by rank
0; the cross-checked report is the same on every rank):
``collective_mismatch`` (0/1) with labels ``seq`` (within the step),
``variable`` (rank 0's tensor) and ``combined`` (every rank's, ``0:bbb/W + 1:aaa/W``);
per step and rank: ``loss``; in race mode ``write_after_completion`` per
variable. The parent adds ``launch_seconds``.

Example::

    >>> from ddplab.cases import allreduce_correctness as case
    >>> params = case.check_params({"steps": 5})
    >>> records = case.run(params)
    >>> case.verdict(records, params).kind
    'bug'
"""
from __future__ import annotations

import math
import time

import torch

from ddplab import records as _records
from ddplab.parameters import Parameter, ParameterSet
from ddplab.verdict import Finding, Verdict

__all__ = [
    "NAME", "TITLE", "SEED", "NOTEBOOK", "PARAMETERS", "QUICK", "MODES", "VARIABLES",
    "WEIGHT_DECAY", "LEARNING_RATE", "REPORT_MAX_DIFF", "BOUND_ORDER",
    "check_params", "channels", "first_variable", "Tower", "make_batch", "losses",
    "reduce_fixed", "reduce_as_ready", "reduce_race", "offset_in_weight_decays",
    "worker", "run", "verdict", "summary_table", "pairing_table", "figures",
    "plot_errors_vs_bound", "plot_bound_ratio", "plot_first_failure", "plot_pairing",
    "plot_signature",
]

NAME = "allreduce_correctness"
TITLE = "nccl_ops.all_sum does not correctly reduce gradients: rounding, or a real bug?"
SEED = "004_aa8fa98cfce03780.txt"
NOTEBOOK = "04_allreduce_correctness.ipynb"

#: The ways of reducing the gradients (see the module docstring).
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
#: The largest difference the report's failed assertion printed.
REPORT_MAX_DIFF = 0.00100000016
#: The live reduction is gloo's ring; its rounding bound judges every result.
BOUND_ORDER = "gloo_ring"
#: An offset counts as k weight-decay gradients when every element is within
#: this fraction of 1e-3 of k·1e-3 (float32 rounding of values near 1e-3 is
#: about 1e-7 of 1e-3; a mispaired gradient varies from element to element
#: by far more).
SIGNATURE_RTOL = 1e-3
#: What each reduction records of :func:`ddplab.numerics.measure`'s answer.
MEASURED = ("max_abs_error", "max_bound_ratio", "within_bound")
#: Longest wait for gloo to finish a race-mode collective before writing anyway.
RACE_POLL_SECONDS = 5.0
#: Full-size channel counts of the report's network, scaled by ``width``.
FULL_CHANNELS = (64, 1280)


def _width_check(width: float) -> str | None:
    if not 0 < width <= 1:
        return "must be in (0, 1]"
    if round(FULL_CHANNELS[0] * width) < 1:
        return f"gives {FULL_CHANNELS[0]}·width < 0.5 channels; use width >= {1 / 128:g}"
    return None


def _positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


PARAMETERS = ParameterSet([
    Parameter("world_size", 2, "number of towers, one rank each (the report: 2 GPUs; tower 0 "
              "uses aaa/W, every other tower bbb/W)", kind="int", minimum=2, maximum=16),
    Parameter("steps", 100, "training steps per mode (the report failed within 100)", kind="int",
              minimum=1, maximum=100_000),
    Parameter("mode", list(MODES), "reductions to run: fixed (agreed order), as_ready (one "
              "all_reduce per gradient as autograd produces it), race (async, buffer written "
              "before wait)", kind="list[str]", choices=MODES),
    Parameter("tolerance", 1e-4, "the report's check: |add_n - reduced| < tolerance",
              kind="float", check=_positive),
    Parameter("seed", 0, "seed of the initial weights (all towers) and of the random batches",
              kind="int", minimum=0, maximum=2**31 - 1),
    Parameter("width", 0.0625, "channel scale: 64·width and 1280·width channels (1/16: seconds "
              "on 2 CPU cores; 1: the report's full size)", kind="float", check=_width_check),
])

#: Seconds: ``ddplab report --quick`` and the notebook test.
QUICK = {"steps": 8}


def check_params(params: dict) -> dict:
    """Validate ``params``; return them parsed. ValueError names the parameter before anything runs."""
    return PARAMETERS.validate(params)


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
        x = F.relu(F.conv2d(x, self.variable("conv1/W"), padding=1))
        x = F.relu(F.conv2d(x, self.variable("conv2/W"), padding=1))
        x = F.relu(F.conv2d(x, self.variable("conv3/W"), stride=2, padding=1))
        x = F.relu(F.conv2d(x, self.variable("conv4/W"), stride=2, padding=1))
        x = F.relu(F.conv2d(x, self.variable("conv5/W"), padding=1))
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
# and leaves what the collectives produced in p.grad. All-reduce is looked up
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

    params = [model.variable(name) for name in sorted(VARIABLES)]
    data_loss.backward(inputs=params)
    works, issued = [], []
    for name, p in zip(sorted(VARIABLES), params):
        if p.grad is None:  # the unused variable: no data gradient, a zero buffer
            p.grad = torch.zeros_like(p)
        issued.append(p.grad.detach().clone())
        works.append(dist.all_reduce(p.grad, async_op=True, label=name))
    decay_grads = torch.autograd.grad(decay, params)
    deadline = time.monotonic() + RACE_POLL_SECONDS
    while not all(w.is_completed() for w in works) and time.monotonic() < deadline:
        time.sleep(1e-4)
    completed = {}
    for name, p, work, extra in zip(sorted(VARIABLES), params, works, decay_grads):
        completed[name] = int(work.is_completed())
        p.grad.add_(extra)  # the bug: the collective's buffer, written before wait()
    for work in works:
        work.wait()
    local = {name: g.add(extra) for name, g, extra in zip(sorted(VARIABLES), issued, decay_grads)}
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


def _ledger_pairs(report) -> tuple[dict[tuple[int, str], dict[int, str]], list[dict]]:
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


def _holders(results: torch.Tensor) -> list[list[int]]:
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


def _measure_step(model: Tower, local: dict, report, mode: str, step: int, params: dict) -> None:
    """Gather every tower's gradients by name; emit the report's check, the bound, the signature.

    A result several ranks hold bit for bit is measured once, by one of them
    in rotation (label ``holders``: the ranks holding it), so ranks share the
    work; a rank whose result differs measures its own.
    """
    import torch.distributed as dist

    from ddplab.numerics import measure, reduce, rounding_bound
    from ddplab.probes import all_gather_flat

    rank, world = dist.get_rank(), dist.get_world_size()
    names = list(VARIABLES)
    sizes = [local[n].numel() for n in names]
    # One gather for what the towers meant to reduce, one for what they got: name
    # by name on every rank, so the check itself cannot mispair.
    meant = all_gather_flat(torch.cat([local[n].reshape(-1) for n in names]))
    got = all_gather_flat(torch.cat([model.variable(n).grad.reshape(-1) for n in names]))
    meant_by_name = {n: t.contiguous() for n, t in zip(names, meant.split(sizes, dim=1))}
    got_by_name = {n: t.contiguous() for n, t in zip(names, got.split(sizes, dim=1))}
    pairs, rows = _ledger_pairs(report)
    if rank == 0:  # the ledger's report is the same on every rank: one copy
        for row in rows:
            _records.emit("collective_mismatch", int(row["problem"] is not None), step=step,
                          mode=mode, seq=row["seq"], variable=row["variable"],
                          combined=row["combined"], problem=row["problem"])
    for index, name in enumerate(names):
        groups = _holders(got_by_name[name])
        if rank == groups[0][(step + index) % len(groups[0])]:
            _records.emit("distinct_results", len(groups), step=step, mode=mode, variable=name)
        mine = next(g for g in groups if rank in g)
        if rank != mine[(step + index) % len(mine)]:
            continue
        contributions = meant_by_name[name]
        reduced = got_by_name[name][rank]
        labels = dict(step=step, mode=mode, variable=name, holders=",".join(map(str, mine)))
        # The report's check: tf.add_n of the towers' gradients against the result, in float32.
        add_n = reduce(contributions, "sequential")
        diff = (add_n - reduced).abs()
        _records.emit("report_max_diff", float(diff.max()), **labels)
        _records.emit("report_check_pass", int(bool((diff < params["tolerance"]).all())), **labels)
        m = measure(reduced, contributions, BOUND_ORDER)
        for metric in MEASURED:
            _records.emit(metric, m[metric], **labels)
        _records.emit("rounding_bound", float(rounding_bound(contributions, BOUND_ORDER).max()),
                      **labels)
        _records.emit("constant_offset_wd", offset_in_weight_decays(add_n, reduced), **labels)
        paired = pairs.get((rank, name), {})
        if paired and any(label != name for label in paired.values()):
            # Mispaired: is the result exactly the sum of what the ledger says was combined?
            combined = torch.stack([meant_by_name[paired.get(r, name)][r] for r in range(world)])
            _records.emit("paired_bound_ratio", measure(reduced, combined, BOUND_ORDER)["max_bound_ratio"],
                          **labels, paired=" + ".join(f"{r}:{paired.get(r, name)}" for r in range(world)))


# --------------------------------------------------------------------------- inside a rank


def _train(mode: str, params: dict, rank: int) -> None:
    import torch.distributed as dist

    from ddplab.ledger import CollectiveLedger

    model = Tower(rank, params["width"], params["seed"])
    for step in range(params["steps"]):
        images, labels = make_batch(params["seed"], step, rank)
        for p in model.parameters():
            p.grad = None
        data_loss, decay = losses(model, images, labels)
        completed = None
        with CollectiveLedger(emit=False) as ledger:
            if mode == "fixed":
                local = reduce_fixed(model, data_loss + decay)
            elif mode == "as_ready":
                local = reduce_as_ready(model, data_loss + decay)
            else:
                local, completed = reduce_race(model, data_loss, decay)
        _measure_step(model, local, ledger.report, mode, step, params)
        if completed is not None:
            for name, flag in completed.items():
                _records.emit("write_after_completion", flag, step=step, mode=mode, variable=name)
        _records.emit("loss", float(data_loss.detach() + decay.detach()), step=step, mode=mode)
        # Plain SGD on the summed gradients, as the report's apply_gradients (torch.optim
        # would import torch._dynamo: seconds per rank for nothing this case uses).
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-LEARNING_RATE)
    dist.barrier()


def worker(params: dict) -> dict:
    """Train one tower per rank for ``steps`` steps in each mode; return this rank's seconds per mode."""
    import torch.distributed as dist

    seconds = {}
    for mode in params["mode"]:
        t0 = time.perf_counter()
        _train(mode, params, dist.get_rank())
        seconds[mode] = time.perf_counter() - t0
    return seconds


def _timeout(params: dict) -> float:
    # Generous: about 40 ms a step at width 1/16 on two busy cores, ~3 s at full width.
    per_step = 0.5 + 40.0 * params["width"] ** 2
    return 120.0 + params["steps"] * len(params["mode"]) * per_step * params["world_size"] / 2


def run(params: dict, progress: bool = True):
    """Validate ``params``, launch ``world_size`` gloo ranks, return the tidy records."""
    from ddplab.launcher import launch
    from ddplab.progress import progress_bar

    params = check_params(params)
    total = params["steps"] * len(params["mode"])
    bar = progress_bar(total=total, desc=f"{NAME} W={params['world_size']}") if progress else None

    def on_record(rec: dict) -> None:
        if bar is not None and rec["metric"] == "loss" and rec["rank"] == 0:
            bar.update(1)

    t0 = time.perf_counter()
    try:
        result = launch(worker, params["world_size"], "gloo", kwargs=dict(params=params),
                        timeout=_timeout(params), on_record=on_record)
    finally:
        if bar is not None:
            bar.close()
    rows = list(result.ordered_records)
    rows.append(_records.record("launch_seconds", time.perf_counter() - t0,
                                world_size=params["world_size"], width=params["width"]))
    for rank, seconds in enumerate(result.returns):
        for mode, value in seconds.items():
            rows.append(_records.record("mode_seconds", value, rank=rank, mode=mode))
    ordered = sorted(rows, key=lambda r: -1 if r.get("rank") is None else r["rank"])
    return _records.to_frame(ordered)


# --------------------------------------------------------------------------- tables


def _rows(records, metric: str, mode: str | None = None):
    rows = records[records["metric"] == metric]
    if mode is not None:
        rows = rows[rows["mode"] == mode]
    return rows


def _modes(records) -> list[str]:
    present = set(_rows(records, "report_check_pass")["mode"].dropna())
    return [m for m in MODES if m in present]


def _first_step(rows) -> int | None:
    return None if rows.empty else int(rows["step"].min())


def _mismatched_pairs(records, mode: str) -> list[str]:
    """The distinct 'combined' descriptions of collectives the ledger flagged in ``mode``."""
    rows = _rows(records, "collective_mismatch", mode)
    return sorted(set(rows.loc[rows["value"] == 1, "combined"].dropna()))


def _mode_facts(records, mode: str, params: dict | None) -> dict:
    """Everything the verdict and the summary say about one mode, computed from its records."""
    import pandas as pd

    check = _rows(records, "report_check_pass", mode)
    ratio = _rows(records, "max_bound_ratio", mode)
    diff = _rows(records, "report_max_diff", mode)
    offset = _rows(records, "constant_offset_wd", mode)
    paired = _rows(records, "paired_bound_ratio", mode)
    distinct = _rows(records, "distinct_results", mode)
    mismatch = _rows(records, "collective_mismatch", mode)
    # A result is (step, rank that measured it, variable); its label holders names every
    # rank that holds it bit for bit.
    keys = ["step", "rank", "variable"]
    failing = check[check["value"] == 0]
    fail_keys = failing.set_index(keys).index
    failing_ratio = ratio.set_index(keys).loc[lambda f: f.index.isin(fail_keys), "value"]
    failing_offset = offset.set_index(keys).loc[lambda f: f.index.isin(fail_keys), "value"]
    failing_diff = diff.set_index(keys).loc[lambda f: f.index.isin(fail_keys), "value"]
    outside = ratio[ratio["value"] > 1]
    facts = dict(
        mode=mode,
        steps=int(check["step"].nunique()),
        results=len(check),
        failed=len(failing),
        failed_steps=int(failing["step"].nunique()),
        first_failing_step=_first_step(failing),
        failing_variables=sorted(set(failing["variable"])),
        max_diff=float(diff["value"].max()) if len(diff) else math.nan,
        max_ratio=float(ratio["value"].max()) if len(ratio) else math.nan,
        min_failing_ratio=float(failing_ratio.min()) if len(failing_ratio) else math.nan,
        outside_bound=len(outside),
        first_outside_step=_first_step(outside),
        classification="rounding" if len(ratio) and ratio["value"].max() <= 1 else "not rounding",
        failing_diffs=(float(failing_diff.min()), float(failing_diff.max())) if len(failing_diff) else None,
        constant_offsets=failing_offset.value_counts().to_dict() if len(failing_offset) else {},
        report_number=int((failing_diff.map(lambda v: f"{v:.9g}") == f"{REPORT_MAX_DIFF:.9g}").sum()),
        max_paired_ratio=float(paired["value"].max()) if len(paired) else math.nan,
        paired_results=len(paired),
        failing_unexplained=int((~fail_keys.isin(paired[paired["value"] <= 1].set_index(keys).index)).sum()),
        mismatched_collectives=int(mismatch["value"].sum()) if len(mismatch) else 0,
        mismatched_steps=int(mismatch.loc[mismatch["value"] == 1, "step"].nunique()) if len(mismatch) else 0,
        pairs=_mismatched_pairs(records, mode),
        ranks_disagree=int((distinct["value"] > 1).sum()),
        agree_checks=len(distinct),
    )
    if mode == "race":
        # Per (step, variable): did every rank's write land after gloo had run?
        writes = _rows(records, "write_after_completion", mode)
        late = writes.groupby(["step", "variable"])["value"].min()
        passed = check.groupby(["step", "variable"])["value"].min()
        both = pd.concat([late.rename("late"), passed.rename("passed")], axis=1).dropna()
        facts.update(writes=len(late), triggered=int((late == 1).sum()),
                     triggered_failed=int(((both["late"] == 1) & (both["passed"] == 0)).sum()),
                     untriggered_failed=int(((both["late"] == 0) & (both["passed"] == 0)).sum()))
    return facts


def summary_table(records, params: dict | None = None):
    """One row per mode: the report's check, ddplab's classification, the ledger, the signature."""
    import pandas as pd

    rows = []
    for mode in _modes(records):
        f = _mode_facts(records, mode, params)
        offsets = ", ".join(f"{int(k)}×1e-3: {n}" if k else f"not constant: {n}"
                            for k, n in sorted(f["constant_offsets"].items()))
        rows.append({
            "mode": mode,
            "results checked": f["results"],
            "failed the report's check": f["failed"],
            "first failing step": "never" if f["first_failing_step"] is None else f["first_failing_step"],
            "largest |add_n - reduced|": f"{f['max_diff']:.9g}",
            "largest error / rounding bound": _fmt_bound(f["max_ratio"]),
            "classification": f["classification"],
            "mispaired collectives (ledger)": f["mismatched_collectives"],
            "failing errors as multiples of 1e-3": offsets or "—",
            "steps × variables where ranks disagree": f"{f['ranks_disagree']} of {f['agree_checks']}",
        })
    return pd.DataFrame(rows).set_index("mode")


def pairing_table(records, step: int | None = None):
    """The ledger's pairing: per mode and collective (seq within the step), each rank's variable.

    Read from the ``combined`` label of rank 0's ``collective_mismatch``
    records (the ledger's cross-checked report is the same on every rank).

    ``step`` defaults to the first recorded step; ``same every step`` says
    whether every other step paired the same tensors.
    """
    import pandas as pd

    rows = _rows(records, "collective_mismatch")
    if rows.empty:
        raise ValueError("the records hold no collective_mismatch rows (no ledger)")
    step = int(rows["step"].min()) if step is None else step
    out = []
    for mode in [m for m in MODES if m in set(rows["mode"])]:
        sub = rows[rows["mode"] == mode]
        # Each step's pairing as one tuple of (seq, combined): equal tuples, equal pairings.
        per_step = sub.sort_values("seq").groupby("step")["combined"].agg(tuple)
        same = per_step.nunique() == 1
        for _, rec in sub[sub["step"] == step].sort_values("seq").iterrows():
            row = {"mode": mode, "collective": int(rec["seq"])}
            row.update({f"rank {r}": v for r, v in (p.split(":", 1) for p in rec["combined"].split(" + "))})
            row["mispaired"] = bool(rec["value"] == 1)
            row["same every step"] = bool(same)
            out.append(row)
    table = pd.DataFrame(out).set_index(["mode", "collective"])
    table.attrs["step"] = step
    return table


# --------------------------------------------------------------------------- the verdict


#: "Many orders of magnitude": a failing reduction this far beyond the bound is no rounding.
MANY_DECADES = 3


def _fmt_ratio(x: float) -> str:
    return "—" if math.isnan(x) else (f"10^{math.log10(x):.1f}" if x > 0 else "0")


def _wd_multiple(k: int) -> str:
    return "1e-3" if k == 1 else f"{k}×1e-3"


def _fmt_bound(x: float) -> str:
    # Seven digits: a ratio of 0.9999996 must not print as 1.
    return f"{x:.7g}"


def _describe_pairs(pairs: list[str], joiner: str = "; ") -> str:
    """'0:bbb/W + 1:aaa/W' → "rank 0's bbb/W with rank 1's aaa/W"."""
    out = []
    for pair in pairs:
        named = [f"rank {r}'s {v}" for r, v in (p.split(":", 1) for p in pair.split(" + "))]
        out.append(named[0] + " with " + ", ".join(named[1:]))
    return joiner.join(out)


def verdict(records, params: dict) -> Verdict:
    """The verdict rule: the agreed order is rounding; as_ready and race are real bugs, and why.

    kind "bug" when a mode other than fixed is classified "not rounding",
    "rounding" when every mode run stays within the rounding bound.
    """
    params = check_params(params)
    modes = _modes(records)
    facts = {m: _mode_facts(records, m, params) for m in modes}
    tol = params["tolerance"]
    findings = []

    f = facts.get("fixed")
    if f:
        ok = f["failed"] == 0 and f["classification"] == "rounding" and f["mismatched_collectives"] == 0
        evidence = (f"{f['results'] - f['failed']} of {f['results']} results ({f['steps']} steps × "
                    f"{len(VARIABLES)} variables; ranks disagree in {f['ranks_disagree']} of them) pass "
                    f"|add_n − reduced| < {tol:g} (largest difference {f['max_diff']:.3g}); largest "
                    f"error / rounding bound {_fmt_bound(f['max_ratio'])} ({f['outside_bound']} beyond 1); "
                    f"the ledger found {f['mismatched_collectives']} mispaired collectives")
    else:
        ok, evidence = False, "not run (mode does not include 'fixed')"
    findings.append(Finding("fixed_within_bound", "fixed (one agreed order): every result passes "
                            "the report's check and stays within the rounding bound at every step",
                            ok, evidence))

    a = facts.get("as_ready")
    if a:
        decades = math.log10(a["min_failing_ratio"]) if a["failed"] and a["min_failing_ratio"] > 0 else 0
        ok = a["failed"] > 0 and a["classification"] == "not rounding" and decades >= MANY_DECADES
        if a["failed"]:
            evidence = (f"{a['failed']} of {a['results']} results fail the report's check, from step "
                        f"{a['first_failing_step']} on, in {', '.join(a['failing_variables'])}; their "
                        f"error is {_fmt_ratio(a['min_failing_ratio'])} to {_fmt_ratio(a['max_ratio'])} "
                        f"times the rounding bound; classified '{a['classification']}'")
        else:
            evidence = (f"no result failed in {a['steps']} steps (largest error / bound "
                        f"{_fmt_bound(a['max_ratio'])})")
        findings.append(Finding(
            "as_ready_not_rounding",
            f"as_ready (one all_reduce per gradient as autograd produces it): fails the report's "
            f"check with errors at least 10^{MANY_DECADES} times the rounding bound — a real bug",
            ok, evidence))
        named = set(v for pair in a["pairs"] for v in (p.split(":", 1)[1] for p in pair.split(" + ")))
        explained = a["failing_unexplained"] == 0 and a["max_paired_ratio"] <= 1
        ok = bool(a["pairs"]) and explained and set(a["failing_variables"]) <= named
        if a["pairs"]:
            evidence = (f"the ledger flags {a['mismatched_collectives']} collectives in "
                        f"{a['mismatched_steps']} of {a['steps']} steps: {_describe_pairs(a['pairs'])}; "
                        f"each of the {a['paired_results']} results of those collectives is the sum of "
                        f"exactly the tensors the ledger paired, within the rounding bound (largest "
                        f"error / bound against that sum {_fmt_bound(a['max_paired_ratio'])}); "
                        f"{a['failed'] - a['failing_unexplained']} of the {a['failed']} failing results "
                        f"are explained so; failing variables {', '.join(a['failing_variables']) or 'none'}; "
                        f"the towers end up holding different results in {a['ranks_disagree']} of "
                        f"{a['agree_checks']} steps × variables")
        else:
            evidence = "the ledger found no mispaired collective"
        findings.append(Finding(
            "as_ready_mispaired",
            "The cause is mispaired collectives: towers issue in different orders and collectives pair "
            "by issue order, so same-shaped gradients of different variables are summed",
            ok, evidence))

    r = facts.get("race")
    if r:
        k = params["world_size"] - 1
        offsets = r["constant_offsets"]
        ok = (r["triggered"] > 0 and r["triggered_failed"] == r["triggered"]
              and r["classification"] == "not rounding" and r["mismatched_collectives"] == 0
              and offsets.get(float(k), 0) == r["failed"])
        evidence = (f"every rank's write landed after gloo had run in {r['triggered']} of {r['writes']} "
                    f"steps × variables"
                    + (" (the race did not trigger in this run)" if r["triggered"] == 0 else "")
                    + f"; {r['triggered_failed']} of those fail the report's check"
                    + (f" ({r['untriggered_failed']} of the {r['writes'] - r['triggered']} others)"
                       if r["writes"] > r["triggered"] else "")
                    + f"; error {_fmt_ratio(r['min_failing_ratio'])} to {_fmt_ratio(r['max_ratio'])} times "
                    f"the rounding bound ('{r['classification']}'); the ledger found "
                    f"{r['mismatched_collectives']} mispaired collectives; {offsets.get(float(k), 0)} of "
                    f"{r['failed']} failing results are short by exactly {_wd_multiple(k)} at every element "
                    f"(the other towers' weight-decay gradients); every tower holds the same wrong "
                    f"value in {r['agree_checks'] - r['ranks_disagree']} of {r['agree_checks']} steps × "
                    f"variables, so a cross-rank consistency check cannot see it")
        findings.append(Finding(
            "race_not_rounding",
            "race (buffer written again before wait()): wherever the write lands after the collective "
            "read the buffer, the result lacks the other towers' last write — a real bug the ledger "
            "cannot see (the pairing is right)",
            ok, evidence))

    if a or r:
        findings.append(_signature_finding(facts, params))

    bugs = [m for m in ("as_ready", "race")
            if m in facts and facts[m]["classification"] == "not rounding"]
    kind = "bug" if bugs else "rounding"
    findings_ok = all(fi.holds for fi in findings)
    parts = []
    if f:
        parts.append(f"with one agreed order (fixed) all {f['results']} results "
                     + ("pass the report's check and stay within the rounding bound"
                        if f["failed"] == 0 and f["classification"] == "rounding"
                        else f"do not: {f['failed']} fail the check, largest error / bound "
                             f"{_fmt_bound(f['max_ratio'])}"))
    if a and a["failed"]:
        pairs = _describe_pairs(a["pairs"], " and ") or "different tensors"
        parts.append(f"issuing each all_reduce as autograd produces the gradient (as_ready) fails from "
                     f"step {a['first_failing_step']}: the towers issue in different orders and collectives "
                     f"pair by issue order, so {pairs} were summed (errors "
                     f"{_fmt_ratio(a['min_failing_ratio'])}–{_fmt_ratio(a['max_ratio'])} × the bound)")
    if r and r["failed"]:
        parts.append(f"writing the buffer before wait() (race) leaves results short by the other towers' "
                     f"weight-decay gradients, {_wd_multiple(params['world_size'] - 1)}"
                     + (f" — {r['report_number']} results print the report's {REPORT_MAX_DIFF:.9g}"
                        if r["report_number"] else ""))
    if kind == "bug":
        headline = "A real bug, not rounding: " + "; ".join(parts) + "."
    else:
        headline = "Rounding only: " + "; ".join(parts) + "." if parts else "Nothing was measured."
    if not findings_ok:
        headline += (" Not every expected finding holds: "
                     + ", ".join(fi.key for fi in findings if not fi.holds) + " (read their evidence).")
    return Verdict(case=NAME, kind=kind, headline=headline, findings=findings)


def _signature_finding(facts: dict, params: dict) -> Finding:
    """Does the reproduction's error carry the report's 0.00100000016, and what does that say?"""
    w = params["world_size"]
    parts, ok = [f"the report printed {REPORT_MAX_DIFF:.9g} = {REPORT_MAX_DIFF / WEIGHT_DECAY:.8f}×1e-3, "
                 f"one weight-decay gradient (an unused variable's whole gradient is 1e-3 everywhere)"], True
    a, r = facts.get("as_ready"), facts.get("race")
    if a and a["failed"]:
        constant = sum(n for k, n in a["constant_offsets"].items() if k)
        lo, hi = a["failing_diffs"]
        ok &= constant == 0
        parts.append(f"as_ready: largest differences {lo:.3g} to {hi:.3g}, a constant multiple of 1e-3 in "
                     f"{constant} of {a['failed']} failing results, the report's number in "
                     f"{a['report_number']}: a mispaired result is off by another tower's whole gradient, "
                     f"which varies from element to element")
    if r and r["failed"]:
        k = w - 1
        exact = r["constant_offsets"].get(float(k), 0)
        ok &= exact == r["failed"]
        parts.append(f"race: {exact} of {r['failed']} failing results are off by exactly "
                     f"{_wd_multiple(k)} at every element, {r['report_number']} print the report's "
                     f"{REPORT_MAX_DIFF:.9g} digit for digit" + (" (W = 2)" if w == 2 else ""))
    parts.append("so the report's failing result most likely summed the right variable's gradients with "
                 "one weight-decay term (1e-3 at every element) missing or doubled, which is what a buffer "
                 "read before its last write gives; swapped aaa/W and bbb/W would be off by a whole "
                 "gradient of another tower")
    return Finding("report_signature",
                   "The report's 0.00100000016 carries the signature of a gradient read before its last "
                   "write (race), not that of a mispaired collective (as_ready)", ok, "; ".join(parts))


# --------------------------------------------------------------------------- figures


def figures(records, params: dict | None = None) -> list:
    """The case's figures, most telling first (the explorer shows them in this order)."""
    return [plot_errors_vs_bound(records, params), plot_bound_ratio(records, params),
            plot_first_failure(records, params), plot_pairing(records, params),
            plot_signature(records, params)]


def _variable_colors() -> dict:
    import seaborn as sns

    palette = sns.color_palette("tab10", n_colors=len(VARIABLES))
    return dict(zip(VARIABLES, palette))


def _max_over_ranks(records, metric: str):
    """``metric`` per (mode, variable, step): the largest value any rank recorded."""
    rows = _rows(records, metric)
    if rows.empty:
        raise ValueError(f"the records hold no {metric!r} rows")
    return (rows.groupby(["mode", "variable", "step"])["value"].max().reset_index()
            .astype({"step": int}))


def _mode_axes(modes: list[str], height: float = 3.6):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, len(modes), figsize=(4.6 * len(modes) + 1.6, height), sharey=True,
                             squeeze=False)
    return fig, dict(zip(modes, axes[0]))


def _floor(values) -> float:
    positive = values[values > 0]
    return 10 ** (math.floor(math.log10(positive.min())) - 1) if len(positive) else 1e-12


def _legend_right(fig, axes) -> None:
    handles = {}
    for ax in axes:
        for h, label in zip(*ax.get_legend_handles_labels()):
            handles.setdefault(label, h)
    fig.legend(list(handles.values()), list(handles), loc="upper left", bbox_to_anchor=(1.0, 0.9),
               frameon=False)


def plot_errors_vs_bound(records, params: dict | None = None):
    """Max error per variable per step (log), the rounding bound, the report's tolerance and 1e-3.

    Error: the largest |reduced − exact sum| over elements and ranks. Bound:
    the largest per-element rounding bound of gloo's ring over the
    variables. Exact zeros are drawn on a dashed floor line.
    """
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    errors = _max_over_ranks(records, "max_abs_error")
    bounds = _rows(records, "rounding_bound").groupby(["mode", "step"])["value"].max()
    modes = [m for m in MODES if m in set(errors["mode"])]
    tol = (params or {}).get("tolerance", PARAMETERS["tolerance"].default)
    floor = _floor(errors["value"])
    colors = _variable_colors()
    with theme():
        fig, axes = _mode_axes(modes)
        for mode, ax in axes.items():
            part = errors[errors["mode"] == mode]
            for name in VARIABLES:
                rows = part[part["variable"] == name].sort_values("step")
                if rows.empty:
                    continue
                ax.plot(rows["step"], rows["value"].clip(lower=floor), color=colors[name], lw=1.4,
                        marker="o", ms=2.5, label=name)
            b = bounds.loc[mode].sort_index()
            ax.plot(b.index.astype(int), b.values, color="black", ls="--", lw=1.2,
                    label="rounding bound (largest, gloo ring)")
            ax.axhline(tol, color="0.45", ls=":", lw=1.2, label=f"the report's tolerance {tol:g}")
            ax.axhline(WEIGHT_DECAY, color="tab:red", ls="-.", lw=0.9, alpha=0.6,
                       label="1e-3: one weight-decay gradient")
            ax.axhline(floor, color="0.6", ls="--", lw=0.6)
            ax.set_yscale("log")
            ax.set_title(mode)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        first = next(iter(axes.values()))
        first.set_ylabel("max |reduced − exact sum|")
        first.text(0.01, floor * 1.6, "exact zero", transform=first.get_yaxis_transform(), fontsize=8,
                   color="0.4")
        _legend_right(fig, axes.values())
        fig.suptitle("Largest error per variable and step, against the rounding bound", y=1.02)
        fig.tight_layout()
    return fig


def plot_bound_ratio(records, params: dict | None = None):
    """Error / rounding bound per variable per step (largest over elements and ranks), log scale."""
    from matplotlib.ticker import MaxNLocator

    from ddplab.plots import theme

    ratios = _max_over_ranks(records, "max_bound_ratio")
    modes = [m for m in MODES if m in set(ratios["mode"])]
    floor = _floor(ratios["value"])
    colors = _variable_colors()
    with theme():
        fig, axes = _mode_axes(modes)
        for mode, ax in axes.items():
            part = ratios[ratios["mode"] == mode]
            for name in VARIABLES:
                rows = part[part["variable"] == name].sort_values("step")
                if not rows.empty:
                    ax.plot(rows["step"], rows["value"].clip(lower=floor), color=colors[name], lw=1.4,
                            marker="o", ms=2.5, label=name)
            ax.axhline(1.0, color="black", ls="--", lw=1.2, label="1: what rounding can explain")
            ax.axhspan(ax.get_ylim()[0] if ax.get_ylim()[0] > 0 else floor, 1.0, color="tab:green",
                       alpha=0.06)
            ax.set_yscale("log")
            ax.set_title(mode)
            ax.set_xlabel("step")
            ax.xaxis.set_major_locator(MaxNLocator(integer=True))
        next(iter(axes.values())).set_ylabel("error / rounding bound")
        _legend_right(fig, axes.values())
        fig.suptitle("Error in multiples of the rounding bound (≤ 1: rounding; above: a bug)", y=1.02)
        fig.tight_layout()
    return fig


def plot_first_failure(records, params: dict | None = None):
    """Per mode: the first step failing the report's check, and the first beyond the rounding bound."""
    import matplotlib.pyplot as plt

    from ddplab.plots import theme

    modes = _modes(records)
    facts = [_mode_facts(records, m, params) for m in modes]
    steps = max(f["steps"] for f in facts) if facts else 1
    bars = (("first_failing_step", "failed", -0.18, "the report's check fails", "tab:red"),
            ("first_outside_step", "outside_bound", 0.18, "beyond the rounding bound", "tab:purple"))
    with theme():
        fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.75 * len(modes)))
        labelled = set()
        for i, f in enumerate(facts):
            for key, count, offset, label, color in bars:
                first, y = f[key], i + offset
                if first is None:
                    ax.barh(y, steps, height=0.32, color="none", edgecolor="0.6", hatch="//",
                            label=None if "never" in labelled else "never")
                    labelled.add("never")
                    ax.text(steps, y, f"  never in {f['steps']} steps", va="center", fontsize=8)
                    continue
                # A failure at step 0 still gets a visible sliver.
                ax.barh(y, max(first, 0.01 * steps), height=0.32, color=color,
                        label=None if label in labelled else label)
                labelled.add(label)
                ax.text(max(first, 0.01 * steps), y, f"  step {first} ({f[count]} of {f['results']} "
                        f"results)", va="center", fontsize=8)
        ax.set_yticks(range(len(modes)), modes)
        ax.invert_yaxis()
        ax.set_xlim(0, steps * 1.55)
        ax.set_xlabel("step")
        ax.legend(loc="lower right", fontsize=8, frameon=False)
        ax.set_title("First failing step per mode")
        fig.tight_layout()
    return fig


def plot_pairing(records, params: dict | None = None):
    """The ledger's pairing table: per mode, which variable each rank reduced in each collective."""
    import matplotlib.pyplot as plt

    from ddplab.plots import theme

    table = pairing_table(records)
    modes = list(dict.fromkeys(table.index.get_level_values("mode")))
    ranks = [c for c in table.columns if c.startswith("rank ")]
    with theme():
        fig, axes = plt.subplots(1, len(modes), figsize=(1.2 + (1.3 * len(ranks) + 0.6) * len(modes), 3.4),
                                 squeeze=False)
        for ax, mode in zip(axes[0], modes):
            sub = table.loc[mode]
            ax.set_xlim(0, len(ranks))
            ax.set_ylim(len(sub), 0)
            for i, (seq, row) in enumerate(sub.iterrows()):
                for j, col in enumerate(ranks):
                    color = "#f4b6b6" if row["mispaired"] else "#cfe8cf"
                    ax.add_patch(plt.Rectangle((j, i), 1, 1, facecolor=color, edgecolor="white", lw=2))
                    ax.text(j + 0.5, i + 0.5, row[col], ha="center", va="center", fontsize=8.5)
            ax.set_xticks([j + 0.5 for j in range(len(ranks))], ranks)
            ax.set_yticks([i + 0.5 for i in range(len(sub))], [f"#{s}" for s in sub.index])
            ax.tick_params(length=0)
            ax.grid(False)
            same = "same at every step" if sub["same every step"].all() else "differs between steps"
            ax.set_title(f"{mode}\n({same})", fontsize=10)
        axes[0][0].set_ylabel("collective (issue order in the step)")
        fig.suptitle(f"The ledger: which variable each rank reduced (step {table.attrs['step']}; "
                     f"red: different tensors combined)", y=1.02)
        fig.tight_layout()
    return fig


def plot_signature(records, params: dict | None = None):
    """Failing results' largest |add_n − reduced| per mode, against the report's 0.00100000016.

    Colour: whether the difference is the same multiple of 1e-3 at every
    element (a weight-decay term missing) or varies (another tensor summed in).
    """
    import matplotlib.pyplot as plt
    import numpy as np

    from ddplab.plots import theme

    diff = _rows(records, "report_max_diff")
    check = _rows(records, "report_check_pass")
    offset = _rows(records, "constant_offset_wd")
    keys = ["mode", "step", "rank", "variable"]
    merged = (diff.set_index(keys)["value"].rename("diff").to_frame()
              .join(check.set_index(keys)["value"].rename("pass"))
              .join(offset.set_index(keys)["value"].rename("offset")).reset_index())
    failing = merged[merged["pass"] == 0]
    modes = [m for m in MODES if m in set(merged["mode"])]
    tol = (params or {}).get("tolerance", PARAMETERS["tolerance"].default)
    rng = np.random.default_rng(0)  # jitter only: where a dot sits sideways means nothing
    with theme():
        fig, ax = plt.subplots(figsize=(7.5, 3.8))
        for i, mode in enumerate(modes):
            part = failing[failing["mode"] == mode]
            if part.empty:
                ax.text(i, tol, "no failure", ha="center", va="bottom", fontsize=8, color="0.4")
                continue
            x = i + rng.uniform(-0.25, 0.25, len(part))
            constant = part["offset"] != 0
            ax.scatter(x[~constant.values], part.loc[~constant, "diff"], s=9, color="tab:blue", alpha=0.6,
                       label="varies by element (another tensor summed in)" if (~constant).any() else None)
            ax.scatter(x[constant.values], part.loc[constant, "diff"], s=9, color="tab:red", alpha=0.6,
                       label=("k·1e-3 at every element (a weight-decay term missing)"
                              if constant.any() else None))
        ax.axhline(REPORT_MAX_DIFF, color="black", ls="--", lw=1.1,
                   label=f"the report's {REPORT_MAX_DIFF:.9g}")
        ax.axhline(tol, color="0.45", ls=":", lw=1.1, label=f"the report's tolerance {tol:g}")
        ax.set_yscale("log")
        ax.set_xticks(range(len(modes)), modes)
        ax.set_xlim(-0.6, len(modes) - 0.4)
        ax.set_ylabel("largest |add_n − reduced| (failing results)")
        ax.legend(loc="upper left", bbox_to_anchor=(1.0, 0.95), frameon=False, fontsize=8)
        ax.set_title("Does the error carry the report's signature?")
        fig.tight_layout()
    return fig

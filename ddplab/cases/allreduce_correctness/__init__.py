"""Case 04 — "nccl_ops.all_sum does not correctly reduce gradients".

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
rank, reducing the gradients three ways (``mode``, one launch each):

``fixed``
    after the backward pass, every rank all-reduces every gradient in one
    agreed order (sorted by variable name): the correct program.
``as_ready``
    one all-reduce per gradient the moment autograd produces it (a
    post-accumulate-grad hook), the report's hypothesis. A leaf's gradient is
    ready once every path to it has been back-propagated: the variable a
    tower does *not* use (its gradient is the weight-decay term alone) comes
    first, the one its first convolution uses comes last. Tower 0 uses
    ``aaa/W`` and the others ``bbb/W``, so tower 0 issues ``bbb/W, conv5/W,
    ..., conv1/W, aaa/W`` and every other tower ``aaa/W, conv5/W, ...,
    bbb/W``: the first and the last collective of a step combine *different
    variables of the same shape*, silently. Autograd's CPU engine is
    single-threaded and orders ready nodes by creation, so the order is the
    same at every step and every run.
``race``
    the agreed order, but asynchronous (``async_op=True``), and the rank
    writes the gradient buffer again before ``wait()``: the data term's
    gradient is issued, the weight-decay term's gradient is added in place
    afterwards. To make the losing interleaving reproducible on CPU, the rank
    writes once gloo reports the work completed (``Work.is_completed()``,
    never ``wait()``); each write records whether the collective had
    completed (``write_after_completion``), so a step in which the race did
    not trigger says so.

The network (the report's, in NCHW): per tower the variables ``aaa/W`` and
``bbb/W`` (64×3×3×3 at full width), one of them convolving the input without
an activation, then 3×3 convolutions ``conv1..conv5`` to 64, 64, 1280
(stride 2), 1280 (stride 2) and 10 channels with ReLU, the spatial mean as
logits, cross-entropy on random ``32×3×30×30`` inputs with labels in 0..8,
plus weight decay ``1e-3·Σ_v Σ w`` over all seven variables, and SGD (lr
0.001) on the *summed* gradients. ``width`` scales the channel counts; every
tower starts from the same Glorot-uniform weights, so only the reduction
differs (the check compares each reduction with the sum of the gradients the
towers actually computed, so the report's independent initialization would
change nothing).

Records (label ``mode`` on every one), per step and variable, measured by one
of the ranks holding a result bit for bit (label ``holders``):
``report_max_diff`` and ``report_check_pass`` (the report's check, in
float32), ``max_abs_error``, ``max_bound_ratio``, ``within_bound`` and
``frac_matches_order`` (:func:`ddplab.numerics.measure` against the exact sum
and gloo's emulated ring; labels ``verdict`` and ``evidence``: "bitwise"
where the ring's bits decide), ``rounding_bound``, ``constant_offset_wd`` (k
when add_n − reduced is k·1e-3 at every element, else 0),
``paired_bound_ratio`` (mispaired results measured against the sum of what
the ledger says was combined; labels ``paired``, ``verdict``, ``evidence``),
``distinct_results``; per collective (rank 0) ``collective_mismatch`` with
labels ``seq``, ``variable`` and ``combined`` (``0:bbb/W + 1:aaa/W``); per
step ``loss``; in race mode ``write_after_completion``; per rank
``mode_seconds``.
"""
from __future__ import annotations

from ddplab.cases.allreduce_correctness import figures, verdict, worker
from ddplab.cases.allreduce_correctness.worker import FULL_CHANNELS, MODES
from ddplab.cases.base import Case, LaunchPlan
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "AllreduceCorrectness"]


def _width_check(width: float) -> str | None:
    if not 0 < width <= 1:
        return "must be in (0, 1]"
    if round(FULL_CHANNELS[0] * width) < 1:
        return f"gives {FULL_CHANNELS[0]}·width < 0.5 channels; use width >= {1 / 128:g}"
    return None


def _positive(value) -> str | None:
    return None if value > 0 else "must be > 0"


class AllreduceCorrectness(Case):
    name = "allreduce_correctness"
    title = "nccl_ops.all_sum does not correctly reduce gradients: rounding, or a real bug?"
    notebook = "04_allreduce_correctness.ipynb"
    reproduces = "allreduce_correctness"
    parameters = ParameterSet([
        Parameter("world_size", 2, "number of towers, one rank each (the report: 2 GPUs; tower 0 "
                  "uses aaa/W, every other tower bbb/W)", kind="int", minimum=2, maximum=16,
                  role="world_size"),
        Parameter("steps", 100, "training steps per mode (the report failed within 100)", kind="int",
                  minimum=1, maximum=100_000, role="steps"),
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
    quick = {"steps": 8}
    figures_by_name = {"errors_vs_bound": figures.plot_errors_vs_bound,
                       "bound_ratio": figures.plot_bound_ratio,
                       "first_failure": figures.plot_first_failure,
                       "pairing": figures.plot_pairing,
                       "signature": figures.plot_signature}
    key_figure = "errors_vs_bound"
    tables_by_name = {"summary": figures.summary_table, "pairing": figures.pairing_table}
    run_label = "mode"
    worker = worker.worker                  # kwargs mode: one launch per mode
    verdict = verdict.verdict

    def launches(self, params: dict) -> list[LaunchPlan]:
        """One launch per mode, so that each gets its own progress bar and timing."""
        # Generous: about 40 ms a step at width 1/16 on two busy cores, ~3 s at full width.
        per_step = 0.5 + 40.0 * params["width"] ** 2
        timeout = 120.0 + params["steps"] * per_step * params["world_size"] / 2
        return [LaunchPlan(world_size=params["world_size"], kwargs={"mode": mode}, label=mode,
                           steps=params["steps"], timeout=timeout) for mode in params["mode"]]


CASE = AllreduceCorrectness()

"""Case 02 — "wrapping an fp16 model in DDP changes the weights".

The report printed the norm of an ``nn.Linear(512, 512, bias=False,
dtype=float16)`` (seed 42) before wrapping it in DDP (5.65625), after
``torch.compile`` (5.65625) and after wrapping (13.0625), and concluded that
DDP changed the weights. Two separate questions hide in that:

* *Did any bit of the weights change?* Each rank fingerprints its parameters
  (sha256 of the bytes) before wrapping, after ``torch.compile`` and after
  DDP's constructor, against its own initial weights and rank 0's. With the
  same seed on every rank DDP changes nothing; with a different seed per rank
  (``same_init=False``) DDP's constructor broadcasts rank 0's parameters: a
  real change on ranks != 0, by design.
* *Why does the printed norm move?* ``‖w‖₂ = √(Σ w_i²)``. Accumulated in
  float16, a running sum of squares stops growing once each increment falls
  below half an ulp of the sum: with ``|w_i| ≤ 1/√512`` every square is
  ``≤ 2⁻⁹`` and half an ulp of 4.0 is ``2⁻⁹``, so the sum stalls at 4.0. K
  partial accumulators ("lanes") stall at 4.0 each: ``√(4K)``, and K = 8 gives
  ``√32 = 5.65625`` in float16 — the report's number. torch's own kernels of
  the installed version are measured beside the model.

Records: ``fingerprint_changed``, ``matches_rank0_initial``,
``same_parameter_objects``, ``compile_ok``, ``compiled_frames``, ``norm``
(labels ``method``, ``stage``, ``device``, ``lanes``, ``accumulator``,
``torch_version``), ``lane_sum_of_squares``, ``running_sum_of_squares``
(``step`` = elements accumulated) and ``stall_element``.
"""
from __future__ import annotations

from ddplab.cases.base import Case, LaunchPlan
from ddplab.cases.half_precision import figures, verdict, worker
from ddplab.parameters import Parameter, ParameterSet

__all__ = ["CASE", "HalfPrecision"]

#: Weight dtypes the case accepts.
DTYPES = ("float16", "bfloat16", "float32", "float64")


def _needs_float16(dtypes: list[str]) -> str | None:
    return None if "float16" in dtypes else "must include 'float16', the report's dtype"


class HalfPrecision(Case):
    name = "half_precision"
    title = "Half-precision weights: does wrapping an fp16 model in DDP change the weights?"
    notebook = "02_half_precision_weights.ipynb"
    reproduces = "half_precision"
    parameters = ParameterSet([
        Parameter("world_size", 2, "number of ranks (processes)", kind="int", minimum=1, maximum=8,
                  role="world_size"),
        Parameter("dtypes", ["float16", "float32"], "weight dtypes to build the model in (must include "
                  "float16, the report's)",
                  kind="list[str]", choices=DTYPES, check=_needs_float16),
        Parameter("seed", 42, "torch.manual_seed before building the model (the report's 42)",
                  kind="int", minimum=0, maximum=2**63 - 1),
        Parameter("in_features", 512, "nn.Linear input features", kind="int", minimum=1,
                  maximum=4096),
        Parameter("out_features", 512, "nn.Linear output features", kind="int", minimum=1,
                  maximum=4096),
        Parameter("lanes", [1, 2, 4, 8, 16, 32], "partial accumulators K of the accumulator model",
                  kind="list[int]", minimum=1, maximum=4096),
        Parameter("same_init", True, "seed every rank alike (False: rank r uses seed + r, "
                  "as when users forget to seed)", kind="bool"),
    ])
    #: Already seconds with the defaults; quick mode drops the float32 model.
    quick = {"dtypes": ["float16"]}
    figures_by_name = {"lanes": figures.plot_lanes, "running_sum": figures.plot_running_sum,
                       "fingerprints": figures.plot_fingerprints}
    key_figure = "lanes"
    tables_by_name = {"fingerprints": figures.fingerprint_table, "norms": figures.norm_table,
                      "versions": figures.versions_markdown}
    run_label = "dtype"
    worker = worker.worker
    verdict = verdict.verdict

    def check(self, params: dict) -> None:
        """No lane count may exceed the number of weights (a lane with no element is no accumulator)."""
        numel = params["in_features"] * params["out_features"]
        too_many = [k for k in params["lanes"] if k > numel]
        if too_many:
            raise ValueError(f"parameter 'lanes': {too_many} exceed the {numel} weights of a "
                             f"{params['out_features']}x{params['in_features']} layer; "
                             f"it accepts lane counts from 1 to {numel}")

    def launches(self, params: dict) -> list[LaunchPlan]:
        # Generous: 2 ranks importing torch._dynamo on 2 busy cores.
        return [LaunchPlan(world_size=params["world_size"], label=f"W={params['world_size']}",
                           timeout=240.0)]

    def progress_total(self, params: dict) -> int:
        return 1


CASE = HalfPrecision()

"""Compare your own distributed training with a single-process reference, and say rounding or bug.

Give a :class:`Setup` (how to build the model, the per-step global batches,
the loss, the optimizer) and the configurations to try; :func:`run` trains
the single-process reference, a float64 shadow of it (the *truth*), and each
configuration on real gloo ranks, on the same global batches, and compares
every step's gradient and updated parameters, parameter by parameter::

    from ddplab import compare
    setup = compare.Setup(model=build_model, batches=batches, loss=F.cross_entropy,
                          optimizer=lambda params: torch.optim.SGD(params, lr=0.1))
    result = compare.run(setup, [compare.DDP(2), compare.Accumulate(2, k=4), compare.FSDP2(2)])
    result                      # one verdict per configuration: rounding / bug / undetermined
    result.records              # tidy records: step, rank, metric, value, config, param, quantity...
    compare.figures.deviation_over_steps(result.records)

Data parallel on device meshes -- :class:`HSDP`, :class:`TP`, :class:`FSDP2TP`
(:mod:`~ddplab.compare.meshes`) -- is judged per mesh axis
(:mod:`~ddplab.compare.mesh_evidence`); :mod:`~ddplab.compare.mesh_examples` ships a tiny
language model, its tensor-parallel plans and planted mesh faults.

The referee (:mod:`~ddplab.compare.referee`) judges each run by its
distance from the truth, in units of the reference's own distance;
:mod:`~ddplab.compare.localization` names the first divergence (a constant
factor, a missing contribution, a desync, ...); :mod:`~ddplab.compare.examples`
ships a correct setup and planted bugs.
"""
from ddplab.compare import examples, figures
from ddplab.compare.comparison import DEFAULT_TIMEOUT, Comparison, ReferenceFailed, run
from ddplab.compare.configurations import (DDP, FSDP2, Accumulate, Configuration, Custom, Fabric,
                                           StepContext)
from ddplab.compare.meshes import FSDP2TP, HSDP, TP
from ddplab.compare import mesh_training  # noqa: F401 - registers the mesh configurations' trainer
from ddplab.compare.setup import Setup, SetupError
from ddplab.compare.verdicts import ConfigVerdict

__all__ = ["run", "Comparison", "ReferenceFailed", "DEFAULT_TIMEOUT", "Setup", "SetupError",
           "Configuration", "DDP", "Accumulate", "Fabric", "FSDP2", "Custom", "StepContext",
           "HSDP", "TP", "FSDP2TP",
           "ConfigVerdict", "examples", "figures"]

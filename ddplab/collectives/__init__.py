"""Every collective a rank issues, recorded and verified bit for bit against its emulation.

Inside each rank::

    from ddplab import collectives
    with collectives.recording() as rec:          # optional: spill_dir=... keeps only digests in memory
        ...                                        # DDP, FSDP2, DTensor, dist.* -- whatever the step does
        rec.set_step(n)                            # label the records of training step n
    return rec.records()

In the parent::

    result = collectives.verify(ddplab.launch(fn, world_size=2).returns)
    result.exact, result.first_mismatch, result.dtypes_by_step, result.records

* :mod:`~ddplab.collectives.interception` — where collectives are caught (the
  c10d dispatcher ops' CPU kernels) and why there;
* :mod:`~ddplab.collectives.ops` — what each c10d op's arguments mean;
* :mod:`~ddplab.collectives.record` — one collective's record, one comm hook's result;
* :mod:`~ddplab.collectives.recorder` — the recorder, steps and spilling;
* :mod:`~ddplab.collectives.comm_hooks` — DDP comm hooks' results;
* :mod:`~ddplab.collectives.emulation` — each collective's outputs from every rank's inputs;
* :mod:`~ddplab.collectives.verification` — pairing across ranks, comparison, findings.
"""
from ddplab.collectives.emulation import EMULATED_OPS, Unverifiable, emulate
from ddplab.collectives.ops import OP_SPECS, REDUCTIONS
from ddplab.collectives.record import CollectiveRecord, HookResult, tensor_digest
from ddplab.collectives.recorder import Recorder, active_recorder, recording, set_step
from ddplab.collectives.verification import CollectiveMismatch, CollectiveVerification, Unverified, verify

__all__ = [
    "recording", "Recorder", "active_recorder", "set_step",
    "CollectiveRecord", "HookResult", "tensor_digest",
    "verify", "CollectiveVerification", "CollectiveMismatch", "Unverified",
    "emulate", "EMULATED_OPS", "Unverifiable", "OP_SPECS", "REDUCTIONS",
]

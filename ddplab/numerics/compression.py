"""What DDP's gradient reductions leave in the bucket, bit for bit: DDP's own and the compression hooks'.

Each function takes every rank's bucket as DDP hands it to the hook (the
``[W, N]`` local, unaveraged gradients, in the bucket's dtype) and returns the
``N`` elements that the live reduction writes back, in that dtype. With
``order="gloo_ring"`` (the default) that is live gloo's result bit for bit
(checked against live gloo in ``tests/test_comm_hooks.py``).

* :func:`emulate_ddp_allreduce` -- DDP without a hook
  (:func:`ddplab.comm_hooks.ddp_default_hook`): ``x_r * fl(1/W)`` rounded
  once to the dtype, then a SUM in the ring's order.
* :func:`emulate_compressed_allreduce` -- torch's ``fp16_compress_hook`` and
  ``bf16_compress_hook`` (``default_hooks._compress_hook``) and ddplab's
  stand-ins for them: ``c_r = fl_d(x_r)`` (the cast rounds to the low
  precision d), ``c_r = fl_d(c_r / W)`` (the division rounds in d too, after
  the cast: torch writes ``buffer.to(dtype).div_(world_size)``), a SUM of the
  ``c_r`` in d in the ring's order (every partial sum rounded to d), and the
  sum converted back into the bucket's dtype (exact when that dtype is wider).

Example::

    >>> x = torch.tensor([[1.0, 3.0], [2.0 ** -12, 1.0]])           # 2 ranks, float32 buckets
    >>> emulate_compressed_allreduce(x, torch.float16)              # (1 + 2^-12)/2 is not a float16
    tensor([0.5000, 2.0000])
    >>> emulate_ddp_allreduce(x)                                    # float32 keeps it
    tensor([0.5001, 2.0000])
"""
from __future__ import annotations

import torch

from ddplab.numerics.fpformat import parse_dtype
from ddplab.numerics.orders import DDP_AVERAGING, reduce

__all__ = ["COMPRESSION_AVERAGING", "emulate_compressed_allreduce", "emulate_ddp_allreduce"]

#: How the compression hooks average: each rank divides its (already cast) bucket by W, then SUM.
COMPRESSION_AVERAGING = "divide_first"


def emulate_compressed_allreduce(contributions: torch.Tensor, dtype, order: str = "gloo_ring") -> torch.Tensor:
    """The bucket a compression hook in ``dtype`` leaves: cast, divide by W, SUM in ``dtype``, cast back.

    ``contributions``: ``[W, N]``, every rank's ``bucket.buffer()`` before the
    hook, in the bucket's dtype; ``dtype``: the compression dtype
    (``torch.float16`` for ``fp16_compress_hook``, ``torch.bfloat16`` for
    ``bf16_compress_hook``); ``order``: the SUM's order (gloo's ring by
    default: each chunk accumulated descending by rank, chunks cut from the
    *compressed* buffer's bytes, so a float16 bucket has half as many
    segments as its float32 source). Returns ``N`` elements in the
    contributions' dtype.

    Example::

        >>> x = torch.randn(3, 1000)
        >>> out = emulate_compressed_allreduce(x, torch.bfloat16)
        >>> out.dtype, bool((out == out.to(torch.bfloat16).float()).all())    # float32 holding bfloat16 values
        (torch.float32, True)
    """
    return reduce(contributions, order, op="avg", averaging=COMPRESSION_AVERAGING,
                  reduce_dtype=parse_dtype(dtype))


def emulate_ddp_allreduce(contributions: torch.Tensor, order: str = "gloo_ring") -> torch.Tensor:
    """The bucket DDP leaves without a hook: each rank multiplies by fl(1/W) (float32's for half
    buckets), then SUM in ``order``; ``[W, N]`` in, ``N`` out, in the contributions' dtype.

    Example::

        >>> x = torch.randn(3, 1000)
        >>> bool((emulate_ddp_allreduce(x) == reduce(x, "gloo_ring", op="avg", averaging=DDP_AVERAGING)).all())
        True
    """
    return reduce(contributions, order, op="avg", averaging=DDP_AVERAGING)

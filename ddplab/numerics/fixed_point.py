"""Order-independent (reproducible) sums through int64 fixed point: the math of the scheme.

Integer addition is exact and associative, so a floating-point all-reduce
becomes reproducible (bitwise identical for any order, backend and rank
placement) when every rank first maps its values to integers on a common
grid:

1. ``E`` = all-reduce MAX of the ranks' :func:`exponents` (frexp: |x| < 2^E),
   per element, per block of elements, or one per tensor;
2. ``k = 62 - H - E`` with ``W <= 2^H`` (:func:`scale_exponent`), so that W
   values below 2^(62-H) each sum below 2^62;
3. ``q = round(x * 2^k)`` as int64 (:func:`quantize`), all-reduce SUM of q;
4. ``y = RN(Q * 2^-k)`` in the dtype (:func:`dequantize`, one correct rounding).

Precision: a contribution is quantized exactly when its lowest significand
bit is at least 2^-k, i.e. when its binade is at most :func:`lossless_binades`
``= 62 - H - p`` below that of the largest contribution sharing its exponent
(35 for float32 and W <= 8). With one exponent per element (or per small
block of similar values) that holds for all but contributions that are
negligible anyway, and the result is the correctly rounded sum. With one
exponent per tensor, E is the tensor's largest exponent and every element
far below the tensor's maximum loses bits: elements more than about
``62 - H - p`` binades below it are rounded to a multiple of 2^-k, and values
below 2^(-k-1) vanish. The cost is two collectives and 12 bytes per element
(int32 exponent + int64) instead of 4.

:func:`reproducible_sum` runs the whole scheme in one process, reducing the
integers in any emulated order, so tests can show the bitwise equality.

Example::

    >>> x = torch.randn(5, 1000)
    >>> a = reproducible_sum(x, "gloo_ring")
    >>> torch.equal(a, reproducible_sum(x[[4, 2, 0, 1, 3]], "pairwise")), torch.equal(a, exact_sum(x))
    (True, True)
"""
from __future__ import annotations

import numpy as np
import torch
from numba import prange

from ddplab.numerics._numba_cache import njit
from ddplab.numerics._parallel import within_torch_threads
from ddplab.numerics._programs import Arithmetic, run
from ddplab.numerics._rounding import round_scaled
from ddplab.numerics.contributions import as_contributions
from ddplab.numerics.fpformat import float_format, parse_dtype

__all__ = ["exponents", "world_bits", "scale_exponent", "lossless_binades", "quantize", "dequantize",
           "reproducible_sum"]

# Bits of int64 used below the sign bit and the headroom for W addends.
_INT_BITS = 62


def world_bits(world_size: int) -> int:
    """H = ceil(log2 W): the headroom bits W addends need."""
    if not isinstance(world_size, int) or world_size < 1:
        raise ValueError(f"world_size must be a positive int, got {world_size!r}")
    return (world_size - 1).bit_length()


def _zero_exponent(dtype) -> int:
    # frexp exponent of the dtype's smallest subnormal: zeros must not raise the max.
    fmt = float_format(dtype)
    return fmt.emin - fmt.p + 2


def exponents(x: torch.Tensor, block_size: int | None = 1) -> torch.Tensor:
    """frexp exponents E (|x| < 2^E), maximized over blocks: int32, ``ceil(N / block_size)`` entries.

    ``block_size=None`` gives one exponent for the whole tensor. Zeros count
    as the dtype's smallest subnormal, so they never raise a block's exponent.
    """
    fmt = float_format(x.dtype)
    flat = x.detach().reshape(-1)
    if not bool(torch.isfinite(flat).all()):
        raise ValueError("fixed-point sums need finite values; got inf or NaN")
    _, e = torch.frexp(flat.to(torch.float64))
    e = torch.where(flat == 0, torch.full_like(e, _zero_exponent(fmt.dtype)), e)
    n = flat.numel()
    block = n if block_size is None else block_size
    if block < 1:
        raise ValueError(f"block_size must be >= 1 or None, got {block_size}")
    if block == 1 or n == 0:
        return e
    pad = (-n) % block
    if pad:
        e = torch.cat([e, torch.full((pad,), _zero_exponent(fmt.dtype), dtype=e.dtype)])
    return e.view(-1, block).amax(1)


def _expand(exponent: torch.Tensor, numel: int, block_size: int | None) -> torch.Tensor:
    exponent = torch.as_tensor(exponent).to(torch.int64).reshape(-1)
    if exponent.numel() == numel:
        return exponent
    if exponent.numel() == 1:
        return exponent.expand(numel)
    block = numel if block_size is None else block_size
    if exponent.numel() != -(-numel // block):
        raise ValueError(f"{exponent.numel()} exponents do not match {numel} elements in blocks of {block_size}")
    return exponent.repeat_interleave(block)[:numel]


def scale_exponent(exponent: torch.Tensor, world_size: int) -> torch.Tensor:
    """k = 62 - H - E: the power of two that puts W values below 2^E under 2^62 together."""
    return _INT_BITS - world_bits(world_size) - torch.as_tensor(exponent).to(torch.int64)


def quantize(x: torch.Tensor, exponent: torch.Tensor, world_size: int, *, block_size: int | None = None) -> torch.Tensor:
    """q = round(x * 2^k) as int64, k = 62 - H - E (ties to even); exact when x's bits reach 2^-k.

    ``exponent`` holds one E per element of x's last dimension, one per
    block of ``block_size`` of them, or a single one; x may carry leading
    dimensions (e.g. [W, N]) that share it.
    """
    parse_dtype(x.dtype)
    k = scale_exponent(_expand(exponent, x.shape[-1], block_size), world_size)
    # Two power-of-two steps: 2^k alone can leave float64's range (k reaches ~1130).
    k1 = torch.div(k, 2, rounding_mode="floor")
    y = torch.ldexp(torch.ldexp(x.to(torch.float64), k1.to(torch.float64)), (k - k1).to(torch.float64))
    return torch.round(y).to(torch.int64)


@njit(parallel=True)
def _round_int_scaled(q, scale, p, emin, emax, out):
    for i in prange(q.size):
        hi = float(q[i])                 # RN64 of the integer
        lo = float(q[i] - np.int64(hi))  # exact: |q| <= 2^62, so hi fits int64
        out[i] = round_scaled(hi, lo, scale[i], p, emin, emax)


@within_torch_threads
def dequantize(q_sum: torch.Tensor, exponent: torch.Tensor, world_size: int, dtype, *,
               block_size: int | None = None) -> torch.Tensor:
    """y = RN(Q * 2^-k) in ``dtype``, one correct rounding of the exact integer sum.

    Example::

        >>> e = exponents(torch.tensor([3.0]))
        >>> dequantize(quantize(torch.tensor([3.0]), e, 2) * 2, e, 2, torch.float32)
        tensor([6.])
    """
    fmt = float_format(dtype)
    q = torch.as_tensor(q_sum)
    if q.dtype != torch.int64:
        raise ValueError(f"q_sum must be int64, got {q.dtype}")
    flat = q.reshape(-1).contiguous()
    scale = -scale_exponent(_expand(exponent, flat.numel(), block_size), world_size)
    out = np.empty(flat.numel(), np.float64 if fmt.p == 53 else np.float32)
    _round_int_scaled(flat.numpy(), scale.contiguous().numpy(), fmt.p, fmt.emin, fmt.emax, out)
    return torch.from_numpy(out).to(fmt.dtype).reshape(q.shape)


def reproducible_sum(contributions, order: str = "gloo_ring", *, block_size: int | None = 1,
                     **options) -> torch.Tensor:
    """Simulate the fixed-point all-reduce in-process: exponents, MAX, quantize, SUM in ``order``, dequantize.

    The result does not depend on ``order`` or on which rank holds which
    contribution. With ``block_size=1`` it is the correctly rounded sum
    whenever every contribution lies within :func:`lossless_binades` of its
    element's largest (see the module docstring); ``block_size=None`` uses
    one exponent per tensor.
    """
    from ddplab.numerics.orders import reduction_pieces

    c = as_contributions(contributions)
    dtype = parse_dtype(c.dtype)
    if order == "exact":
        raise ValueError("reproducible_sum reduces integers in an emulated order; 'exact' is not one")
    w = c.world_size
    e_max = None
    for r in range(w):           # what all_reduce(MAX) of the exponents computes
        e = exponents(c.row(r), block_size)
        e_max = e if e_max is None else torch.maximum(e_max, e)
    q = c.map(lambda x: quantize(x, e_max, w, block_size=block_size), dtype=torch.int64)
    pieces = reduction_pieces(order, c.numel, w, 8, **options)
    q_sum = run(q, pieces, Arithmetic(torch.int64, torch.int64)) if c.numel else torch.empty(0, dtype=torch.int64)
    return dequantize(q_sum, e_max, w, dtype, block_size=block_size)


def lossless_binades(dtype, world_size: int) -> int:
    """62 - H - p: how many binades below the largest contribution's another may lie and stay exact."""
    return _INT_BITS - world_bits(world_size) - float_format(dtype).p

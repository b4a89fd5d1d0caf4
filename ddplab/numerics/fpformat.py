"""The four floating-point formats ddplab reasons about, as numbers.

A binary floating-point format is fixed by its precision ``p`` (significand
bits, the implicit one included) and its exponent range ``[emin, emax]`` of
normal numbers. Everything else follows: the unit roundoff ``u = 2^-p`` (half
of ``torch.finfo(dtype).eps``), the largest finite value
``(2 - 2^(1-p)) * 2^emax``, the smallest normal ``2^emin`` and the smallest
subnormal ``2^(emin-p+1)``.

Example::

    >>> fmt = float_format("bf16")
    >>> fmt.p, fmt.emin, fmt.emax, fmt.u == 2.0 ** -8
    (8, -126, 127, True)
"""
from __future__ import annotations

import dataclasses

import torch

__all__ = [
    "FloatFormat",
    "SUPPORTED_DTYPES",
    "float_format",
    "parse_dtype",
    "unit_roundoff",
]

SUPPORTED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)

# Every spelling a notebook parameter or a CLI flag is likely to use.
_DTYPE_NAMES = {
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16, "f16": torch.float16,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "single": torch.float32, "f32": torch.float32,
    "float64": torch.float64, "fp64": torch.float64, "double": torch.float64, "f64": torch.float64,
}


@dataclasses.dataclass(frozen=True)
class FloatFormat:
    """Precision and exponent range of a binary floating-point format.

    ``p`` counts significand bits including the implicit leading one; normal
    numbers are ``m * 2^e`` with ``1 <= |m| < 2`` and ``emin <= e <= emax``.
    """

    name: str
    dtype: torch.dtype
    p: int
    emin: int
    emax: int

    @property
    def u(self) -> float:
        """Unit roundoff 2^-p: the largest relative error of one rounding to nearest."""
        return 2.0 ** -self.p

    @property
    def max(self) -> float:
        """Largest finite value, (2 - 2^(1-p)) * 2^emax."""
        return (2.0 - 2.0 ** (1 - self.p)) * 2.0 ** self.emax

    @property
    def tiny(self) -> float:
        """Smallest positive normal value, 2^emin."""
        return 2.0 ** self.emin

    @property
    def smallest_subnormal(self) -> float:
        """Smallest positive value, 2^(emin-p+1): the spacing of the subnormal range."""
        return 2.0 ** (self.emin - self.p + 1)

    @property
    def overflow_threshold(self) -> float:
        """Values of at least this magnitude round to infinity: max + half an ulp."""
        return (2.0 - 2.0 ** -self.p) * 2.0 ** self.emax

    @property
    def bits(self) -> int:
        """Storage width in bits."""
        return torch.finfo(self.dtype).bits

    @property
    def int_dtype(self) -> torch.dtype:
        """The signed integer dtype of the same width (for bit-level views)."""
        return {16: torch.int16, 32: torch.int32, 64: torch.int64}[self.bits]


_FORMATS = {
    torch.float16: FloatFormat("float16", torch.float16, p=11, emin=-14, emax=15),
    torch.bfloat16: FloatFormat("bfloat16", torch.bfloat16, p=8, emin=-126, emax=127),
    torch.float32: FloatFormat("float32", torch.float32, p=24, emin=-126, emax=127),
    torch.float64: FloatFormat("float64", torch.float64, p=53, emin=-1022, emax=1023),
}


def parse_dtype(name_or_dtype) -> torch.dtype:
    """Return the torch dtype for a dtype or a name such as ``"fp32"``, ``"bf16"`` or ``"half"``.

    Raises ValueError naming the accepted values for anything else.
    """
    if isinstance(name_or_dtype, torch.dtype):
        if name_or_dtype in _FORMATS:
            return name_or_dtype
    elif isinstance(name_or_dtype, str):
        key = name_or_dtype.strip().lower()
        key = key[len("torch."):] if key.startswith("torch.") else key
        if key in _DTYPE_NAMES:
            return _DTYPE_NAMES[key]
    accepted = ", ".join(sorted(_DTYPE_NAMES))
    raise ValueError(
        f"unsupported dtype {name_or_dtype!r}; ddplab.numerics handles float16, bfloat16, "
        f"float32 and float64, given as torch dtypes or one of: {accepted}"
    )


def float_format(dtype) -> FloatFormat:
    """The :class:`FloatFormat` of ``dtype`` (a torch dtype or a name accepted by :func:`parse_dtype`)."""
    return _FORMATS[parse_dtype(dtype)]


def unit_roundoff(dtype) -> float:
    """Unit roundoff u = 2^-p of ``dtype`` (note: ``torch.finfo(dtype).eps`` is 2u)."""
    return float_format(dtype).u

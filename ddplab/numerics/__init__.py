"""Exact references, emulated reduction orders, ulps and rounding bounds: pure functions on tensors.

* :mod:`~ddplab.numerics.fpformat` — precision and range of the four dtypes;
* :mod:`~ddplab.numerics.contributions` — W per-rank inputs, stored or generated;
* :mod:`~ddplab.numerics.exact` — correctly rounded sums and means (the reference);
* :mod:`~ddplab.numerics.orders` — sequential, pairwise, gloo ring, NCCL ring/tree, bit for bit;
* :mod:`~ddplab.numerics.ulp` — signed ulp distances;
* :mod:`~ddplab.numerics.bounds` — γ_d·Σ|x_r| and the rounding / not-rounding verdict;
* :mod:`~ddplab.numerics.accuracy` — one call to measure a result, tidy records of it;
* :mod:`~ddplab.numerics.accumulators` — float16-style K-lane accumulators (seed 001);
* :mod:`~ddplab.numerics.fixed_point` — the order-independent int64 reduction.
"""
# First: where numba may cache the kernels the modules below compile (see _numba_cache).
from ddplab.numerics import _numba_cache  # noqa: F401  isort: skip
from ddplab.numerics.accumulators import (lane_norm, lane_partials, lane_sum, lane_sum_of_squares,
                                          running_sum_of_squares)
from ddplab.numerics.accuracy import METRICS, error_records, measure
from ddplab.numerics.bounds import Classification, abs_sum, classify, gamma, pair_bound, rounding_bound
from ddplab.numerics.contributions import Contributions, as_contributions
from ddplab.numerics.exact import exact_mean, exact_parts, exact_sum, round_to_dtype
from ddplab.numerics.fixed_point import (dequantize, exponents, lossless_binades, quantize,
                                         reproducible_sum, scale_exponent, world_bits)
from ddplab.numerics.fpformat import SUPPORTED_DTYPES, FloatFormat, float_format, parse_dtype, unit_roundoff
from ddplab.numerics.orders import (AVERAGING, GLOO_MAX_SEGMENT_BYTES, ORDERS, default_averaging,
                                    gloo_ring_segments, nccl_double_binary_tree, nccl_ring_chunks,
                                    order_depth, order_options, reduce, reduction_pieces)
from ddplab.numerics.ulp import ordered_int, ulp, ulp_distance

__all__ = [
    # formats
    "FloatFormat", "SUPPORTED_DTYPES", "float_format", "parse_dtype", "unit_roundoff",
    # contributions
    "Contributions", "as_contributions",
    # exact reference
    "exact_sum", "exact_mean", "exact_parts", "round_to_dtype",
    # orders
    "ORDERS", "AVERAGING", "GLOO_MAX_SEGMENT_BYTES", "reduce", "order_depth", "order_options",
    "default_averaging", "gloo_ring_segments", "nccl_ring_chunks", "nccl_double_binary_tree",
    "reduction_pieces",
    # ulps, bounds, accuracy
    "ordered_int", "ulp", "ulp_distance",
    "gamma", "abs_sum", "rounding_bound", "pair_bound", "classify", "Classification",
    "METRICS", "measure", "error_records",
    # accumulators
    "lane_partials", "lane_sum", "lane_sum_of_squares", "lane_norm", "running_sum_of_squares",
    # fixed point
    "exponents", "world_bits", "scale_exponent", "lossless_binades", "quantize", "dequantize",
    "reproducible_sum",
]

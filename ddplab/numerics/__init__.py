"""Exact references, emulated reduction orders, ulps and rounding bounds: pure functions on tensors.

* :mod:`~ddplab.numerics.fpformat` — precision and range of the four dtypes;
* :mod:`~ddplab.numerics.contributions` — W per-rank inputs, stored or generated;
* :mod:`~ddplab.numerics.exact` — correctly rounded sums and means (the reference);
* :mod:`~ddplab.numerics.orders` — sequential, pairwise, gloo ring, NCCL ring/tree, bit for bit;
* :mod:`~ddplab.numerics.compression` — the bucket DDP's reduction and the fp16/bf16 compression hooks leave;
* :mod:`~ddplab.numerics.reduce_scatter` — the same for reduce-scatter, and FSDP2's divide factors;
* :mod:`~ddplab.numerics.accumulation` — k local accumulations (no_sync) then the reduction;
* :mod:`~ddplab.numerics.ulp` — signed ulp distances;
* :mod:`~ddplab.numerics.bounds` — γ_d·Σ|x_r|, the probabilistic bound, error vs bound;
* :mod:`~ddplab.numerics.accuracy` — the referee: measure a result, the verdict, tidy records;
* :mod:`~ddplab.numerics.accumulators` — float16-style K-lane accumulators (seed 001);
* :mod:`~ddplab.numerics.fixed_point` — the order-independent int64 reduction.
"""
from ddplab.numerics.accumulators import (lane_norm, lane_partials, lane_sum, lane_sum_of_squares,
                                          running_sum_of_squares)
from ddplab.numerics.accumulation import (accumulated_bound, accumulated_bounds, accumulated_depth,
                                          accumulated_exact_parts, as_micro_contributions, local_sums,
                                          reduce_accumulated)
from ddplab.numerics.accuracy import (ACCUMULATED_REDUCTION_SCOPE, EVIDENCE, METRICS, REDUCTION_SCOPE,
                                      error_records, matches_order, measure, records_of)
from ddplab.numerics.bounds import (LABELS, NOT_ROUNDING, OVERFLOW, PROBABILISTIC_CONFIDENCE, ROUNDING,
                                    UNDETERMINED, Classification, ReductionBounds, abs_sum, classify,
                                    finite_abs_sum, gamma, pair_bound, probabilistic_bound, probabilistic_gamma,
                                    reduction_bounds, rounding_bound)
from ddplab.numerics.compression import emulate_compressed_allreduce, emulate_ddp_allreduce
from ddplab.numerics.contributions import Contributions, as_contributions
from ddplab.numerics.exact import exact_mean, exact_parts, exact_sum, round_to_dtype
from ddplab.numerics.fixed_point import (dequantize, exponents, lossless_binades, quantize,
                                         reproducible_sum, scale_exponent, world_bits)
from ddplab.numerics.fpformat import SUPPORTED_DTYPES, FloatFormat, float_format, parse_dtype, unit_roundoff
from ddplab.numerics.orders import (AVERAGING, BIT_EXACT_ORDERS, DDP_AVERAGING, GLOO_MAX_SEGMENT_BYTES, ORDERS,
                                    check_reduction, default_averaging, gloo_ring_segments,
                                    nccl_double_binary_tree, nccl_ring_chunks, order_depth, order_options,
                                    reduce, reduction_pieces)
from ddplab.numerics.reduce_scatter import (REDUCE_SCATTER_ORDERS, FSDPReduction, fsdp_reduction,
                                            reduce_scatter, reduce_scatter_pieces, shard_range)
from ddplab.numerics.ulp import ordered_int, ulp, ulp_distance

__all__ = [
    # formats
    "FloatFormat", "SUPPORTED_DTYPES", "float_format", "parse_dtype", "unit_roundoff",
    # contributions
    "Contributions", "as_contributions",
    # exact reference
    "exact_sum", "exact_mean", "exact_parts", "round_to_dtype",
    # orders
    "ORDERS", "BIT_EXACT_ORDERS", "AVERAGING", "DDP_AVERAGING", "GLOO_MAX_SEGMENT_BYTES", "reduce",
    "check_reduction", "order_depth", "order_options",
    "default_averaging", "gloo_ring_segments", "nccl_ring_chunks", "nccl_double_binary_tree",
    "reduction_pieces",
    # DDP's buckets: its own reduction and the compression hooks'
    "emulate_ddp_allreduce", "emulate_compressed_allreduce",
    # reduce-scatter
    "REDUCE_SCATTER_ORDERS", "reduce_scatter", "reduce_scatter_pieces", "shard_range",
    "FSDPReduction", "fsdp_reduction",
    # gradient accumulation
    "as_micro_contributions", "local_sums", "reduce_accumulated", "accumulated_depth",
    "accumulated_bounds", "accumulated_bound", "accumulated_exact_parts",
    # ulps, bounds, the referee
    "ordered_int", "ulp", "ulp_distance",
    "gamma", "probabilistic_gamma", "abs_sum", "finite_abs_sum", "rounding_bound", "probabilistic_bound",
    "reduction_bounds", "ReductionBounds", "pair_bound", "classify", "Classification",
    "ROUNDING", "NOT_ROUNDING", "UNDETERMINED", "OVERFLOW", "LABELS", "PROBABILISTIC_CONFIDENCE",
    "METRICS", "EVIDENCE", "REDUCTION_SCOPE", "ACCUMULATED_REDUCTION_SCOPE", "measure", "error_records",
    "matches_order", "records_of",
    # accumulators
    "lane_partials", "lane_sum", "lane_sum_of_squares", "lane_norm", "running_sum_of_squares",
    # fixed point
    "exponents", "world_bits", "scale_exponent", "lossless_binades", "quantize", "dequantize",
    "reproducible_sum",
]

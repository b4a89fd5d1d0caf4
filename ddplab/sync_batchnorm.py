"""SyncBatchNorm that runs on gloo/CPU: torch's math, with the collectives on any backend.

``torch.nn.SyncBatchNorm`` computes its statistics with CUDA-only kernels
(``batch_norm_stats``, ``batch_norm_gather_stats_with_counts``, ...) and DDP's
constructor refuses it on CPU ("SyncBatchNorm layers only work with GPU
modules"), so a model that uses it cannot be reproduced on a CPU machine.
:class:`SyncBatchNorm` is a drop-in for it (same constructor, same
``state_dict`` keys, ``process_group``) that computes the same formulas with
plain tensor ops, in float32 for float32/float16/bfloat16 inputs and in
float64 for float64 ones, as torch's kernels accumulate.

Forward, per channel, on each of the W ranks of the group (rank r holding
``n_r`` values of the channel):

1. local statistics ``mean_r``, ``invstd_r = 1 / sqrt(var_r + eps)`` (biased
   variance) and the count ``n_r``, all-gathered (``[W, 2C + 1]``; ranks with
   ``n_r = 0`` are dropped);
2. merged rank by rank as torch's ``batch_norm_reduce_statistics_kernel``
   does: ``v_r = (1/invstd_r^2 - eps) * n_r``, ``f = 1 / (n + n_r)``,
   ``M2 += v_r + (mean - mean_r)^2 * n * n_r * f``,
   ``mean = n * f * mean + n_r * f * mean_r``, ``n += n_r``; then
   ``invstd = 1 / sqrt(M2 / n + eps)``;
3. running statistics ``(1 - momentum) * running + momentum * stat`` with the
   *unbiased* variance ``M2 / (n - 1)`` of the global count;
4. ``y = weight * (x - mean) * invstd + bias``.

Backward (``batch_norm_backward_reduce`` and ``_elemt``): local
``sum_dy = Σ dy`` and ``sum_dy_xmu = Σ dy (x - mean)`` give the local weight
and bias gradients (``sum_dy_xmu * invstd`` and ``sum_dy``, reduced by DDP
like any gradient); the two sums are all-reduced (SUM) and
``dx = (dy - sum_dy / N - (x - mean) * invstd^2 * sum_dy_xmu / N) * weight * invstd``
with N the global count. A rank's loss thereby back-propagates into every
rank's input, as one process over the global batch would.

Outside a process group, with a group of one rank or in eval mode it is
``F.batch_norm``, bit for bit ``BatchNorm``: a single-process reference of
a SyncBatchNorm model computes exactly what the BatchNorm model does.

Example::

    >>> model = convert_sync_batchnorm(torch.nn.Sequential(torch.nn.Linear(8, 4), torch.nn.BatchNorm1d(4)))
    >>> ddp = torch.nn.parallel.DistributedDataParallel(model)      # on gloo, CPU
"""
from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.autograd.function import Function
from torch.nn.modules.batchnorm import _BatchNorm

__all__ = ["SyncBatchNorm", "convert_sync_batchnorm"]


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    # torch's kernels accumulate in accscalar_t: double for double, float for the rest.
    return torch.float64 if dtype == torch.float64 else torch.float32


def _per_channel(t: torch.Tensor, dim: int) -> torch.Tensor:
    """A ``[C]`` tensor shaped to broadcast against ``[N, C, *]``."""
    return t.view(1, -1, *([1] * (dim - 2)))


def _reduce_dims(x: torch.Tensor) -> list[int]:
    return [0, *range(2, x.dim())]


def _merge_statistics(mean_all: torch.Tensor, invstd_all: torch.Tensor, counts: torch.Tensor,
                      eps: float) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Rank-by-rank merge of each rank's (mean, invstd, count), in rank order as torch's kernel:
    the global mean, invstd, M2 (sum of squared deviations) and count."""
    acc = mean_all.dtype
    n = torch.zeros((), dtype=acc)
    mean = torch.zeros(mean_all.shape[1], dtype=acc)
    m2 = torch.zeros_like(mean)
    for j in range(mean_all.shape[0]):
        count = counts[j].to(acc)
        v = 1.0 / invstd_all[j]
        v = (v * v - eps) * count
        factor = 1.0 / (n + count)
        delta = mean - mean_all[j]
        m2 = m2 + (v + delta * delta * n * count * factor)
        mean = n * factor * mean + count * factor * mean_all[j]
        n = n + count
    invstd = 1.0 / torch.sqrt(m2 / n + eps)
    return mean, invstd, m2, n


class _SyncBatchNormFunction(Function):
    """torch's ``torch.nn.modules._functions.SyncBatchNorm`` with its CUDA kernels written as tensor ops."""

    @staticmethod
    def forward(ctx, input, weight, bias, running_mean, running_var, eps, momentum, process_group, world_size):
        input = input.contiguous()
        channels = input.shape[1]
        size = input.numel() // channels if channels else 0
        if size == 1 and world_size < 2:
            raise ValueError(f"Expected more than 1 value per channel when training, got input size {size}")
        acc = _acc_dtype(input.dtype)
        x = input.to(acc)
        if input.numel() > 0:
            var, mean = torch.var_mean(x, dim=_reduce_dims(x), correction=0)
            invstd = 1.0 / torch.sqrt(var + eps)
            count = torch.full((1,), size, dtype=acc)
            combined = torch.cat([mean, invstd, count])
        else:
            # An empty share still takes part in the all_gather (its peers wait for it); count 0 drops it.
            combined = torch.zeros(2 * channels + 1, dtype=acc)
        gathered = [torch.empty_like(combined) for _ in range(world_size)]
        dist.all_gather(gathered, combined, group=process_group)
        mean_all, invstd_all, count_all = torch.stack(gathered).split(channels, dim=1)
        keep = count_all.squeeze(-1) >= 1
        mean_all, invstd_all, count_all = mean_all[keep], invstd_all[keep], count_all[keep]
        mean, invstd, m2, n = _merge_statistics(mean_all, invstd_all, count_all.view(-1), eps)
        if running_mean is not None:
            with torch.no_grad():
                running_mean.copy_((1 - momentum) * running_mean.to(acc) + momentum * mean)
        if running_var is not None:
            with torch.no_grad():
                unbiased = m2 / (n - 1)          # the global count's unbiased variance
                running_var.copy_((1 - momentum) * running_var.to(acc) + momentum * unbiased)
        ctx.save_for_backward(input, weight, mean, invstd, count_all.to(torch.int32))
        ctx.process_group = process_group
        if input.numel() == 0:
            return torch.empty_like(input)
        dim = input.dim()
        centered = x - _per_channel(mean, dim)
        if weight is not None:      # torch's batch_norm_elemt: gamma * (x - mean) * invstd + beta
            centered = _per_channel(weight.to(acc), dim) * centered
        out = centered * _per_channel(invstd, dim)
        if bias is not None:
            out = out + _per_channel(bias.to(acc), dim)
        return out.to(input.dtype)

    @staticmethod
    def backward(ctx, grad_output):
        saved_input, weight, mean, invstd, count_tensor = ctx.saved_tensors
        grad_input = grad_weight = grad_bias = None
        needs_input, needs_weight, needs_bias = ctx.needs_input_grad[:3]
        channels = saved_input.shape[1]
        acc = mean.dtype
        if saved_input.numel() > 0:
            dim = saved_input.dim()
            dims = _reduce_dims(saved_input)
            dy = grad_output.contiguous().to(acc)
            xmu = saved_input.to(acc) - _per_channel(mean, dim)
            sum_dy = dy.sum(dims)
            sum_dy_xmu = (dy * xmu).sum(dims)
            if weight is not None and needs_weight:
                grad_weight = (sum_dy_xmu * invstd).to(weight.dtype)
            if weight is not None and needs_bias:
                grad_bias = sum_dy.to(weight.dtype)
            if needs_input:
                # The statistics came from every rank, so their gradient goes back to every rank.
                combined = torch.cat([sum_dy, sum_dy_xmu])
                dist.all_reduce(combined, dist.ReduceOp.SUM, group=ctx.process_group)
                sum_dy, sum_dy_xmu = combined.split(channels)
                norm = 1.0 / count_tensor.sum().to(acc)
                mean_dy = sum_dy * norm
                factor_1 = invstd * invstd * sum_dy_xmu * norm
                factor_2 = invstd if weight is None else weight.to(acc) * invstd
                grad_input = ((dy - _per_channel(mean_dy, dim) - xmu * _per_channel(factor_1, dim))
                              * _per_channel(factor_2, dim)).to(saved_input.dtype)
        elif needs_input:
            # No values here, but the peers' all_reduce needs this rank's zeros.
            dist.all_reduce(torch.zeros(2 * channels, dtype=acc), dist.ReduceOp.SUM, group=ctx.process_group)
        return grad_input, grad_weight, grad_bias, None, None, None, None, None, None


class SyncBatchNorm(_BatchNorm):
    r"""Batch normalization over the whole process group's batch, on any backend (gloo/CPU included).

    A drop-in for :class:`torch.nn.SyncBatchNorm`: the same arguments, the
    same parameters and buffers (``state_dict`` keys), statistics reduced
    across ``process_group`` (default: the world) while training, computed
    as the module docstring says. Not a subclass of torch's class, so DDP's
    GPU-only check does not refuse it.

    .. math::
        y = \frac{x - \mathrm{E}[x]}{\sqrt{\mathrm{Var}[x] + \epsilon}} \gamma + \beta,
        \quad \mathrm{E}, \mathrm{Var} \text{ over every rank's batch (biased variance)}

    ``collective_in_forward``: the module issues collectives of its own in
    forward (all_gather) and backward (all_reduce), on every rank, once per call.

    Example::
        >>> bn = SyncBatchNorm(16)                  # like torch.nn.BatchNorm1d/2d/3d(16)
        >>> y = bn(torch.randn(8, 16, 4, 4))        # inside a process group: the group's statistics
    """

    collective_in_forward = True

    def __init__(self, num_features: int, eps: float = 1e-5, momentum: float | None = 0.1, affine: bool = True,
                 track_running_stats: bool = True, process_group: Any | None = None, device=None, dtype=None,
                 *, bias: bool = True) -> None:
        super().__init__(num_features, eps, momentum, affine, track_running_stats, device=device, dtype=dtype,
                         bias=bias)
        self.process_group = process_group

    def _check_input_dim(self, input: torch.Tensor) -> None:
        if input.dim() < 2:
            raise ValueError(f"expected at least 2D input (got {input.dim()}D input)")

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        self._check_input_dim(input)
        if input.size(1) == 0:
            raise ValueError("SyncBatchNorm number of input channels should be non-zero")
        # Momentum and num_batches_tracked exactly as torch's SyncBatchNorm (and _BatchNorm).
        factor = 0.0 if self.momentum is None else self.momentum
        if self.training and self.track_running_stats:
            self.num_batches_tracked.add_(1)
            factor = 1.0 / float(self.num_batches_tracked) if self.momentum is None else self.momentum
        bn_training = self.training or (self.running_mean is None and self.running_var is None)
        running_mean = self.running_mean if not self.training or self.track_running_stats else None
        running_var = self.running_var if not self.training or self.track_running_stats else None
        group, world = None, 1
        if bn_training and self.training and dist.is_available() and dist.is_initialized():
            group = self.process_group or dist.group.WORLD
            world = dist.get_world_size(group)
        if world == 1:
            # No peers: BatchNorm itself, bit for bit.
            return F.batch_norm(input, running_mean, running_var, self.weight, self.bias, bn_training,
                                factor, self.eps)
        return _SyncBatchNormFunction.apply(input, self.weight, self.bias, running_mean, running_var,
                                            self.eps, factor, group, world)

    @classmethod
    def convert_sync_batchnorm(cls, module: torch.nn.Module, process_group: Any | None = None) -> torch.nn.Module:
        """Replace every ``BatchNorm*d`` (and torch's ``SyncBatchNorm``) in ``module`` by this class.

        As :meth:`torch.nn.SyncBatchNorm.convert_sync_batchnorm`: the new
        layers share the old ones' parameters and buffers (the optimizer's
        parameters stay valid); children are replaced in place and
        ``module`` is returned, or the new layer if ``module`` itself is one.
        Layers that already are ddplab SyncBatchNorm stay as they are.

        Example::
            >>> net = SyncBatchNorm.convert_sync_batchnorm(torch.nn.Sequential(torch.nn.BatchNorm1d(4)))
            >>> type(net[0]).__name__
            'SyncBatchNorm'
        """
        output = module
        if isinstance(module, _BatchNorm) and not isinstance(module, cls):
            output = cls(module.num_features, module.eps, module.momentum, module.affine,
                         module.track_running_stats, process_group, bias=module.bias is not None)
            if module.affine:
                with torch.no_grad():
                    output.weight = module.weight
                    output.bias = module.bias
            output.running_mean = module.running_mean
            output.running_var = module.running_var
            output.num_batches_tracked = module.num_batches_tracked
            output.training = module.training
            if hasattr(module, "qconfig"):
                output.qconfig = module.qconfig
        for name, child in module.named_children():
            output.add_module(name, cls.convert_sync_batchnorm(child, process_group))
        return output


def convert_sync_batchnorm(module: torch.nn.Module, process_group: Any | None = None) -> torch.nn.Module:
    """:meth:`SyncBatchNorm.convert_sync_batchnorm`: every BatchNorm layer of ``module`` -> ddplab's SyncBatchNorm.

    Example::
        >>> model = convert_sync_batchnorm(model)           # before wrapping it in DDP
        >>> ddp = torch.nn.parallel.DistributedDataParallel(model)
    """
    return SyncBatchNorm.convert_sync_batchnorm(module, process_group)

"""The residual networks the backend-divergence case trains.

``SmallResNet`` is the CPU stand-in for the report's ResNet-50: the same
ingredients (3×3 convolutions, basic residual blocks, normalization, ReLU,
global average pooling, a linear classifier) at a size that trains a step of
batch 32 in float64 in milliseconds on one core. ``resnet50`` is the
report's model written out with bottleneck blocks (the CIFAR variant of
kuangliu/pytorch-cifar that the report imports as ``models.resnet.ResNet50``:
a 3×3 stride-1 stem, no max-pool, stages [3, 4, 6, 3]), selectable for GPU
runs. torchvision is not needed.

Normalization and DDP. The default is BatchNorm, as in the report. In
training mode BatchNorm normalizes with the statistics of the rank's own
mini-batch, so each rank's forward pass depends only on its shard; the
running mean and variance are updated locally and, with DDP's default
``broadcast_buffers=True`` (the report's setting), overwritten by rank 0's
copy before each forward. A broadcast copies bits and rounds nothing, and the
running statistics are never read in training mode, so BatchNorm adds no
reduction-order effect: the only collective that can round is the gradient
all-reduce -- which is what the case studies. ``norm="group"`` (GroupNorm,
no buffers, no broadcast) is offered to check that claim by experiment.

Example::

    >>> model = build_model("resnet", num_classes=10, in_channels=1, dtype=torch.float64)
    >>> model(torch.zeros(2, 1, 8, 8, dtype=torch.float64)).shape
    torch.Size([2, 10])
"""
from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MODELS", "NORMS", "BasicBlock", "Bottleneck", "SmallResNet", "ResNet",
           "resnet50", "build_model"]

#: Model names :func:`build_model` accepts.
MODELS = ("resnet", "resnet50")
#: Normalization layers the models accept.
NORMS = ("batch", "group")
#: Groups of GroupNorm (channel counts below are all multiples of it).
GROUPS = 8


def _norm(kind: str, channels: int) -> nn.Module:
    if kind == "batch":
        return nn.BatchNorm2d(channels)
    if kind == "group":
        return nn.GroupNorm(min(GROUPS, channels), channels)
    raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {kind!r}")


class BasicBlock(nn.Module):
    """Two 3×3 convolutions with a residual connection: relu(F(x) + shortcut(x))."""

    expansion = 1

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        self.conv1 = nn.Conv2d(in_planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=1, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, planes, 1, stride=stride, bias=False), _norm(norm, planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class Bottleneck(nn.Module):
    """1×1 reduce, 3×3, 1×1 expand (×4), with a residual connection (ResNet-50's block)."""

    expansion = 4

    def __init__(self, in_planes: int, planes: int, stride: int = 1, norm: str = "batch"):
        super().__init__()
        out_planes = self.expansion * planes
        self.conv1 = nn.Conv2d(in_planes, planes, 1, bias=False)
        self.bn1 = _norm(norm, planes)
        self.conv2 = nn.Conv2d(planes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn2 = _norm(norm, planes)
        self.conv3 = nn.Conv2d(planes, out_planes, 1, bias=False)
        self.bn3 = _norm(norm, out_planes)
        self.shortcut = nn.Sequential()
        if stride != 1 or in_planes != out_planes:
            self.shortcut = nn.Sequential(
                nn.Conv2d(in_planes, out_planes, 1, stride=stride, bias=False),
                _norm(norm, out_planes))

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = F.relu(self.bn2(self.conv2(out)))
        out = self.bn3(self.conv3(out))
        return F.relu(out + self.shortcut(x))


class ResNet(nn.Module):
    """A CIFAR-style ResNet: 3×3 stem, residual stages, global average pool, linear head.

    ``blocks[i]`` blocks of ``block`` with ``widths[i]`` planes; every stage
    after the first halves the spatial size. Global average pooling makes the
    network accept any input size (8×8 digits, 32×32 CIFAR-10).
    """

    def __init__(self, block: type, blocks: list[int], widths: list[int], num_classes: int = 10,
                 in_channels: int = 3, norm: str = "batch"):
        super().__init__()
        if len(blocks) != len(widths) or not blocks:
            raise ValueError(f"blocks and widths must be non-empty and of equal length, "
                             f"got {blocks} and {widths}")
        if num_classes < 1 or in_channels < 1:
            raise ValueError(f"num_classes and in_channels must be >= 1, got {num_classes}, {in_channels}")
        self.conv1 = nn.Conv2d(in_channels, widths[0], 3, stride=1, padding=1, bias=False)
        self.bn1 = _norm(norm, widths[0])
        in_planes = widths[0]
        stages = []
        for i, (count, planes) in enumerate(zip(blocks, widths)):
            layers = []
            for j in range(count):
                stride = 2 if (i > 0 and j == 0) else 1
                layers.append(block(in_planes, planes, stride, norm))
                in_planes = planes * block.expansion
            stages.append(nn.Sequential(*layers))
        self.layers = nn.Sequential(*stages)
        self.linear = nn.Linear(in_planes, num_classes)

    def forward(self, x):
        out = F.relu(self.bn1(self.conv1(x)))
        out = self.layers(out)
        out = F.adaptive_avg_pool2d(out, 1).flatten(1)
        return self.linear(out)


class SmallResNet(ResNet):
    """Three stages of one basic block each (widths 16, 32, 64 by default): about 78k weights.

    Small enough for a 2-core CPU, deep enough to have the report's moving
    parts, and -- with a small DDP ``bucket_cap_mb`` -- several gradient buckets.
    """

    def __init__(self, num_classes: int = 10, in_channels: int = 1, widths=(16, 32, 64),
                 norm: str = "batch"):
        super().__init__(BasicBlock, [1] * len(widths), list(widths), num_classes, in_channels, norm)


def resnet50(num_classes: int = 10, in_channels: int = 3, norm: str = "batch") -> ResNet:
    """The report's ResNet-50: bottleneck stages [3, 4, 6, 3] of 64..512 planes (23.5M weights)."""
    return ResNet(Bottleneck, [3, 4, 6, 3], [64, 128, 256, 512], num_classes, in_channels, norm)


def build_model(name: str, num_classes: int, in_channels: int, dtype: torch.dtype = torch.float32,
                *, norm: str = "batch", seed: int | None = None) -> nn.Module:
    """Build model ``name`` ("resnet" or "resnet50") in ``dtype``.

    With ``seed`` the initialization is drawn from ``torch.manual_seed(seed)``
    (in float32, as PyTorch's initializers do, then cast), so every rank and
    every run builds bitwise the same weights.
    """
    if name not in MODELS:
        raise ValueError(f"model must be one of {', '.join(MODELS)}, got {name!r}")
    if norm not in NORMS:
        raise ValueError(f"norm must be one of {', '.join(NORMS)}, got {norm!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating torch.dtype, got {dtype!r}")
    if seed is not None:
        torch.manual_seed(seed)
    if name == "resnet":
        model = SmallResNet(num_classes, in_channels, norm=norm)
    else:
        model = resnet50(num_classes, in_channels, norm=norm)
    return model.to(dtype)

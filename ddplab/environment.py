"""The environment block every report carries, so an issue thread can trust a result."""
from __future__ import annotations

import datetime
import os
import platform

__all__ = ["environment_info", "environment_markdown"]


def environment_info(backend: str | None = None, world_sizes: list[int] | None = None) -> dict:
    """Versions, hardware and date: ddplab, torch, Python, CPU/GPU, backend, world sizes."""
    import torch

    import ddplab

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    info = {
        "ddplab": ddplab.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": platform.processor() or platform.machine(),
        "cpu_count": os.cpu_count(),
        "gpus": gpus,
        "gpu_names": [torch.cuda.get_device_name(i) for i in range(gpus)],
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())) if gpus else None,
        "gloo": torch.distributed.is_gloo_available(),
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
    }
    if backend is not None:
        info["backend"] = backend
    if world_sizes is not None:
        info["world_sizes"] = list(world_sizes)
    return info


def environment_markdown(info: dict) -> str:
    """The environment as a two-column Markdown table (values shown literally: they are data)."""
    from ddplab import markup

    rows = []
    for key in ("ddplab", "torch", "python", "backend", "world_sizes", "cpu", "cpu_count",
                "gpus", "gpu_names", "cuda", "nccl", "platform", "date", "note"):
        if key in info and info[key] not in (None, [], ""):
            value = info[key]
            if isinstance(value, list):
                value = ", ".join(map(str, value))
            rows.append([markup.text(key), markup.text(value)])
    return markup.table(["", ""], rows)

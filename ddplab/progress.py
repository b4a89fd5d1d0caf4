"""Progress bars that work in JupyterLab, in papermill logs and in a terminal.

In a live notebook ``tqdm.auto`` draws a widget. Under papermill that widget is
saved as its initial "0/N" (the final state lives only in widget state), so in
batch runs -- ``DDPLAB_BATCH=1``, which ``ddplab report`` sets -- a plain text
bar is used instead, redrawn at most every ``TQDM_MININTERVAL`` seconds
(default :data:`BATCH_MININTERVAL`) so logs stay short. ``TQDM_DISABLE=1``
silences every bar.
"""
from __future__ import annotations

import os

__all__ = ["BATCH_MININTERVAL", "in_batch", "progress_bar"]

BATCH_MININTERVAL = 5.0


def in_batch() -> bool:
    """True when running a batch job (papermill under ``ddplab report``)."""
    return os.environ.get("DDPLAB_BATCH", "") not in ("", "0")


def progress_bar(total: int, desc: str = ""):
    """A tqdm bar for ``total`` steps that suits where it runs."""
    disable = os.environ.get("TQDM_DISABLE", "") not in ("", "0")
    if in_batch():
        from tqdm.std import tqdm

        interval = float(os.environ.get("TQDM_MININTERVAL", BATCH_MININTERVAL))
        return tqdm(total=total, desc=desc, mininterval=interval, disable=disable)
    from tqdm.auto import tqdm

    return tqdm(total=total, desc=desc, disable=disable)

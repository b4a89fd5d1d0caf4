"""A small tmpfs in a private mount namespace: real ENOSPC and EROFS, nothing mounted on this machine."""
from __future__ import annotations

import pathlib
import shutil
import subprocess
import sys

import pytest


def can_mount() -> bool:
    if not shutil.which("unshare"):
        return False
    probe = subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c",
                            "mount -t tmpfs -o size=64k tmpfs /mnt && umount /mnt"],
                           capture_output=True, timeout=30)
    return probe.returncode == 0


needs_mount = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not can_mount(),
    reason="needs a mount namespace (unshare --user --mount) for a small or read-only tmpfs: "
           "as root a chmod'ed folder is still writable")


def on_tmpfs(disk: pathlib.Path, options: str, command: list[str], *, cwd, env, timeout=300):
    """Run ``command`` with a fresh tmpfs mounted at ``disk`` (``options``: size, ro), in a
    private mount namespace."""
    disk.mkdir()
    script = (f"mount -t tmpfs -o size=2m tmpfs {disk} && mount -o remount,{options} {disk} "
              f'&& exec "$@"')
    return subprocess.run(["unshare", "--user", "--map-root-user", "--mount", "sh", "-c", script,
                           "sh", *command], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)

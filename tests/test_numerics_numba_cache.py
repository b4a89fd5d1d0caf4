"""numba's on-disk cache for ddplab's kernels: found when the package and the home are read-only, and never stale.

Fresh interpreters import a copy of the package in which numba's own places
cannot be used (a file stands where ``__pycache__`` and the user cache
directory would go, which stops root as well as anyone else): the import must
still work, the kernels must be cached in a private directory under the
temporary directory, and a second fresh interpreter must load them from there
instead of compiling. Editing a module whose helpers the kernels inline must
give them a fresh cache (numba alone checks only the kernel's own file).
"""
from __future__ import annotations

import json
import os
import pathlib
import shutil
import subprocess
import sys

import ddplab

_CODE = """
import json, numpy as np
from ddplab.numerics import _numba_cache, _program_kernels as K
ops = np.zeros((1, 3), np.int32)
K.needed_ranks(np.zeros(1, np.int64), np.zeros(1, np.int64), ops, np.array([0, 1]), 2)
print(json.dumps({"path": _numba_cache.CACHE_PATH,
                  "hits": sum(K.needed_ranks.stats.cache_hits.values()),
                  "misses": sum(K.needed_ranks.stats.cache_misses.values())}))
"""


def _fresh_process(env: dict, cwd: pathlib.Path) -> dict:
    # Not run from the checkout, whose ddplab would come first on sys.path.
    proc = subprocess.run([sys.executable, "-c", _CODE], env=env, cwd=cwd, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_kernels_cache_in_a_private_temp_dir_when_package_and_home_are_not_writable_and_never_go_stale(tmp_path):
    site = tmp_path / "site"
    shutil.copytree(pathlib.Path(ddplab.__file__).parent, site / "ddplab",
                    ignore=shutil.ignore_patterns("__pycache__"))
    numerics = site / "ddplab" / "numerics"
    (numerics / "__pycache__").write_text("not a directory")
    blocked = tmp_path / "blocked"
    blocked.write_text("not a directory")
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    env = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
    env.update(PYTHONPATH=str(site), XDG_CACHE_HOME=str(blocked / "cache"), HOME=str(blocked / "home"),
               TMPDIR=str(tmp), PYTHONDONTWRITEBYTECODE="1")

    first = _fresh_process(env, tmp)
    path = pathlib.Path(first["path"])
    assert path.parent.parent == tmp and path.parent.name.startswith("ddplab-numba-cache"), path
    assert first["misses"] == 1 and list(path.rglob("*.nbi")), "compiled, but nothing was written to the cache"
    second = _fresh_process(env, tmp)
    assert second["path"] == first["path"]
    assert second["hits"] == 1 and second["misses"] == 0, second

    # exact.py inlines _bignum's helpers: a change there must not load kernels compiled from the old code.
    with open(numerics / "_bignum.py", "a") as f:
        f.write("\n# edited\n")
    third = _fresh_process(env, tmp)
    assert third["path"] != first["path"]
    assert third["misses"] == 1 and third["hits"] == 0, third

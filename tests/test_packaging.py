"""An installed ddplab (the built wheel, not this checkout) runs a report and a torchrun job from anywhere."""
from __future__ import annotations

import os
import pathlib
import socket
import subprocess
import sys
import sysconfig
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh virtualenv holding only the built ddplab wheel; its dependencies come from this
    environment's site-packages (a path entry, so this checkout's editable install stays out)."""
    tmp = tmp_path_factory.mktemp("wheel")
    out = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", str(ROOT), "-w",
                          str(tmp / "dist")], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    [wheel] = (tmp / "dist").glob("ddplab-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "ddplab/notebooks/02_half_precision_weights.ipynb" in names
    assert "ddplab/reproduced/half_precision.md" in names
    venv = tmp / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    out = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", site,
                          str(wheel)], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr
    (pathlib.Path(site) / "deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env["PATH"] = f"{venv / 'bin'}{os.pathsep}{env.get('PATH', '')}"
    # Borrowed packages' data files (nbconvert's templates) live in this environment's share/.
    env["JUPYTER_PATH"] = str(pathlib.Path(sys.prefix) / "share" / "jupyter")
    where = subprocess.run([str(python), "-c", "import ddplab; print(ddplab.__file__)"], env=env, cwd=tmp,
                           capture_output=True, text=True, check=True).stdout.strip()
    assert where.startswith(site), where   # the wheel's copy, not this checkout
    return python, env, tmp


@pytest.mark.slow  # a kernel and a case report from the wheel (about 35 s); the fixture checks the wheel carries the notebooks
def test_installed_wheel_runs_a_report_from_any_directory(installed):
    python, env, tmp = installed
    elsewhere = tmp / "somewhere"
    elsewhere.mkdir()
    out = subprocess.run([str(python), "-m", "ddplab", "report", "half_precision", "--quick",
                          "--output", "out"], cwd=elsewhere, env=env, capture_output=True, text=True,
                         timeout=600)
    assert out.returncode == 0, out.stdout + out.stderr
    assert (elsewhere / "out" / "half_precision" / "results" / "verdict.json").exists()


def test_installed_wheel_runs_under_torchrun(installed):
    python, env, tmp = installed
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([str(python), "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}",
                          "--max-restarts", "0", "-m", "ddplab", "run", "half_precision",
                          "--out", "run", "-p", "dtypes", "float16", "-p", "in_features", "32",
                          "-p", "out_features", "16", "-p", "lanes", "1,8"],
                         cwd=tmp, env={**env, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
                         timeout=300)
    saved = (tmp / "run" / "run.json").exists()
    assert out.returncode == 0, f"run.json written: {saved}\n{out.stdout}{out.stderr}"
    assert saved

"""User code called while `ddplab report` checks parameters: bounded by --timeout, its exit an error."""
from __future__ import annotations

import os
import pathlib
import subprocess
import sys
import textwrap
import threading

import pytest

from ddplab.user_code import UserCodeExit, UserCodeTimeout, call_bounded

REPO = pathlib.Path(__file__).resolve().parent.parent

#: User modules a `-p setup module:function` names: one exits, one hangs in its call, one in its import.
USER_MODULES = {
    "exits": """
        import sys

        def setup():
            sys.exit(3)
    """,
    "hangs_in_call": """
        import threading

        def setup():
            threading.Event().wait()
    """,
    "hangs_in_import": """
        import time

        while True:
            time.sleep(1)

        def setup():
            pass
    """,
}


def _report(tmp_path: pathlib.Path, *args: str) -> subprocess.CompletedProcess:
    for name, source in USER_MODULES.items():
        (tmp_path / f"{name}.py").write_text(textwrap.dedent(source))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "ddplab", "report", "your_training", *args,
                           "--output", "out"], capture_output=True, text=True, cwd=tmp_path, env=env,
                          timeout=300)


@pytest.mark.parametrize("setup, code", [("sys:exit", None), ("exits:setup", 3)])
def test_a_setup_that_calls_sys_exit_is_an_error_naming_it(tmp_path, setup, code):
    proc = _report(tmp_path, "-p", "setup", setup)
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"'{setup}' called sys.exit({code!r})" in proc.stderr and "Traceback" not in proc.stderr
    assert not (tmp_path / "out").exists()  # refused before anything ran


@pytest.mark.parametrize("setup", ["hangs_in_call:setup", "hangs_in_import:setup"])
def test_a_setup_that_hangs_is_stopped_by_the_timeout(tmp_path, setup):
    proc = _report(tmp_path, "-p", "setup", setup, "--timeout", "3")
    assert proc.returncode == 2, (proc.stdout, proc.stderr)
    assert f"setup={setup!r}) did not return within 3 s (--timeout)" in proc.stderr
    assert "Traceback" not in proc.stderr and not (tmp_path / "out").exists()


def test_call_bounded_returns_raises_and_stops_waiting():
    assert call_bounded(divmod, 7, 2, timeout=5, what="divmod") == (3, 1)
    with pytest.raises(ZeroDivisionError):
        call_bounded(divmod, 1, 0, timeout=5, what="divmod")
    with pytest.raises(UserCodeExit, match=r"the setup called sys.exit\('bye'\)") as exit_info:
        call_bounded(sys.exit, "bye", timeout=5, what="the setup")
    assert isinstance(exit_info.value, ValueError)  # bad input to the command: exit status 2
    release = threading.Event()
    try:
        with pytest.raises(UserCodeTimeout, match="the wait did not return within 0.2 s"):
            call_bounded(release.wait, timeout=0.2, what="the wait")
    finally:
        release.set()  # the thread left behind ends here, not with the test process
    with pytest.raises(ValueError, match="finite number of seconds"):
        call_bounded(print, timeout=float("nan"), what="print")

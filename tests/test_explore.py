"""The explorer: widgets driven from Python, and end to end in JupyterLab + headless Chromium."""
from __future__ import annotations

import os
import pathlib
import re
import shutil
import socket
import subprocess
import sys
import time
import urllib.request

import pytest
import torch

from ddplab.cases import case_names, get_case
from ddplab.process_tree import kill_tree
from ddplab.explore import (CaseExplorer, NumericsPlayground, parameter_widget,
                            playground_contributions)

NOTEBOOKS = pathlib.Path(__file__).resolve().parent.parent / "notebooks"


@pytest.mark.parametrize("case", case_names())
def test_widgets_round_trip_every_case_parameter(case):
    spec = get_case(case)
    explorer = CaseExplorer(case)
    assert explorer.params() == spec.check_params()
    for p in spec.parameters:
        assert parameter_widget(p).description == p.name


def _images(output) -> int:
    return sum("image/png" in o.get("data", {}) for o in output.outputs)


@pytest.mark.slow
def test_run_button_produces_records_figures_and_verdict(no_leftovers):
    explorer = CaseExplorer("half_precision")
    explorer.set_values(**get_case("half_precision").quick)
    explorer.run_button.click()
    explorer.wait(180)
    assert explorer.error is None, explorer.error
    assert len(explorer.records) > 0 and explorer.verdict is not None
    assert _images(explorer.output) >= 1
    assert explorer.status.value.startswith("done")
    assert not explorer.run_button.disabled and explorer.stop_button.disabled
    assert explorer.bars.children and all(b.value == b.max for b in explorer.bars.children)


@pytest.mark.slow
def test_stop_button_ends_a_running_launch(no_leftovers):
    explorer = CaseExplorer("backend_divergence")
    explorer.set_values(world_sizes=[2], steps=500)
    explorer.run_button.click()
    deadline = time.monotonic() + 120
    while not explorer.bars.children and time.monotonic() < deadline:
        time.sleep(0.1)  # wait for the first streamed record
    assert explorer.bars.children, explorer.status.value
    explorer.stop_button.click()
    explorer.wait(60)
    assert not explorer.running
    assert explorer.status.value.startswith("stopped"), explorer.status.value
    assert len(explorer.records) > 0  # what was streamed before the stop is kept


#: A count of cases or reports in prose: "the four reproduced reports", "5 cases".
COUNTED = re.compile(r"\b(one|two|three|four|five|six|seven|eight|nine|ten|\d+)\s+"
                     r"(?:\w+\s+)?(cases|reports)\b", re.IGNORECASE)
WORDS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine", "ten"]


def test_the_explorers_text_states_no_wrong_count_of_cases():
    """The intro describes what the case menu offers: every registered case."""
    import json

    nb = json.loads((NOTEBOOKS / "00_explore.ipynb").read_text())
    text = " ".join("".join(c["source"]) for c in nb["cells"] if c["cell_type"] == "markdown")
    offered = CaseExplorer().case_picker.options
    assert list(offered) == case_names()
    for number, _ in COUNTED.findall(text):
        count = int(number) if number.isdigit() else WORDS.index(number.lower())
        assert count == len(offered), f"the intro says {number!r}; the menu offers {len(offered)}"


def test_bad_values_are_reported_without_running():
    explorer = CaseExplorer("backend_divergence")
    explorer.inputs["world_sizes"].value = "2, 0"
    explorer.run_button.click()
    assert not explorer.running and explorer.records is None
    assert "world_sizes" in explorer.status.value


def test_playground_updates_on_every_change():
    pg = NumericsPlayground(world_size=4, numel=2000)
    first = dict(pg.results)
    assert set(first) == {"sequential", "pairwise", "gloo_ring", "nccl_ring"}
    assert all(m["classification"] == "rounding" for m in first.values())
    assert bytes(pg.figure.value).startswith(b"\x89PNG")
    pg.distribution.value = "cancellation-heavy"
    heavy = pg.results
    # Cancellation: errors huge in ulps of the tiny sum, yet within the bound on Σ|x|.
    assert max(m["max_ulp"] for m in heavy.values()) > max(m["max_ulp"] for m in first.values())
    assert all(m["max_bound_ratio"] <= 1.0 for m in heavy.values())
    pg.orders.value = ("gloo_ring",)
    assert list(pg.results) == ["gloo_ring"]
    pg.world_size.value = 2
    # Two addends: every order is one correctly rounded addition.
    assert pg.results["gloo_ring"]["frac_correctly_rounded"] == 1.0


def test_playground_data_is_deterministic_and_large_w_streams():
    a = playground_contributions("heavy-tailed", 3, 100, torch.float32, seed=1)
    b = playground_contributions("heavy-tailed", 3, 100, torch.float32, seed=1)
    assert torch.equal(a.row(2), b.row(2))
    big = playground_contributions("normal", 1024, 1 << 16, torch.float32)
    assert big.kind == "rows"  # generated per rank, never W×N in memory
    with pytest.raises(ValueError, match="unknown distribution"):
        playground_contributions("uniform", 2, 10, torch.float32)


# ---------------------------------------------------------------- JupyterLab + Chromium


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def make_lab_args() -> list[str]:
    """The arguments `make lab` gives JupyterLab (the Makefile's LAB_ARGS), less the notebook folder."""
    import shlex

    makefile = (NOTEBOOKS.parent / "Makefile").read_text()
    match = re.search(r"^LAB_ARGS\s*:?=\s*(.*)$", makefile, re.MULTILINE)
    assert match, "the Makefile defines no LAB_ARGS"
    args = shlex.split(match.group(1).replace("$(CURDIR)", str(NOTEBOOKS.parent)))
    return [a for a in args if not a.startswith("--notebook-dir")]


def _start_lab(tmp_path, root, extra=()):
    """JupyterLab on a free loopback port with `make lab`'s arguments; returns (process, url, token).

    Its own config, runtime and user-settings folders, so this machine's settings play no part.
    """
    port, token = _free_port(), "ddplab-test"
    env = {**os.environ, "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
           "JUPYTER_RUNTIME_DIR": str(tmp_path / "rt"), "TQDM_DISABLE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={port}", "--ip=127.0.0.1",
         f"--ServerApp.token={token}", f"--ServerApp.root_dir={root}", "--allow-root",
         *make_lab_args(), *extra],
        env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "lab.log", "w"))
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 90
    while True:
        try:
            urllib.request.urlopen(f"{url}/api/status?token={token}", timeout=2)
            return proc, url, token
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                kill_tree(proc.pid)
                pytest.fail("JupyterLab did not start:\n" + (tmp_path / "lab.log").read_text()[-3000:])
            time.sleep(0.5)


@pytest.fixture(scope="module")
def make_lab(tmp_path_factory):
    """A JupyterLab as `make lab` starts it, on a copy of the explorer notebook; ``api(path, ...)``."""
    import json

    tmp_path = tmp_path_factory.mktemp("make_lab")
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOKS / "00_explore.ipynb", root / "00_explore.ipynb")
    proc, url, token = _start_lab(tmp_path, root)

    def api(path: str, method: str = "GET", body: dict | None = None):
        request = urllib.request.Request(f"{url}{path}?token={token}", method=method,
                                         data=None if body is None else json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        with urllib.request.urlopen(request, timeout=60) as response:
            text = response.read()
        return json.loads(text) if text else None

    yield api
    kill_tree(proc.pid)  # the server and any kernel it started


def test_make_labs_jupyterlab_fetches_no_news_and_asks_nothing(make_lab):
    """The "notified about official Jupyter news?" pop-up shows when fetchNews is "none" (its
    default); the lab `make lab` starts has it off, as the settings it serves say."""
    settings = make_lab("/lab/api/settings/@jupyterlab/apputils-extension:notification")
    # What the page computes: the schema's defaults (with the lab's overrides), then the user's.
    defaults = {name: prop.get("default") for name, prop in settings["schema"]["properties"].items()}
    composite = {**defaults, **settings["settings"]}
    assert composite["fetchNews"] == "false"  # never fetched, never asked
    assert composite["checkForUpdates"] is False
    # Defaults, not locks: the user's own settings (none here) can still turn the news on.
    assert settings["settings"] == {}


def test_the_explorer_opens_on_ddplabs_kernel_in_make_lab(make_lab):
    """JupyterLab starts the kernel a notebook names when it has it: "ddplab", which runs this
    environment's Python (make setup registers it), not "Python 3 (ipykernel)"."""
    import json

    wanted = json.loads((NOTEBOOKS / "00_explore.ipynb").read_text())["metadata"]["kernelspec"]["name"]
    specs = make_lab("/api/kernelspecs")["kernelspecs"]
    if wanted not in specs:
        pytest.skip(f"no {wanted!r} kernel registered here (make setup registers it)")
    argv0 = specs[wanted]["spec"]["argv"][0]
    # This environment's interpreter (a venv's python is a symlink: compare unresolved paths).
    assert os.path.abspath(shutil.which(argv0) or argv0).startswith(os.path.abspath(sys.prefix) + os.sep), argv0
    # What the page does on opening the notebook: a session on the kernel its metadata names.
    session = make_lab("/api/sessions", "POST", {"path": "00_explore.ipynb", "type": "notebook",
                                                 "name": "00_explore.ipynb", "kernel": {"name": wanted}})
    try:
        assert session["kernel"]["name"] == wanted
    finally:
        make_lab(f"/api/sessions/{session['id']}", "DELETE")


@pytest.fixture
def jupyterlab(tmp_path):
    root = tmp_path / "lab"
    root.mkdir()
    shutil.copy(NOTEBOOKS / "00_explore.ipynb", root / "00_explore.ipynb")
    # As `make lab` starts it (no news pop-up over the panel), plus the app handle the test drives.
    proc, url, token = _start_lab(tmp_path, root, ["--LabApp.expose_app_in_browser=True"])
    yield url, token
    kill_tree(proc.pid)  # the server, its kernel and any ranks the kernel started


@pytest.mark.slow
@pytest.mark.browser
def test_explorer_end_to_end_in_jupyterlab(jupyterlab, tmp_path):
    chromium = shutil.which("chromium")
    if chromium is None:
        pytest.skip("Debian's chromium is not installed (make test installs it as root)")
    from playwright.sync_api import sync_playwright

    url, token = jupyterlab
    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=chromium, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        page = browser.new_page(viewport={"width": 1400, "height": 1000})
        page.set_default_timeout(120_000)
        page.goto(f"{url}/lab/tree/00_explore.ipynb?token={token}")
        page.wait_for_selector(".jp-Notebook")
        page.wait_for_function("() => window.jupyterapp && window.jupyterapp.commands")

        def wait_for(js: str, seconds: float = 150) -> None:
            # JupyterLab asks which kernel to use if the notebook's "ddplab" is not registered: accept.
            deadline = time.monotonic() + seconds
            while not page.evaluate(js):
                if page.locator(".jp-Dialog .jp-mod-accept").count():
                    page.locator(".jp-Dialog .jp-mod-accept").first.click()
                assert time.monotonic() < deadline, f"timed out waiting for {js}"
                time.sleep(0.5)

        # Run only once the notebook's own kernel is connected and idle.
        wait_for("() => { const s = window.jupyterapp.shell.currentWidget?.sessionContext?.session;"
                 " return !!s && !!s.kernel && s.kernel.connectionStatus === 'connected'"
                 " && s.kernel.status === 'idle'; }")
        page.evaluate("() => { window.jupyterapp.commands.execute('notebook:run-all-cells'); }")
        # The playground draws a figure without any process.
        wait_for("() => { const i = document.querySelector('.ddplab-playground-figure');"
                 " return !!i && i.naturalWidth > 0; }")
        # The case panel: a fast case, quick values, Run.
        page.locator(".widget-dropdown select").first.select_option("half_precision")
        page.get_by_role("button", name="quick values").click()
        page.locator("button.jupyter-button", has_text=re.compile(r"^\s*Run\s*$")).click()
        wait_for("() => { const imgs = [...document.querySelectorAll('.ddplab-explorer-output img')];"
                 " return imgs.length > 0 && imgs.every(i => i.naturalWidth > 0); }")
        wait_for("() => document.body.innerText.includes('done in')")
        shot = tmp_path / "explorer.png"
        page.screenshot(path=str(shot), full_page=True)
        assert shot.stat().st_size > 20_000
        browser.close()

"""Headless Chromium with the network cut, for the page tests (a helper module, not tests)."""
from __future__ import annotations

import pathlib
import re
import shutil

import pytest


def _chromium():
    return shutil.which("chromium") or shutil.which("chromium-browser")


#: What raw TeX looks like when no renderer ran.
RAW_TEX = ("\\sqrt", "\\sum", "$\\", "\\gamma", "\\|")


def check_pages_offline(pages: dict, shots: pathlib.Path, *, successful: tuple = ()) -> None:
    """Open each page in headless Chromium with the network cut: it renders, every
    image loads, nothing is fetched, no raw TeX is visible; a screenshot of each
    lands in ``shots``. Pages named in ``successful`` must show no error-styled
    output (stderr streams, tracebacks)."""
    if _chromium() is None:
        pytest.skip("Debian's chromium is not installed (make test installs it as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking",
            "--disable-component-update", "--disable-sync", "--no-first-run"])
        context = browser.new_context(offline=True)
        remote = []
        context.route(re.compile(r"^(?!file:|data:).*"),
                      lambda route: (remote.append(route.request.url), route.abort()))
        page = context.new_page()
        for name, path in pages.items():
            page.goto(path.resolve().as_uri())
            page.wait_for_load_state("load")
            images = page.eval_on_selector_all(
                "img", "els => els.map(e => [e.complete, e.naturalWidth])")
            assert images, f"{name}: no images"
            assert all(done and width > 0 for done, width in images), (name, images)
            visible = page.inner_text("body")
            assert not [t for t in RAW_TEX if t in visible], (name, [t for t in RAW_TEX if t in visible])
            if name in successful:
                errors = page.eval_on_selector_all(
                    "[data-mime-type='application/vnd.jupyter.stderr'], .jp-OutputArea-output.jp-mod-error"
                    ", .output_stderr, .output_error", "els => els.map(e => e.innerText.slice(0, 200))")
                assert errors == [], (name, errors)
            page.screenshot(path=str(shots / f"{name}.png"), full_page=True)
            assert (shots / f"{name}.png").stat().st_size > 10_000
        browser.close()
    assert remote == []  # nothing fetched from the network


#: What the injection payloads set when they run.
INJECTED = "__ddplab_injected"


def inert_page_facts(path: pathlib.Path) -> dict:
    """Open ``path`` offline in headless Chromium and report what script could do there:
    ``ran`` (the payloads' :data:`INJECTED` flag), ``dialogs`` (alert/confirm/prompt),
    ``handlers`` (elements with an ``on...`` attribute), ``scripts`` (script elements that
    mention the flag) and ``text`` (the visible text)."""
    if _chromium() is None:
        pytest.skip("Debian's chromium is not installed (make test installs it as root)")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as p:
        browser = p.chromium.launch(executable_path=_chromium(), args=["--no-sandbox", "--disable-gpu"])
        context = browser.new_context(offline=True)
        context.route(re.compile(r"^(?!file:|data:).*"), lambda route: route.abort())
        page = context.new_page()
        dialogs = []
        page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
        page.goto(path.resolve().as_uri())
        page.wait_for_load_state("load")
        page.wait_for_timeout(300)  # an image's onerror fires after load
        facts = {
            "ran": page.evaluate(f"typeof window.{INJECTED} !== 'undefined'"),
            "dialogs": dialogs,
            "handlers": page.evaluate("[...document.querySelectorAll('*')].filter(e => [...e.attributes]"
                                      ".some(a => a.name.startsWith('on'))).map(e => e.outerHTML.slice(0, 120))"),
            "scripts": page.evaluate(f"[...document.scripts].map(s => s.text).filter(t => t.includes('{INJECTED}'))"),
            "text": page.inner_text("body"),
        }
        browser.close()
    return facts

"""A real browser (Playwright driving Debian's Chromium, headless) against a real
``streamkv serve`` on loopback. Skips, saying why, where Chromium or playwright is missing;
``.ci/run`` installs both. Screenshots of every test land in tests/web/artifacts/ (ignored
by git)."""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from pathlib import Path

import pytest

from tests.entrypoints.conftest import run_server

CHROMIUM = os.environ.get("STREAMKV_CHROMIUM", "/usr/bin/chromium")
ARTIFACTS = Path(__file__).parent / "artifacts"
# No sandbox: CI runs as root, where Chromium refuses its sandbox. The rest keeps a
# headless run from reaching anything outside the loopback server.
FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--no-first-run",
    "--disable-default-apps",
    "--disable-extensions",
]


@pytest.fixture(scope="package")
def server():
    # One torch thread: Chromium needs the other core of a 2-core CI machine, and on a busy
    # machine idle OpenMP threads spin against everything else (steps ~10x slower, measured).
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OMP_NUM_THREADS", "1")
            s = stack.enter_context(run_server("--max-num-seqs", "8"))
        yield s


@pytest.fixture(scope="package")
def browser():
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        pytest.skip(
            "browser tests need the Python package playwright "
            "(the dev extra: pip install -e '.[dev]')"
        )
    if not os.access(CHROMIUM, os.X_OK):
        pytest.skip(
            f"browser tests need Chromium at {CHROMIUM} (`apt-get install -y chromium` as root, "
            "or set STREAMKV_CHROMIUM)"
        )
    profile = tempfile.mkdtemp(prefix="streamkv-chromium-")
    pw = sync_playwright().start()
    try:
        context = pw.chromium.launch_persistent_context(
            profile,
            executable_path=CHROMIUM,
            headless=True,
            args=FLAGS,
            viewport={"width": 1280, "height": 800},
        )
        yield context
        context.close()
    finally:
        pw.stop()
        shutil.rmtree(profile, ignore_errors=True)


@pytest.fixture
def page(browser, server, request):
    """A fresh tab on the chat page with empty storage, connected to the server. Fails the
    test on any uncaught error in the page."""
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.goto(server.url + "/")
    tab.evaluate("localStorage.clear(); sessionStorage.clear()")
    tab.reload()
    tab.wait_for_selector("#status[data-state=connected]")
    yield tab
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"))
    tab.close()
    assert not errors, errors

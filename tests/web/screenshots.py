"""The screenshots in docs/ (web-*.png), taken from a default ``streamkv serve`` (the
embedded model on the CPU, its default 2,912-block pool) in headless Chromium:

    .venv/bin/python -m tests.web.screenshots --out docs

web-chat-kv.png      a reply of n=4 samples streaming, the KV pane beside it (desktop)
web-chat-rich.png    a reply with a table, nested lists, code and math (desktop)
web-chat-phone.png   the same conversation on a phone, dark mode
web-kv-phone.png     the KV pane on a phone while a reply streams

Not a pytest module (its name does not start with test_): it takes a minute or two.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
from pathlib import Path

from load_tests.local_server import local_server
from tests.web.conftest import CHROMIUM, FLAGS
from tests.web.test_chat_features import RICH

DESKTOP = {"width": 1280, "height": 800}
PHONE = {"width": 390, "height": 844}
STORY = "Tell me a story about a lighthouse keeper who watches the stars, in many words."


def fresh(page, url: str, settings: dict, kv_open: bool, theme: str = "light") -> None:
    page.goto(url + "/")
    page.evaluate(
        "([s, kv, theme]) => { localStorage.clear(); "
        "localStorage.setItem('streamkv.settings.v1', s);"
        " localStorage.setItem('streamkv.kv.open', kv ? '1' : "
        "''); localStorage.setItem('streamkv.theme', theme); }",
        [json.dumps(settings), kv_open, theme],
    )
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")
    if kv_open:
        page.wait_for_selector("#kv-root[data-state=live]")


def stored(page, url: str, theme: str) -> None:
    conv = {
        "id": "c1",
        "title": "What can you render?",
        "created": 1,
        "messages": [
            {"id": "m0", "role": "user", "content": "What can you render?"},
            {"id": "m1", "role": "assistant", "content": RICH},
        ],
    }
    fresh(page, url, {}, False, theme)
    page.evaluate(
        "c => { localStorage.setItem('streamkv.conversations.v1', JSON.stringify([c]));"
        " localStorage.setItem('streamkv.current.v1', JSON.stringify(c.id)); }",
        conv,
    )
    page.reload()
    page.wait_for_selector(".msg.assistant .katex")


def streaming_kv(page, url: str, out: Path) -> None:
    fresh(page, url, {"max_tokens": 300, "temperature": 0, "n": 4}, True)
    page.fill("#input", STORY)
    page.press("#input", "Enter")
    page.wait_for_function(
        "() => { const r = document.querySelector('.kv-request.mine');"
        " return r && r.querySelectorAll('.kv-row').length === 4 && r.querySelector('.blk .rc')"
        " && document.querySelector('.kv-events li'); }",
        timeout=120_000,
    )
    page.wait_for_timeout(1500)
    page.screenshot(path=str(out))
    page.click("#stop")


def main() -> None:
    ap = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--out", default="docs", help="folder for the PNG files")
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    from playwright.sync_api import sync_playwright

    profile = tempfile.mkdtemp(prefix="streamkv-shots-")
    with local_server([], env={"OMP_NUM_THREADS": "1"}) as server, sync_playwright() as pw:
        browser = pw.chromium.launch_persistent_context(
            profile, executable_path=CHROMIUM, headless=True, args=FLAGS, viewport=DESKTOP
        )
        try:
            page = browser.new_page()
            streaming_kv(page, server.url, out / "web-chat-kv.png")
            stored(page, server.url, "light")
            page.screenshot(path=str(out / "web-chat-rich.png"))
            page.set_viewport_size(PHONE)
            stored(page, server.url, "dark")
            page.screenshot(path=str(out / "web-chat-phone.png"))
            page.set_viewport_size(PHONE)
            streaming_kv(page, server.url, out / "web-kv-phone.png")
        finally:
            browser.close()
            shutil.rmtree(profile, ignore_errors=True)
    for name in sorted(os.listdir(out)):
        if name.startswith("web-") and name.endswith(".png"):
            print(out / name)


if __name__ == "__main__":
    main()

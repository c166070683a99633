"""The live KV-cache view in headless Chromium, against the real server: the block map fills
while a request runs and empties after it, and n=4 samples visibly share blocks."""

from __future__ import annotations

import httpx
import pytest

from tests.web.conftest import ARTIFACTS
from tests.web.test_chat_page import send, use_settings, wait_reply_done

pytestmark = pytest.mark.slow


def stat(page, key: str) -> float:
    return float(page.get_attribute(f".kv-stat[data-key={key}]", "data-value"))


def open_kv(page) -> None:
    page.click("#toggle-kv")
    page.wait_for_selector("#kv-root[data-state=live]")
    page.wait_for_selector(".kv-grid .cell")


def wait_all_free(page) -> None:
    page.wait_for_function(
        "() => document.querySelector('.kv-stat[data-key=used_blocks]').dataset.value === '0'"
        " && !document.querySelector('.kv-grid .st-used, .kv-grid .st-shared')"
        " && document.querySelector('.kv-idle')",
        timeout=20_000,
    )


def test_block_map_fills_while_a_request_runs_and_is_free_after(page, server):
    open_kv(page)
    total = page.locator(".kv-grid:not(.kv-cpu) .cell").count()
    assert total == 256  # the test server's pool, one cell per block
    assert stat(page, "used_blocks") == 0
    use_settings(page, max_tokens=400, temperature=0)  # reloads: the pane stays open
    page.wait_for_selector("#kv-root[data-state=live]")
    send(page, "Write a long story about a lighthouse keeper. " * 6)  # a prompt of several blocks
    page.wait_for_function(
        "() => Number(document.querySelector('.kv-stat[data-key=used_blocks]').dataset.value) >= 3"
        " && document.querySelectorAll('.kv-row .blk').length >= 3",
        timeout=60_000,
    )
    used_cells = page.locator(".kv-grid .st-used").count()
    assert used_cells >= 3
    # The row's physical blocks are the used cells of the grid.
    blocks = [int(b) for b in page.locator(".kv-row .blk").all_inner_texts()]
    states = page.evaluate(
        "bs => bs.map(b => document.querySelectorAll('.kv-grid:not(.kv-cpu) .cell')[b].className)",
        blocks,
    )
    assert all("st-used" in s for s in states), states
    page.click("#stop")
    wait_reply_done(page, timeout=15_000)
    wait_all_free(page)
    h = {k: stat(page, k) for k in ("used_blocks", "shared_blocks", "kv_usage")}
    assert h == {"used_blocks": 0, "shared_blocks": 0, "kv_usage": 0}
    # Freed prompt blocks stay in the prefix cache (free to reuse): drawn as cached.
    assert (
        page.locator(".kv-grid:not(.kv-cpu) .st-free, .kv-grid:not(.kv-cpu) .st-cached").count()
        == total
    )


def prompt_with_partial_last_block(server, text: str) -> str:
    """``text``, lengthened until its chat prompt ends inside a block (the test server's
    blocks are 16 tokens): then each sample's first token is a write into a shared block."""
    while True:
        r = httpx.post(
            f"{server.url}/tokenize",
            json={"messages": [{"role": "user", "content": text}]},
            timeout=30,
        )
        if r.json()["count"] % 16:
            return text
        text += " Please."


def test_n4_samples_share_their_prompt_blocks(page, server):
    open_kv(page)
    use_settings(page, max_tokens=200, temperature=1, seed=3, n=4)
    page.wait_for_selector("#kv-root[data-state=live]")
    send(
        page,
        prompt_with_partial_last_block(
            server, "Tell me a story about the sea and the stars, in many words. " * 4
        ),
    )
    page.wait_for_function(
        "() => Number(document.querySelector('.kv-stat[data-key=shared_blocks]').dataset.value) > 0"
        " && [...document.querySelectorAll('.kv-request')].some(r "
        "=> r.querySelectorAll('.kv-row').length === 4)",
        timeout=60_000,
    )
    assert page.locator(".kv-grid .st-shared").count() > 0
    assert page.locator(".kv-row .blk.st-shared").count() >= 4  # the same blocks in 4 tables
    assert stat(page, "sharing_savings") > 0
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / "kv_view_n4.png"))
    # Each sample's first token lands in the shared last prompt block: copy-on-write.
    page.wait_for_selector(".kv-events .ev-cow_copies", timeout=30_000)
    page.click("#stop")
    wait_reply_done(page, timeout=15_000)
    wait_all_free(page)


def test_a_beam_search_request_shares_blocks_between_beams(page):
    open_kv(page)
    use_settings(page, max_tokens=40, n=2, beam_width=3)
    page.wait_for_selector("#kv-root[data-state=live]")
    send(page, "Write a long story about a lighthouse keeper and the sea.")
    page.wait_for_function(
        "() => Number(document.querySelector('.kv-stat[data-key=shared_blocks]').dataset.value) > 0"
        " && [...document.querySelectorAll('.kv-request')].some(r "
        "=> r.querySelectorAll('.kv-row').length >= 2)",
        timeout=60_000,
    )
    wait_reply_done(page, timeout=120_000)
    # Answered whole: the two best beams arrive together as choices.
    assert page.locator(".msg.assistant .choices button").count() == 2
    assert "tok/s" in page.locator(".msg.assistant .stats").inner_text()
    wait_all_free(page)


def test_a_server_with_the_view_off_is_said_once_not_retried(page):
    calls = []

    def off(route):
        calls.append(route.request.url)
        route.fulfill(
            status=404,
            content_type="application/json",
            body='{"error": {"message": "the KV-cache view is '
            'off on this server (it listens beyond loopback; enable it explicitly)"}}',
        )

    page.route("**/v1/kv/stream*", off)
    page.click("#toggle-kv")
    page.wait_for_selector("#kv-root[data-state=off]")
    assert "the KV-cache view is off on this server" in page.locator(".kv-status").inner_text()
    page.wait_for_timeout(1500)  # a retry would come after 0.5 s
    assert len(calls) == 1

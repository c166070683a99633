"""The KV-cache view at the default pool size (2,912 blocks, a default CPU run), as a
newcomer first sees it: the block tables, the events and a short explanation on top, the
pool as a compact overview below; the reply on screen marked in the tables; shared blocks
with their ref counts (also in the pool's tooltip); copy-on-write and prefix-cache hits
drawn on the blocks they touched; the late-sharing case explained; a time axis with
preemptions and swaps."""

from __future__ import annotations

import contextlib
import json
import threading

import httpx
import pytest

from tests.entrypoints.conftest import run_server
from tests.web.conftest import ARTIFACTS
from tests.web.test_chat_page import send, use_settings, wait_reply_done

pytestmark = pytest.mark.slow

DEFAULT_BLOCKS = 2912  # `streamkv serve` on the CPU with the default model and memory


@pytest.fixture(scope="module")
def default_server():
    with contextlib.ExitStack() as stack:
        with pytest.MonkeyPatch.context() as env:
            env.setenv("OMP_NUM_THREADS", "1")
            # The pool of a default CPU run: 2,912 blocks and no swap space.
            s = stack.enter_context(
                run_server(
                    "--num-kv-blocks",
                    str(DEFAULT_BLOCKS),
                    "--num-swap-blocks",
                    "0",
                    "--max-num-seqs",
                    "8",
                )
            )
        yield s


@pytest.fixture
def kv_page(browser, default_server, request):
    tab = browser.new_page()
    errors: list[str] = []
    tab.on("pageerror", lambda e: errors.append(str(e)))
    tab.goto(default_server.url + "/")
    tab.evaluate(
        "localStorage.clear(); sessionStorage.clear(); "
        "localStorage.setItem('streamkv.kv.open', '1')"
    )
    tab.reload()
    tab.wait_for_selector("#status[data-state=connected]")
    tab.wait_for_selector("#kv-root[data-state=live]")
    tab.wait_for_selector(".kv-device .cell")
    yield tab
    ARTIFACTS.mkdir(exist_ok=True)
    tab.screenshot(path=str(ARTIFACTS / f"{request.node.name}.png"))
    tab.close()
    assert not errors, errors


def box(page, selector: str) -> dict:
    return page.locator(selector).first.bounding_box()


def test_the_default_pool_is_a_compact_overview_below_the_tables(kv_page):
    page = kv_page
    assert page.locator(".kv-device .cell").count() == DEFAULT_BLOCKS
    assert page.get_attribute(".kv-device", "data-per-cell") == "1"
    assert box(page, ".kv-device")["height"] <= 160  # not a screenful of grey cells
    page.click(".kv-pool .kv-zoom")  # every block at full size, on demand
    page.wait_for_function(
        "() => document.querySelector('.kv-device').getBoundingClientRect().height > 400"
    )
    page.click(".kv-pool .kv-zoom")
    page.wait_for_function(
        "() => document.querySelector('.kv-device').getBoundingClientRect().height <= 160"
    )
    # What teaches comes first and is in the first screen of the pane.
    tables, events, pool = box(page, ".kv-tables"), box(page, ".kv-events"), box(page, ".kv-device")
    assert tables["y"] < events["y"] < pool["y"]
    assert tables["y"] < 500
    explain = page.locator(".kv-explain").inner_text()
    for words in (
        "16 tokens",
        "Block table",
        "logical block",
        "physical block",
        "ref count",
        "Copy-on-write",
    ):
        assert words in explain, (words, explain)
    assert page.locator(".kv-explain").is_visible()
    # On a phone the explanation is one line (the rest a tap away), and the tables follow it.
    page.set_viewport_size({"width": 390, "height": 844})
    page.reload()
    page.wait_for_selector("#kv-root[data-state=live]")
    summary = page.locator(".kv-explain summary")
    assert (
        summary.is_visible()
        and "16 tokens" in summary.inner_text()
        and "copy-on-write" in summary.inner_text()
    )
    assert box(page, ".kv-tables")["y"] < 400
    page.set_viewport_size({"width": 1280, "height": 800})
    page.reload()
    page.wait_for_selector(".kv-device .cell")
    assert "2,912 blocks" in page.locator(".kv-pool").first.inner_text()
    # The swap half of the paper is not hidden: where it would be, the page says how to see it.
    swap = page.locator(".kv-pool").nth(1)
    assert (
        swap.is_visible()
        and "none: a preempted request" in swap.inner_text()
        and "--swap-space" in swap.inner_text()
    )


def test_the_reply_on_screen_is_marked_in_the_block_tables(kv_page):
    page = kv_page
    use_settings(page, max_tokens=300, temperature=0)
    page.wait_for_selector("#kv-root[data-state=live]")
    send(page, "Write a long story about a lighthouse keeper. " * 4)
    page.wait_for_selector(".kv-request.mine .kv-row .blk", timeout=60_000)
    # The WebSocket reply is named with the view's token: its row is marked exactly, by its id.
    label = page.locator(".kv-request.mine .kv-req-id").inner_text()
    assert "your reply · chatcmpl-web-" in label and "newest" not in label
    # Its blocks are outlined in the pool overview as well.
    page.wait_for_function("() => document.querySelectorAll('.kv-device .cell.mine').length >= 2")
    mine = {int(b) for b in page.locator(".kv-request.mine .blk").all_inner_texts()}
    cells = page.evaluate(
        "() => [...document.querySelectorAll('.kv-device "
        ".cell')].flatMap((c, i) => c.classList.contains('mine') ? [i] : [])"
    )
    assert set(cells) & mine
    page.click("#stop")
    wait_reply_done(page, timeout=15_000)


def test_shared_blocks_show_ref_counts_and_copy_on_write_marks_the_copies(kv_page):
    page = kv_page
    # Greedy: the four samples are alike and end together, so all four rows stay on screen.
    use_settings(page, max_tokens=200, temperature=0, n=4)
    page.wait_for_selector("#kv-root[data-state=live]")
    send(page, "Tell me a story about the sea and the stars, in many words. " * 4 + "Please.")
    page.wait_for_function(
        "() => { const r = document.querySelector('.kv-request.mine');"
        " return r && r.querySelectorAll('.kv-row').length === 4 && r.querySelector('.blk .rc'); }",
        timeout=60_000,
    )
    assert "×4" in page.locator(".kv-request.mine .blk .rc").all_inner_texts()
    # An HTTP reply names itself with the page's token: the server shows it as the page's own.
    assert page.get_attribute(".kv-request.mine", "data-request-id").startswith("chatcmpl-web-")
    assert "your reply · " in page.locator(".kv-request.mine .kv-req-id").inner_text()
    # The pool's tooltip gives a shared block's ref count (drawing the CPU pool used to wipe them).
    shared = int(page.locator(".kv-request.mine .blk.st-shared").first.get_attribute("data-block"))
    page.hover(f".kv-device .cell >> nth={shared}")
    title = page.get_attribute(f".kv-device .cell >> nth={shared}", "title")
    assert f"block {shared}: shared, ref count 4" in title, title
    # Each sample's first token was a write into the shared last prompt block: its copies
    # are named in the event and outlined where they are.
    page.wait_for_selector(".kv-events .ev-cow_copies", timeout=30_000)
    event = page.locator(".kv-events .ev-cow_copies").first
    assert "copy-on-write" in event.inner_text() and "copy " in event.inner_text(), (
        event.inner_text()
    )
    copied = event.get_attribute("data-blocks").split(",")
    assert copied and page.locator(".kv-timeline .tl-mark.tl-cow").count() >= 1
    # Pointing at the event lights its blocks up in the pool (and in the tables while they hold
    # them).
    event.hover()
    spotted = page.evaluate(
        "() => [...document.querySelectorAll('.kv-device .cell')].flatMap((c, "
        "i) => c.classList.contains('spot') ? [String(i)] : [])"
    )
    assert set(spotted) == set(copied), (spotted, copied)
    page.screenshot(path=str(ARTIFACTS / "kv_default_n4.png"))
    page.click("#stop")
    wait_reply_done(page, timeout=15_000)


def complete(server, prompt: str | list[str], max_tokens: int) -> None:
    httpx.post(
        f"{server.url}/v1/completions",
        timeout=120,
        json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True},
    ).raise_for_status()


def test_a_prefix_cache_hit_is_drawn_on_the_reused_blocks(kv_page, default_server):
    page = kv_page
    prompt = "The history of lighthouses on the coast of Brittany, told in detail. " * 8
    complete(default_server, prompt, 1)  # computed once: its full blocks stay cached
    page.wait_for_selector(".kv-idle", timeout=20_000)
    worker = threading.Thread(target=complete, args=(default_server, prompt, 120))
    worker.start()
    try:
        page.wait_for_selector(".kv-events .ev-prefix_cache_hits", timeout=60_000)
        event = page.locator(".kv-events .ev-prefix_cache_hits").first
        assert "prompt tokens reused" in event.inner_text()
        reused = event.get_attribute("data-blocks").split(",")
        assert len(reused) >= 3
        assert page.locator(".kv-timeline .tl-mark.tl-hit").count() >= 1
    finally:
        worker.join()


def test_requests_arriving_together_wait_for_the_shared_prefix_and_say_why(kv_page, default_server):
    """One completions request with 4 prompts submits 4 engine requests at the same instant:
    one computes the common prefix, the others wait for it (a block is shared only once it
    is computed), then reuse it. The page says so while they wait."""
    page = kv_page
    prompt = "A fresh system prompt nobody has sent before, about tide tables and harbours. " * 50
    worker = threading.Thread(target=complete, args=(default_server, [prompt] * 4, 20))
    worker.start()
    try:
        page.wait_for_selector(".kv-events .ev-late_sharing", timeout=60_000)
        text = page.locator(".kv-events .ev-late_sharing").first.inner_text()
        assert "3 requests waiting" in text and "shared only once its K/V are computed" in text, (
            text
        )
        page.wait_for_selector(".kv-events .ev-prefix_cache_hits", timeout=60_000)
    finally:
        worker.join()


def test_the_timeline_shows_usage_preemptions_and_swaps(kv_page):
    """Preemption needs a full pool, which a default pool does not reach in a test: the
    snapshots that follow one are made from the live one (the page draws what it is sent)."""
    page = kv_page
    page.wait_for_function("() => window.streamkv.kv.last")
    snap = page.evaluate("() => window.streamkv.kv.last")
    assert snap["device"]["num_blocks"] == DEFAULT_BLOCKS

    def shown(s: dict) -> None:
        page.evaluate("s => window.streamkv.kv.show(s)", s)

    snap["cpu"] = {
        "num_blocks": 64,
        "blocks_per_cell": 1,
        "cells": "." * 64,
    }  # as with --num-swap-blocks 64
    busy = json.loads(json.dumps(snap))
    busy["headline"].update(kv_usage=0.6, used_blocks=1747)
    busy["requests"] = [
        {
            "request_id": "chatcmpl-a",
            "seqs": [
                {
                    "seq_id": 1,
                    "status": "running",
                    "num_tokens": 40,
                    "num_computed_tokens": 39,
                    "table": [5, 6, 7],
                    "num_blocks": 3,
                }
            ],
        }
    ]
    shown(busy)
    out = json.loads(json.dumps(busy))
    out["counters"]["preemptions"] += 1
    out["counters"]["swapped_out_blocks"] += 3
    out["headline"].update(kv_usage=0.1, swapped=1, cpu_used_blocks=3)
    out["requests"][0]["seqs"][0].update(status="swapped", table=[0, 1, 2])
    out["cpu"]["cells"] = "uuu" + "." * 61
    shown(out)
    back = json.loads(json.dumps(out))
    back["counters"]["swapped_in_blocks"] += 3
    back["headline"].update(swapped=0, cpu_used_blocks=0)
    back["requests"][0]["seqs"][0].update(status="running", table=[9, 10, 11])
    shown(back)
    for cls in ("tl-preempt", "tl-swap-out", "tl-swap-in"):
        assert page.locator(f".kv-timeline .tl-mark.{cls}").count() == 1, cls
    assert int(page.get_attribute(".kv-timeline", "data-samples")) >= 3
    events = page.locator(".kv-events").inner_text()
    assert "preempted 1 request" in events and "chatcmpl-a now in CPU blocks" in events
    assert "swapped 3 blocks out to CPU RAM" in events and "swapped 3 blocks back in" in events
    assert (
        page.locator(".kv-cpu .cell").count() == 64
        and "64 blocks of CPU RAM" in page.locator(".kv-pool").nth(1).inner_text()
    )

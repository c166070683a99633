"""The chat page at / in headless Chromium, against the real server: streaming with its
stats, Stop, Regenerate, edit-and-resend, a failed turn that stays out of the history,
conversations kept across a reload, safe markdown, phone width."""

from __future__ import annotations

import json

import pytest

pytestmark = pytest.mark.slow

REPLY = ".msg.assistant"
DONE = ".msg.assistant:not(.pending)"


def use_settings(page, **settings) -> None:
    """Store the chat parameters as the settings panel would, then reload the page."""
    page.evaluate("s => localStorage.setItem('streamkv.settings.v1', s)", json.dumps(settings))
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")


def send(page, text: str) -> None:
    page.fill("#input", text)
    page.press("#input", "Enter")


def wait_reply_done(page, count: int = 1, timeout: float = 60_000) -> None:
    page.wait_for_function(
        "n => document.querySelectorAll('.msg.assistant:not(.pending)').length "
        ">= n && !document.querySelector('.msg.pending')",
        arg=count,
        timeout=timeout,
    )


def test_reply_streams_with_tokens_per_second_and_time_to_first_token(page):
    use_settings(page, max_tokens=12, temperature=0)
    send(page, "Tell me about the sea.")
    # Text shows while the reply is still streaming, not only at the end.
    page.wait_for_function(
        "() => { const m = document.querySelector('.msg.assistant.pending .body');"
        " return m && m.textContent.trim().length > 0; }",
        timeout=60_000,
    )
    wait_reply_done(page)
    reply = page.locator(REPLY)
    assert reply.locator(".body").inner_text().strip()
    stats = reply.locator(".stats").inner_text()
    assert (
        "12 tokens" in stats and "tok/s" in stats and "first token" in stats and "length" in stats
    ), stats
    assert float(reply.locator(".stats").get_attribute("data-tps")) > 0
    assert page.locator(".msg.user .body").inner_text() == "Tell me about the sea."


def test_stop_ends_the_reply_and_the_page_can_send_again(page):
    use_settings(page, max_tokens=400, temperature=0)
    send(page, "Write a long story about a lighthouse keeper.")
    page.wait_for_function(
        "() => (document.querySelector('.msg.pending .body')?.textContent || '').length > 5",
        timeout=60_000,
    )
    assert page.locator("#send").is_disabled()
    page.click("#stop")
    wait_reply_done(page, timeout=15_000)
    stats = page.locator(f"{REPLY} .stats").inner_text()
    assert "stopped" in stats, stats
    tokens = int(stats.split(" tokens")[0])
    assert 0 < tokens < 400
    assert page.locator("#stop").is_hidden() and page.locator("#send").is_enabled()
    assert not page.locator(".msg.failed").count()


def test_regenerate_keeps_the_old_reply_as_a_branch(page):
    use_settings(page, max_tokens=8, temperature=0)
    send(page, "Name a colour.")
    wait_reply_done(page)
    first_id = page.locator(REPLY).get_attribute("data-id")
    first_text = page.locator(f"{REPLY} .body").inner_text()
    page.click(f"{REPLY} .regen-btn")
    page.wait_for_function(
        "id => { const m = document.querySelector('.msg.assistant');"
        " return m && m.dataset.id !== id && !m.classList.contains('pending'); }",
        arg=first_id,
        timeout=60_000,
    )
    assert page.locator(REPLY).count() == 1 and page.locator(".msg.user").count() == 1
    # Greedy: the same prompt gives the same reply, so the history sent was the same.
    assert page.locator(f"{REPLY} .body").inner_text() == first_text
    assert "8 tokens" in page.locator(f"{REPLY} .stats").inner_text()
    assert page.locator(f"{REPLY} .branch-label").inner_text() == "2/2"
    page.click(f"{REPLY} .branch-prev")
    assert page.locator(REPLY).get_attribute("data-id") == first_id
    assert page.locator(f"{REPLY} .branch-label").inner_text() == "1/2"
    page.reload()  # the branches are kept with the conversation
    page.wait_for_selector("#status[data-state=connected]")
    assert page.locator(f"{REPLY} .branch-label").inner_text() == "1/2"


def test_edit_and_resend_keeps_the_original_turn_as_a_branch(page):
    use_settings(page, max_tokens=6, temperature=0)
    send(page, "Name a fruit.")
    wait_reply_done(page)
    first_reply = page.locator(f"{REPLY} .body").inner_text()
    page.click(".msg.user .edit-btn")
    page.fill(".msg.user textarea.edit", "Name a vegetable.")
    page.click(".msg.user .primary")
    wait_reply_done(page)
    assert page.locator(".msg.user .body").all_inner_texts() == ["Name a vegetable."]
    assert page.locator(REPLY).count() == 1
    assert "6 tokens" in page.locator(f"{REPLY} .stats").inner_text()
    assert page.locator(".msg.user .branch-label").inner_text() == "2/2"
    page.click(".msg.user .branch-prev")  # the original question, with its own reply
    assert page.locator(".msg.user .body").all_inner_texts() == ["Name a fruit."]
    assert page.locator(f"{REPLY} .body").inner_text() == first_reply


def test_overlong_prompt_fails_its_turn_and_the_next_turn_succeeds(page):
    use_settings(page, max_tokens=8, temperature=0)
    send(page, "word " * 1100)  # over the test server's 1024-token context
    page.wait_for_selector(".msg.assistant.failed", timeout=30_000)
    error = page.locator(".msg.assistant.failed .error-text").inner_text()
    assert "maximum context length" in error, error
    assert page.locator(".msg.user.failed").count() == 1
    assert page.locator(".error-text").count() == 1  # one marked turn, no stray error bubble
    send(page, "Hi!")
    wait_reply_done(page, count=2)
    last = page.locator(REPLY).last
    assert "failed" not in (last.get_attribute("class") or "")
    assert "8 tokens" in last.locator(".stats").inner_text()


def test_reload_keeps_conversations(page):
    use_settings(page, max_tokens=4, temperature=0)
    send(page, "First conversation.")
    wait_reply_done(page)
    reply = page.locator(f"{REPLY} .body").inner_text()
    page.click("#new-chat")
    send(page, "Second conversation.")
    wait_reply_done(page)
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")
    titles = page.locator("#conversations .conv-title").all_inner_texts()
    assert titles == ["Second conversation.", "First conversation."]
    assert page.locator(".msg.user .body").inner_text() == "Second conversation."
    page.click("#conversations .conv-title >> text=First conversation.")
    assert page.locator(".msg.user .body").inner_text() == "First conversation."
    assert page.locator(f"{REPLY} .body").inner_text() == reply
    assert "4 tokens" in page.locator(f"{REPLY} .stats").inner_text()


def test_settings_panel_sends_n_samples_as_choices(page):
    page.click("#settings summary")
    for field, value in (("max_tokens", "6"), ("temperature", "1"), ("seed", "7"), ("n", "3")):
        page.fill(f"#{field}", value)
        page.dispatch_event(f"#{field}", "change")
    send(page, "Say something.")
    wait_reply_done(page)
    assert page.locator(f"{REPLY} .choices button").count() == 3
    tokens = int(page.locator(f"{REPLY} .stats").inner_text().split(" tokens")[0])
    assert 3 <= tokens <= 18  # 3 samples of at most 6 tokens each
    page.click(f"{REPLY} .choices button >> nth=2")
    assert "chosen" in page.locator(f"{REPLY} .choices button >> nth=2").get_attribute("class")
    page.reload()  # the settings stay too
    page.wait_for_selector("#status[data-state=connected]")
    assert page.input_value("#n") == "3" and page.input_value("#seed") == "7"


MARKDOWN_CASES = r"""
import("/web/markdown.js").then(({ renderMarkdown }) => {
  const box = document.createElement("div");
  box.innerHTML = renderMarkdown(
    "# Title\n**bold** and `<b>code</b>` <img src=x onerror=alert(1)> [x](javascript:alert(1))\n" +
    "[ok](https://example.com/a?b=1&c=\"2\")\n\n" +
    "```html\n<script>alert(1)</script>\n```\n- one\n- two");
  return {
    imgs: box.querySelectorAll("img, script").length,
    strong: box.querySelector("strong")?.textContent,
    code: box.querySelector("p code")?.textContent,
    pre: box.querySelector("pre code")?.textContent,
    links: Array.from(box.querySelectorAll("a"), (a) => a.getAttribute("href")),
    items: box.querySelectorAll("ul li").length,
    text: box.textContent,
  };
})
"""


def test_markdown_renders_model_output_without_injection(page):
    out = page.evaluate(MARKDOWN_CASES)
    assert out["imgs"] == 0
    assert out["strong"] == "bold" and out["code"] == "<b>code</b>"
    assert out["pre"].strip() == "<script>alert(1)</script>"
    assert out["links"] == ["https://example.com/a?b=1&c=%222%22"]  # javascript: stays text
    assert out["items"] == 2 and "<img src=x onerror=alert(1)>" in out["text"]


def test_phone_width_has_no_horizontal_scroll(page):
    page.set_viewport_size({"width": 390, "height": 800})
    use_settings(page, max_tokens=4, temperature=0)
    send(page, "Hi")
    wait_reply_done(page)
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    assert page.locator("#sidebar").is_hidden()
    page.click("#toggle-sidebar")
    assert page.locator("#sidebar").is_visible()
    page.click("#conversations .conv-title")
    assert page.locator("#sidebar").is_hidden()


def test_a_dropped_connection_fails_the_reply_and_reconnects(page):
    sockets = []

    def through(ws):  # a pass-through to the real server that the test can cut
        ws.connect_to_server()
        sockets.append(ws)

    page.route_web_socket("**/v1/chat/ws", through)
    use_settings(page, max_tokens=400, temperature=0)
    assert len(sockets) == 1
    send(page, "Write a long story about a lighthouse keeper.")
    page.wait_for_function(
        "() => (document.querySelector('.msg.pending .body')?.textContent || '').length > 0",
        timeout=60_000,
    )
    sockets[0].close(code=1011, reason="test: the network dropped")
    page.wait_for_selector(".msg.assistant.failed", timeout=10_000)
    assert (
        "connection to the server was lost"
        in page.locator(".msg.assistant.failed .error-text").inner_text()
    )
    page.wait_for_function(
        "() => document.querySelector('#status').dataset.state === 'connected'", timeout=10_000
    )
    assert len(sockets) == 2  # the page opened a new socket by itself (backoff starts at ~0.5 s)
    use_settings(page, max_tokens=4, temperature=0)
    send(page, "Hi!")
    wait_reply_done(page, count=2)
    assert "4 tokens" in page.locator(REPLY).last.locator(".stats").inner_text()

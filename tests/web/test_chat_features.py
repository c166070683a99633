"""The chat page's features beyond a plain exchange, in headless Chromium against the real
server, at desktop and phone sizes: GFM markdown with highlighted code and math (vendored
libraries, nothing fetched from another origin), Continue for a reply cut at max tokens,
dark mode (the OS preference and the toggle), JSON export and import, deletion only after
a confirmation and never to make room, and Send disabled while the server is unreachable."""

from __future__ import annotations

import json
import re
from urllib.parse import urlsplit

import pytest

from tests.web.conftest import ARTIFACTS
from tests.web.test_chat_page import DONE, REPLY, send, use_settings, wait_reply_done

pytestmark = pytest.mark.slow

SIZES = {"desktop": {"width": 1280, "height": 800}, "phone": {"width": 390, "height": 800}}

RICH = r"""Here is a table:

| model | params | context |
|-------|-------:|---------|
| SmolLM2 | 135M | 8192 |
| Llama 2 | 7B | 4096 |

1. first
   - nested a
   - nested b
2. second

```python
def attention(q, k, v):
    return softmax(q @ k.T) @ v
```

Inline math $e^{i\pi} + 1 = 0$ and a display:

$$
\sum_{i=1}^{n} i = \frac{n(n+1)}{2}
$$

Prices like $5 and $10 stay text. ~~old~~ **new**
"""


@pytest.fixture(params=list(SIZES))
def sized(page, request):
    page.set_viewport_size(SIZES[request.param])
    return page, request.param


def stored_conversation(page, messages: list[dict], title: str = "Stored") -> None:
    """A conversation put straight into storage (as an older page would have saved it)."""
    conv = {
        "id": "c1",
        "title": title,
        "created": 1,
        "messages": [{"id": f"m{i}", **m} for i, m in enumerate(messages)],
    }
    page.evaluate(
        "c => { localStorage.setItem('streamkv.conversations.v1', JSON.stringify([c]));"
        " localStorage.setItem('streamkv.current.v1', JSON.stringify(c.id)); }",
        conv,
    )
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")


def test_markdown_tables_nested_lists_code_and_math_render_offline(sized, server):
    page, size = sized
    origins = []
    page.on("request", lambda r: origins.append(urlsplit(r.url).netloc))
    stored_conversation(
        page,
        [
            {"role": "user", "content": "Show me everything."},
            {"role": "assistant", "content": RICH},
        ],
    )
    reply = page.locator(REPLY)
    assert reply.locator("table th").all_inner_texts() == ["model", "params", "context"]
    assert reply.locator("table tbody tr").count() == 2
    assert reply.locator("ol > li > ul > li").count() == 2  # nested, not flattened
    assert reply.locator("pre code .hljs-keyword").count() >= 2  # def, return
    assert reply.locator("pre").get_attribute("data-lang") == "python"
    assert reply.locator(".math .katex").count() == 2  # inline and display
    assert reply.locator(".math.display .katex-display").count() == 1
    assert "$5 and $10" in reply.inner_text()
    assert reply.locator("s, del").inner_text() == "old"
    page.wait_for_function("document.fonts.status === 'loaded'")
    # Every script, style and font came from the server itself.
    assert set(origins) <= {urlsplit(server.url).netloc}, origins
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")
    ARTIFACTS.mkdir(exist_ok=True)
    page.screenshot(path=str(ARTIFACTS / f"chat_markdown_{size}.png"))


def test_continue_extends_a_reply_cut_at_max_tokens(sized):
    page, _ = sized
    use_settings(page, max_tokens=6, temperature=0)
    send(page, "Write a long story about a lighthouse keeper.")
    wait_reply_done(page)
    assert "length" in page.locator(f"{REPLY} .stats").inner_text()
    before = page.locator(f"{REPLY} .body").inner_text()
    page.click(f"{REPLY} .continue-btn")
    page.wait_for_function(
        "t => { const m = document.querySelector('.msg.assistant:not(.pending) .body');"
        " return m && m.innerText.length > t.length; }",
        arg=before,
        timeout=60_000,
    )
    wait_reply_done(page)
    after = page.locator(f"{REPLY} .body").inner_text()
    assert after.startswith(before.rstrip()[:10]) and len(after) > len(before)
    assert page.locator(REPLY).count() == 1  # the same message, longer


def background(page, selector: str = "body") -> str:
    return page.evaluate(f"getComputedStyle(document.querySelector('{selector}')).backgroundColor")


def test_dark_mode_follows_the_os_and_the_toggle(sized):
    page, size = sized
    page.emulate_media(color_scheme="light")
    light = background(page)
    page.emulate_media(color_scheme="dark")
    dark = background(page)
    assert light != dark
    assert sum(map(int, re.findall(r"\d+", dark)[:3])) < 150  # a dark background
    assert page.locator("#toggle-theme").inner_text().endswith("auto")
    page.click("#toggle-theme")  # auto -> dark
    page.emulate_media(color_scheme="light")
    assert background(page) == dark  # forced dark beats the OS
    page.click("#toggle-theme")  # dark -> light
    page.emulate_media(color_scheme="dark")
    assert background(page) == light
    page.click("#toggle-theme")  # light -> auto
    page.click("#toggle-theme")  # auto -> dark
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")
    assert page.locator("#toggle-theme").inner_text().endswith("dark") and background(page) == dark
    stored_conversation(
        page, [{"role": "user", "content": "Dark?"}, {"role": "assistant", "content": RICH}]
    )
    page.screenshot(path=str(ARTIFACTS / f"chat_dark_{size}.png"))


def test_export_and_import_conversations(page, tmp_path):
    stored_conversation(
        page,
        [{"role": "user", "content": "Keep me."}, {"role": "assistant", "content": "Kept."}],
        "Keep me.",
    )
    with page.expect_download() as info:
        page.click("#export")
    path = tmp_path / "chats.json"
    info.value.save_as(path)
    data = json.loads(path.read_text())
    assert data["format"] == "streamkv-conversations"
    assert [m["content"] for m in data["conversations"][0]["nodes"]] == ["Keep me.", "Kept."]
    page.once("dialog", lambda d: d.accept())
    page.click("#conversations .conv-delete")
    assert "Keep me." not in page.locator("#conversations").inner_text()
    page.set_input_files("#import-file", str(path))
    page.wait_for_selector("#notice:not([hidden])")
    assert "imported 1 conversation" in page.locator("#notice").inner_text()
    assert page.locator(".msg.user .body").inner_text() == "Keep me."
    assert page.locator(f"{REPLY} .body").inner_text() == "Kept."
    page.set_input_files(
        "#import-file",
        files=[{"name": "bad.json", "mimeType": "application/json", "buffer": b"{}"}],
    )
    page.wait_for_function(
        "() => document.querySelector('#notice').textContent.includes('could not import bad.json')"
    )


def test_nothing_is_deleted_without_asking(page):
    convs = [{"id": f"c{i}", "title": f"chat {i}", "created": i, "messages": []} for i in range(60)]
    page.evaluate(
        "c => localStorage.setItem('streamkv.conversations.v1', JSON.stringify(c))", convs
    )
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")
    assert page.locator("#conversations li").count() == 60
    page.evaluate("() => window.streamkv.store.create()")  # the 61st drops none
    page.reload()
    page.wait_for_selector("#status[data-state=connected]")
    assert page.locator("#conversations li").count() == 61
    asked = []
    page.once("dialog", lambda d: (asked.append(d.message), d.dismiss()))
    page.click("#conversations li >> nth=1 >> .conv-delete")
    assert asked and "cannot be undone" in asked[0]
    assert page.locator("#conversations li").count() == 61
    page.once("dialog", lambda d: d.accept())
    page.click("#conversations li >> nth=1 >> .conv-delete")
    assert page.locator("#conversations li").count() == 60


def test_send_is_disabled_while_the_server_is_unreachable(sized):
    page, _ = sized
    down = [True]

    def socket(ws):  # every attempt fails while the "server" is down
        if down[0]:
            ws.close(code=1006)
        else:
            ws.connect_to_server()

    page.route_web_socket("**/v1/chat/ws", socket)
    page.route("**/v1/models", lambda route: route.abort() if down[0] else route.continue_())
    page.reload()
    page.wait_for_selector("#status[data-state=disconnected]")
    assert page.locator("#send").is_disabled()
    page.wait_for_function(
        "() => /server unreachable · retrying in \\d+ "
        "s/.test(document.querySelector('#status').textContent)"
    )
    # The countdown runs (it used to freeze) and no API key is asked for.
    seen = {page.locator("#status").inner_text()}
    page.wait_for_function(
        "t => document.querySelector('#status').textContent !== t", arg=seen.pop(), timeout=10_000
    )
    assert "API key" not in page.locator("#status").inner_text()
    down[0] = False  # back: the page reconnects by itself within its backoff
    page.wait_for_selector("#status[data-state=connected]", timeout=20_000)
    assert page.locator("#send").is_enabled()


def test_a_finished_reply_can_be_regenerated_at_phone_width(page):
    page.set_viewport_size(SIZES["phone"])
    use_settings(page, max_tokens=4, temperature=0)
    send(page, "Hi")
    wait_reply_done(page)
    page.click(f"{DONE} .regen-btn")
    page.wait_for_selector(f"{REPLY} .branch-label")
    wait_reply_done(page)
    assert page.locator(f"{REPLY} .branch-label").inner_text() == "2/2"
    assert page.locator(f"{REPLY} .branch-prev").is_visible()
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")


def test_a_text_file_is_attached_into_the_message(sized):
    page, _ = sized
    page.fill("#input", "Summarise this:")
    page.set_input_files(
        "#attach-file",
        files=[
            {"name": "notes.txt", "mimeType": "text/plain", "buffer": b"first line\nsecond line\n"}
        ],
    )
    page.wait_for_function("() => document.querySelector('#input').value.includes('second line')")
    assert (
        page.input_value("#input")
        == "Summarise this:\n\nnotes.txt:\n```\nfirst line\nsecond line\n```\n"
    )
    page.set_input_files(
        "#attach-file",
        files=[
            {"name": "blob.bin", "mimeType": "application/octet-stream", "buffer": b"\x00\x01\x02"}
        ],
    )
    page.wait_for_function(
        "() => document.querySelector('#notice').textContent === 'blob.bin is not a text file'"
    )
    assert page.locator("#attach").is_visible()
    assert page.evaluate("document.documentElement.scrollWidth <= window.innerWidth")

"""``--loop``: the server runs on asyncio's event loop by default and on uvloop when asked
(docs/benchmarks.md "Serving": uvloop writes each SSE event holding the GIL)."""

from __future__ import annotations

import httpx
import pytest

from tests.entrypoints.conftest import run_server

pytestmark = pytest.mark.slow  # two real servers


def _uvloop_loaded(pid: int) -> bool:
    with open(f"/proc/{pid}/maps") as f:
        return "uvloop" in f.read()


@pytest.mark.parametrize("args, uvloop", [((), False), (("--loop", "uvloop"), True)])
def test_the_loop_flag_picks_the_event_loop(args, uvloop):
    pytest.importorskip("uvloop")
    with run_server(*args) as server:
        r = httpx.post(
            f"{server.url}/v1/completions",
            json={"prompt": "Hi", "max_tokens": 2, "stream": True},
            timeout=60,
        )
        assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
        assert _uvloop_loaded(server.proc.pid) == uvloop

"""The Host, Origin and failed-authentication rules as plain functions (no server), and the
same rules through the app on a fake engine: HTTP and WebSocket refusals, logged at INFO."""

from __future__ import annotations

import logging

import pytest
from starlette.datastructures import Headers
from starlette.testclient import TestClient
from starlette.websockets import WebSocketDisconnect

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.openai.errors import APIError
from streamkv.entrypoints.server.app import ServerConfig, build_app
from streamkv.entrypoints.server.security import (
    AuthFailures,
    HostPolicy,
    check_api_key,
    origin_allowed,
    split_host,
)
from tests.entrypoints.fake_engine import FakeEngine


@pytest.mark.parametrize(
    "value, expected",
    [
        ("localhost:8000", ("localhost", 8000)),
        ("Example.COM.", ("example.com", None)),
        ("[::1]:9", ("::1", 9)),
        ("::1", ("::1", None)),
        ("127.0.0.1", ("127.0.0.1", None)),
    ],
)
def test_split_host(value, expected):
    assert split_host(value) == expected


def test_host_policy():
    p = HostPolicy.build("0.0.0.0", ["api.example.com", ".corp.example"])
    for name in (
        "localhost",
        "127.0.0.1",
        "::1",
        "0.0.0.0",
        "api.example.com",
        "x.corp.example",
        "corp.example",
        "foo.localhost",
    ):
        assert p.allows(name), name
    for name in ("evil.com", "example.com", "evilcorp.example", "10.0.0.5"):
        assert not p.allows(name), name
    # An IP literal equal to the address the connection arrived on cannot be a rebinding.
    assert p.allows("10.0.0.5", local_addr="10.0.0.5") and not p.allows(
        "evil.com", local_addr="evil.com"
    )
    assert HostPolicy.build(None, ["*"]).allows("anything.example")


def test_origin_is_compared_with_allowed_hosts_not_with_host():
    p = HostPolicy.build("127.0.0.1")
    # The rebinding request: Origin equal to its own (attacker-chosen) Host.
    assert not origin_allowed("http://evil.com", "http", "evil.com", p, ())
    assert origin_allowed("http://localhost:8000", "http", "localhost:8000", p, ())
    assert origin_allowed("http://127.0.0.1:8000", "ws", "localhost:8000", p, ())
    assert not origin_allowed(
        "http://localhost:3000", "http", "localhost:8000", p, ()
    )  # another local app
    assert not origin_allowed("https://localhost:8000", "http", "localhost:8000", p, ())
    assert not origin_allowed("null", "http", "localhost:8000", p, ())
    assert origin_allowed("http://ok.example", "http", "localhost:8000", p, ("http://ok.example",))
    assert origin_allowed(None, "http", "evil.com", p, ())  # not a browser


def test_failed_authentications_are_capped_per_client_and_expire():
    failures = AuthFailures(limit=3, window=10.0)
    headers = Headers({"authorization": "Bearer wrong"})
    for _ in range(3):
        with pytest.raises(APIError) as e:
            check_api_key("k", headers, failures=failures, client="a")
        assert e.value.code == "invalid_api_key"
    with pytest.raises(APIError) as e:  # even the right key is not compared now
        check_api_key("k", Headers({"authorization": "Bearer k"}), failures=failures, client="a")
    assert e.value.status == 429 and e.value.code == "too_many_auth_failures"
    check_api_key("k", Headers({"authorization": "Bearer k"}), failures=failures, client="b")
    failures.check("a", now=1e12)  # the window has passed
    # Only the first two bearer.* subprotocols are tried.
    with pytest.raises(APIError):
        check_api_key("k", Headers(), ["bearer.x", "bearer.y", "bearer.k"], failures, "c")
    check_api_key("k", Headers(), ["bearer.x", "bearer.k"], failures, "c")
    small = AuthFailures(max_clients=2)
    for client in "xyz":
        small.record(client, 0.0)
    assert list(small._seen) == ["y", "z"]


def test_app_refuses_foreign_host_on_http_and_websocket_and_logs_info(caplog):
    app = build_app(
        AsyncEngine(lambda: FakeEngine()),
        ServerConfig(model_name="fake", hosts=HostPolicy.build("testserver")),
    )
    with TestClient(app) as c, caplog.at_level(logging.INFO, logger="streamkv"):
        r = c.post(
            "/v1/completions",
            json={"prompt": "x"},
            headers={"host": "evil.com", "origin": "http://evil.com"},
        )
        assert r.status_code == 421 and r.json()["error"]["code"] == "host_not_allowed"
        with (
            pytest.raises(WebSocketDisconnect),
            c.websocket_connect("/v1/chat/ws", headers={"host": "evil.com"}),
        ):
            pass
        with (
            pytest.raises(WebSocketDisconnect),
            c.websocket_connect(
                "/v1/chat/ws", subprotocols=["streamkv"] + [f"bearer.{i}" for i in range(20)]
            ),
        ):
            pass
    refusals = [r for r in caplog.records if "refused" in r.getMessage()]
    assert len(refusals) == 3 and all(r.levelno == logging.INFO for r in refusals)

"""The live KV view shows no one else's requests (issue 26): a viewer sees the ids of its own
requests (those holding its secret token) and anonymous, unlinkable rows for the rest; the
view is off when the server listens beyond loopback, unless enabled."""

from __future__ import annotations

import json

from starlette.testclient import TestClient

from streamkv.engine.async_engine import AsyncEngine
from streamkv.entrypoints.server.app import ServerConfig, build_app
from streamkv.entrypoints.server.kv_view import _Viewer
from streamkv.entrypoints.server.security import HostPolicy
from tests.entrypoints.fake_engine import FakeEngine

TOKEN = "k7Qv2mXbL9pTzR4w"
HEAD = json.dumps({"type": "kv_snapshot", "v": 1, "seq": 1})


def _snap(*ids: str) -> dict:
    return {
        "block_size": 16,
        "requests": [
            {
                "request_id": rid,
                "seqs": [
                    {
                        "seq_id": 40 + i,
                        "status": "running",
                        "num_tokens": 20,
                        "num_computed_tokens": 19,
                        "table": [i, 9],
                        "num_blocks": 2,
                    }
                ],
            }
            for i, rid in enumerate(ids)
        ],
    }


def _rows(viewer: _Viewer, snap: dict) -> list[dict]:
    viewer.offer(HEAD, snap)
    return json.loads(viewer.latest)["requests"]


def test_a_viewer_sees_its_own_ids_and_anonymous_rows_for_others() -> None:
    snap = _snap("cmpl-user-alice-medical-42", f"cmpl-{TOKEN}-1")
    mine = _Viewer(TOKEN)
    rows = _rows(mine, snap)
    assert (
        rows[1]["request_id"] == f"cmpl-{TOKEN}-1"
        and rows[1]["own"]
        and rows[1]["seqs"][0]["seq_id"] == 41
    )
    other = rows[0]
    assert (
        not other["own"]
        and "alice" not in json.dumps(other)
        and other["request_id"].startswith("anon-")
    )
    assert other["seqs"][0]["table"] == [0, 9]  # the blocks are the view's point; the owner is not
    assert _rows(mine, snap)[0]["request_id"] == other["request_id"]  # stable while it watches
    # Another viewer (no token, or another connection) gets other labels: nothing links them.
    stranger = _rows(_Viewer(None), snap)
    assert all(not r["own"] for r in stranger)
    assert stranger[0]["request_id"] != other["request_id"] and TOKEN not in json.dumps(stranger)


def _client(hosts: HostPolicy, **config) -> TestClient:
    engine = AsyncEngine(lambda: FakeEngine())
    return TestClient(build_app(engine, ServerConfig(model_name="fake", hosts=hosts, **config)))


def test_the_view_is_off_beyond_loopback_unless_enabled() -> None:
    with _client(HostPolicy.build("0.0.0.0", ["testserver"])) as c:
        r = c.get("/v1/kv/stream")
        assert r.status_code == 404 and r.json()["error"]["code"] == "kv_view_disabled"
    with _client(HostPolicy.build("0.0.0.0", ["testserver"]), kv_view=True) as c:
        r = c.get("/v1/kv/stream?token=short")
        assert r.status_code == 400 and r.json()["error"]["param"] == "token"
    assert (
        HostPolicy.build("127.0.0.1").loopback_only
        and not HostPolicy.build("0.0.0.0").loopback_only
    )


def test_the_view_honours_the_api_key() -> None:
    with _client(HostPolicy.build("testserver"), kv_view=True, api_key="secret-key-123") as c:
        assert c.get("/v1/kv/stream").status_code == 401

"""GET /v1/kv/stream on the real server, without a browser: what a snapshot message holds,
and that the engine takes no snapshots while nobody watches."""

from __future__ import annotations

import json
import time

import httpx
import pytest

pytestmark = pytest.mark.slow


def first_snapshot(server) -> tuple[dict, int]:
    with httpx.stream("GET", f"{server.url}/v1/kv/stream", timeout=30) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        event = None
        for line in r.iter_lines():
            if line.startswith("event:"):
                event = line.split(":", 1)[1].strip()
            elif line.startswith("data:"):
                assert event == "kv_snapshot"
                data = line.split(":", 1)[1].strip()
                return json.loads(data), len(data)
    raise AssertionError("the stream ended before a snapshot")


def test_a_snapshot_message_describes_the_idle_pool(server):
    server.wait_idle()
    snap, size = first_snapshot(server)
    assert (snap["type"], snap["v"]) == ("kv_snapshot", 1)
    assert snap["device"] == {
        "num_blocks": 256,
        "blocks_per_cell": 1,
        "cells": snap["device"]["cells"],
    }
    assert len(snap["device"]["cells"]) == 256 and set(snap["device"]["cells"]) <= {".", "c"}
    assert snap["cpu"]["num_blocks"] == 64 and snap["block_size"] == 16
    assert snap["requests"] == [] and snap["headline"]["used_blocks"] == 0
    assert set(snap["counters"]) >= {"cow_copies", "preemptions", "swapped_out_blocks", "evictions"}
    assert snap["legend"]["s"] == "shared" and snap["interval_ms"] >= 250 and snap["cost_ms"] >= 0
    assert size < 4096


def test_no_snapshots_are_taken_while_nobody_watches(server):
    first, _ = first_snapshot(server)
    time.sleep(2.0)  # at 4 snapshots a second, a producer left running would take ~8
    second, _ = first_snapshot(server)
    assert second["seq"] - first["seq"] <= 2, (first["seq"], second["seq"])

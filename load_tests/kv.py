"""The engine's KV waste (Fig 2) and batched-request (Fig 13) figures over one run: two
snapshots of the raw sums, differenced, so a sweep against one server or engine gets each
rate point's own averages."""

from __future__ import annotations

import re

KINDS = ("token", "reserved", "internal", "external")


def snapshot_from_stats(stats: dict) -> dict:
    return {
        "share_sums": dict(stats["kv_waste_share_sums"]),
        "samples": stats["kv_waste_samples"],
        "batched_sum": stats["batched_requests_sum"],
        "batched_steps": stats["batched_steps"],
        "kv_allocation": stats["kv_allocation"],
        "preemptions": stats["num_preemptions"],
    }


def snapshot_from_metrics(text: str) -> dict | None:
    """From a /metrics scrape; None when the server does not export the figures."""

    def value(name: str, kind: str | None = None) -> float | None:
        label = rf'[^}}]*kind="{kind}"' if kind else r"[^}]*"
        m = re.search(rf"^streamkv:{name}\{{{label}[^}}]*\}} (\S+)$", text, re.M)
        return float(m.group(1)) if m else None

    samples = value("kv_memory_samples_total")
    if samples is None:
        return None
    alloc = re.search(r'kv_allocation="([^"]+)"', text)
    return {
        "share_sums": {k: value("kv_memory_share_sum_total", k) or 0.0 for k in KINDS},
        "samples": samples,
        "batched_sum": value("batched_requests_sum_total") or 0.0,
        "batched_steps": value("batched_steps_total") or 0.0,
        "kv_allocation": alloc.group(1) if alloc else None,
        "preemptions": _vllm_counter(text, "num_preemptions_total"),
    }


def _vllm_counter(text: str, name: str) -> float:
    m = re.search(rf"^vllm:{name}(?:\{{[^}}]*\}})? (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def window(before: dict | None, after: dict | None) -> dict | None:
    """Averages between two snapshots: shares of held KV memory by kind, batched requests."""
    if before is None or after is None:
        return None
    samples = after["samples"] - before["samples"]
    steps = after["batched_steps"] - before["batched_steps"]
    shares = {
        k: (after["share_sums"][k] - before["share_sums"][k]) / samples if samples else None
        for k in KINDS
    }
    return {
        "kv_allocation": after["kv_allocation"],
        "samples": samples,
        "shares": shares,
        "avg_batched_requests": (after["batched_sum"] - before["batched_sum"]) / steps
        if steps
        else None,
        "preemptions": after["preemptions"] - before["preemptions"],
    }

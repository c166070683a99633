"""Capacity, as the paper's hour-long traces read it: the completed requests per second a
system sustains under overload, and one JSON per (system, workload, rate) point.

Past a system's capacity its normalized latency grows with the trace's length (the queue
does), so "the rate at which latency stays under X" read from a short trace overstates the
faster system's lead. What does not depend on the length is the rate at which requests
complete while a queue is waiting: ``completed_req_s``, read between the 10th and the 90th
percentile of completion times, which leaves out the ramp (the batch filling up) and the
drain (the last requests finishing with fewer and fewer beside them). It is the capacity
when the point is overloaded (``offered_req_s`` well above it: ``overloaded``).

    python -m load_tests.bench ... --point-dir docs/paper/h200 --figure 12 --record-steps 4000
"""

from __future__ import annotations

import json
import os
import re

from load_tests.runner import RequestRecord

STEADY = (0.1, 0.9)  # the completions between these fractions of the run's
OVERLOAD = 1.1  # offered / completed above this: the point is past capacity


def completed_req_s(records: list[RequestRecord]) -> float | None:
    """Requests completed per second between the 10th and 90th percentile completion (None
    with fewer than 10 completions)."""
    ends = sorted(r.end for r in records if r.ok)
    if len(ends) < 10:
        return None
    lo, hi = int(STEADY[0] * len(ends)), int(STEADY[1] * len(ends)) - 1
    span = ends[hi] - ends[lo]
    return (hi - lo) / span if span > 0 else None


def offered_req_s(records: list[RequestRecord]) -> float | None:
    """The arrival rate the trace actually offered (its seeded draw, not the nominal rate)."""
    times = sorted(r.scheduled for r in records)
    if len(times) < 2 or times[-1] <= times[0]:
        return None
    return (len(times) - 1) / (times[-1] - times[0])


def figures(records: list[RequestRecord]) -> dict:
    done, offered = completed_req_s(records), offered_req_s(records)
    return {
        "completed_req_s": done,
        "offered_req_s": offered,
        "overloaded": bool(done and offered and offered > OVERLOAD * done),
    }


def device_name(args, hardware: dict) -> str:
    if args.simulate:
        return (
            f"simulated StepCost (base {args.sim_base_ms} ms, token {args.sim_token_ms} ms, "
            f"kv {args.sim_kv_us} us, block {args.sim_block_us} us)"
        )
    if args.backend != "offline":
        return f"server at {args.url}"
    return (
        hardware.get("gpu")
        if str(args.device).startswith("cuda") and hardware.get("gpu")
        else f"cpu ({args.device})"
    )


def point(result: dict, run: dict, args, figure: str) -> dict:
    """One rate point as a flat record (the fields docs/paper.md's tables read), with the
    run's summary, KV figures and step records beside them."""
    summary, kv = run["summary"], run.get("kv") or {}
    return {
        "figure": figure,
        "system": run["label"],
        "workload": result["workload"],
        "num_requests": summary["num_requests"],
        "request_rate": run["request_rate"],
        **run["capacity"],
        "normalized_latency_s_per_token": summary["normalized_latency_s"],
        "completed": summary["completed"],
        "incomplete": summary["incomplete"],
        "duration_s": summary["duration_s"],
        "avg_batched_requests": kv.get("avg_batched_requests"),
        "batched_while_arriving": (kv.get("while_arriving") or {}).get("avg_batched_requests"),
        "kv_shares": kv.get("shares"),
        "preemptions": kv.get("preemptions"),
        "device": device_name(args, result["hardware"]),
        "model": args.model,
        "num_kv_blocks": args.num_kv_blocks,
        "block_size": args.block_size,
        "hardware": result["hardware"],
        "summary": summary,
        "kv": kv,
        "steps": run.get("steps"),
        "args": result["args"],
    }


def point_path(directory: str, workload: str, system: str, rate: float) -> str:
    name = re.sub(r"[^A-Za-z0-9._-]+", "-", f"{workload}-{system}-{rate:g}").strip("-")
    return os.path.join(directory, f"{name}.json")


def write_point(directory: str, record: dict) -> str:
    os.makedirs(directory, exist_ok=True)
    path = point_path(directory, record["workload"], record["system"], record["request_rate"])
    with open(path, "w") as f:
        json.dump(record, f, indent=1, default=str)
    return path


def sweep_capacity(result: dict) -> tuple[float | None, bool]:
    """A sweep's capacity: the most requests/s completed at a point past its knee, and True;
    where no point was overloaded, the most completed at any point (a lower bound) and False."""
    runs = [r for r in result.get("runs", []) if (r.get("capacity") or {}).get("completed_req_s")]
    over = [r["capacity"]["completed_req_s"] for r in runs if r["capacity"]["overloaded"]]
    if over:
        return max(over), True
    return max((r["capacity"]["completed_req_s"] for r in runs), default=None), False


def capacity_ratio(a: float | None, a_over: bool, b: float | None, b_over: bool) -> str:
    """``a / b`` as a capacity ratio: a side not overloaded only bounds its capacity from
    below, so the ratio is then a bound ('>=' or '<='), or unknown when both are."""
    if not a or not b:
        return "not run"
    if not a_over and not b_over:
        return f"? ({a / b:.2f}x, neither overloaded)"
    bound = "" if a_over and b_over else ">= " if b_over else "<= "
    return f"{bound}{a / b:.2f}x"

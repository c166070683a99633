"""The summary block (laid out like ``vllm bench serve``'s) and the plots: latency against
request rate with one line per system (Fig 12 / 17), the KV memory split per system
(Fig 2), and the batched requests per system (Fig 13)."""

from __future__ import annotations

import math

WIDTH = 58


def _rule(title: str = "", ch: str = "-") -> str:
    return title.center(WIDTH, ch)


def format_summary(run: dict) -> str:
    s, lines = run["summary"], []

    def row(name: str, value, fmt: str = "{:<10.2f}") -> None:
        text = (
            fmt.format(value)
            if isinstance(value, (int, float)) and value is not None
            else str(value)
        )
        lines.append(f"{name:<46}{text}")

    lines.append(_rule(" Serving Benchmark Result ", "="))
    row("System:", run["label"], "{}")
    row("Request rate (req/s, configured):", run["request_rate"])
    row("Burstiness:", run["burstiness"])
    row("Successful requests:", s["completed"], "{:<10}")
    row("Failed requests:", s["errors"], "{:<10}")
    row("Incomplete at the time limit:", s["incomplete"], "{:<10}")
    row("Benchmark duration (s):", s["duration_s"])
    row("Total input tokens:", s["total_input_tokens"], "{:<10}")
    row("Total generated tokens:", s["total_output_tokens"], "{:<10}")
    row("Request throughput (req/s):", s["request_throughput"])
    row("Output token throughput (tok/s):", s["output_throughput"])
    row("Total token throughput (tok/s):", s["total_token_throughput"])
    if s["goodput"] is not None:
        row("Request goodput (req/s):", s["goodput"])
    for key, title in (
        ("ttft_ms", "Time to First Token"),
        ("tpot_ms", "Time per Output Token (excl. 1st token)"),
        ("itl_ms", "Inter-token Latency"),
        ("e2e_ms", "End-to-end Latency"),
    ):
        lines.append(_rule(title))
        short = key.split("_")[0].upper()
        row(f"Mean {short} (ms):", s[key]["mean"])
        row(f"Median {short} (ms):", s[key]["p50"])
        row(f"P90 {short} (ms):", s[key]["p90"])
        row(f"P99 {short} (ms):", s[key]["p99"])
    lines.append(_rule("Paper metrics"))
    row("Normalized latency (s/token):", s["normalized_latency_s"], "{:<10.4f}")
    kv = run.get("kv")
    if kv and kv["shares"]["token"] is not None:
        row("KV allocation:", kv["kv_allocation"], "{}")
        for kind, name in (
            ("token", "token states"),
            ("reserved", "reserved"),
            ("internal", "internal fragmentation"),
            ("external", "external fragmentation"),
        ):
            row(f"KV memory held: {name} (%):", 100 * kv["shares"][kind])
        row("Avg batched requests:", kv["avg_batched_requests"])
        if (kv.get("while_arriving") or {}).get("avg_batched_requests") is not None:
            row(
                "Avg batched requests while arriving:", kv["while_arriving"]["avg_batched_requests"]
            )
        if kv.get("time_avg_batched_seqs") is not None:
            row("Time-avg batched sequences (sim clock):", kv["time_avg_batched_seqs"])
        row("Preemptions:", kv["preemptions"], "{:<10.0f}")
    row("Send lag p99 (ms, harness health):", s["send_lag_ms"]["p99"])
    if s["error_examples"]:
        lines.append(_rule("Errors"))
        lines.extend(f"  {e}" for e in s["error_examples"])
    lines.append("=" * WIDTH)
    return "\n".join(lines)


METRICS = {
    "normalized_latency": ("Normalized latency (s/token)", lambda s: s["normalized_latency_s"]),
    "ttft_p50": ("TTFT p50 (ms)", lambda s: s["ttft_ms"]["p50"]),
    "tpot_p50": ("TPOT p50 (ms)", lambda s: s["tpot_ms"]["p50"]),
    "e2e_p50": ("E2E latency p50 (ms)", lambda s: s["e2e_ms"]["p50"]),
    "e2e_p99": ("E2E latency p99 (ms)", lambda s: s["e2e_ms"]["p99"]),
    "throughput": ("Output tokens/s", lambda s: s["output_throughput"]),
}


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    return plt


def plot_latency(
    results: list[dict],
    out: str,
    metric: str = "normalized_latency",
    title: str = "",
    ylim: float | None = None,
    logy: bool = False,
) -> None:
    """One line per system: ``metric`` against the configured request rate."""
    plt = _pyplot()
    name, get = METRICS[metric]
    fig, ax = plt.subplots(figsize=(4.8, 3.4), dpi=110)
    for res in results:
        pts = sorted(
            (r["request_rate"], get(r["summary"]))
            for r in res["runs"]
            if not math.isinf(r["request_rate"])
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=res["label"])
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel(name)
    if logy:
        ax.set_yscale("log")
    if ylim:
        ax.set_ylim(top=ylim) if logy else ax.set_ylim(0, ylim)
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_waste(results: list[dict], out: str, title: str = "", rate: float | None = None) -> None:
    """Stacked bars per system: the held KV memory by kind, averaged over the system's runs
    (only those at ``rate`` when given) weighted by samples (Fig 2)."""
    plt = _pyplot()
    kinds = (
        ("token", "token states"),
        ("reserved", "reserved"),
        ("internal", "internal frag."),
        ("external", "external frag."),
    )
    labels, rows = [], []
    for res in results:
        kvs = [
            r["kv"]
            for r in res["runs"]
            if r.get("kv") and r["kv"]["samples"] and (rate is None or r["request_rate"] == rate)
        ]
        total = sum(k["samples"] for k in kvs)
        if not total:
            continue
        labels.append(res["label"])
        rows.append(
            [100 * sum(k["shares"][kind] * k["samples"] for k in kvs) / total for kind, _ in kinds]
        )
    fig, ax = plt.subplots(figsize=(4.8, 3.6), dpi=110)
    bottom = [0.0] * len(labels)
    for j, (_, name) in enumerate(kinds):
        vals = [row[j] for row in rows]
        ax.bar(labels, vals, bottom=bottom, label=name)
        for i, v in enumerate(vals):
            if v >= 6:
                ax.text(i, bottom[i] + v / 2, f"{v:.1f}", ha="center", va="center", fontsize=7)
        bottom = [b + v for b, v in zip(bottom, vals)]
    ax.set_ylabel("KV memory held (%)")
    ax.set_ylim(0, 100)
    ax.set_title(title, fontsize=9)
    ax.tick_params(axis="x", labelsize=8)
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.09), ncol=4, frameon=False)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def plot_batched(results: list[dict], out: str, title: str = "") -> None:
    """Average batched requests against request rate, one line per system (Fig 13)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(4.8, 3.4), dpi=110)
    for res in results:
        pts = sorted(
            (r["request_rate"], r["kv"]["avg_batched_requests"])
            for r in res["runs"]
            if r.get("kv")
            and r["kv"]["avg_batched_requests"] is not None
            and not math.isinf(r["request_rate"])
        )
        ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o", ms=3, label=res["label"])
    ax.set_xlabel("Request rate (req/s)")
    ax.set_ylabel("Avg batched requests")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out)
    plt.close(fig)


def sustained_rate(
    result: dict, threshold: float, metric: str = "normalized_latency"
) -> float | None:
    """The highest request rate at which ``metric`` stays at or below ``threshold``,
    interpolated linearly between the last sweep point under it and the first one over."""
    get = METRICS[metric][1]
    pts = sorted(
        (r["request_rate"], get(r["summary"]))
        for r in result["runs"]
        if not math.isinf(r["request_rate"])
    )
    best = None
    for (r0, y0), (r1, y1) in zip(pts, pts[1:]):
        if y0 > threshold:
            break
        best = r0 if y1 <= threshold else r0 + (r1 - r0) * (threshold - y0) / (y1 - y0)
        if y1 > threshold:
            return best
    return pts[-1][0] if pts and pts[-1][1] <= threshold else best


def markdown_table(results: list[dict], threshold: float, rate: float | None) -> str:
    """Per system: the rate sustained under ``threshold`` s/token (and how many times that the
    first system sustains), and at ``rate``: batched requests and the KV memory split."""
    head = [f"| system | rate at {threshold} s/token | {results[0]['label']} ÷ this |"]
    sep = "|---|---|---|"
    if rate is not None:
        head[0] += (
            f" batched @ {rate:g} req/s | token / reserved / internal / external % @ {rate:g} |"
        )
        sep += "---|---|"
    rows, base = [*head, sep], sustained_rate(results[0], threshold)
    for res in results:
        r = sustained_rate(res, threshold)
        ratio = f"{base / r:.2f}x" if r and base else "-"
        line = (
            f"| {res['label']} | {r:.2f} |" if r is not None else f"| {res['label']} | < lowest |"
        )
        line += f" {ratio} |"
        if rate is not None:
            run = next((x for x in res["runs"] if x["request_rate"] == rate and x.get("kv")), None)
            if run is None:
                line += " - | - |"
            else:
                sh = run["kv"]["shares"]
                line += (
                    f" {run['kv']['avg_batched_requests']:.1f} | "
                    + " / ".join(
                        f"{100 * sh[k]:.1f}" for k in ("token", "reserved", "internal", "external")
                    )
                    + " |"
                )
        rows.append(line)
    return "\n".join(rows)

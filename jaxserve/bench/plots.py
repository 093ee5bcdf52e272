"""PNG plots of `jaxserve bench` results (matplotlib, from the `bench` extra, imported only when plotting).

Each function writes one PNG with the Agg backend (no display needed) and returns its path.
"""

from __future__ import annotations

from collections.abc import Sequence


def _pyplot():
    """matplotlib.pyplot on the Agg backend."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path: str) -> str:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    _pyplot().close(fig)
    return path


def latency_vs_rate(rate_results: list[dict], path: str) -> str:
    """Three panels against the offered request rate (one point per rate of `jaxserve bench serve`, "inf"
    last): TTFT p50/p99, TPOT p50/p99 (ms), and output tokens/s. The rates are evenly spaced categories."""
    plt = _pyplot()
    labels = [r["request_rate"] if isinstance(r["request_rate"], str) else f"{r['request_rate']:g}"
              for r in rate_results]
    x = range(len(rate_results))
    fig, axes = plt.subplots(1, 3, figsize=(14, 4))
    panels = ((axes[0], "ttft_ms", "time to first token"), (axes[1], "tpot_ms", "time per output token"))
    for ax, metric, title in panels:
        for stat, style in (("p50", "o-"), ("p99", "s--")):
            values = [r["latency_ms"][metric][stat] for r in rate_results]
            ax.plot(x, [float("nan") if v is None else v for v in values], style, label=stat)
        ax.set(title=title, ylabel="ms")
        ax.legend()
    axes[2].plot(x, [r["output_tokens_per_s"] for r in rate_results], "o-")
    axes[2].set(title="output throughput", ylabel="tokens/s")
    for ax in axes:
        ax.set_xticks(list(x), labels)
        ax.set_xlabel("request rate (req/s)")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, path)


def throughput_bars(rows: list[dict], path: str) -> str:
    """Output tokens/s per system: a bar for each row's "output_tokens_per_s" (mean), and a marker at its
    "best_output_tokens_per_s" when the row has one; rows carry "system" (the bar's label)."""
    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(max(6, 1.3 * len(rows)), 4))
    x = range(len(rows))
    ax.bar(x, [r["output_tokens_per_s"] for r in rows], color="tab:blue", label="mean")
    best = [(i, r["best_output_tokens_per_s"]) for i, r in enumerate(rows) if r.get("best_output_tokens_per_s")]
    if best:
        ax.plot([i for i, _ in best], [v for _, v in best], "k_", markersize=24, mew=2, label="best")
        ax.legend()
    ax.set_xticks(list(x), [r["system"] for r in rows], rotation=20, ha="right")
    ax.set(ylabel="output tokens/s", title="throughput per system")
    ax.grid(axis="y", alpha=0.3)
    return _save(fig, path)


def step_timeline(steps: Sequence, page_size: int, path: str) -> str:
    """Two stacked panels over time (s from the first step's start) of driver StepRecords (at least one):
    tokens per step, and KV pages in use against the pages the held tokens need (token_slots_used /
    page_size), each value held from the previous step's end to its own."""
    plt = _pyplot()
    t0 = steps[0].start  # s
    edges = [0.0] + [s.end - t0 for s in steps]  # s, (len(steps) + 1,)
    fig, (top, bottom) = plt.subplots(2, 1, sharex=True, figsize=(10, 6))
    top.stairs([s.num_tokens for s in steps], edges)
    top.set(ylabel="tokens per step", title="engine steps")
    bottom.stairs([s.pages_in_use for s in steps], edges, label="pages in use")
    bottom.stairs([s.token_slots_used / page_size for s in steps], edges, label="pages needed")
    bottom.set(xlabel="time (s)", ylabel="KV pages")
    bottom.legend()
    for ax in (top, bottom):
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
    return _save(fig, path)

"""Draws the chart of docs/benchmarks.md from standby-bench's results.json.

Left: assignment to run start by path and injected latency. Right (when
measured): the next turn of a thread, submit to run start, by tier. Bars are
medians, whiskers reach the p95, the scale is logarithmic (cold is one to two
orders of magnitude above warm).

usage: python3 bench/chart.py target/bench/results.json out.png
"""

import json
import math
import sys

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
from matplotlib.ticker import FuncFormatter, LogLocator  # noqa: E402

PATHS = [
    ("warm-parallel", "warm, parallel install", "#1b9e77"),
    ("warm-sequential", "warm, sequential install", "#7570b3"),
    ("cold", "cold: sandbox created at submit", "#d95f02"),
]
TIERS = [
    ("tier2", "Tier 2\nkept running", "#1b9e77"),
    ("tier1-resume", "Tier 1\nresumed from stopped", "#e6ab02"),
    ("cold", "cold\nnot kept", "#d95f02"),
]


def label(value):
    if value >= 1000:
        return f"{value / 1000:.1f} s"
    if value >= 10:
        return f"{value:.0f} ms"
    return f"{value:.1f} ms"


def axis_label(value, _position):
    if value >= 1000:
        return f"{value / 1000:g} s"
    return f"{value:g} ms" if value >= 1 else ""


def log_axis(ax, values):
    low = min(values) / 2
    ax.set_yscale("log")
    ax.set_ylim(10 ** math.floor(math.log10(low)), max(values) * 2.2)
    ax.yaxis.set_major_locator(LogLocator(base=10))
    ax.yaxis.set_major_formatter(FuncFormatter(axis_label))
    ax.yaxis.set_minor_formatter(FuncFormatter(lambda *_: ""))
    ax.grid(axis="y", which="major", alpha=0.35)
    ax.set_axisbelow(True)


def bar(ax, x, width, summary, color, name=None):
    median, p95 = summary["median"], summary["p95"]
    ax.bar([x], [median], width, color=color, label=name, yerr=[[0], [max(p95 - median, 0)]], capsize=3,
           error_kw={"elinewidth": 1, "ecolor": "#333333"})
    ax.annotate(label(median), (x, max(p95, median)), xytext=(0, 3), textcoords="offset points", ha="center",
                va="bottom", fontsize=8)
    return [median, p95]


def latency_panel(ax, latency):
    latencies = latency["latencies_ms"]
    cells = {(cell["path"], cell["latency_ms"]): cell for cell in latency["cells"]}
    width = 0.27
    values = []
    for index, (path, name, color) in enumerate(PATHS):
        for position, ms in enumerate(latencies):
            cell = cells.get((path, ms))
            if cell and cell.get("assignment_to_start"):
                x = position + (index - 1) * width
                values += bar(ax, x, width * 0.92, cell["assignment_to_start"], color, name if position == 0 else None)
                if path == "warm-parallel" and cell.get("bound"):
                    ax.hlines(cell["bound"]["median"], x - width / 2, x + width / 2, colors="black",
                              linestyles="dashed", linewidth=1.2,
                              label="its bound (slowest install step + confirmation + terminal check)" if position == 0 else None)
    log_axis(ax, values)
    ax.set_xticks(range(len(latencies)))
    ax.set_xticklabels([f"{ms} ms" for ms in latencies])
    ax.set_xlabel("latency injected per server call")
    ax.set_title("Assignment → run start, by path", fontsize=11)
    ax.legend(loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2, fontsize=8.5, frameon=False)


def follow_up_panel(ax, follow_ups):
    cells = {cell["tier"]: cell for cell in follow_ups["cells"]}
    values = []
    names = []
    for position, (tier, name, color) in enumerate(TIERS):
        cell = cells.get(tier)
        if cell and cell.get("submit_to_start"):
            values += bar(ax, position, 0.6, cell["submit_to_start"], color)
        names.append(name)
    log_axis(ax, values)
    ax.set_xticks(range(len(names)))
    ax.set_xticklabels(names, fontsize=9)
    ax.set_xlabel(f"{follow_ups['latency_ms']} ms injected per server call")
    ax.set_title("Next turn of a thread: submit → run start", fontsize=11)


def main():
    source, target = sys.argv[1], sys.argv[2]
    with open(source) as f:
        results = json.load(f)
    latency = results.get("latency")
    if not latency:
        sys.exit("no latency results to draw")
    follow_ups = results.get("follow_ups")
    if follow_ups:
        fig, (left, right) = plt.subplots(1, 2, figsize=(12.5, 6.0), gridspec_kw={"width_ratios": [1.75, 1]})
        follow_up_panel(right, follow_ups)
    else:
        fig, left = plt.subplots(figsize=(8.5, 6.0))
    latency_panel(left, latency)
    left.set_ylabel("time (log scale)")
    runs = latency["runs_per_path"]
    mode = ", quick mode" if results["meta"]["quick"] else ""
    fig.suptitle(f"standby: time until the run runs (median of {runs} runs, whisker to p95{mode})", fontsize=12)
    fig.tight_layout(rect=(0, 0, 1, 0.95))
    fig.savefig(target, dpi=130)


if __name__ == "__main__":
    main()

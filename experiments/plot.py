#!/usr/bin/env python3
"""Plots a kvlab results folder (written by `kvlab run`): one PNG per view, in <results>/plots/.

    python3 experiments/plot.py results/quickstart

  throughput_latency.png  output tokens/s against TTFT and TPOT p50/p99, one point per run
  latency_cdf.png         CDFs of TTFT and end-to-end latency, one curve per run
  kv_usage.png            KV slots used / reserved-unused / last-block slack over (virtual) time
  kv_waste.png            the KV waste breakdown averaged over steps, one bar per run
"""
import csv
import json
import pathlib
import sys

try:
    import matplotlib
except ModuleNotFoundError:
    sys.exit(f"plot.py: {sys.executable} has no matplotlib: install Debian's python3-matplotlib "
             "(scripts/setup.sh does) and run it with /usr/bin/python3, or pip install matplotlib")

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402


def load(results):
    index = json.loads((results / "runs.json").read_text())
    runs = []
    for entry in index:
        folder = results / entry["dir"]
        with open(folder / "requests.csv", newline="") as f:
            requests = list(csv.DictReader(f))
        with open(folder / "steps.csv", newline="") as f:
            steps = list(csv.DictReader(f))
        summary = json.loads((folder / "summary.json").read_text())
        label = entry["label"] or "(base)"
        if entry.get("repeat"):
            label += f" #{entry['repeat']}"
        runs.append({"label": label, "requests": requests, "steps": steps, "summary": summary})
    return runs


def values(rows, key):
    return sorted(float(r[key]) for r in rows if r.get(key) not in (None, ""))


def main(argv):
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    results = pathlib.Path(argv[1])
    if not (results / "runs.json").exists():
        print(f"plot.py: {results} is not a kvlab results folder (no runs.json)", file=sys.stderr)
        return 1
    runs = load(results)
    out = results / "plots"
    out.mkdir(exist_ok=True)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        s = run["summary"]
        for ax, metric in zip(axes, ("ttft_s", "tpot_s")):
            ax.scatter([s["output_tokens_per_s"]] * 2, [s[metric]["p50"], s[metric]["p99"]], label=run["label"])
    for ax, metric in zip(axes, ("TTFT", "TPOT")):
        ax.set_xlabel("output tokens/s")
        ax.set_ylabel(f"{metric} p50 and p99 (s)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.suptitle("throughput vs latency")
    fig.tight_layout()
    fig.savefig(out / "throughput_latency.png", dpi=110)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        for ax, key in zip(axes, ("ttft_s", "e2e_s")):
            xs = values(run["requests"], key)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post", label=run["label"])
    for ax, title in zip(axes, ("TTFT", "end-to-end latency")):
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110)

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t = [float(s["start_s"]) for s in run["steps"]]
        capacity = max(float(run["steps"][0]["kv_capacity"]), 1.0) if run["steps"] else 1.0
        series = [[float(s[k]) / capacity for s in run["steps"]] for k in ("kv_used", "kv_reserved_unused", "kv_last_block_slack")]
        ax.stackplot(t, *series, labels=["used", "reserved unused", "last-block slack"], alpha=0.8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of KV")
        ax.set_title(run["label"], fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s, virtual clock)")
    fig.tight_layout()
    fig.savefig(out / "kv_usage.png", dpi=110)

    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(runs)), 4))
    # The summary's waste/pool: reserved ahead, unfilled last blocks, a static batch's padding,
    # and free holes only on steps they blocked an admission (docs/experiments.md).
    parts = ("kv_reserved_unused", "kv_last_block_slack", "padding_slots", "kv_blocking_unusable_free")
    names = ("reserved unused", "last-block slack", "padding", "holes that blocked an admission")
    bottom = [0.0] * len(runs)
    for part, name in zip(parts, names):
        heights = []
        for run in runs:
            steps = run["steps"]
            heights.append(sum(float(s.get(part, 0)) / float(s["kv_capacity"]) for s in steps) / max(len(steps), 1))
        ax.bar([r["label"] for r in runs], heights, bottom=bottom, label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set_ylabel("mean fraction of the KV pool wasted")
    ax.tick_params(axis="x", labelsize=7, rotation=15)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kv_waste.png", dpi=110)
    print(f"plots: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

#!/usr/bin/env python3
"""Plots a kvlab results folder (written by `kvlab run`): one PNG per view, in <results>/plots/.

    python3 experiments/plot.py results/quickstart

  throughput_latency.png  TTFT, TPOT and ITL (p50: circles, solid; p99: triangles, dashed)
                          against output tokens/s; a sweep over load (a key ending in `rate`
                          or `rate_scale`) draws one line per policy across the load
  latency_cdf.png         CDFs of TTFT and end-to-end latency, one curve per run
  kv_usage.png            KV slots used / reserved-unused / last-block slack / padding over time
  kv_waste.png            the KV waste breakdown averaged over steps, one bar per run
Each policy (series) keeps its colour in every plot.
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


def dotted(table, key):
    for part in key.split("."):
        if not isinstance(table, dict) or part not in table:
            return None
        table = table[part]
    return table


def sweep_keys(results):
    """The [[sweep]] keys of the experiment file the results came from."""
    try:
        import tomllib
        experiment = tomllib.loads((results / "experiment.toml").read_text())
    except (ImportError, OSError, ValueError):
        return []
    return [axis["key"] for axis in experiment.get("sweep", []) if "key" in axis]


def load(results):
    index = json.loads((results / "runs.json").read_text())
    keys = sweep_keys(results)
    load_keys = [k for k in keys if k.endswith("rate") or k.endswith("rate_scale")]
    runs = []
    for entry in index:
        folder = results / entry["dir"]
        with open(folder / "requests.csv", newline="") as f:
            requests = list(csv.DictReader(f))
        with open(folder / "steps.csv", newline="") as f:
            steps = list(csv.DictReader(f))
        summary = json.loads((folder / "summary.json").read_text())
        label = entry["label"] or "(base)"
        series, load_value = label, None
        if load_keys and (folder / "config.toml").exists():
            import tomllib
            config = tomllib.loads((folder / "config.toml").read_text())
            load_value = dotted(config, load_keys[0])
            others = [f"{k.split('.')[-1]}={dotted(config, k)}" for k in keys if k not in load_keys]
            series = ", ".join(others) or "(base)"
        if entry.get("repeat"):
            label += f" #{entry['repeat']}"
        runs.append({"label": label, "series": series, "load": load_value, "requests": requests,
                     "steps": steps, "summary": summary})
    colours = {}
    for run in runs:  # one colour per series, the same in every plot
        colours.setdefault(run["series"], f"C{len(colours) % 10}")
    for run in runs:
        run["colour"] = colours[run["series"]]
    return runs, load_keys[0] if load_keys else None


def throughput_latency(runs, load_key, out):
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.5))
    series = {}
    for run in runs:
        series.setdefault(run["series"], []).append(run)
    for name, members in series.items():
        if load_key:
            members = sorted(members, key=lambda r: float(r["load"] or 0))
        colour = members[0]["colour"]
        x = [r["summary"]["output_tokens_per_s"] for r in members]
        for ax, metric in zip(axes, ("ttft_s", "tpot_s", "itl_s")):
            for pct, marker, style in (("p50", "o", "-"), ("p99", "^", "--")):
                y = [r["summary"][metric][pct] for r in members]
                ax.plot(x, y, marker=marker, linestyle=style if load_key else "none",
                        color=colour, label=f"{name} {pct}")
    for ax, metric in zip(axes, ("TTFT", "TPOT", "ITL")):
        ax.set_xlabel("output tokens/s" + (f" (points: {load_key})" if load_key else ""))
        ax.set_ylabel(f"{metric} (s)")
        ax.set_yscale("log")
        ax.grid(alpha=0.3)
    handles, labels = axes[0].get_legend_handles_labels()
    fig.legend(handles, labels, fontsize=7, loc="lower center", ncol=min(4, len(labels)))
    fig.suptitle("throughput vs latency (p50 circles, p99 triangles)")
    fig.tight_layout(rect=(0, 0.08 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(out / "throughput_latency.png", dpi=110, bbox_inches="tight")


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
    runs, load_key = load(results)
    out = results / "plots"
    out.mkdir(exist_ok=True)
    throughput_latency(runs, load_key, out)

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for run in runs:
        for ax, key in zip(axes, ("ttft_s", "e2e_s")):
            xs = values(run["requests"], key)
            if xs:
                ax.step(xs, [(i + 1) / len(xs) for i in range(len(xs))], where="post",
                        label=run["label"], color=run["colour"],
                        linestyle=("-", "--", ":", "-.")[runs.index(run) // 10 % 4])
    for ax, title in zip(axes, ("TTFT", "end-to-end latency")):
        ax.set_xlabel(f"{title} (s)")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=6)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110, bbox_inches="tight")

    fig, axes = plt.subplots(len(runs), 1, figsize=(10, 2.6 * len(runs)), squeeze=False)
    for ax, run in zip(axes[:, 0], runs):
        t = [float(s["start_s"]) for s in run["steps"]]
        capacity = max(float(run["steps"][0]["kv_capacity"]), 1.0) if run["steps"] else 1.0
        # used counts a padded static batch's finished rows: shown apart as padding
        padding = [float(s.get("padding_slots", 0)) / capacity for s in run["steps"]]
        live = [float(s["kv_used"]) / capacity - p for s, p in zip(run["steps"], padding)]
        series = [live] + [[float(s[k]) / capacity for s in run["steps"]]
                           for k in ("kv_reserved_unused", "kv_last_block_slack")] + [padding]
        ax.stackplot(t, *series, labels=["live", "reserved unused", "last-block slack", "padding"],
                     alpha=0.8)
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of KV")
        ax.set_title(run["label"], fontsize=9)
    axes[0, 0].legend(fontsize=7, loc="upper right")
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(out / "kv_usage.png", dpi=110, bbox_inches="tight")

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
    ax.tick_params(axis="x", labelsize=7, rotation=20)
    for tick in ax.get_xticklabels():
        tick.set_horizontalalignment("right")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "kv_waste.png", dpi=110, bbox_inches="tight")
    print(f"plots: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

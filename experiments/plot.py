#!/usr/bin/env python3
"""Plots a kvlab results folder (written by `kvlab run`): one PNG per view, in <results>/plots/.

    python3 experiments/plot.py results/quickstart

  throughput_latency.png  TTFT, TPOT and ITL (p50: circles, solid; p99: triangles, dashed)
                          against output tokens/s; a sweep over load (a key ending in `rate`
                          or `rate_scale`) draws one line per policy across the load
  latency_cdf.png         CDFs of TTFT and end-to-end latency, one curve per run (a log time
                          axis where the latencies span more than a decade)
  kv_usage.png            the KV pool over time: live KV in the run's colour, reserved-unused,
                          last-block slack and padding in greys; preemptions marked on top
                          (x: recompute, v: swap out)
  kv_waste.png            KV waste among held slots (vLLM's definition, the table's
                          "KV waste/held"), by cause, one bar per run; its waste of the pool
                          (the table's "KV waste/pool") written above the bar
Runs are named by their swept values ("fcfs, preemption=swap": keys that do not vary are left
out), and each policy (series) keeps one colour in every plot.
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

LOAD_SUFFIXES = ("rate", "rate_scale")
GREYS = ("0.55", "0.75", "0.88")  # reserved unused, last-block slack, padding
HATCHES = ("//", "..", "xx", "--")


def flat_items(prefix, value):
    """A swept value as (dotted key, scalar) pairs: a table sweeps each of its keys."""
    if isinstance(value, dict):
        for key, item in value.items():
            yield from flat_items(f"{prefix}.{key}", item)
    else:
        yield prefix, value


def flat(swept):
    """A run's swept values ({"scheduler.name": ..., "scheduler.params": {...}}) flattened."""
    return dict(pair for key, value in swept.items() for pair in flat_items(key, value))


def short(key, value):
    """One swept value as a reader says it: the plugin name bare, other keys by their last part."""
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool):
        value = str(value).lower()
    bare = key.endswith((".name", ".allocator", ".variant", ".router"))  # a plugin's name
    return f"{value}" if bare else f"{key.split('.')[-1]}={value}"


def readable_labels(swept_of_runs, leave_out=()):
    """Each run's label from its swept values: the keys that differ between runs, in order."""
    runs = [flat(swept) for swept in swept_of_runs]
    keys = []
    for run in runs:
        keys += [k for k in run if k not in keys and k not in leave_out]
    varying = [k for k in keys if len({json.dumps(run.get(k)) for run in runs}) > 1]
    return [", ".join(short(k, run[k]) for k in varying if k in run) or "(base)" for run in runs]


def load(results):
    index = json.loads((results / "runs.json").read_text())
    swept = [entry.get("swept", {}) for entry in index]
    load_keys = sorted({k for s in swept for k in flat(s) if k.endswith(LOAD_SUFFIXES)})
    load_key = load_keys[0] if load_keys else None
    labels = readable_labels(swept)
    series_names = readable_labels(swept, leave_out=(load_key,)) if load_key else labels
    runs = []
    for entry, s, label, series in zip(index, swept, labels, series_names):
        folder = results / entry["dir"]
        with open(folder / "requests.csv", newline="") as f:
            requests = list(csv.DictReader(f))
        with open(folder / "steps.csv", newline="") as f:
            steps = list(csv.DictReader(f))
        events = [json.loads(line) for line in (folder / "events.jsonl").read_text().splitlines()
                  if line.strip()] if (folder / "events.jsonl").exists() else []
        summary = json.loads((folder / "summary.json").read_text())
        load_value = flat(s).get(load_key) if load_key else None
        if entry.get("repeat"):
            label += f" #{entry['repeat']}"
        runs.append({"label": label, "series": series, "load": load_value, "requests": requests,
                     "steps": steps, "events": events, "summary": summary})
    colours = {}
    for run in runs:  # one colour per series, the same in every plot
        colours.setdefault(run["series"], f"C{len(colours) % 10}")
    for run in runs:
        run["colour"] = colours[run["series"]]
    return runs, load_key


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
    fig.legend(handles, labels, fontsize=8, loc="lower center", ncol=min(4, len(labels)))
    fig.suptitle("throughput vs latency (p50 circles, p99 triangles)")
    fig.tight_layout(rect=(0, 0.08 + 0.03 * (len(labels) // 4), 1, 1))
    fig.savefig(out / "throughput_latency.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def values(rows, key):
    return sorted(float(r[key]) for r in rows if r.get(key) not in (None, ""))


def spans_decades(samples):
    """True when the positive samples span more than a factor of 10: a log axis shows them."""
    positive = [v for v in samples if v > 0]
    return len(positive) > 1 and max(positive) > 10 * min(positive)


def latency_cdf(runs, out):
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, title in zip(axes, ("ttft_s", "e2e_s"), ("TTFT", "end-to-end latency")):
        every = []
        for i, run in enumerate(runs):
            xs = values(run["requests"], key)
            every += xs
            if xs:
                ax.step(xs, [(k + 1) / len(xs) for k in range(len(xs))], where="post",
                        label=run["label"], color=run["colour"],
                        linestyle=("-", "--", ":", "-.")[i // 10 % 4])
        log = spans_decades(every)
        if log:
            ax.set_xscale("log")
        ax.set_xlabel(f"{title} (s{', log scale' if log else ''})")
        ax.set_ylabel("fraction of requests")
        ax.grid(alpha=0.3, which="both")
    axes[0].legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(out / "latency_cdf.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


def preemption_times(run):
    """Times of recompute preemptions and of swaps out, from the run's event log."""
    recompute = [e["t"] for e in run["events"] if e.get("event") == "preempt"]
    swap = [e["t"] for e in run["events"] if e.get("event") == "swap_out"]
    return recompute, swap


def kv_usage(runs, out):
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 2.6 * len(runs)), squeeze=False,
                             sharex=True)  # one clock: a run that ends sooner shows it
    for ax, run in zip(axes[:, 0], runs):
        steps = run["steps"]
        t = [float(s["start_s"]) for s in steps]
        capacity = max(float(steps[0]["kv_capacity"]), 1.0) if steps else 1.0
        # used counts a padded static batch's finished rows: shown apart as padding
        padding = [float(s.get("padding_slots", 0)) / capacity for s in steps]
        live = [float(s["kv_used"]) / capacity - p for s, p in zip(steps, padding)]
        parts = [[float(s[k]) / capacity for s in steps]
                 for k in ("kv_reserved_unused", "kv_last_block_slack")] + [padding]
        ax.stackplot(t, live, *parts, colors=[run["colour"], *GREYS],
                     labels=["live", "reserved unused", "last-block slack", "padding"])
        recompute, swap = preemption_times(run)
        if recompute:
            ax.plot(recompute, [0.97] * len(recompute), "x", color="black", markersize=5,
                    label=f"preempted, recompute ({len(recompute)})")
        if swap:
            ax.plot(swap, [0.97] * len(swap), "v", color="black", markersize=4,
                    label=f"preempted, swap out ({len(swap)})")
        ax.set_ylim(0, 1)
        ax.set_ylabel("fraction of KV")
        ax.set_title(run["label"], fontsize=10, color=run["colour"])
        ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[-1, 0].set_xlabel("time (s)")
    fig.tight_layout()
    fig.savefig(out / "kv_usage.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


WASTE_PARTS = (("kv_reserved_unused", "reserved unused"), ("kv_last_block_slack", "last-block slack"),
               ("padding_slots", "padding"))


def waste_of_held(steps):
    """vLLM's waste among held slots by cause: each part summed over steps / held slots summed
    (held = used + reserved unused + last-block slack); the parts add up to the summary's
    kv_waste_of_held_fraction."""
    held = sum(float(s["kv_used"]) + float(s["kv_reserved_unused"]) + float(s["kv_last_block_slack"])
               for s in steps)
    return {name: (sum(float(s.get(part, 0)) for s in steps) / held if held else 0.0)
            for part, name in WASTE_PARTS}


def kv_waste(runs, out):
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(runs)), 4.2))
    bottom = [0.0] * len(runs)
    x = range(len(runs))
    for (part, name), hatch in zip(WASTE_PARTS, HATCHES):
        heights = [100 * waste_of_held(run["steps"])[name] for run in runs]
        ax.bar(x, heights, bottom=bottom, color=[run["colour"] for run in runs], hatch=hatch,
               edgecolor="white", label=name)
        bottom = [b + h for b, h in zip(bottom, heights)]
    for i, run in enumerate(runs):
        pool = run["summary"].get("mean_kv_waste_fraction")
        ax.annotate(f"{bottom[i]:.1f}%" + (f"\n(pool: {100 * pool:.1f}%)" if pool is not None else ""),
                    (i, bottom[i]), ha="center", va="bottom", fontsize=8)
    ax.set_xticks(list(x), [run["label"] for run in runs], fontsize=8, rotation=15, ha="right")
    for tick, run in zip(ax.get_xticklabels(), runs):
        tick.set_color(run["colour"])
    ax.set_ylabel("KV waste among held slots (%)")
    top = max(bottom + [1.0])
    ax.set_ylim(0, top * 1.5 if top < 60 else 112)  # room for the labels and the legend
    ax.set_title("KV waste among held slots (vLLM's definition), by cause", fontsize=10)
    legend = ax.legend(fontsize=8, loc="upper center", ncol=3)
    for patch in legend.get_patches():
        patch.set_facecolor("0.6")
    fig.tight_layout()
    fig.savefig(out / "kv_waste.png", dpi=110, bbox_inches="tight")
    plt.close(fig)


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
    latency_cdf(runs, out)
    kv_usage(runs, out)
    kv_waste(runs, out)
    print(f"plots: {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

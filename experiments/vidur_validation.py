#!/usr/bin/env python3
"""Tables and a plot of the simulator against Vidur's measured GPU operators, from the reports
`kvlab calibrate --vidur ... --report FILE.csv` writes (docs/concepts/simulated-backend.md).

    python3 experiments/vidur_validation.py results/vidur-a100.csv results/vidur-h100.csv \\
        [--plot docs/images/vidur_predicted_vs_measured.png]

Prints markdown: per GPU, model and tensor parallelism the operators' and the layers' mean and
worst |error| (fit or held out); each operator's error over the held-out models; attention alone
and in its layer; the all-reduces. |error| = |predicted / measured - 1|.
"""
import argparse
import csv
import pathlib
import sys
from collections import defaultdict


def read(paths):
    rows = []
    for path in paths:
        with open(path, newline="") as f:
            for r in csv.DictReader(f):
                r["tp"] = int(r["tp"])
                r["tokens"] = int(r["tokens"])
                r["measured_s"] = float(r["measured_s"])
                r["predicted_s"] = float(r["predicted_s"])
                r["error"] = abs(r["predicted_s"] / r["measured_s"] - 1)
                rows.append(r)
    return rows


def stats(errors):
    errors = sorted(errors)
    if not errors:
        return "", "", ""
    p90 = errors[min(len(errors) - 1, int(0.9 * len(errors)))]
    return (f"{100 * sum(errors) / len(errors):.1f}%", f"{100 * p90:.0f}%",
            f"{100 * errors[-1]:.0f}%")


def layer_table(rows):
    print("| GPU | model | role | TP | operators: mean | worst operator (its mean) | layer: mean | p90 | max |")
    print("|---|---|---|---|---|---|---|---|---|")
    groups = defaultdict(lambda: defaultdict(list))
    for r in rows:
        if r["kind"] in ("operator", "layer"):
            key = (r["gpu"], r["role"] != "fit", r["model"], r["tp"])
            groups[key][r["name"] if r["kind"] == "operator" else "~layer"].append(r["error"])
    for (gpu, held_out, model, tp), by in sorted(groups.items()):
        ops = [e for name, errs in by.items() if name != "~layer" for e in errs]
        worst = max((n for n in by if n != "~layer"), key=lambda n: sum(by[n]) / len(by[n]))
        mean, p90, worst_err = stats(by["~layer"])
        print(f"| {gpu} | {model} | {'held out' if held_out else 'fit'} | {tp} | {stats(ops)[0]} | "
              f"{worst} ({stats(by[worst])[0]}) | {mean} | {p90} | {worst_err} |")


def operator_table(rows):
    print("\n| GPU | operator (held-out models, every TP) | points | mean | p90 | max |")
    print("|---|---|---|---|---|---|")
    groups = defaultdict(list)
    for r in rows:
        if r["kind"] == "operator" and r["role"] != "fit":
            groups[(r["gpu"], r["name"])].append(r["error"])
    for (gpu, name), errs in sorted(groups.items()):
        print(f"| {gpu} | {name} | {len(errs)} | " + " | ".join(stats(errs)) + " |")


def other_table(rows):
    print("\n| GPU | measurement | model (role) | points | mean | p90 | max |")
    print("|---|---|---|---|---|---|---|")
    groups = defaultdict(list)
    for r in rows:
        if r["kind"] in ("operator", "layer"):
            continue
        if r["kind"] == "all_reduce":
            key = (r["gpu"], f"all-reduce, {r['tp']} GPUs", "")
        else:
            what = r["kind"] if r["kind"] != "layer_with_attention" else "layer + " + r["name"]
            key = (r["gpu"], what, f"{r['model']} ({r['role'].replace('_', ' ')})")
        groups[key].append(r["error"])
    for (gpu, what, model), errs in sorted(groups.items()):
        print(f"| {gpu} | {what} | {model} | {len(errs)} | " + " | ".join(stats(errs)) + " |")


def plot(rows, out):
    try:
        import matplotlib
    except ModuleNotFoundError:
        sys.exit("vidur_validation.py: --plot needs matplotlib (Debian's python3-matplotlib; run "
                 "with /usr/bin/python3)")
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    gpus = sorted({r["gpu"] for r in rows})
    fig, axes = plt.subplots(1, len(gpus), figsize=(6 * len(gpus), 5.5), squeeze=False)
    kinds = [("operator", "operators", "#9ecae1", 4), ("layer", "layers", "#08519c", 6),
             ("layer_with_attention", "layers with attention", "#d94801", 14)]
    for ax, gpu in zip(axes[0], gpus):
        for kind, label, colour, size in kinds:
            pts = [r for r in rows if r["gpu"] == gpu and r["kind"] == kind and r["role"] != "fit"]
            if pts:
                ax.scatter([r["measured_s"] * 1e3 for r in pts], [r["predicted_s"] * 1e3 for r in pts],
                           s=size, c=colour, label=f"{label} ({len(pts)})", alpha=0.6, linewidths=0)
        lo, hi = 1e-3, 30
        ax.plot([lo, hi], [lo, hi], "k-", lw=0.8)
        for f in (0.85, 1.15):
            ax.plot([lo, hi], [lo * f, hi * f], "k:", lw=0.8)
        ax.set(xscale="log", yscale="log", xlim=(lo, hi), ylim=(lo, hi), xlabel="measured ms (Vidur)",
               ylabel="kvlab predicted ms",
               title=f"{gpu.upper()}: held-out models, TP 1-8 (dotted: ±15%)")
        ax.legend(loc="upper left", fontsize=8)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"\nwrote {out}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("reports", nargs="+", type=pathlib.Path)
    parser.add_argument("--plot", type=pathlib.Path)
    args = parser.parse_args()
    rows = read(args.reports)
    layer_table(rows)
    operator_table(rows)
    other_table(rows)
    if args.plot:
        plot(rows, args.plot)


if __name__ == "__main__":
    main()

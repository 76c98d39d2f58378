#!/usr/bin/env python3
"""Compares a results folder's measured runs with the simulated runs of the same workload.

    python3 experiments/compare_calibration.py results/calibration [--max-error 10]
    python3 experiments/compare_calibration.py MEASURED_FOLDER SIMULATED_FOLDER

Runs are paired by their sweep label without `backend.name` and `experiment.clock` (across
every folder given: a GPU run and its simulated replay may be two `kvlab run`s): the run on
the measured (or wall) clock is the truth, the one on the virtual clock the prediction. With
`experiment.repeats` > 1 both sides are the mean over their repeats (seeds). Prints a Markdown
table of output tok/s, TTFT p50 and TPOT mean with the prediction's relative error, the measured
runs' median step time over the profile's price for the same step (summary.json
step_time_ratio: near 1, the per-step model held and any error is the engine's dynamics; far
from 1 in every workload, the machine ran at another speed than when it was calibrated), and how
many of the output tok/s and TTFT p50 predictions land within --max-error percent (the
simulator's validation, docs/concepts/simulated-backend.md). Exit status 0 with a report; 2 when the folder
holds no measured/predicted pair. Standard library only.
"""
import argparse
import json
import statistics
import sys
from pathlib import Path

IGNORED_KEYS = ("backend.name", "experiment.clock")
METRICS = (  # (column, how to read it from summary.json, unit scale, format)
    ("output tok/s", lambda s: s["output_tokens_per_s"], 1.0, "{:.1f}"),
    ("TTFT p50", lambda s: s["ttft_s"]["p50"], 1e3, "{:.1f} ms"),
    ("TPOT mean", lambda s: s["tpot_s"]["mean"], 1e3, "{:.2f} ms"),
)
VALIDATED = ("output tok/s", "TTFT p50")  # what the 10% target names


def split_label(label):
    """'a=1, b={ x = 1, y = 2 }' -> [('a', '1'), ('b', '{ x = 1, y = 2 }')]: commas inside
    braces or brackets do not separate."""
    parts, depth, current = [], 0, ""
    for ch in label:
        if ch in "{[":
            depth += 1
        elif ch in "}]":
            depth -= 1
        if ch == "," and depth == 0:
            parts.append(current.strip())
            current = ""
        else:
            current += ch
    if current.strip():
        parts.append(current.strip())
    return [tuple(p.split("=", 1)) if "=" in p else (p, "") for p in parts]


def load_pairs(folders):
    groups = {}  # workload label -> {"measured": [summary], "predicted": [summary]}
    for folder in folders:
        add_runs(folder, groups)
    return {w: g for w, g in groups.items() if g["measured"] and g["predicted"]}


def add_runs(folder, groups):
    runs_file = folder / "runs.json"
    if not runs_file.is_file():
        sys.exit(f"compare_calibration: {runs_file} not found (give a kvlab run results folder)")
    for run in json.loads(runs_file.read_text()):
        summary = json.loads((folder / run["dir"] / "summary.json").read_text())
        pairs = split_label(run["label"])
        workload = ", ".join(f"{k}={v}" for k, v in pairs if k not in IGNORED_KEYS) or "(one run)"
        side = "predicted" if summary.get("clock") in ("virtual", "offline") else "measured"
        groups.setdefault(workload, {"measured": [], "predicted": []})[side].append(summary)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("folders", type=Path, nargs="+", metavar="folder")
    parser.add_argument("--max-error", type=float, default=10.0, help="percent (default 10)")
    args = parser.parse_args()
    pairs = load_pairs(args.folders)
    if not pairs:
        names = " + ".join(str(f) for f in args.folders)
        print(f"compare_calibration: {names} has no workload run both on a measured and on "
              "a virtual clock", file=sys.stderr)
        return 2
    header = ["workload", "runs"] + [m[0] for m in METRICS] + ["steps measured / predicted"]
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    within, total = 0, 0
    for workload, group in pairs.items():
        cells = [workload, f"{len(group['measured'])} + {len(group['predicted'])}"]
        for name, read, scale, fmt in METRICS:
            measured = statistics.mean(read(s) for s in group["measured"])
            predicted = statistics.mean(read(s) for s in group["predicted"])
            error = 100 * (predicted - measured) / measured if measured else float("nan")
            cells.append(f"{fmt.format(measured * scale)} -> {fmt.format(predicted * scale)} "
                         f"({error:+.1f}%)")
            if name in VALIDATED:
                total += 1
                within += abs(error) <= args.max_error
        ratios = [s["step_time_ratio"]["p50"] for s in group["measured"] if "step_time_ratio" in s]
        cells.append(f"{statistics.mean(ratios):.2f} (median step)" if ratios else "-")
        print("| " + " | ".join(cells) + " |")
    print(f"\n{within} of {total} predictions of {' and '.join(VALIDATED)} within "
          f"{args.max_error:g}% of the measured runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""kvlab's CPU backend against llama.cpp on the same GGUF files, in one interleaved run.

For each round and each model file, in turn: llama-bench (pp512, tg128), llama-batched-bench
(64 sequences of 128 prompt tokens, 32 new tokens each: decode at 64 x 128-160 cached tokens),
then kvlab_bench_gguf (prefill 512, decode 1 at 64 cached tokens, decode 64 at 128-255), both
with an f16 KV cache (llama.cpp's default; KVLAB_BENCH_KV is passed through). Both
use 2 threads. kvlab runs once per --activations choice that applies to the file (f32: the
reference's products, always; q8: 8-bit activations, for Q4/Q8 files; bf16: bf16 activations,
for bf16 files), q8 and bf16 being llama.cpp's own kinds of product for those formats;
KVLAB_BENCH_WEIGHTS=q8_0 (say) makes kvlab multiply every matrix in that format, and q8 applies.
Medians over the rounds, and their ratios, are printed as a Markdown table and
every measurement is written to a CSV.

llama.cpp is built outside the repository (docs/benchmarks.md says how); pass its bin folder:

    python3 tests/bench/compare_llamacpp.py --llama-bin /tmp/llama.cpp/build/bin \\
        --kvlab-bin build/bin --rounds 5 --out results/llamacpp.csv MODEL.gguf...
"""
import argparse
import csv
import io
import json
import os
import statistics
import subprocess
import sys

THREADS = "2"


def run(cmd, env=None):
    done = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if done.returncode != 0:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{done.stderr[-2000:]}")
    return done.stdout


def llama_cpp(bin_dir, model):
    out = run([f"{bin_dir}/llama-bench", "-m", model, "-t", THREADS, "-p", "512", "-n", "128",
               "-r", "1", "-o", "csv"])
    rows = list(csv.DictReader(io.StringIO(out)))
    result = {}
    for row in rows:
        key = "prefill512" if int(row["n_prompt"]) > 0 else "decode1"
        result[key] = float(row["avg_ts"])
    out = run([f"{bin_dir}/llama-batched-bench", "-m", model, "-t", THREADS, "-c", "10240",
               "-b", "2048", "-ub", "512", "-npp", "128", "-ntg", "32", "-npl", "64"])
    for line in out.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) >= 8 and cells[0] == "128" and cells[2] == "64":
            result["decode64"] = float(cells[7])  # S_TG t/s
    return result


def kvlab(bin_dir, model, activations):
    env = dict(os.environ, KVLAB_BENCH_GGUF=model, KVLAB_BENCH_ACTIVATIONS=activations)
    out = run([f"{bin_dir}/kvlab_bench_gguf", "--benchmark_min_time=1",
               "--benchmark_filter=^BM_(Prefill512|Decode1|Decode64)$",
               "--benchmark_format=json"], env)
    names = {"BM_Prefill512": "prefill512", "BM_Decode1": "decode1", "BM_Decode64": "decode64"}
    result = {}
    for b in json.loads(out)["benchmarks"]:
        result[names[b["name"].split("/")[0]]] = b["tok/s"]
        result["ceiling"] = b["ceiling_tok/s"]
        if "of_limit" in b:  # decode B=1 against the read bandwidth measured in the same run
            result["decode1_of_limit"] = b["of_limit"]
    return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", required=True)
    parser.add_argument("--kvlab-bin", default="build/bin")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--out", default="results/llamacpp_compare.csv")
    parser.add_argument("--activations", default="f32,q8,bf16",
                        help="kvlab's activation formats, comma-separated (default f32,q8,bf16)")
    parser.add_argument("models", nargs="+")
    args = parser.parse_args()
    activations = args.activations.split(",")

    # KVLAB_BENCH_WEIGHTS (passed through to kvlab_bench_gguf): kvlab multiplies every matrix in
    # that format instead of the file's own (e.g. q8_0 for a file of K-quants it has no kernel for)
    weights = os.environ.get("KVLAB_BENCH_WEIGHTS", "")

    def label(model, act):  # a file's row in the table; kvlab's reduced-precision runs get theirs
        name = os.path.basename(model) + (f", kvlab {weights} weights" if weights else "")
        return name if act == "f32" else f"{name}, kvlab {act} activations"

    def applies(model, act):  # q8 changes only Q4/Q8 matrices, bf16 only bf16 ones
        name = (weights or os.path.basename(model)).lower()
        kinds = {"f32": ("",), "q8": ("q4_0", "q4_1", "q8_0"), "bf16": ("bf16",)}[act]
        return any(k in name for k in kinds)

    rows = []
    for r in range(args.rounds):
        for model in args.models:
            llama = llama_cpp(args.llama_bin, model)
            for act in activations:
                if not applies(model, act):
                    continue
                for tool, result in (("llama.cpp", llama),
                                     ("kvlab", kvlab(args.kvlab_bin, model, act))):
                    for shape, value in result.items():
                        rows.append({"round": r, "model": label(model, act), "tool": tool,
                                     "shape": shape, "tok_s": value})
            print(f"round {r + 1}/{args.rounds}: {os.path.basename(model)}", file=sys.stderr)
    os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
    with open(args.out, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=["round", "model", "tool", "shape", "tok_s"])
        writer.writeheader()
        writer.writerows(rows)

    def median(model, tool, shape):
        values = [x["tok_s"] for x in rows
                  if x["model"] == model and x["tool"] == tool and x["shape"] == shape]
        return statistics.median(values) if values else float("nan")

    print(f"median of {args.rounds} interleaved rounds, {THREADS} threads, tok/s "
          "(kvlab / llama.cpp)\n")
    print("| model | prefill 512 | decode B=1 | B=1 / memory limit | decode B=64 "
          "| B=64 / compute ceiling |")
    print("|---|---|---|---|---|---|")
    for model in dict.fromkeys(x["model"] for x in rows):
        cells = []
        for shape in ("prefill512", "decode1", "decode64"):
            k, l = median(model, "kvlab", shape), median(model, "llama.cpp", shape)
            cells.append(f"{k:.0f} vs {l:.0f} ({k / l:.2f}x)")
            if shape == "decode1":
                cells.append(f"{median(model, 'kvlab', 'decode1_of_limit'):.2f}")
        ceiling = median(model, "kvlab", "ceiling")
        share = median(model, "kvlab", "decode64") / ceiling
        cells.append(f"{share:.2f} of {ceiling:.0f}")
        print(f"| {model} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()

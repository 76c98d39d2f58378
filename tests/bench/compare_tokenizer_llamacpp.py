#!/usr/bin/env python3
"""Byte-level BPE encoding speed, kvlab against llama.cpp's llama-tokenize, interleaved.

Two 1 MiB inputs: one letter repeated (one pre-token piece of 1,048,576 bytes) and the first
1 MiB of a real text (WikiText-2's wiki.test.raw by default). kvlab's time is
kvlab_bench_tokenizer's encode time; llama.cpp's is llama-tokenize's wall time on the file less
its wall time on a 3-byte file (model load and start), printing ids included. Token counts of
both must agree. Usage:

  python3 tests/bench/compare_tokenizer_llamacpp.py --llama-bin DIR --model FILE.gguf \
      [--text FILE] [--rounds 3] [--kvlab-bin build/bin]
"""
import argparse
import ast
import json
import os
import statistics
import subprocess
import tempfile
import time

MIB = 1 << 20


def llama_seconds(binary, model, path):
    start = time.perf_counter()
    out = subprocess.run([binary, "-m", model, "-f", path, "--ids", "--log-disable", "--no-bos"],
                         check=True, capture_output=True, text=True).stdout
    return time.perf_counter() - start, len(ast.literal_eval(out.strip()))


def kvlab_seconds(binary, model, text_path):
    env = dict(os.environ, KVLAB_BENCH_TOKENIZER=model, KVLAB_BENCH_TEXT=text_path)
    out = subprocess.run([binary, "--benchmark_format=json", "--benchmark_repetitions=1"],
                         check=True, capture_output=True, text=True, env=env).stdout
    rows = {b["name"]: b for b in json.loads(out)["benchmarks"]}
    return {name: (rows[name]["real_time"] / 1e3, int(rows[name]["tokens"]))
            for name in ("EncodeOneLetter", "EncodeRealText")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--llama-bin", required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--text", default="../shared/data/wikitext-2-raw/wiki.test.raw")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--kvlab-bin", default="build/bin")
    args = parser.parse_args()
    llama = os.path.join(args.llama_bin, "llama-tokenize")
    kvlab = os.path.join(args.kvlab_bin, "kvlab_bench_tokenizer")
    with tempfile.TemporaryDirectory() as tmp:
        files = {"EncodeOneLetter": os.path.join(tmp, "one_letter.txt"),
                 "EncodeRealText": os.path.join(tmp, "real.txt")}
        with open(files["EncodeOneLetter"], "w") as f:
            f.write("a" * MIB)
        data = open(args.text, "rb").read()[:MIB]
        data = data.decode("utf-8", errors="ignore").encode("utf-8")
        with open(files["EncodeRealText"], "wb") as f:
            f.write(data)
        tiny = os.path.join(tmp, "tiny.txt")
        with open(tiny, "w") as f:
            f.write("hi\n")
        times = {name: {"kvlab": [], "llama.cpp": []} for name in files}
        counts = {}
        for _ in range(args.rounds):
            for name, (seconds, tokens) in kvlab_seconds(kvlab, args.model,
                                                         files["EncodeRealText"]).items():
                times[name]["kvlab"].append(seconds)
                base, _ = llama_seconds(llama, args.model, tiny)
                full, llama_tokens = llama_seconds(llama, args.model, files[name])
                times[name]["llama.cpp"].append(full - base)
                if llama_tokens != tokens:
                    raise SystemExit(f"{name}: kvlab {tokens} tokens, llama.cpp {llama_tokens}")
                counts[name] = tokens
        for name, t in times.items():
            k, l = statistics.median(t["kvlab"]), statistics.median(t["llama.cpp"])
            print(f"{name}: kvlab {k * 1e3:.0f} ms, llama.cpp {l * 1e3:.0f} ms "
                  f"(kvlab / llama.cpp time {k / l:.2f}x; {counts[name]} tokens in both)")


if __name__ == "__main__":
    main()

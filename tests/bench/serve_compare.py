"""kvlab serve against llama.cpp's llama-server: the same GGUF, the same prompts, the same client,
the same concurrency levels, 2 threads each, interleaved on one machine (docs/benchmarks.md).

The client is an asyncio load generator on the official openai SDK, as vLLM's `bench serve`
measures: each of C workers sends its next prompt when its last answer ends (closed loop), every
request streamed (chat completions, temperature 0, max_tokens fixed and EOS ignored so both servers
generate the same number of tokens); TTFT = first content chunk, ITL = gaps between chunks,
output tok/s = completion tokens / the level's wall time.

Mooncake-shaped prompts (--mooncake TRACE --wikitext FILE): the trace's requests in order, each
prompt the concatenation of its hash ids' blocks (block i: a fixed run of WikiText-2 words, the
same text wherever the id recurs, so requests share prefixes as the trace says), lengths scaled
down by --scale (a 512-token block becomes 512/scale tokens, about) and max_tokens = its output
length / scale: the trace's shape (the spread of lengths, the prefix sharing) at a size 2 cores
can prefill.

Usage:
  PYTHON tests/bench/serve_compare.py --kvlab build/bin/kvlab --llama-server PATH \
      --gguf models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf \
      --prompts data/prompts/mt_bench_questions.jsonl [--levels 1,4,16,64] [--rounds 2]
  PYTHON tests/bench/serve_compare.py ... --mooncake data/mooncake-fast25/conversation_trace.jsonl \
      --wikitext data/wikitext-2-raw/wiki.test.raw --scale 16 --context 65536 --step-tokens 512
Servers bind 127.0.0.1 only; every level is bounded (requests per level) and every call has a
timeout.
"""

import argparse
import asyncio
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request

import openai

SERVE_TOML = """[experiment]
name = "serve_compare"
seed = 1
[model]
name = "{gguf}"
[backend]
name = "cpu"
threads = 2
[kv_cache]
allocator = "paged"
slots = {slots}
[kv_cache.params]
block_size = 16
[attention]
variant = "gqa"
[scheduler]
name = "{scheduler}"
[scheduler.params]
max_batch = {max_batch}
max_tokens_per_step = {step_tokens}
[workload]
requests = 1
"""


def percentile(values, q):
    if not values:
        return float("nan")
    ordered = sorted(values)
    k = (len(ordered) - 1) * q / 100
    lo, hi = int(k), min(int(k) + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (k - lo)


def wait_healthy(port, proc, seconds=180):
    deadline = time.time() + seconds
    while time.time() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with {proc.returncode}")
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as r:
                if r.status == 200:
                    return
        except Exception:  # noqa: BLE001 - not up yet
            pass
        time.sleep(0.2)
    raise RuntimeError("server did not become healthy")


def start_kvlab(args, port, work, max_batch):
    toml = os.path.join(work, "serve_compare.toml")
    with open(toml, "w") as f:
        # Prompts past the step's token budget (Mooncake's) need chunked prefill, as vLLM's
        # default scheduler has it.
        f.write(SERVE_TOML.format(gguf=os.path.abspath(args.gguf), slots=args.context,
                                  max_batch=max_batch, step_tokens=args.step_tokens,
                                  scheduler="chunked" if args.mooncake else "fcfs"))
    proc = subprocess.Popen([args.kvlab, "serve", toml, "--port", str(port), "--out",
                             os.path.join(work, f"served_{port}"), "--force", "--max-seconds",
                             "3600", "--max-queued", "1024"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_healthy(port, proc)
    return proc, os.path.splitext(os.path.basename(args.gguf))[0]


def start_llama(args, port, parallel):
    # Long prompts: one KV pool shared by the slots (as kvlab's is), not -c split C ways.
    unified = ["-kvu"] if args.mooncake else []
    proc = subprocess.Popen([args.llama_server, *unified, "-m", args.gguf, "-t", "2", "-tb", "2",
                             "-c", str(args.context), "-np", str(parallel), "--host", "127.0.0.1",
                             "--port", str(port), "--no-webui",
                             # cpp-httplib serves a connection per thread: one per client
                             "--threads-http", str(parallel + 4)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    wait_healthy(port, proc)
    return proc, "model"


async def one_request(client, model, prompt, max_tokens, stats):
    start = time.perf_counter()
    last = None
    first = None
    gaps = []
    tokens = prompt_tokens = 0
    stream = await client.chat.completions.create(
        model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
        temperature=0, stream=True, stream_options={"include_usage": True},
        extra_body={"ignore_eos": True})
    async for chunk in stream:
        now = time.perf_counter()
        if chunk.usage:
            tokens = chunk.usage.completion_tokens
            prompt_tokens = chunk.usage.prompt_tokens
        if not chunk.choices or not chunk.choices[0].delta.content:
            continue
        if first is None:
            first = now - start
        elif last is not None:
            gaps.append(now - last)
        last = now
    stats["ttft"].append(first if first is not None else float("nan"))
    stats["itl"].extend(gaps)
    stats["tokens"] += tokens
    stats["prompt_tokens"] = stats.get("prompt_tokens", 0) + prompt_tokens


async def run_level(port, model, prompts, concurrency, requests):
    # Retries as real clients make them: cpp-httplib (llama-server) closes a keep-alive
    # connection after 5 requests, and a request sent on it as it closes gets no answer.
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                timeout=600, max_retries=2)
    stats = {"ttft": [], "itl": [], "tokens": 0, "prompt_tokens": 0}
    warm = "Say hello."  # not a prompt of the level: its prefix would be cached for the level
    await one_request(client, model, warm, 8, {"ttft": [], "itl": [], "tokens": 0})
    queue = list(range(requests))
    queue.reverse()  # popped from the end: the prompts in their order

    async def worker():
        while queue:
            i = queue.pop()
            text, max_tokens = prompts[i % len(prompts)]
            await one_request(client, model, text, max_tokens, stats)

    start = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(concurrency)))
    wall = time.perf_counter() - start
    await client.close()
    return {"tok_s": stats["tokens"] / wall, "prompt_tokens": stats["prompt_tokens"], "ttft_p50": percentile(stats["ttft"], 50),
            "ttft_p99": percentile(stats["ttft"], 99), "itl_p50": percentile(stats["itl"], 50),
            "itl_p99": percentile(stats["itl"], 99), "tokens": stats["tokens"], "wall": wall}


def mooncake_prompts(trace, wikitext, scale):
    """(text, max_tokens) per trace request: its hash ids' blocks of WikiText words, scaled."""
    words = open(wikitext, encoding="utf-8").read().split()
    block_words = max(1, int(512 / scale / 1.3))  # WikiText: about 1.3 tokens per word
    prompts = []
    for line in open(trace):
        if not line.strip():
            continue
        r = json.loads(line)
        blocks = []
        for h in r["hash_ids"]:
            start = (h * block_words * 7) % (len(words) - block_words)  # a fixed run per id
            blocks.append(" ".join(words[start:start + block_words]))
        prompts.append((" ".join(blocks), max(8, r["output_length"] // scale)))
    return prompts


def stop(proc):
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvlab", required=True)
    parser.add_argument("--llama-server", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--prompts", help="MT-Bench-style jsonl: each first turn a prompt")
    parser.add_argument("--mooncake", help="a Mooncake trace (jsonl) instead of --prompts")
    parser.add_argument("--wikitext", help="with --mooncake: the text the blocks are cut from")
    parser.add_argument("--scale", type=int, default=8, help="with --mooncake: lengths / scale")
    parser.add_argument("--step-tokens", type=int, default=2048,
                        help="kvlab's max_tokens_per_step (prefill chunk + decodes)")
    parser.add_argument("--servers", default="kvlab,llama-server",
                        help="which to run (comma-separated)")
    parser.add_argument("--requests", type=int, default=0,
                        help="requests per level (default: max(8, 2 x concurrency))")
    parser.add_argument("--levels", default="1,4,16,64")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--context", type=int, default=32768)
    args = parser.parse_args()
    if args.mooncake:
        prompts = mooncake_prompts(args.mooncake, args.wikitext, args.scale)
    else:
        prompts = [(json.loads(line)["turns"][0], args.max_tokens)
                   for line in open(args.prompts) if line.strip()]
    levels = [int(x) for x in args.levels.split(",")]
    results = {}
    with tempfile.TemporaryDirectory() as work:
        for round_ in range(args.rounds):
            for c in levels:
                requests = args.requests or (max(8, c) if args.mooncake else max(8, 2 * c))
                order = ["kvlab", "llama-server"] if round_ % 2 == 0 else ["llama-server", "kvlab"]
                order = [name for name in order if name in args.servers.split(",")]
                for name in order:
                    port = 18400 + round_ * 100 + levels.index(c) * 2 + order.index(name)
                    proc, model = (start_kvlab(args, port, work, max(c, 1)) if name == "kvlab"
                                   else start_llama(args, port, c))
                    try:
                        r = asyncio.run(run_level(port, model, prompts, c, requests))
                    finally:
                        stop(proc)
                    results.setdefault((name, c), []).append(r)
                    print(f"round {round_} c={c} {name}: {r['tok_s']:.1f} tok/s, TTFT p50 "
                          f"{r['ttft_p50']*1e3:.0f} ms p99 {r['ttft_p99']*1e3:.0f} ms, ITL p50 "
                          f"{r['itl_p50']*1e3:.1f} ms p99 {r['itl_p99']*1e3:.1f} ms "
                          f"({r['tokens']} tokens out, {r['prompt_tokens']} in, in "
                          f"{r['wall']:.1f} s)", flush=True)
    print("\n| concurrency | server | output tok/s | TTFT p50 (ms) | TTFT p99 (ms) | ITL p50 (ms) "
          "| ITL p99 (ms) |\n|---|---|---|---|---|---|---|")
    for c in levels:
        for name in ["kvlab", "llama-server"]:
            if (name, c) not in results:
                continue
            rs = results[(name, c)]
            med = {k: statistics.median(r[k] for r in rs) for k in rs[0]}
            print(f"| {c} | {name} | {med['tok_s']:.1f} | {med['ttft_p50']*1e3:.0f} | "
                  f"{med['ttft_p99']*1e3:.0f} | {med['itl_p50']*1e3:.1f} | "
                  f"{med['itl_p99']*1e3:.1f} |")
        if ("kvlab", c) not in results or ("llama-server", c) not in results:
            continue
        k = statistics.median(r["tok_s"] for r in results[("kvlab", c)])
        l = statistics.median(r["tok_s"] for r in results[("llama-server", c)])
        print(f"| {c} | kvlab / llama-server | {k / l:.2f}x | | | | |")


if __name__ == "__main__":
    sys.exit(main())

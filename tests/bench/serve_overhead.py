"""What the server costs: the same requests, all arriving at once, through `kvlab run` (the engine
alone, measured clock) and through `kvlab serve` (a client sends them at once over HTTP, every
answer streamed as server-sent events, one JSON chunk per token, or whole with --no-stream),
interleaved over rounds.

The figure is output tokens per second of wall time, served / offline. Offline counts the
engine's run (kvlab run's "wall ... in the engine"); served counts from the first request sent
to the last answer received, so HTTP, JSON, detokenization and the client's own parsing are
all in it.

The client shares the machine's cores with the server, so its own work per chunk is in the
served figure too. --client sdk is the official openai SDK (a pydantic object per chunk);
--client raw reads the same streams off the socket (asyncio, Connection: close) and parses only
the usage at the end: what is left with it is the server's own cost. Each round also reports the
client's CPU seconds.

Usage: PYTHON tests/bench/serve_overhead.py --kvlab build/bin/kvlab --gguf GGUF [--rounds 3]
           [--client sdk|raw] [--no-stream]
(PYTHON with the openai package: build/pyclients/bin/python after ctest -R serve.get_openai_sdk)
"""

import argparse
import asyncio
import csv
import json
import os
import random
import re
import signal
import statistics
import subprocess
import tempfile
import time

import openai

TOML = """[experiment]
name = "serve_overhead"
seed = 5
clock = "measured"
[model]
name = "{gguf}"
[backend]
name = "cpu"
threads = 2
[kv_cache]
allocator = "paged"
slots = 32768
[kv_cache.params]
block_size = 16
[attention]
variant = "gqa"
[scheduler]
name = "fcfs"
[scheduler.params]
max_batch = 64
max_tokens_per_step = 2048
[workload]
requests = {requests}
arrival = "all_at_once"
prompt_tokens = {{ dist = "uniform", min = 40, max = 120 }}
output_tokens = {{ dist = "fixed", value = {output} }}
ignore_eos = true
"""


def offline(args, toml, out):
    run = subprocess.run([args.kvlab, "run", toml, "--out", out, "--force"], capture_output=True,
                         text=True, check=True)
    engine_s = float(re.search(r"wall [\d.]+ s \(([\d.]+) s in the engine", run.stdout +
                               run.stderr).group(1))
    rows = list(csv.DictReader(open(os.path.join(out, "000", "requests.csv"))))
    tokens = sum(int(r["output_tokens"]) for r in rows)
    return tokens / engine_s, [int(r["prompt_tokens"]) for r in rows]


async def send_all(port, model, lengths, output, stream):
    client = openai.AsyncOpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none",
                                timeout=900, max_retries=0)
    rng = random.Random(1)
    counts = []

    async def one(length):
        prompt = [rng.randrange(1, 49000) for _ in range(length)]
        tokens = 0
        if not stream:
            answer = await client.completions.create(
                model=model, prompt=prompt, max_tokens=output, temperature=0,
                extra_body={"ignore_eos": True})
            counts.append(answer.usage.completion_tokens)
            return
        chunks = await client.completions.create(
            model=model, prompt=prompt, max_tokens=output, temperature=0, stream=True,
            stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        async for chunk in chunks:
            if chunk.usage:
                tokens = chunk.usage.completion_tokens
        counts.append(tokens)

    start = time.perf_counter()
    await asyncio.gather(*(one(n) for n in lengths))
    wall = time.perf_counter() - start
    await client.close()
    return sum(counts) / wall


async def raw_send_all(port, model, lengths, output, stream):
    """The same requests over plain sockets: no SDK, no per-chunk parsing."""
    rng = random.Random(1)
    counts = []

    async def one(length):
        prompt = [rng.randrange(1, 49000) for _ in range(length)]
        body = json.dumps({"model": model, "prompt": prompt, "max_tokens": output,
                           "temperature": 0, "ignore_eos": True, "stream": stream,
                           "stream_options": {"include_usage": True} if stream else None})
        body = body.replace(', "stream_options": null', "").encode()
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(b"POST /v1/completions HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                     b"Content-Type: application/json\r\nConnection: close\r\n"
                     + f"Content-Length: {len(body)}\r\n\r\n".encode() + body)
        await writer.drain()
        tail = b""
        while chunk := await asyncio.wait_for(reader.read(1 << 16), timeout=900):
            tail = (tail + chunk)[-4096:]  # the usage is in the last chunk
        writer.close()
        found = re.findall(rb'"completion_tokens":(\d+)', tail)
        if not found:
            raise RuntimeError(f"no usage in the answer's end: {tail[-300:]!r}")
        counts.append(int(found[-1]))

    start = time.perf_counter()
    await asyncio.gather(*(one(n) for n in lengths))
    wall = time.perf_counter() - start
    return sum(counts) / wall


def served(args, toml, work, lengths):
    proc = subprocess.Popen([args.kvlab, "serve", toml, "--port", "0", "--out",
                             os.path.join(work, "served"), "--force", "--max-seconds", "1800"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    port = model = None
    while port is None:
        line = proc.stderr.readline()
        if not line:
            raise RuntimeError("kvlab serve did not start")
        match = re.search(r"on http://127\.0\.0\.1:(\d+) \(model \"([^\"]+)\"", line)
        if match:
            port, model = int(match.group(1)), match.group(2)
    send = raw_send_all if args.client == "raw" else send_all
    try:
        cpu = time.process_time()
        tok_s = asyncio.run(send(port, model, lengths, args.output, not args.no_stream))
        return tok_s, time.process_time() - cpu
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=300)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--kvlab", required=True)
    parser.add_argument("--gguf", required=True)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--requests", type=int, default=128)
    parser.add_argument("--output", type=int, default=128)
    parser.add_argument("--no-stream", action="store_true",
                        help="whole answers: one JSON per request, not one per token (the "
                             "client's own parsing on the same cores is most of a stream's cost)")
    parser.add_argument("--client", choices=["sdk", "raw"], default="sdk")
    args = parser.parse_args()
    ratios = []
    with tempfile.TemporaryDirectory() as work:
        toml = os.path.join(work, "overhead.toml")
        with open(toml, "w") as f:
            f.write(TOML.format(gguf=os.path.abspath(args.gguf), requests=args.requests,
                                output=args.output))
        for r in range(args.rounds):
            off, lengths = offline(args, toml, os.path.join(work, "offline"))
            on, client_cpu = served(args, toml, work, lengths)
            ratios.append(on / off)
            print(f"round {r}: offline {off:.1f} tok/s, served {on:.1f} tok/s, "
                  f"served/offline {on / off:.3f}, client CPU {client_cpu:.2f} s", flush=True)
    print(f"median served/offline: {statistics.median(ratios):.3f} "
          f"(server cost {100 * (1 - statistics.median(ratios)):.1f}%)")


if __name__ == "__main__":
    main()

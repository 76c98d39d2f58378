"""kvlab serve driven by one of this field's load generators: NVIDIA's aiperf (PyPI), a short run.

Serves SmolLM2 (experiments/real_model_chat.toml, fcfs) on 127.0.0.1 and runs `aiperf profile`
against it: chat completions, streamed, concurrency 4, 16 requests of synthetic prompts, output
lengths fixed by ignore_eos. Checks that aiperf finished every request with no error, that the
served run's requests.csv holds exactly those requests, and that aiperf's output token count
equals the engine's.

aiperf synthesizes prompts with a tokenizer; offline it cannot fetch SmolLM2's from a hub, so it
gets the GPT-2 tokenizer of the test fixtures (prompt lengths are approximate) and counts output
tokens from the server's usage (--use-server-token-count).

Usage: python3 aiperf_client.py KVLAB AIPERF SOURCE_DIR WORK_DIR
Exit 77 (ctest: skipped) without aiperf or without the SmolLM2 file.
"""

import csv
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
import urllib.request

REQUESTS = 16


def main():
    kvlab, aiperf, source, work = sys.argv[1:5]
    gguf = os.path.join(source, "models", "smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")
    if not os.access(aiperf, os.X_OK) or not os.path.exists(gguf):
        print("aiperf or models/smollm2 is missing (offline setup): skipped")
        return 77
    tokenizer = os.path.join(work, "gpt2-tokenizer")
    os.makedirs(tokenizer, exist_ok=True)
    shutil.copy(os.path.join(source, "tests", "fixtures", "tokenizer", "gpt2.tokenizer.json"),
                os.path.join(tokenizer, "tokenizer.json"))
    with open(os.path.join(tokenizer, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "model_max_length": 8192}, f)
    out = os.path.join(work, "served")
    server = subprocess.Popen(
        [kvlab, "serve", os.path.join(source, "experiments", "real_model_chat.toml"), "--set",
         "scheduler.name=fcfs", "--set", "scheduler.params={max_batch=16}", "--port", "0",
         "--max-seconds", "400", "--out", out, "--force"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    port = model = None
    deadline = time.time() + 120
    while time.time() < deadline and port is None:
        line = server.stderr.readline()
        match = re.search(r"on http://127\.0\.0\.1:(\d+) \(model \"([^\"]+)\"", line)
        if match:
            port, model = match.group(1), match.group(2)
    assert port, "kvlab serve did not start"
    artifacts = os.path.join(work, "aiperf")
    try:
        run = subprocess.run(
            [aiperf, "profile", "--model", model, "--url", f"http://127.0.0.1:{port}",
             "--endpoint-type", "chat", "--streaming", "--concurrency", "4", "--request-count",
             str(REQUESTS), "--tokenizer", tokenizer, "--synthetic-input-tokens-mean", "64",
             "--output-tokens-mean", "24", "--extra-inputs", "ignore_eos:true",
             "--use-server-token-count", "--ui-type", "none", "--artifact-dir", artifacts],
            capture_output=True, text=True, timeout=300)
        print(run.stdout[-3000:])
        assert run.returncode == 0, run.stderr[-3000:]
    finally:
        server.send_signal(signal.SIGTERM)
        _, stderr = server.communicate(timeout=120)
    assert server.returncode == 0, stderr
    with open(os.path.join(artifacts, "profile_export_aiperf.json")) as f:
        report = json.load(f)
    count = report["request_count"]["avg"]
    osl = report["total_osl"]["avg"]
    errors = report.get("error_request_count", {}).get("avg", 0)
    runs = [d for d in os.listdir(out) if os.path.isdir(os.path.join(out, d))]
    with open(os.path.join(out, runs[0], "requests.csv")) as f:
        rows = list(csv.DictReader(f))
    engine_tokens = sum(int(r["output_tokens"]) for r in rows)
    print(f"aiperf: {count:.0f} requests, {errors:.0f} errors, {osl:.0f} output tokens, "
          f"TTFT p50 {report['time_to_first_token']['p50']:.1f} ms, output "
          f"{report['output_token_throughput']['avg']:.1f} tok/s; the served run: {len(rows)} "
          f"requests, {engine_tokens} output tokens")
    assert count == REQUESTS and errors == 0, report
    assert len(rows) == REQUESTS, len(rows)  # every request it sent is in the record, once
    assert engine_tokens == osl, (engine_tokens, osl)
    return 0


if __name__ == "__main__":
    sys.exit(main())

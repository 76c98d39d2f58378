#!/usr/bin/env python3
"""Hugging Face transformers' generate() on the requests of a kvlab run: the baseline kvlab's
output tok/s is a ratio to (issue 15, item 5), measured on the same GPU in the same script run.

It reads a kvlab results folder (kvlab run ... --out DIR): the prompt and output lengths of its
first run's requests.csv, and every run's output tok/s from its summary.json. It then builds the
model preset's shape with random weights (as kvlab's presets have), feeds the same number of
requests with the same prompt lengths (random token ids, seeded) in static batches of --batch,
left-padded, greedy, each batch generating its longest output (EOS ignored, as the kvlab
workload's ignore_eos), and counts only each request's own output tokens as useful: what a
padded static batch delivers. Prints the baseline and each kvlab run's ratio to it.

    python3 scripts/hf_generate_baseline.py build-gpu/cuda_fcfs_vs_static --batch 256 --max-requests 256

Needs torch and transformers (the GPU machine has both). --device cpu --small runs a 2-layer
model of the same code path on a CPU (a smoke test of this script, not a measurement).
"""
import argparse
import csv
import json
import pathlib
import sys
import time

import torch
from transformers import LlamaConfig, LlamaForCausalLM

# kvlab's presets (core/src/model_config.cpp): vocab, hidden, ffn, layers, heads, kv heads,
# context, rms eps, rope theta.
PRESETS = {
    "tinyllama-1.1b": (32000, 2048, 5632, 22, 32, 4, 2048, 1e-5, 10000.0),
    "small": (32000, 64, 176, 2, 4, 2, 2048, 1e-5, 10000.0),  # --small: a CPU smoke test
}


def read_results(folder):
    """(prompt_tokens, output_tokens) per request of the first run; (label, tok/s) per run."""
    runs = json.loads((folder / "runs.json").read_text())
    if not runs:
        sys.exit(f"{folder}/runs.json lists no runs")
    with open(folder / runs[0]["dir"] / "requests.csv", newline="") as f:
        requests = [(int(r["prompt_tokens"]), int(r["output_tokens"]))
                    for r in csv.DictReader(f) if r["rejected"] == "0"]
    rates = []
    for run in runs:
        summary = json.loads((folder / run["dir"] / "summary.json").read_text())
        if summary["clock"] not in ("measured", "wall"):
            sys.exit(f"{folder}: run {run['dir']} ran on the {summary['clock']} clock; its tok/s "
                     "is a model's, not this machine's: compare a measured or wall-clock run")
        rates.append((run["label"] or "base", summary["output_tokens_per_s"]))
    return requests, rates


def build_model(preset, dtype, device):
    vocab, hidden, ffn, layers, heads, kv_heads, context, eps, theta = PRESETS[preset]
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=ffn,
                         num_hidden_layers=layers, num_attention_heads=heads,
                         num_key_value_heads=kv_heads, max_position_embeddings=context,
                         rms_norm_eps=eps, rope_theta=theta, tie_word_embeddings=False)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype)
    return model.eval(), vocab


def run_batch(model, vocab, batch, device, generator):
    """One static batch: left-padded random prompts, greedy, its longest output."""
    longest_prompt = max(p for p, _ in batch)
    new_tokens = max(o for _, o in batch)
    ids = torch.randint(1, vocab, (len(batch), longest_prompt), generator=generator)
    mask = torch.zeros_like(ids)
    for row, (prompt, _) in enumerate(batch):
        mask[row, longest_prompt - prompt:] = 1
    ids = (ids * mask).to(device)
    out = model.generate(input_ids=ids, attention_mask=mask.to(device), do_sample=False,
                         max_new_tokens=new_tokens, min_new_tokens=new_tokens, pad_token_id=0)
    assert out.shape[1] == longest_prompt + new_tokens, out.shape


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("results", type=pathlib.Path, help="a kvlab run's results folder")
    parser.add_argument("--batch", type=int, default=128, help="static batch size")
    parser.add_argument("--preset", default="tinyllama-1.1b", choices=sorted(PRESETS))
    parser.add_argument("--small", action="store_true", help="the 'small' preset (CPU smoke)")
    parser.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--max-requests", type=int, default=0, help="0: all of them")
    args = parser.parse_args()
    if args.batch < 1:
        sys.exit("--batch must be >= 1")
    requests, rates = read_results(args.results)
    if args.max_requests > 0:
        requests = requests[:args.max_requests]
    if not requests:
        sys.exit(f"{args.results}: no finished request to replay")
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    model, vocab = build_model("small" if args.small else args.preset, dtype, args.device)
    generator = torch.Generator().manual_seed(1)
    with torch.inference_mode():
        run_batch(model, vocab, requests[:2], args.device, generator)  # warm-up, not timed
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        start = time.perf_counter()
        for first in range(0, len(requests), args.batch):
            run_batch(model, vocab, requests[first:first + args.batch], args.device, generator)
        if args.device.startswith("cuda"):
            torch.cuda.synchronize()
        seconds = time.perf_counter() - start
    useful = sum(o for _, o in requests)
    baseline = useful / seconds
    print(f"hf generate ({args.preset if not args.small else 'small'}, {args.dtype}, "
          f"{args.device}, static batch {args.batch}): {len(requests)} requests, {useful} output "
          f"tokens in {seconds:.2f} s = {baseline:.1f} tok/s")
    for label, rate in rates:
        print(f"kvlab [{label}]: {rate:.1f} output tok/s = {rate / baseline:.2f}x hf generate")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Runs a GGUF LLaMA in kvlab and in Hugging Face transformers (which reads the same file with
its own dequantization and Q/K un-permutation) and compares greedy tokens and logprobs.

A manual check (it needs torch, transformers, gguf and accelerate from PyPI, and a model file):

    python3 -m venv /tmp/hf && /tmp/hf/bin/pip install torch transformers gguf accelerate
    /tmp/hf/bin/python scripts/compare_gguf_with_transformers.py MODEL.gguf \\
        --chat "What is the capital of France?" [--kvlab build/bin/kvlab] [--tokens 24]

Exit 0 when the greedy tokens are equal; prints the largest |delta logprob| of the chosen tokens.
"""
import argparse
import json
import pathlib
import subprocess
import sys

import torch
from transformers import AutoTokenizer, LlamaForCausalLM

parser = argparse.ArgumentParser()
parser.add_argument("gguf")
parser.add_argument("--chat", default="What is the capital of France?")
parser.add_argument("--kvlab", default="build/bin/kvlab")
parser.add_argument("--tokens", type=int, default=24)
args = parser.parse_args()

path = pathlib.Path(args.gguf).resolve()
tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
model = LlamaForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32).eval()
text = f"<|im_start|>user\n{args.chat}<|im_end|>\n<|im_start|>assistant\n"  # ChatML (SmolLM2)
ids = tokenizer(text)["input_ids"]
with torch.no_grad():
    out = model.generate(torch.tensor([ids]), max_new_tokens=args.tokens, do_sample=False,
                         output_logits=True, return_dict_in_generate=True)
reference = out.sequences[0][len(ids):].tolist()
logprobs = [torch.log_softmax(step[0], -1) for step in out.logits]

command = [args.kvlab, "generate", "--model", str(path), "--prompt-ids", ",".join(map(str, ids)),
           "--max-tokens", str(args.tokens), "--logprobs", "1", "--json"]
run = subprocess.run(command, capture_output=True, text=True)
if run.returncode != 0:
    sys.exit(f"kvlab failed: {run.stderr}")
rows = [json.loads(line) for line in run.stdout.splitlines() if line.startswith("{")]
tokens = [row["token"] for row in rows]
worst = max(abs(row["logprob"] - logprobs[i][row["token"]].item()) for i, row in enumerate(rows))
print("transformers:", reference, repr(tokenizer.decode(reference)))
print("kvlab:       ", tokens, repr(tokenizer.decode(tokens)))
print(f"equal: {tokens == reference}; max |delta logprob| of the chosen tokens: {worst:.2e}")
sys.exit(0 if tokens == reference else 1)

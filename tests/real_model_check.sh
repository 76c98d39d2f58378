#!/bin/sh
# kvlab check on SmolLM2 (experiments/real_model_check.toml) over a pairwise cover of
# allocator x attention variant x scheduler: 20 points (variant v x scheduler s, allocator
# (v + s) mod 3) hold every allocator-variant, allocator-scheduler and variant-scheduler pair;
# the file's own full 3 x 5 x 4 sweep (60 points, ~70 s on 2 cores) is the by-hand run. The
# file's requests ask for 5 logprobs: each token's are held to the reference's too.
# Exit 77 (ctest: skipped) when the model could not be fetched.
# Usage: tests/real_model_check.sh KVLAB_BINARY
set -eu
cd "$(dirname "$0")/.."
if [ ! -f models/smollm2/SmolLM2-135M-Instruct.Q4_1.gguf ]; then
  echo "models/smollm2 is not here: scripts/get_model.sh smollm2 could not fetch it (see models.get_smollm2)"
  exit 77
fi
exec "$1" check experiments/real_model_check.toml --set 'sweep=[{key="kv_cache.allocator",zip="p",values=["static","dynamic","paged","static","dynamic","paged","static","dynamic","paged","static","dynamic","paged","static","dynamic","paged","static","dynamic","paged","static","dynamic"]},{key="kv_cache.params",zip="p",values=[{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{},{block_size=16},{max_seq_len=64},{}]},{key="attention.variant",zip="p",values=["gqa","gqa","gqa","gqa","mha","mha","mha","mha","mqa","mqa","mqa","mqa","sliding_window","sliding_window","sliding_window","sliding_window","recompute","recompute","recompute","recompute"]},{key="attention.params",zip="p",values=[{},{},{},{},{},{},{},{},{},{},{},{},{window=24},{window=24},{window=24},{window=24},{},{},{},{}]},{key="scheduler.name",zip="p",values=["static","fcfs","chunked","priority","static","fcfs","chunked","priority","static","fcfs","chunked","priority","static","fcfs","chunked","priority","static","fcfs","chunked","priority"]},{key="scheduler.params",zip="p",values=[{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=16},{max_batch=4},{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=16},{max_batch=4},{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=16},{max_batch=4},{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=16},{max_batch=4},{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=16},{max_batch=4}]}]'

#!/bin/sh
# kvlab check on Gemma 3 270M (experiments/gemma3_check.toml) over 4 points that hold every
# allocator and every scheduler once (static + static, dynamic + fcfs, paged + chunked, paged +
# priority); the file's own 3 x 4 sweep (12 points, ~80 s on 2 cores) is the by-hand run, and
# gemma3-tiny's checks (experiments.check.gemma3_tiny_*) cover every pair. Exit 77 (ctest:
# skipped) when the model could not be fetched.
# Usage: tests/gemma3_check.sh KVLAB_BINARY
set -eu
cd "$(dirname "$0")/.."
if [ ! -f models/gemma3/gemma-3-270m-q4_k_m.gguf ]; then
  echo "models/gemma3 is not here: scripts/get_model.sh gemma3 could not fetch it (see models.get_gemma3)"
  exit 77
fi
exec "$1" check experiments/gemma3_check.toml --set 'sweep=[{key="kv_cache.allocator",zip="p",values=["static","dynamic","paged","paged"]},{key="kv_cache.params",zip="p",values=[{max_seq_len=640},{},{block_size=16},{block_size=16}]},{key="scheduler.name",zip="p",values=["static","fcfs","chunked","priority"]},{key="scheduler.params",zip="p",values=[{max_batch=4},{max_batch=4},{max_batch=4,max_tokens_per_step=128},{max_batch=4}]}]'

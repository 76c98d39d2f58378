#!/bin/sh
# The plugins kvlab ships (schedulers, allocators, attention variants, routers, the simulated
# backend) link only kvlab_base: no engine, simulator, model files or tokenizers
# (core/CMakeLists.txt). The cpu and cuda backends link the CPU reference (its math).
#   tests/check_plugin_links.sh PLUGIN_DIR
set -eu
dir=$1
found=0
for plugin in "$dir"/kvlab_plugin_scheduler_*.so "$dir"/kvlab_plugin_allocator_*.so \
              "$dir"/kvlab_plugin_attention_*.so "$dir"/kvlab_plugin_router_*.so \
              "$dir"/kvlab_plugin_backend_simulated.so; do
  found=$((found + 1))
  if readelf -d "$plugin" | grep NEEDED | grep -E 'libkvlab_(model|engine|sim|core|cpu_reference|experiment)'; then
    echo "$(basename "$plugin") links more than kvlab_base" >&2
    exit 1
  fi
done
[ "$found" -ge 17 ] || { echo "expected the 17 shipped plugins in $dir, found $found" >&2; exit 1; }
echo "$found plugins link only kvlab_base"

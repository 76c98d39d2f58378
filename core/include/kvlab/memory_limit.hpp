#pragma once
// Allocations sized by input (a KV pool from kv_cache.slots, weights from a model shape, request
// tables from workload.requests) are checked against what this machine can hold *before* they
// are made: a clear error naming the field instead of std::bad_alloc, or minutes of paging.
#include <cstdint>
#include <string_view>

namespace kvlab {

// The most this process may allocate: physical memory, or the address-space limit
// (RLIMIT_AS, ulimit -v) when that is smaller.
std::uint64_t allocatable_bytes();

// Throws kvlab::Error "<what> needs N GiB, more than this machine can hold (M GiB)" when
// `bytes` exceeds allocatable_bytes().
void check_allocation(std::uint64_t bytes, std::string_view what);

}  // namespace kvlab

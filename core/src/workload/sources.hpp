#pragma once
// Each workload source's row functions (internal): formats.cpp lists them in its table.
#include <filesystem>

#include "kvlab/workload/formats.hpp"

namespace kvlab::detail {

RealWorkload load_synthetic_source(const WorkloadInput& input);
bool is_kvlab_trace(const std::filesystem::path& file);
RealWorkload load_kvlab_source(const WorkloadInput& input);
bool is_azure_trace(const std::filesystem::path& file);
RealWorkload load_azure_source(const WorkloadInput& input);
RealWorkload load_mooncake_source(const WorkloadInput& input);
RealWorkload load_prompt_source(const WorkloadInput& input);

}  // namespace kvlab::detail

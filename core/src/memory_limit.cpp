#include "kvlab/memory_limit.hpp"

#include <fmt/format.h>
#include <sys/resource.h>
#include <unistd.h>

#include <algorithm>

#include "kvlab/error.hpp"

namespace kvlab {

std::uint64_t allocatable_bytes() {
  const long pages = sysconf(_SC_PHYS_PAGES);
  const long page_size = sysconf(_SC_PAGE_SIZE);
  std::uint64_t limit = pages > 0 && page_size > 0 ? static_cast<std::uint64_t>(pages) *
                                                         static_cast<std::uint64_t>(page_size)
                                                   : UINT64_MAX;
  rlimit address_space{};
  if (getrlimit(RLIMIT_AS, &address_space) == 0 && address_space.rlim_cur != RLIM_INFINITY)
    limit = std::min<std::uint64_t>(limit, address_space.rlim_cur);
  return limit;
}

void check_allocation(std::uint64_t bytes, std::string_view what) {
  const std::uint64_t limit = allocatable_bytes();
  if (bytes <= limit) return;
  constexpr double kGiB = 1024.0 * 1024.0 * 1024.0;
  throw Error(fmt::format("{} needs {:.1f} GiB, more than this machine can hold ({:.1f} GiB)", what,
                          static_cast<double>(bytes) / kGiB, static_cast<double>(limit) / kGiB));
}

}  // namespace kvlab

#pragma once
// The third-party data sets scripts/get_data.sh installs into data/ (docs/data.md): none is in
// the repository, so a run that names one of their files before it is installed gets an error
// that says which command installs it.
#include <string>
#include <string_view>

namespace kvlab {

// "; it is a third-party data set, not in the repository: scripts/get_data.sh NAME installs
// it" when `path` names a file of one of them (data/mooncake-fast25/..., data/prompts/...),
// else "". For the end of a "cannot read" message.
std::string data_set_hint(std::string_view path);

}  // namespace kvlab

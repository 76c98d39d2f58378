#pragma once
// Helpers shared by the kvlab tests: temporary folders, error-message matchers, tolerances.
#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <filesystem>
#include <fstream>
#include <functional>
#include <random>
#include <span>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace kvlab::test {

// A fresh folder under the system temp dir, removed when the object dies.
class TempDir {
 public:
  TempDir() {
    std::random_device rd;
    path_ = std::filesystem::temp_directory_path() /
            ("kvlab_test_" + std::to_string(rd()) + std::to_string(rd()));
    std::filesystem::create_directories(path_);
  }
  ~TempDir() {
    std::error_code ec;
    std::filesystem::remove_all(path_, ec);
  }
  TempDir(const TempDir&) = delete;
  TempDir& operator=(const TempDir&) = delete;
  const std::filesystem::path& path() const { return path_; }
  std::filesystem::path operator/(const std::string& name) const { return path_ / name; }

 private:
  std::filesystem::path path_;
};

inline std::string read_file(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  std::stringstream s;
  s << in.rdbuf();
  return s.str();
}

inline void write_file(const std::filesystem::path& path, const std::string& bytes) {
  if (path.has_parent_path()) std::filesystem::create_directories(path.parent_path());
  std::ofstream out(path, std::ios::binary | std::ios::trunc);
  out << bytes;
}

// Runs `body`, expects it to throw E, and returns the message (empty + failure otherwise).
template <typename E, typename F>
std::string error_of(F&& body) {
  try {
    body();
  } catch (const E& e) {
    return e.what();
  }
  ADD_FAILURE() << "expected an exception";
  return {};
}

// Expects `body` to throw a std::exception whose message contains every one of `parts`.
template <typename F>
void expect_error_containing(F&& body, const std::vector<std::string>& parts) {
  const std::string message = error_of<std::exception>(std::forward<F>(body));
  for (const auto& part : parts)
    EXPECT_NE(message.find(part), std::string::npos) << "\"" << part << "\" not in: " << message;
}

// Max abs / rel error between two float arrays, and whether either holds a NaN.
struct Closeness {
  double max_abs = 0;
  double max_rel = 0;
  bool has_nan = false;
};

inline Closeness compare(std::span<const float> actual, std::span<const float> expected) {
  Closeness c;
  EXPECT_EQ(actual.size(), expected.size());
  for (std::size_t i = 0; i < std::min(actual.size(), expected.size()); ++i) {
    if (std::isnan(actual[i]) || std::isnan(expected[i])) c.has_nan = true;
    const double diff = std::abs(static_cast<double>(actual[i]) - expected[i]);
    c.max_abs = std::max(c.max_abs, diff);
    c.max_rel =
        std::max(c.max_rel, diff / std::max(1e-6, std::abs(static_cast<double>(expected[i]))));
  }
  return c;
}

// Polls `done` every 5 ms for up to 20 s (a live engine's or server's threads catching up).
template <class F>
bool eventually(F done) {
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
  while (std::chrono::steady_clock::now() < deadline) {
    if (done()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  return false;
}

}  // namespace kvlab::test

#include <fmt/format.h>
#include <gtest/gtest.h>

#include "kvlab/error.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

using test::error_of;

const std::filesystem::path kPlugins = KVLAB_PLUGIN_DIR;
const std::filesystem::path kTestPlugins = KVLAB_TEST_PLUGIN_DIR;

std::string load_error(const std::filesystem::path& file) {
  return error_of<Error>([&] {
    PluginRegistry registry({});
    registry.load_file(file);
  });
}

TEST(PluginLoader, FindsTheShippedPlugins) {
  const PluginRegistry registry({kPlugins});
  for (const char* name : {"static", "dynamic", "paged"})
    EXPECT_EQ(registry.find(PluginKind::kv_allocator, name).name, name);
  for (const char* name : {"recompute", "mha", "gqa", "mqa", "sliding_window"})
    EXPECT_EQ(registry.find(PluginKind::attention_variant, name).name, name);
  const PluginInfo& paged = registry.find(PluginKind::kv_allocator, "paged");
  ASSERT_EQ(paged.params.size(), 3u);
  EXPECT_STREQ(paged.params[0].name, "block_size");
  EXPECT_STREQ(paged.params[2].name, "reuse_order");
  EXPECT_NE(paged.file.string().find("kvlab_plugin_allocator_paged.so"), std::string::npos);
}

TEST(PluginLoader, MissingFile) {
  EXPECT_NE(load_error(kTestPlugins / "kvlab_plugin_nope.so").find("does not exist"),
            std::string::npos);
}

TEST(PluginLoader, SharedLibraryThatIsNotAPlugin) {
  const std::string message = load_error(kTestPlugins / "kvlab_plugin_test_not_a_plugin.so");
  EXPECT_NE(message.find("is not a kvlab plugin"), std::string::npos) << message;
  EXPECT_NE(message.find("kvlab_plugin_test_not_a_plugin.so"), std::string::npos) << message;
}

TEST(PluginLoader, FileThatIsNotALibrary) {
  test::TempDir dir;
  test::write_file(dir / "kvlab_plugin_text.so", "just text");
  EXPECT_NE(load_error(dir / "kvlab_plugin_text.so").find("cannot load plugin"), std::string::npos);
}

// Files that are not loadable libraries: each gets dlopen's reason or the ELF check's, never
// "Bad file descriptor" and never a crash (a truncated library used to SIGBUS inside glibc).
TEST(PluginLoader, UnloadableFilesSayWhy) {
  test::TempDir dir;
  const std::string real = test::read_file(kPlugins / "kvlab_plugin_allocator_paged.so");
  std::string random(4096, '\0');
  std::uint32_t state = 12345;
  for (char& c : random) c = static_cast<char>((state = state * 1664525u + 1013904223u) >> 24);
  std::string aarch64 = real;
  aarch64[18] = static_cast<char>(183);  // e_machine = EM_AARCH64
  aarch64[19] = 0;
  const std::vector<std::pair<std::string, std::string>> cases{
      {"", "fewer than an ELF header"},
      {"just text, long enough to fill an ELF header's sixty-four bytes...........", "not an ELF"},
      {random, "not an ELF"},
      {real.substr(0, 40), "fewer than an ELF header"},
      {real.substr(0, 200), "truncated"},
      {real.substr(0, real.size() / 2), "truncated"},
      {aarch64, "another machine"},
  };
  for (std::size_t i = 0; i < cases.size(); ++i) {
    const auto file = dir / fmt::format("kvlab_plugin_case{}.so", i);
    test::write_file(file, cases[i].first);
    const std::string message = load_error(file);
    EXPECT_NE(message.find("cannot load plugin"), std::string::npos) << i << ": " << message;
    EXPECT_NE(message.find(cases[i].second), std::string::npos) << i << ": " << message;
  }
  // An executable is an ELF file of the right machine; dlopen itself refuses it, in its words.
  const std::string message = load_error("/bin/true");
  EXPECT_NE(message.find("cannot load plugin"), std::string::npos) << message;
  EXPECT_EQ(message.find("Bad file descriptor"), std::string::npos) << message;
}

TEST(PluginLoader, DescriptorThatIsAFunctionIsRefused) {
  const std::string message = load_error(kTestPlugins / "kvlab_plugin_test_function_descriptor.so");
  EXPECT_NE(message.find("is not the pointer KVLAB_PLUGIN exports"), std::string::npos) << message;
}

TEST(PluginLoader, BrokenDescriptorsAreNamed) {
  const std::vector<std::string> expected{"name is null", "create or destroy function is null",
                                          "kind 77", "params are null"};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const std::string message =
        load_error(kTestPlugins / fmt::format("kvlab_plugin_test_bad_descriptor_{}.so", i + 1));
    EXPECT_NE(message.find("broken descriptor: its " + expected[i]), std::string::npos) << message;
  }
}

// Parameter schemas are checked at load: a plugin cannot hand the host a default it cannot read.
TEST(PluginLoader, BrokenParameterSchemasAreNamed) {
  const std::vector<std::string> expected{
      "parameter \"block\"'s default 5000 is outside its range [1, 4096]",
      "parameter \"block\"'s default \"sixteen\" is not a integer",
      "parameter \"rate\" has the range [1, nan]: not a range",
      "parameter \"what\" has type 9, not one kvlab knows",
      "parameter \"name\" has a null default",
      "it declares parameter \"ok\" twice"};
  for (std::size_t i = 0; i < expected.size(); ++i) {
    const std::string message =
        load_error(kTestPlugins / fmt::format("kvlab_plugin_test_bad_descriptor_{}.so", i + 5));
    EXPECT_NE(message.find("broken descriptor: " + expected[i]), std::string::npos) << message;
  }
}

// A hand-written create that throws an int: one error naming the plugin, no std::terminate.
TEST(PluginLoader, CreateThatThrowsANonStdExceptionIsReported) {
  PluginRegistry registry({});
  registry.load_file(kTestPlugins / "kvlab_plugin_test_bad_descriptor_11.so");
  const std::string message = error_of<Error>(
      [&] { (void)registry.create<PluginKind::attention_variant>("bad_descriptor", {}, {}); });
  EXPECT_NE(message.find("attention plugin \"bad_descriptor\""), std::string::npos) << message;
  EXPECT_NE(message.find("threw something that is not a std::exception from create"),
            std::string::npos)
      << message;
}

// The descriptor alias is a pointer, but null or pointing to data: calling it would crash.
TEST(PluginLoader, DescriptorAliasThatIsNullOrPointsToDataIsRefused) {
  EXPECT_NE(load_error(kTestPlugins / "kvlab_plugin_test_bad_alias_1.so")
                .find("\"kvlab_plugin_descriptor\" is null"),
            std::string::npos);
  EXPECT_NE(load_error(kTestPlugins / "kvlab_plugin_test_bad_alias_2.so")
                .find("points to data, not to the function KVLAB_PLUGIN exports"),
            std::string::npos);
}

// A shipped plugin with flipped bits (every byte of its code after the ELF headers, one at a
// time in a few places): loading it is refused with a reason or works, and never crashes kvlab.
TEST(PluginLoader, FlippedBitsNeverCrashTheHost) {
  test::TempDir dir;
  const auto original = kPlugins / "kvlab_plugin_allocator_paged.so";
  const std::string bytes = test::read_file(original);
  ASSERT_GT(bytes.size(), 4096u);
  int refused = 0;
  for (std::size_t k = 0; k < 24; ++k) {
    std::string damaged = bytes;
    const std::size_t at = 64 + (k * 7919 * 131) % (bytes.size() - 64);
    damaged[at] = static_cast<char>(damaged[at] ^ (1 << (k % 8)));
    const auto file = dir / fmt::format("kvlab_plugin_damaged_{}.so", k);
    test::write_file(file, damaged);
    try {
      PluginRegistry registry({});
      registry.load_file(file);
    } catch (const Error& e) {
      ++refused;
      EXPECT_NE(std::string(e.what()).find(file.string()), std::string::npos) << e.what();
    }
  }
  SUCCEED() << refused << " of 24 damaged copies refused";
}

// A library that ends the process loading it (a static initializer calling _Exit, or ld.so's
// assertion on a damaged file: exit status 127) is refused by the probe in a child process;
// before, only a child killed by a signal counted, and such a file then ended kvlab.
TEST(PluginLoader, ALibraryThatEndsTheLoadingProcessIsRefused) {
  const std::string message = load_error(kTestPlugins / "kvlab_plugin_test_exiting_initializer.so");
  EXPECT_NE(message.find("ended a test process (exit status 3)"), std::string::npos) << message;
}

TEST(PluginLoader, AbiMismatchReportsBothVersions) {
  const std::string message = load_error(kTestPlugins / "kvlab_plugin_test_wrong_abi.so");
  EXPECT_NE(message.find("ABI version " + std::to_string(kPluginAbiVersion + 98)),
            std::string::npos)
      << message;
  EXPECT_NE(message.find("this kvlab has ABI version " + std::to_string(kPluginAbiVersion)),
            std::string::npos)
      << message;
}

TEST(PluginLoader, LayoutFingerprintMismatchIsRefused) {
  const std::string message = load_error(kTestPlugins / "kvlab_plugin_test_wrong_fingerprint.so");
  EXPECT_NE(message.find(fmt::format("fingerprint {:016x}", kPluginAbiFingerprint ^ 1)),
            std::string::npos)
      << message;
  EXPECT_NE(message.find(fmt::format("this kvlab has {:016x}", kPluginAbiFingerprint)),
            std::string::npos)
      << message;
}

// The fingerprint moves when a boundary type's layout does (checked here on the function the
// headers evaluate: a different ABI version alone changes it).
TEST(PluginLoader, FingerprintCoversTheAbiVersionAndLayouts) {
  EXPECT_NE(kPluginAbiFingerprint, plugin_abi_fingerprint());
  EXPECT_NE(plugin_abi_fingerprint(), detail::Fnv1a{}.mix(kPluginAbiVersion).hash);
}

TEST(PluginLoader, DuplicateNames) {
  test::TempDir dir;
  std::filesystem::copy_file(kPlugins / "kvlab_plugin_allocator_paged.so",
                             dir / "kvlab_plugin_paged_copy.so");
  const std::string message = error_of<Error>([&] {
    PluginRegistry registry({kPlugins, dir.path()});
  });
  EXPECT_NE(message.find("two allocator plugins are named \"paged\""), std::string::npos)
      << message;
  EXPECT_NE(message.find("kvlab_plugin_paged_copy.so"), std::string::npos) << message;
}

TEST(PluginLoader, UnknownNameListsAndSuggests) {
  const PluginRegistry registry({kPlugins});
  const std::string message =
      error_of<Error>([&] { registry.find(PluginKind::kv_allocator, "pagde"); });
  EXPECT_NE(message.find("unknown allocator plugin \"pagde\""), std::string::npos) << message;
  EXPECT_NE(message.find("did you mean \"paged\""), std::string::npos) << message;
  EXPECT_NE(message.find("dynamic"), std::string::npos) << message;
}

class PluginParameters : public ::testing::Test {
 protected:
  PluginParameters() : registry_({kPlugins}), pool_({1, 1, 4, 64}) { context_.pool = &pool_; }
  std::string create_error(const std::string& name,
                           std::map<std::string, ParamValue, std::less<>> params) {
    return error_of<Error>(
        [&] { registry_.create<PluginKind::kv_allocator>(name, params, context_); });
  }
  PluginRegistry registry_;
  KvPool pool_;
  PluginContext context_;
};

TEST_F(PluginParameters, UnknownParameter) {
  const std::string message = create_error("paged", {{"blocksize", std::int64_t{8}}});
  EXPECT_NE(message.find(
                "plugin \"paged\" has no parameter \"blocksize\" (did you mean \"block_size\"?)"),
            std::string::npos)
      << message;
}

TEST_F(PluginParameters, WrongType) {
  const std::string message = create_error("paged", {{"block_size", std::string("big")}});
  EXPECT_NE(message.find("parameter \"block_size\" must be an integer, got \"big\""),
            std::string::npos)
      << message;
  EXPECT_NE(create_error("paged", {{"prefix_caching", std::int64_t{1}}}).find("must be a boolean"),
            std::string::npos);
}

TEST_F(PluginParameters, OutOfRange) {
  const std::string message = create_error("paged", {{"block_size", std::int64_t{0}}});
  EXPECT_NE(message.find("\"block_size\" = 0 is out of range [1, 4096]"), std::string::npos)
      << message;
  EXPECT_NE(create_error("dynamic", {{"growth", 0.5}}).find("out of range"), std::string::npos);
}

TEST_F(PluginParameters, CreationFailureCrossesTheBoundaryAsAMessage) {
  const std::string message =
      create_error("paged", {{"block_size", std::int64_t{48}}});  // 64 % 48 != 0
  EXPECT_NE(
      message.find("could not be created: pool slots (64) must be a multiple of block_size (48)"),
      std::string::npos)
      << message;
}

TEST_F(PluginParameters, IntegerAcceptedForReal) {
  auto allocator = registry_.create<PluginKind::kv_allocator>(
      "dynamic", {{"growth", std::int64_t{3}}}, context_);
  EXPECT_TRUE(allocator);
}

TEST(PluginLifetime, ObjectsKeepTheirLibraryLoaded) {
  KvPool pool({1, 1, 4, 64});
  PluginContext context;
  context.pool = &pool;
  PluginObject<KvAllocator> allocator;
  {
    const PluginRegistry registry({kPlugins});
    allocator = registry.create<PluginKind::kv_allocator>(
        "paged", {{"block_size", std::int64_t{8}}}, context);
  }  // the registry (and its handles) are gone; the object's handle keeps the .so mapped
  const std::vector<std::int32_t> prompt{1, 2, 3};
  ASSERT_TRUE(
      allocator->allocate({7, prompt, 10}).has_value());  // virtual calls into the plugin's code
  EXPECT_EQ(allocator->stats().used, 3);
  allocator.reset();  // destroyed by the plugin's destroy, then the library may unload
  EXPECT_FALSE(allocator);
}

}  // namespace
}  // namespace kvlab

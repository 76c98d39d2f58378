#include "kvlab/plugin/plugin_loader.hpp"

#include <fmt/format.h>

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <boost/dll/runtime_symbol_info.hpp>
#include <boost/dll/shared_library.hpp>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <span>

#include "kvlab/error.hpp"
#include "kvlab/suggest.hpp"

namespace kvlab {

const char* plugin_kind_name(PluginKind kind) {
  switch (kind) {
    case PluginKind::kv_allocator:
      return "allocator";
    case PluginKind::attention_variant:
      return "attention";
    case PluginKind::scheduler:
      return "scheduler";
    case PluginKind::backend:
      return "backend";
    case PluginKind::router:
      return "router";
    case PluginKind::tier_policy:
      return "tier_policy";
    case PluginKind::kv_policy:
      return "kv_policy";
    case PluginKind::proposer:
      return "proposer";
  }
  return "unknown";
}

namespace {
constexpr const char* kDescriptorSymbol = "kvlab_plugin_descriptor";
constexpr const char* kFilePrefix = "kvlab_plugin_";

// Why a file of `file_size` bytes starting with `bytes` is not a shared library this process can
// dlopen, or "" when its ELF header and program headers are sound. glibc's dlopen maps segments
// without checking them against the file size, so a truncated library crashes it with SIGBUS.
std::string elf_problem(std::span<const std::byte> bytes, std::uint64_t file_size) {
  if (bytes.size() < sizeof(ElfW(Ehdr)))
    return fmt::format("it has {} bytes, fewer than an ELF header", bytes.size());
  ElfW(Ehdr) header;
  std::memcpy(&header, bytes.data(), sizeof(header));
  if (std::memcmp(header.e_ident, ELFMAG, SELFMAG) != 0) return "it is not an ELF file";
  if (header.e_ident[EI_CLASS] != ELFCLASS64 || header.e_ident[EI_DATA] != ELFDATA2LSB)
    return "it is not a 64-bit little-endian ELF file";
  if (header.e_machine != EM_X86_64)
    return fmt::format("it is built for another machine (ELF e_machine {}, this is x86-64)",
                       header.e_machine);
  if (header.e_type != ET_DYN) return "it is not a shared library (ELF type is not ET_DYN)";
  if (header.e_phentsize != sizeof(ElfW(Phdr)) || header.e_phnum == 0)
    return "its ELF program headers are missing or malformed";
  const std::uint64_t table_end =
      header.e_phoff + std::uint64_t{header.e_phnum} * sizeof(ElfW(Phdr));
  if (header.e_phoff > file_size || table_end > file_size)
    return fmt::format("it is truncated: its program headers end at byte {}, the file has {}",
                       table_end, file_size);
  if (table_end > bytes.size()) return "its program headers lie beyond the first 64 KiB";
  for (std::size_t i = 0; i < header.e_phnum; ++i) {
    ElfW(Phdr) segment;
    std::memcpy(&segment, bytes.data() + header.e_phoff + i * sizeof(segment), sizeof(segment));
    if (segment.p_type != PT_LOAD) continue;
    if (segment.p_offset > file_size || segment.p_filesz > file_size - segment.p_offset)
      return fmt::format("it is truncated: segment {} ends at byte {}, the file has {}", i,
                         segment.p_offset + segment.p_filesz, file_size);
  }
  return "";
}

std::string elf_problem(const std::filesystem::path& file) {
  std::error_code ec;
  const std::uint64_t size = std::filesystem::file_size(file, ec);
  std::ifstream in(file, std::ios::binary);
  if (ec || !in) return "it cannot be read";
  std::vector<char> head(static_cast<std::size_t>(std::min<std::uint64_t>(size, 64 * 1024)));
  in.read(head.data(), static_cast<std::streamsize>(head.size()));
  if (!in) return "it cannot be read";
  return elf_problem(std::as_bytes(std::span<const char>(head)), size);
}

// dlopen's own reason (Boost.DLL reports an errno-style code such as "Bad file descriptor").
std::string dlopen_reason(const std::filesystem::path& file) {
  void* handle = dlopen(file.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (handle != nullptr) {
    dlclose(handle);
    return "unknown reason";
  }
  const char* reason = dlerror();
  return reason != nullptr ? reason : "unknown reason";
}

// The descriptor alias must be a pointer-sized data object (what KVLAB_PLUGIN exports); a
// function of that name would be read as a pointer and crash. "" when it is.
std::string descriptor_symbol_problem(const void* address) {
  Dl_info info{};
  void* entry = nullptr;  // the symbol's ElfW(Sym)
  if (dladdr1(address, &info, &entry, RTLD_DL_SYMENT) == 0 || entry == nullptr)
    return "its symbol cannot be inspected";
  const auto* symbol = static_cast<const ElfW(Sym)*>(entry);
  if (ELF64_ST_TYPE(symbol->st_info) != STT_OBJECT || symbol->st_size != sizeof(void*))
    return "it is not the pointer KVLAB_PLUGIN exports (a function or object of that name?)";
  return "";
}

std::string descriptor_problem(const PluginDescriptor& d);

// Whether `address` lies in an executable segment of the loaded object based at `base`.
bool in_executable_segment(const void* base, const void* address) {
  struct Query {
    std::uintptr_t base, address;
    bool found = false, executable = false;
  } query{reinterpret_cast<std::uintptr_t>(base), reinterpret_cast<std::uintptr_t>(address)};
  dl_iterate_phdr(
      [](dl_phdr_info* info, std::size_t, void* data) {
        auto* q = static_cast<Query*>(data);
        for (int i = 0; i < info->dlpi_phnum; ++i) {
          const ElfW(Phdr)& segment = info->dlpi_phdr[i];
          const std::uintptr_t start = info->dlpi_addr + segment.p_vaddr;
          if (segment.p_type != PT_LOAD || q->address < start ||
              q->address >= start + segment.p_memsz)
            continue;
          q->found = true;
          q->executable =
              (segment.p_flags & PF_X) != 0 && (info->dlpi_addr == q->base || start == q->base);
          return 1;
        }
        return 0;
      },
      &query);
  return query.found && query.executable;
}

// The function the descriptor alias points to, or why it cannot be called: it must be code of
// the same library (a null alias, or one pointing to data, would crash the call).
std::string alias_target_problem(const void* alias_address, const void* target) {
  if (target == nullptr) return "is null";
  Dl_info alias_info{};
  if (dladdr(alias_address, &alias_info) == 0) return "cannot be inspected";
  if (!in_executable_segment(alias_info.dli_fbase, target))
    return "points to data, not to the function KVLAB_PLUGIN exports";
  return "";
}

// In a child process: loads `file` and reads its descriptor as load_file will.
void probe_one(const std::filesystem::path& file) {
  void* handle = dlopen(file.c_str(), RTLD_LAZY | RTLD_LOCAL);
  if (handle == nullptr) return;  // the parent reports dlopen's reason
  const void* alias = dlsym(handle, kDescriptorSymbol);
  if (alias == nullptr || !descriptor_symbol_problem(alias).empty()) return;
  const void* target = nullptr;
  std::memcpy(&target, alias, sizeof(target));
  if (!alias_target_problem(alias, target).empty()) return;
  using DescriptorFunction = const PluginDescriptor*();
  const PluginDescriptor* d = reinterpret_cast<DescriptorFunction*>(const_cast<void*>(target))();
  if (d == nullptr || d->abi_version != kPluginAbiVersion ||
      d->abi_fingerprint != kPluginAbiFingerprint)
    return;
  (void)descriptor_problem(*d);  // reads every field and string the host reads
}

// Why the child probing a file did not finish it: it hung, a signal killed it, or it exited on
// its own (the dynamic loader's "Inconsistency detected by ld.so" assertion ends the process
// that called dlopen with status 127: in kvlab it would have ended kvlab).
std::string probe_failure(bool hung, int status, int timeout_ms) {
  if (hung)
    return fmt::format("loading it did not finish within {} s (a static initializer that hangs?)",
                       timeout_ms / 1000);
  if (WIFSIGNALED(status))
    return fmt::format(
        "loading it crashed a test process (signal {}: {}): the file is damaged or its "
        "descriptor points to memory it does not own",
        WTERMSIG(status), strsignal(WTERMSIG(status)));
  return fmt::format(
      "loading it ended a test process (exit status {}): the dynamic loader or a static "
      "initializer gave up on the file, which is damaged",
      WEXITSTATUS(status));
}

// Loads each file in a child process first, one child for all of them: a damaged library
// (flipped bits, a crashing or hanging static initializer, a descriptor whose strings point
// nowhere) kills the child, not kvlab. The child says which file it starts on through a pipe;
// after a crash the files left are probed by a new child. Returns each file's problem ("" for
// none; a file that cannot be probed at all gets "", and the in-process checks still run).
std::vector<std::string> probe_in_child(const std::vector<std::filesystem::path>& files,
                                        std::size_t first = 0) {
  std::vector<std::string> problems(files.size());
  if (first >= files.size()) return problems;
  int fds[2];
  if (pipe2(fds, O_CLOEXEC) != 0) return problems;
  std::fflush(nullptr);
  const pid_t child = fork();
  if (child < 0) {
    close(fds[0]);
    close(fds[1]);
    return problems;
  }
  if (child == 0) {
    close(fds[0]);
    for (std::size_t i = first; i < files.size(); ++i) {
      if (write(fds[1], &i, sizeof(i)) != sizeof(i)) _exit(1);
      probe_one(files[i]);
    }
    _exit(0);
  }
  close(fds[1]);
  constexpr int kTimeoutMs = 20000;  // per file
  std::size_t started = first;
  bool hung = false;
  for (pollfd p{fds[0], POLLIN, 0};;) {
    const int ready = poll(&p, 1, kTimeoutMs);
    if (ready == 0) {
      hung = true;
      kill(child, SIGKILL);
      break;
    }
    std::size_t index = 0;
    if (ready < 0 || read(fds[0], &index, sizeof(index)) != sizeof(index)) break;  // done
    started = index;
  }
  close(fds[0]);
  int status = 0;
  waitpid(child, &status, 0);
  if (!hung && WIFEXITED(status) && WEXITSTATUS(status) == 0) return problems;
  problems[started] = probe_failure(hung, status, kTimeoutMs);
  std::vector<std::string> rest = probe_in_child(files, started + 1);
  for (std::size_t i = started + 1; i < files.size(); ++i) problems[i] = std::move(rest[i]);
  return problems;
}

// What is wrong with a descriptor's parameter schema, or "".
std::string params_problem(const PluginDescriptor& d) {
  if (d.param_count > 0 && d.params == nullptr)
    return fmt::format("its params are null but param_count is {}", d.param_count);
  if (d.param_count > 1024)
    return fmt::format("its param_count is {} (at most 1024)", d.param_count);
  for (std::size_t i = 0; i < d.param_count; ++i) {
    if (d.params[i].name == nullptr) return fmt::format("its parameter {} has no name", i);
    if (std::string problem = param_spec_problem(d.params[i]); !problem.empty()) return problem;
    for (std::size_t j = 0; j < i; ++j)
      if (std::strcmp(d.params[i].name, d.params[j].name) == 0)
        return fmt::format("it declares parameter \"{}\" twice", d.params[i].name);
  }
  return "";
}

std::string descriptor_problem(const PluginDescriptor& d) {
  if (d.name == nullptr || d.name[0] == '\0') return "its name is null or empty";
  if (d.description == nullptr) return "its description is null";
  if (d.create == nullptr || d.destroy == nullptr) return "its create or destroy function is null";
  if (std::string problem = params_problem(d); !problem.empty()) return problem;
  switch (d.kind) {
    case PluginKind::kv_allocator:
    case PluginKind::attention_variant:
    case PluginKind::scheduler:
    case PluginKind::backend:
    case PluginKind::router:
    case PluginKind::tier_policy:
    case PluginKind::kv_policy:
    case PluginKind::proposer:
      return "";
  }
  return fmt::format("its kind {} is not one kvlab knows (1-8)",
                     static_cast<std::uint32_t>(d.kind));
}
}  // namespace

PluginRegistry::PluginRegistry(const std::vector<std::filesystem::path>& directories) {
  for (const auto& directory : directories) {
    std::error_code ec;
    if (!std::filesystem::is_directory(directory, ec)) continue;
    std::vector<std::filesystem::path> files;
    for (const auto& entry : std::filesystem::directory_iterator(directory, ec)) {
      const auto name = entry.path().filename().string();
      if (entry.is_regular_file() && name.rfind(kFilePrefix, 0) == 0 &&
          entry.path().extension() == ".so")
        files.push_back(entry.path());
    }
    std::sort(files.begin(), files.end());
    const std::vector<std::string> problems = probe_in_child(files);
    for (std::size_t i = 0; i < files.size(); ++i) load_probed_file(files[i], problems[i]);
  }
}

std::vector<std::filesystem::path> PluginRegistry::default_search_path() {
  std::vector<std::filesystem::path> path;
  std::error_code ec;
  const std::filesystem::path program = boost::dll::program_location(ec);
  if (!ec) {
    const auto bin = program.parent_path();
    path.push_back(bin.parent_path() / "plugins");  // build tree: build/bin/kvlab
    path.push_back(bin.parent_path() / "lib" / "kvlab" /
                   "plugins");  // installed: <prefix>/bin/kvlab
  }
  if (const char* env = std::getenv("KVLAB_PLUGIN_PATH")) {
    std::string list = env;
    std::size_t start = 0;
    while (start <= list.size()) {
      const std::size_t end = std::min(list.find(':', start), list.size());
      if (end > start) path.emplace_back(list.substr(start, end - start));
      start = end + 1;
    }
  }
  return path;
}

void PluginRegistry::load_file(const std::filesystem::path& file) {
  std::error_code ec;
  const auto canonical = std::filesystem::canonical(file, ec);
  load_probed_file(file, ec ? "" : probe_in_child({canonical}).front());
}

void PluginRegistry::load_probed_file(const std::filesystem::path& file,
                                      const std::string& probe_problem) {
  std::error_code ec;
  if (!std::filesystem::exists(file, ec))
    throw Error(fmt::format("plugin file {} does not exist", file.string()));
  const auto canonical = std::filesystem::canonical(file, ec);
  for (const auto& loaded : plugins_)
    if (std::filesystem::equivalent(loaded.file, canonical, ec))
      return;  // same file twice on the path

  if (const std::string problem = elf_problem(canonical); !problem.empty())
    throw Error(fmt::format("cannot load plugin {}: {}", file.string(), problem));
  if (!probe_problem.empty())
    throw Error(fmt::format("cannot load plugin {}: {}", file.string(), probe_problem));
  auto library = std::make_shared<boost::dll::shared_library>();
  boost::dll::fs::error_code load_error;
  library->load(canonical, boost::dll::load_mode::rtld_lazy | boost::dll::load_mode::rtld_local,
                load_error);
  if (load_error)
    throw Error(fmt::format("cannot load plugin {}: {}", file.string(), dlopen_reason(canonical)));
  if (!library->has(kDescriptorSymbol))
    throw Error(fmt::format(
        "{} is not a kvlab plugin: it exports no \"{}\" (build it with KVLAB_PLUGIN(...))",
        file.string(), kDescriptorSymbol));
  // The symbol's address, taken as a byte's: a function's address need not be aligned like the
  // pointer the symbol should be (binding a `const void*&` to it is undefined; UBSan says so).
  if (const std::string problem =
          descriptor_symbol_problem(&library->get<const char>(kDescriptorSymbol));
      !problem.empty())
    throw Error(fmt::format("{} is not a kvlab plugin: \"{}\" {}", file.string(), kDescriptorSymbol,
                            problem));
  const void* alias = &library->get<const char>(kDescriptorSymbol);
  const void* target = nullptr;
  std::memcpy(&target, alias, sizeof(target));
  if (const std::string problem = alias_target_problem(alias, target); !problem.empty())
    throw Error(fmt::format("{} is not a kvlab plugin: \"{}\" {}", file.string(), kDescriptorSymbol,
                            problem));
  using DescriptorFunction = const PluginDescriptor*();
  const PluginDescriptor* descriptor =
      reinterpret_cast<DescriptorFunction*>(const_cast<void*>(target))();
  if (descriptor == nullptr)
    throw Error(fmt::format("plugin {}: descriptor is null", file.string()));
  if (descriptor->abi_version != kPluginAbiVersion)
    throw Error(fmt::format(
        "plugin {} was built for kvlab plugin ABI version {}, this kvlab has ABI version {}: "
        "rebuild the plugin against this kvlab",
        file.string(), descriptor->abi_version, kPluginAbiVersion));
  if (descriptor->abi_fingerprint != kPluginAbiFingerprint)
    throw Error(fmt::format(
        "plugin {} was built against other kvlab headers (type layout fingerprint {:016x}, this "
        "kvlab has {:016x}): a type crossing the plugin boundary changed; rebuild the plugin "
        "against this kvlab",
        file.string(), descriptor->abi_fingerprint, kPluginAbiFingerprint));
  if (const std::string problem = descriptor_problem(*descriptor); !problem.empty())
    throw Error(fmt::format("plugin {} has a broken descriptor: {}", file.string(), problem));
  PluginInfo info;
  info.kind = descriptor->kind;
  info.name = descriptor->name;
  info.description = descriptor->description;
  info.params.assign(descriptor->params, descriptor->params + descriptor->param_count);
  info.file = canonical;
  info.library = library;
  info.descriptor = descriptor;
  for (const auto& other : plugins_)
    if (other.kind == info.kind && other.name == info.name)
      throw Error(fmt::format(
          "two {} plugins are named \"{}\": {} and {} (remove one from the plugin path)",
          plugin_kind_name(info.kind), info.name, other.file.string(), info.file.string()));
  plugins_.push_back(std::move(info));
}

const PluginInfo& PluginRegistry::find(PluginKind kind, std::string_view name) const {
  std::vector<std::string> names;
  for (const auto& info : plugins_) {
    if (info.kind != kind) continue;
    if (info.name == name) return info;
    names.push_back(info.name);
  }
  std::string message = fmt::format("unknown {} plugin \"{}\"", plugin_kind_name(kind), name);
  if (auto near = nearest_name(name, names))
    message += fmt::format(" (did you mean \"{}\"?)", *near);
  message += names.empty()
                 ? fmt::format(
                       "; no {} plugins were found (is the plugin path right? see `kvlab plugins`)",
                       plugin_kind_name(kind))
                 : "; available: " + join_names(names);
  throw Error(message);
}

void* PluginRegistry::create_raw(const PluginInfo& info,
                                 const std::map<std::string, ParamValue, std::less<>>& params,
                                 const PluginContext& context) const {
  const PluginParams validated = validate_plugin_params(info.name, info.params, params);
  char error[1024] = {};
  void* object = nullptr;
  try {  // KVLAB_PLUGIN's create catches everything; a hand-written descriptor may not
    object = info.descriptor->create(validated, context, error, sizeof(error) - 1);
  } catch (const std::exception& e) {
    throw Error(fmt::format("{} plugin \"{}\" ({}) threw from create: {}",
                            plugin_kind_name(info.kind), info.name, info.file.string(), e.what()));
  } catch (...) {
    throw Error(fmt::format(
        "{} plugin \"{}\" ({}) threw something that is not a std::exception from create",
        plugin_kind_name(info.kind), info.name, info.file.string()));
  }
  if (object == nullptr)
    throw Error(fmt::format("{} plugin \"{}\" ({}) could not be created: {}",
                            plugin_kind_name(info.kind), info.name, info.file.string(),
                            error[0] ? error : "no reason given"));
  return object;
}

}  // namespace kvlab

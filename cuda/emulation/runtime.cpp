// The CUDA emulator's scheduler (fibers per block, barriers, warp exchanges) and the subset of
// the CUDA runtime API the kernels and their tests call, on host memory. See
// kvlab/cuda/emulation.hpp for what it shows and what it cannot.
#include <sys/mman.h>
#include <unistd.h>

#include <boost/context/fiber.hpp>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <mutex>
#include <sstream>
#include <vector>

#include "kvlab/cuda/emulation.hpp"

namespace kvlab::cuda::emulation {

thread_local const Coordinates* current = nullptr;

namespace {
namespace ctx = boost::context;

constexpr int kWarpSize = 32;

// Fiber stacks, mapped once per OS thread and reused by every block: each has a guard page
// below it, so a kernel that overflows its stack faults instead of corrupting a neighbour.
class StackPool {
 public:
  static constexpr std::size_t kStackBytes = 256 * 1024;

  ~StackPool() {
    for (void* base : mappings_) munmap(base, kStackBytes + page_bytes());
  }
  ctx::stack_context take() {
    if (free_.empty()) {
      void* base = mmap(nullptr, kStackBytes + page_bytes(), PROT_READ | PROT_WRITE,
                        MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
      if (base == MAP_FAILED) throw std::bad_alloc();
      mprotect(base, page_bytes(), PROT_NONE);
      mappings_.push_back(base);
      free_.push_back(static_cast<char*>(base) + page_bytes() + kStackBytes);
    }
    ctx::stack_context stack;
    stack.sp = free_.back();  // the top: stacks grow down
    stack.size = kStackBytes;
    free_.pop_back();
    return stack;
  }
  void give_back(const ctx::stack_context& stack) { free_.push_back(stack.sp); }

 private:
  static std::size_t page_bytes() { return static_cast<std::size_t>(sysconf(_SC_PAGESIZE)); }
  std::vector<void*> mappings_;
  std::vector<void*> free_;
};

struct PooledStack {
  StackPool* pool;
  ctx::stack_context allocate() { return pool->take(); }
  void deallocate(ctx::stack_context& stack) noexcept { pool->give_back(stack); }
};

enum class State { runnable, at_block_barrier, at_warp_exchange, exited };

struct EmulatedThread {
  Coordinates coordinates;
  ctx::fiber fiber;      // this thread, while the scheduler runs
  ctx::fiber scheduler;  // the scheduler, while this thread runs
  State state = State::runnable;
  unsigned mask = 0;  // of the warp exchange it waits at
  std::uint64_t offered = 0;
  int source_lane = 0;
  std::uint64_t received = 0;
};

struct BlockRun {
  std::vector<EmulatedThread> threads;
  EmulatedThread* running = nullptr;
};

// Stream capture (CUDA graphs): while a capture is open on this thread, launches and cuBLAS
// calls are recorded as work instead of run; a launched graph runs its work in order.
thread_local std::vector<std::function<void()>>* capture = nullptr;

thread_local BlockRun* active_block = nullptr;
thread_local StackPool stacks;
thread_local std::string last_failure;
cudaError_t sticky_error = cudaSuccess;

EmulatedThread& running_thread(const char* what) {
  if (active_block == nullptr || active_block->running == nullptr) {
    std::fprintf(stderr, "kvlab CUDA emulator: %s called outside a kernel\n", what);
    std::abort();
  }
  return *active_block->running;
}

void suspend(EmulatedThread& thread) {
  thread.scheduler = std::move(thread.scheduler).resume();
}

const char* state_name(State s) {
  switch (s) {
    case State::runnable:
      return "runnable";
    case State::at_block_barrier:
      return "__syncthreads";
    case State::at_warp_exchange:
      return "warp shuffle";
    case State::exited:
      return "exited";
  }
  return "?";
}

// The warps whose every lane waits at a shuffle exchange their values and run on. Returns
// whether one did; a lane whose mask is not its warp's full mask is a failure (`failure` set).
bool release_warp_exchanges(BlockRun& block, std::string& failure) {
  const int count = static_cast<int>(block.threads.size());
  bool released = false;
  for (int first = 0; first < count; first += kWarpSize) {
    const int lanes = std::min(kWarpSize, count - first);
    int waiting = 0;
    for (int lane = 0; lane < lanes; ++lane)
      waiting += block.threads[first + lane].state == State::at_warp_exchange;
    if (waiting == 0 || waiting < lanes) continue;
    const unsigned warp_mask = lanes == kWarpSize ? 0xffffffffu : (1u << lanes) - 1u;
    for (int lane = 0; lane < lanes; ++lane) {
      const EmulatedThread& t = block.threads[first + lane];
      if (t.mask == warp_mask) continue;
      std::ostringstream out;
      out << "warp " << first / kWarpSize << " lane " << lane << ": shuffle mask 0x" << std::hex
          << t.mask << " is not the warp's full mask 0x" << warp_mask
          << " (the emulator runs whole warps only)";
      failure = out.str();
      return false;
    }
    for (int lane = 0; lane < lanes; ++lane) {
      EmulatedThread& t = block.threads[first + lane];
      const int source = t.source_lane >= 0 && t.source_lane < lanes ? t.source_lane : lane;
      t.received = block.threads[first + source].offered;
    }
    for (int lane = 0; lane < lanes; ++lane) block.threads[first + lane].state = State::runnable;
    released = true;
  }
  return released;
}

// When every thread still running waits at __syncthreads, they all run on; returns whether so.
bool release_block_barrier(BlockRun& block) {
  bool all_at_block_barrier = true, any_waiting = false;
  for (const EmulatedThread& t : block.threads) {
    if (t.state == State::exited) continue;
    any_waiting = true;
    all_at_block_barrier &= t.state == State::at_block_barrier;
  }
  if (!any_waiting || !all_at_block_barrier) return false;
  for (EmulatedThread& t : block.threads)
    if (t.state == State::at_block_barrier) t.state = State::runnable;
  return true;
}

// What the block's threads wait at when none can be released.
std::string deadlock_message(const BlockRun& block) {
  const int count = static_cast<int>(block.threads.size());
  std::ostringstream out;
  out << "deadlock: the threads of block (" << block.threads[0].coordinates.block_index.x << ","
      << block.threads[0].coordinates.block_index.y << ","
      << block.threads[0].coordinates.block_index.z << ") wait at barriers that cannot release:";
  int shown = 0;
  for (int i = 0; i < count && shown < 8; ++i) {
    const State s = block.threads[i].state;
    if (i > 0 && s == block.threads[i - 1].state) continue;
    out << " thread " << i << " " << state_name(s) << ";";
    ++shown;
  }
  return out.str();
}

// Releases every barrier that can be released; false when none can (a deadlock).
bool release_barriers(BlockRun& block, std::string& failure) {
  if (release_warp_exchanges(block, failure)) return true;
  if (!failure.empty()) return false;
  if (release_block_barrier(block)) return true;
  failure = deadlock_message(block);
  return false;
}

// Runs one block to completion; false (with `failure`) on a deadlock.
bool run_block(BlockRun& block, const std::function<void()>& body, std::string& failure) {
  const int count = static_cast<int>(block.threads.size());
  for (int i = 0; i < count; ++i) {
    EmulatedThread& t = block.threads[i];
    t.state = State::runnable;
    t.fiber =
        ctx::fiber(std::allocator_arg, PooledStack{&stacks}, [&t, &body](ctx::fiber&& scheduler) {
          t.scheduler = std::move(scheduler);
          body();
          t.state = State::exited;
          return std::move(t.scheduler);
        });
  }
  for (;;) {
    bool all_exited = true;
    for (EmulatedThread& t : block.threads) {
      if (t.state == State::runnable) {
        block.running = &t;
        current = &t.coordinates;
        t.fiber = std::move(t.fiber).resume();
      }
      all_exited &= t.state == State::exited;
    }
    block.running = nullptr;
    current = nullptr;
    if (all_exited) return true;
    if (!release_barriers(block, failure)) {
      for (EmulatedThread& t : block.threads) t.fiber = ctx::fiber();  // unwinds their stacks
      return false;
    }
  }
}

cudaError_t fail(cudaError_t error, std::string message) {
  last_failure = std::move(message);
  sticky_error = error;
  std::fprintf(stderr, "kvlab CUDA emulator: %s\n", last_failure.c_str());
  return error;
}

}  // namespace

const std::string& failure_message() {
  return last_failure;
}

void sync_block() {
  EmulatedThread& t = running_thread("__syncthreads");
  t.state = State::at_block_barrier;
  suspend(t);
}

std::uint64_t warp_exchange(unsigned mask, std::uint64_t value, int source_lane) {
  EmulatedThread& t = running_thread("a warp shuffle");
  t.state = State::at_warp_exchange;
  t.mask = mask;
  t.offered = value;
  t.source_lane = source_lane;
  suspend(t);
  return t.received;
}

bool record(std::function<void()> work) {
  if (capture == nullptr) return false;
  capture->push_back(std::move(work));
  return true;
}
bool capturing() {
  return capture != nullptr;
}

namespace {

// The limits a device enforces (compute capability 9.0).
bool valid_launch(dim3 grid, dim3 block, std::uint64_t threads) {
  const bool grid_ok = grid.x > 0 && grid.y > 0 && grid.z > 0 && grid.x <= 0x7fffffffu &&
                       grid.y <= 65535 && grid.z <= 65535;
  return grid_ok && threads > 0 && threads <= 1024 && block.z <= 64;
}

// Each thread of the block at `block_index` gets its coordinates (x fastest).
void place_threads(BlockRun& run, dim3 block_index, dim3 block, dim3 grid) {
  std::size_t i = 0;
  for (unsigned tz = 0; tz < block.z; ++tz)
    for (unsigned ty = 0; ty < block.y; ++ty)
      for (unsigned tx = 0; tx < block.x; ++tx, ++i)
        run.threads[i].coordinates = {{tx, ty, tz}, block_index, block, grid};
}

}  // namespace

cudaError_t launch(dim3 grid, dim3 block, const std::function<void()>& thread_body) {
  if (record([grid, block, thread_body] { launch(grid, block, thread_body); })) return cudaSuccess;
  last_failure.clear();
  const std::uint64_t threads = std::uint64_t{block.x} * block.y * block.z;
  if (!valid_launch(grid, block, threads)) {
    std::ostringstream out;
    out << "invalid launch configuration: grid (" << grid.x << "," << grid.y << "," << grid.z
        << "), block (" << block.x << "," << block.y << "," << block.z << ")";
    return fail(cudaErrorInvalidConfiguration, out.str());
  }
  if (active_block != nullptr) return fail(cudaErrorLaunchFailure, "a launch inside a kernel");
  BlockRun run;
  run.threads.resize(threads);
  active_block = &run;
  std::string failure;
  bool ok = true;
  for (unsigned z = 0; z < grid.z && ok; ++z)
    for (unsigned y = 0; y < grid.y && ok; ++y)
      for (unsigned x = 0; x < grid.x && ok; ++x) {
        place_threads(run, {x, y, z}, block, grid);
        ok = run_block(run, thread_body, failure);
      }
  active_block = nullptr;
  if (!ok) return fail(cudaErrorLaunchFailure, failure);
  return cudaSuccess;
}

}  // namespace kvlab::cuda::emulation

// ---- The CUDA runtime API subset, on host memory ------------------------------------------
namespace {

using kvlab::cuda::emulation::sticky_error;

// Live "device" allocations: start -> bytes, so copies and frees are checked like cudart does.
struct Allocations {
  std::mutex mutex;
  std::map<const char*, std::size_t> live;

  bool contains(const void* pointer, std::size_t bytes) {
    const char* p = static_cast<const char*>(pointer);
    std::lock_guard lock(mutex);
    auto it = live.upper_bound(p);
    if (it == live.begin()) return false;
    --it;
    return p >= it->first && p + bytes <= it->first + it->second;
  }
};
Allocations& allocations() {
  static Allocations instance;
  return instance;
}

cudaError_t copy(void* dst, const void* src, std::size_t count, cudaMemcpyKind kind) {
  const bool device_dst = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
  const bool device_src = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
  if (kind == cudaMemcpyDefault || kind == cudaMemcpyHostToHost) {
    std::memmove(dst, src, count);
    return cudaSuccess;
  }
  if ((device_dst && !allocations().contains(dst, count)) ||
      (device_src && !allocations().contains(src, count))) {
    std::fprintf(stderr,
                 "kvlab CUDA emulator: cudaMemcpy of %zu bytes outside a device allocation\n",
                 count);
    return cudaErrorInvalidValue;
  }
  std::memmove(dst, src, count);
  return cudaSuccess;
}

}  // namespace

extern "C" {

cudaError_t cudaMalloc(void** pointer, size_t size) {
  if (pointer == nullptr) return cudaErrorInvalidValue;
  // cudaMalloc aligns to at least 256 bytes. The block is exactly `size` bytes, so valgrind or
  // ASan see an access one byte past it.
  void* memory = nullptr;
  if (posix_memalign(&memory, 256, std::max<std::size_t>(size, 1)) != 0)
    return cudaErrorMemoryAllocation;
  std::lock_guard lock(allocations().mutex);
  allocations().live[static_cast<const char*>(memory)] = size;
  *pointer = memory;
  return cudaSuccess;
}

cudaError_t cudaFree(void* pointer) {
  if (pointer == nullptr) return cudaSuccess;
  std::lock_guard lock(allocations().mutex);
  auto it = allocations().live.find(static_cast<const char*>(pointer));
  if (it == allocations().live.end()) return cudaErrorInvalidValue;
  allocations().live.erase(it);
  std::free(pointer);
  return cudaSuccess;
}

cudaError_t cudaMallocHost(void** pointer, size_t size) {
  *pointer = std::malloc(std::max<std::size_t>(size, 1));  // "pinned" host memory
  return *pointer == nullptr ? cudaErrorMemoryAllocation : cudaSuccess;
}
cudaError_t cudaFreeHost(void* pointer) {
  std::free(pointer);
  return cudaSuccess;
}

// Streams: the emulator runs every launch and copy before returning, so a stream only has to
// exist; each gets a distinct handle.
cudaError_t cudaStreamCreate(cudaStream_t* stream) {
  *stream = reinterpret_cast<cudaStream_t>(new char);
  return cudaSuccess;
}
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
  delete reinterpret_cast<char*>(stream);
  return cudaSuccess;
}

// Copies and synchronization inside a capture: the emulator refuses them (a GPU refuses the
// synchronizing ones and would record the rest; the backend keeps all of them outside).
cudaError_t cudaMemcpy(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind) {
  if (kvlab::cuda::emulation::capturing()) return cudaErrorStreamCaptureUnsupported;
  return copy(dst, src, count, kind);
}
cudaError_t cudaMemcpyAsync(void* dst, const void* src, size_t count, enum cudaMemcpyKind kind,
                            cudaStream_t) {
  if (kvlab::cuda::emulation::capturing()) return cudaErrorStreamCaptureUnsupported;
  return copy(dst, src, count, kind);
}
cudaError_t cudaMemset(void* pointer, int value, size_t count) {
  if (!allocations().contains(pointer, count)) return cudaErrorInvalidValue;
  std::memset(pointer, value, count);
  return cudaSuccess;
}
cudaError_t cudaMemsetAsync(void* pointer, int value, size_t count, cudaStream_t) {
  return cudaMemset(pointer, value, count);
}

cudaError_t cudaDeviceSynchronize(void) {
  if (kvlab::cuda::emulation::capturing()) return cudaErrorStreamCaptureUnsupported;
  return sticky_error;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  if (kvlab::cuda::emulation::capturing()) return cudaErrorStreamCaptureUnsupported;
  return sticky_error;
}

cudaError_t cudaStreamBeginCapture(cudaStream_t, enum cudaStreamCaptureMode) {
  using kvlab::cuda::emulation::capture;
  if (capture != nullptr) return cudaErrorIllegalState;
  capture = new std::vector<std::function<void()>>();
  return cudaSuccess;
}
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t* graph) {
  using kvlab::cuda::emulation::capture;
  if (capture == nullptr) return cudaErrorIllegalState;
  *graph = reinterpret_cast<cudaGraph_t>(capture);
  capture = nullptr;
  return cudaSuccess;
}
cudaError_t cudaGraphInstantiate(cudaGraphExec_t* exec, cudaGraph_t graph, unsigned long long) {
  const auto* work = reinterpret_cast<const std::vector<std::function<void()>>*>(graph);
  *exec = reinterpret_cast<cudaGraphExec_t>(new std::vector<std::function<void()>>(*work));
  return cudaSuccess;
}
cudaError_t cudaGraphLaunch(cudaGraphExec_t exec, cudaStream_t) {
  if (kvlab::cuda::emulation::capturing()) return cudaErrorStreamCaptureUnsupported;
  for (const auto& work : *reinterpret_cast<const std::vector<std::function<void()>>*>(exec))
    work();
  return sticky_error;
}
cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
  delete reinterpret_cast<std::vector<std::function<void()>>*>(graph);
  return cudaSuccess;
}
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t exec) {
  delete reinterpret_cast<std::vector<std::function<void()>>*>(exec);
  return cudaSuccess;
}
cudaError_t cudaGetLastError(void) {
  const cudaError_t error = sticky_error;
  sticky_error = cudaSuccess;
  return error;
}
cudaError_t cudaPeekAtLastError(void) {
  return sticky_error;
}

const char* cudaGetErrorString(cudaError_t error) {
  switch (error) {
    case cudaSuccess:
      return "no error";
    case cudaErrorInvalidValue:
      return "invalid argument";
    case cudaErrorMemoryAllocation:
      return "out of memory";
    case cudaErrorInvalidConfiguration:
      return "invalid configuration argument";
    case cudaErrorLaunchFailure:
      return "unspecified launch failure (emulator: see its message on stderr)";
    default:
      return "CUDA error (emulator)";
  }
}

cudaError_t cudaGetDeviceCount(int* count) {
  *count = 1;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int device) {
  return device == 0 ? cudaSuccess : cudaErrorInvalidDevice;
}
cudaError_t cudaGetDeviceProperties(struct cudaDeviceProp* properties, int device) {
  if (device != 0) return cudaErrorInvalidDevice;
  *properties = cudaDeviceProp{};
  std::snprintf(properties->name, sizeof(properties->name), "kvlab CUDA emulator (CPU)");
  properties->major = 0;
  properties->minor = 0;
  properties->totalGlobalMem = std::size_t{1} << 32;
  properties->warpSize = 32;
  properties->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}

}  // extern "C"

#pragma once
// The KV pool: host memory for the keys and values of every layer, divided into slots (one
// slot = one token's K and V in every layer). Allocators decide which slots a sequence owns;
// the backend reads and writes them through a KvView.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

namespace kvlab {

struct KvPoolShape {
  std::int64_t layers = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t slots = 0;
  std::int64_t slot_width() const {
    return kv_heads * head_dim;
  }  // floats per slot per layer, K or V
};

// Layout: keys and values each (layers, slots, kv_heads, head_dim), fp32, row-major.
// A pool without storage (KvStorage::none) is bookkeeping only: allocators hand out its slots
// as usual, key()/value() must not be called (the simulated backend computes nothing).
enum class KvStorage { host, none };

// Where K/V live when not in this host pool: a GPU backend's device pool, indexed by the same
// slots. The pool forwards slot copies to it (an allocator's move or copy-on-write) and the
// engine swaps through it. Host buffers are (layers, 2 [K, V], slots.size(), slot_width) fp32.
class KvDeviceStorage {
 public:
  virtual ~KvDeviceStorage() = default;
  virtual void copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) = 0;
  virtual void download(const std::vector<std::int64_t>& slots, float* host) = 0;
  virtual void upload(const std::vector<std::int64_t>& slots, const float* host) = 0;
};

class KvPool {
 public:
  explicit KvPool(const KvPoolShape& shape, KvStorage storage = KvStorage::host);
  bool has_storage() const { return keys_ != nullptr; }
  // A device that holds this pool's K/V (the pool itself then has KvStorage::none); nullptr
  // to detach. Not owned.
  void attach_device(KvDeviceStorage* device) { device_ = device; }
  KvDeviceStorage* device() const { return device_; }

  const KvPoolShape& shape() const { return shape_; }
  // (kv_heads * head_dim) floats of one slot in one layer.
  float* key(std::int64_t layer, std::int64_t slot) { return keys_.get() + offset(layer, slot); }
  float* value(std::int64_t layer, std::int64_t slot) {
    return values_.get() + offset(layer, slot);
  }
  const float* key(std::int64_t layer, std::int64_t slot) const {
    return keys_.get() + offset(layer, slot);
  }
  const float* value(std::int64_t layer, std::int64_t slot) const {
    return values_.get() + offset(layer, slot);
  }
  // Bytes one slot holds over all layers, K and V (as stored here: fp32).
  std::int64_t bytes_per_slot() const;
  // Copies `count` slots starting at `source` to `destination` in every layer, K and V
  // (ranges may overlap). Returns the bytes copied.
  std::int64_t copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count);

 private:
  std::int64_t offset(std::int64_t layer, std::int64_t slot) const {
    return (layer * shape_.slots + slot) * shape_.slot_width();
  }
  KvPoolShape shape_;
  KvDeviceStorage* device_ = nullptr;
  struct Free {
    void operator()(float* p) const { std::free(p); }
  };
  // Zeroed, on 2 MiB boundaries and advised as huge pages (Linux): attention reads one head's
  // slice of every slot row, a stride that would otherwise miss the TLB on every row.
  using Buffer = std::unique_ptr<float[], Free>;
  static Buffer allocate(std::int64_t floats);
  Buffer keys_;    // (layers, slots, kv_heads, head_dim)
  Buffer values_;  // (layers, slots, kv_heads, head_dim)
};

// A contiguous run of slots holding consecutive tokens of one sequence.
struct KvExtent {
  std::int64_t start_slot = 0;
  std::int64_t length = 0;
};

// Where a sequence's KV lives: its tokens [first_position, first_position + length()) in order,
// as a list of extents. Tokens before first_position were released (sliding window).
struct KvView {
  std::vector<KvExtent> extents;
  std::int64_t first_position = 0;

  std::int64_t length() const;
  std::int64_t end_position() const { return first_position + length(); }
  // The slot of token `position` (first_position <= position < end_position()).
  std::int64_t slot_of(std::int64_t position) const;
};

}  // namespace kvlab

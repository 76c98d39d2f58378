#pragma once
// The KV pool: host memory for the keys and values of every layer, divided into slots (one
// slot = one token's K and V in every layer). Allocators decide which slots a sequence owns;
// the backend reads and writes them through a KvView.
#include <cstddef>
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "kvlab/dtype.hpp"
#include "kvlab/kv/kivi_groups.hpp"

namespace kvlab {

struct KvPoolShape {
  std::int64_t layers = 0;
  std::int64_t kv_heads = 0;
  std::int64_t head_dim = 0;
  std::int64_t slots = 0;
  // f32, f16, bf16 (rounded to nearest even on write), fp8 (e4m3) or a quantized row format
  // (int8, q8_0, q4_0, q4_1, int2: each head row of each token quantized on write, its scales
  // beside it): K's rows, and V's unless value_dtype says otherwise.
  DType dtype = DType::dtype_f32;
  // Every head row holds H x (its K or V), H the orthonormal Walsh-Hadamard matrix of head_dim
  // (a power of two): a rotation spreads a few large channels over all of them before rounding
  // (QuaRot; llama.cpp's attn_rot for quantized caches). The backend rotates its queries the
  // same way (scores are unchanged, H orthonormal) and its attention output back (H = H^-1).
  bool hadamard_rotated = false;
  // A KIVI pool (kivi2, kivi4): the residual length R, a multiple of 32 (>= 0): the backend seals
  // a group once it is older than a sequence's newest R tokens (seal_open_groups).
  std::int64_t kivi_residual = kKiviResidualDefault;
  // V's rows in a dtype of their own (llama.cpp's -ctv beside -ctk: K usually needs more bits
  // than V); nullopt: dtype. KIVI sets K and V together.
  std::optional<DType> value_dtype = std::nullopt;
  // The dtype of K's rows, or of V's when `value`.
  DType dtype_of(bool value) const { return value && value_dtype ? *value_dtype : dtype; }
  bool splits_dtypes() const { return dtype_of(true) != dtype; }
  // Values per slot per layer, K or V.
  std::int64_t slot_width() const { return kv_heads * head_dim; }
  // Bytes of one head's row (head_dim values, scales included) and of one slot's row (every
  // head) in one layer, of K or (`value`) V.
  std::int64_t head_row_bytes(bool value) const {
    return dtype_row_bytes(dtype_of(value), head_dim);
  }
  std::int64_t slot_row_bytes(bool value) const { return kv_heads * head_row_bytes(value); }
};

// Whether a host KV pool holds `dtype` (the cpu backend reads every one of them in place), and
// their names for messages: "f32, f16, bf16, ...".
bool kv_pool_holds(DType dtype);
std::string kv_pool_dtype_names();
// The dtype named `name` when a KV pool holds it; else kvlab::Error "`what` must be one of ...".
DType kv_pool_dtype(std::string_view name, std::string_view what);

// Key rows in a block format (q8_0, q4_0, q4_1, int2) keep each RoPE pair's two channels (d and
// d + head_dim / 2, Hugging Face's rotate-half order) in one block, as llama.cpp's GGUF order of K
// does: block b holds channels [16b, 16b + 16) then [half + 16b, half + 16b + 16). Which channels
// share a scale decides the error: the low-frequency pairs carry K's large values, and a block
// that mixes them with high-frequency ones rounds those coarsely (q4_0 on SmolLM2: +8.8%
// perplexity in channel order, +2.6% paired). Value rows and the other dtypes: channel order.
bool pairs_key_channels(DType dtype);
// Where channel d of a key row of `head_dim` values sits in the stored row (pairs_key_channels).
inline std::int64_t paired_key_position(std::int64_t d, std::int64_t head_dim) {
  const std::int64_t half = head_dim / 2, second = d >= half ? 1 : 0, c = d - second * half;
  return c / 16 * 32 + second * 16 + c % 16;
}
// A key head row (head_dim values) to / from its stored bytes: convert_to_f32 /
// convert_from_f32 in the stored channel order.
void key_row_to_f32(DType dtype, const std::byte* row, std::int64_t head_dim, float* out);
void key_row_from_f32(DType dtype, const float* values, std::int64_t head_dim, std::byte* row);

// Layout: keys and values each (layers, slots, kv_heads, head row) row-major, a head row being
// head_dim values in K's or V's dtype (with its scales, for a quantized format).
// A pool without storage (KvStorage::none) is bookkeeping only: allocators hand out its slots
// as usual, key()/value() must not be called (the simulated backend computes nothing).
enum class KvStorage { host, none };

// Where K/V live when not in this host pool: a GPU backend's device pool, indexed by the same
// slots. The pool forwards slot copies to it (an allocator's move or copy-on-write) and the
// engine swaps through it. Host buffers are (layers, 2 [K, V], slots.size(), host_row_bytes):
// fp32 rows (slot_width floats) for K/V the device keeps in a float dtype, or the rows of the
// host pool's own quantized dtype (slot_row_bytes: fp8, int8), moved exactly.
class KvDeviceStorage {
 public:
  virtual ~KvDeviceStorage() = default;
  virtual void copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count) = 0;
  virtual std::int64_t host_row_bytes() const = 0;
  virtual void download(const std::vector<std::int64_t>& slots, std::byte* host) = 0;
  virtual void upload(const std::vector<std::int64_t>& slots, const std::byte* host) = 0;
};

class KvPool {
 public:
  explicit KvPool(const KvPoolShape& shape, KvStorage storage = KvStorage::host);
  bool has_storage() const { return keys_ != nullptr; }
  // Allocates the host storage a pool made with KvStorage::none lacks (zeroed): how a backend
  // that computes on the host (cpu) brings K/V to the bookkeeping pool a serving stack made
  // before it. Nothing when it has storage. Throws kvlab::Error for a dtype the host pool cannot
  // hold (f32, f16, bf16) or more memory than the machine has.
  void provide_host_storage();
  // A device that holds this pool's K/V (the pool itself then has KvStorage::none); nullptr
  // to detach. Not owned.
  void attach_device(KvDeviceStorage* device) { device_ = device; }
  KvDeviceStorage* device() const { return device_; }

  const KvPoolShape& shape() const { return shape_; }
  // One slot's row in one layer (kv_heads head rows, slot_row_bytes(value)), in K's or V's dtype.
  std::byte* key_bytes(std::int64_t layer, std::int64_t slot) {
    return keys_.get() + offset(layer, slot, false);
  }
  std::byte* value_bytes(std::int64_t layer, std::int64_t slot) {
    return values_.get() + offset(layer, slot, true);
  }
  const std::byte* key_bytes(std::int64_t layer, std::int64_t slot) const {
    return keys_.get() + offset(layer, slot, false);
  }
  const std::byte* value_bytes(std::int64_t layer, std::int64_t slot) const {
    return values_.get() + offset(layer, slot, true);
  }
  // The same as floats: an f32 pool only.
  float* key(std::int64_t layer, std::int64_t slot) {
    return as_floats(key_bytes(layer, slot), false);
  }
  float* value(std::int64_t layer, std::int64_t slot) {
    return as_floats(value_bytes(layer, slot), true);
  }
  const float* key(std::int64_t layer, std::int64_t slot) const {
    return as_floats(const_cast<std::byte*>(key_bytes(layer, slot)), false);
  }
  const float* value(std::int64_t layer, std::int64_t slot) const {
    return as_floats(const_cast<std::byte*>(value_bytes(layer, slot)), true);
  }
  // One slot row of one layer (K, or V when `value`) widened to / rounded from fp32, whatever
  // the dtype: slot_width() floats (a quantized format quantizes each head's row on its own).
  void read_row(std::int64_t layer, std::int64_t slot, bool value, float* out) const;
  void write_row(std::int64_t layer, std::int64_t slot, bool value, const float* row);
  // Head `head`'s rows of `count` consecutive slots (K, or V when `value`) widened to fp32: out
  // (count, head_dim), row-major.
  void read_head_rows(std::int64_t layer, std::int64_t slot, std::int64_t count, bool value,
                      std::int64_t head, float* out) const;
  // Bytes one slot holds over all layers, K and V, in the pool's dtype.
  std::int64_t bytes_per_slot() const;

  // A KIVI pool (kivi2, kivi4; kvlab/kv/kivi_groups.hpp) quantizes keys per channel over groups
  // of 32 slots, [32g, 32g + 32). A group is open from the write of one of its rows until its
  // owner seals it (seal_open_groups: the backend, once the group's 32 tokens are older than the
  // sequence's newest kivi_residual, after the forward that read them): until then its K and V
  // rows of each layer live in fp16 beside the pool (KIVI's full-precision residual) and its slot
  // rows are unused. Writes come one thread at a time, in slot order within a group, as a paged
  // allocator with blocks of a multiple of 32 slots makes them; a write into a sealed group
  // reopens it (its rows dequantized). Copies and swaps carry open groups.
  //
  // The fp16 slot row (kv_heads x head_dim values) of an open group's row; nullptr when its
  // group is sealed (or this is not a KIVI pool).
  const std::uint16_t* open_row(std::int64_t layer, std::int64_t slot, bool value) const;
  // Quantizes the open (layer, K/V) halves of the groups holding any of `count` slots from
  // `first_slot` into their slot rows (every row of them written): keys per channel, values per
  // token. Nothing for groups that are not open (or other pools).
  void seal_open_groups(std::int64_t first_slot, std::int64_t count);
  // Forgets the open groups wholly inside [first_slot, first_slot + count): their slots were
  // freed (an allocator's released block). Nothing for other pools.
  void discard_open_groups(std::int64_t first_slot, std::int64_t count);
  // The fp16 residual held now, and one open group's: 2 x layers x 32 x slot_width x 2 bytes
  // (bytes_per_open_group works on a pool without storage too).
  std::int64_t open_group_bytes() const;
  std::int64_t bytes_per_open_group() const;
  // Copies `count` slots starting at `source` to `destination` in every layer, K and V
  // (ranges may overlap). Returns the bytes copied.
  std::int64_t copy_slots(std::int64_t source, std::int64_t destination, std::int64_t count);
  // Moves one slot's K and V of every layer to `destination` (a KV policy's compaction within a
  // sequence): copy_slots, or in a KIVI pool, whose groups cannot be split, the rows as they read
  // (dequantized) written into the destination's group, which reopens and is sealed again by its
  // owner: what moves there is rounded twice. Returns the bytes moved.
  std::int64_t move_slot(std::int64_t source, std::int64_t destination);

 private:
  std::int64_t offset(std::int64_t layer, std::int64_t slot, bool value) const {  // in bytes
    return (layer * shape_.slots + slot) * shape_.slot_row_bytes(value);
  }
  float* as_floats(std::byte* p, bool value) const;  // checks the dtype is f32
  // An open KIVI group: rows (layers, 2 [K, V], 32, slot_width) fp16, and which (layer, K/V)
  // halves are still open (the others sealed in the slot rows).
  struct OpenGroup {
    std::vector<std::uint16_t> rows;
    std::vector<std::uint8_t> open;  // (layers, 2)
  };
  bool kivi() const { return dtype_is_kivi(shape_.dtype) && has_storage(); }  // K and V both
  std::uint16_t* group_row(OpenGroup& group, std::int64_t layer, bool value, std::int64_t r) const;
  OpenGroup& reopen(std::int64_t group, std::int64_t layer, bool value, std::int64_t r);
  void fill_from_slots(OpenGroup& open, std::int64_t group, std::int64_t layer, bool value) const;
  void seal(std::int64_t group, std::int64_t layer, bool value);
  void release_group(std::int64_t group);
  void kivi_write_row(std::int64_t layer, std::int64_t slot, bool value, const float* row);
  void kivi_read_row(std::int64_t layer, std::int64_t slot, bool value, float* out) const;
  void kivi_read_head_rows(std::int64_t layer, std::int64_t slot, std::int64_t count, bool value,
                           std::int64_t head, float* out) const;
  void kivi_copy_groups(std::int64_t source, std::int64_t destination, std::int64_t count);
  KvPoolShape shape_;
  KvDeviceStorage* device_ = nullptr;
  struct Release {
    // (a constructor, not a member initialiser: unique_ptr asks before KvPool is complete)
    Release() noexcept : mapped_bytes(0) {}
    explicit Release(std::size_t mapped) noexcept : mapped_bytes(mapped) {}
    void operator()(std::byte* p) const;
    std::size_t mapped_bytes;  // 0: from the heap (under AddressSanitizer, which then checks it)
  };
  // Zeroed, on 2 MiB boundaries and advised as huge pages (Linux): attention reads one head's
  // slice of every slot row, a stride that would otherwise miss the TLB on every row. Mapped
  // anonymous memory: the kernel zeroes a page when a slot on it is first written, so a run pays
  // for the slots it uses, not for the whole pool up front (a 1.5 GB pool's memset took ~1 s).
  using Buffer = std::unique_ptr<std::byte[], Release>;
  static Buffer allocate(std::int64_t bytes);
  Buffer keys_;                                           // (layers, slots, kv_heads, head row)
  Buffer values_;                                         // (layers, slots, kv_heads, head row)
  std::vector<std::unique_ptr<OpenGroup>> open_groups_;   // (slots / 32): null when not open
  std::vector<std::unique_ptr<OpenGroup>> spare_groups_;  // released, for reuse
  std::int64_t open_count_ = 0;
};

// A contiguous run of slots holding consecutive tokens of one sequence.
struct KvExtent {
  std::int64_t start_slot = 0;
  std::int64_t length = 0;
};

// Where a sequence's KV lives: its tokens in position order, as a list of extents. Without
// `positions` they are [first_position, first_position + length()), consecutive; tokens before
// first_position were released (sliding window). With `positions` (a KV policy dropped some,
// kvlab/kv_policy.hpp) they are the listed ones: one increasing position per token, in order,
// positions.front() == first_position.
struct KvView {
  std::vector<KvExtent> extents;
  std::int64_t first_position = 0;
  std::vector<std::int64_t> positions;  // (length()) or empty: consecutive

  std::int64_t length() const;
  bool has_holes() const { return !positions.empty(); }
  std::int64_t end_position() const {
    return positions.empty() ? first_position + length() : positions.back() + 1;
  }
  // The position of the view's index-th token (0 <= index < length()).
  std::int64_t position_at(std::int64_t index) const {
    return positions.empty() ? first_position + index : positions[static_cast<std::size_t>(index)];
  }
  // The index of the first token at or after `position` (length() when none is).
  std::int64_t index_at_or_after(std::int64_t position) const;
  // The slot of the view's index-th token.
  std::int64_t slot_at(std::int64_t index) const;
  // The slot of token `position`, which the view holds.
  std::int64_t slot_of(std::int64_t position) const;
};

}  // namespace kvlab

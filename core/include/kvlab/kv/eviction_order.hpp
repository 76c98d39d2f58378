#pragma once
// What leaves first: one priority function for everything in kvlab that gives up cached KV
// (SGLang's EvictionStrategy.get_priority): the block pool choosing which free cached block to
// reuse, each KV tier choosing which block to give up (the lru and shared_first tier policies),
// and the draft proposer choosing whose draft KV to drop. Each keeps the facts of what it may
// give up; eviction_priority turns them into a key, and the smallest key leaves first.
//
// The three seams that decide what leaves, each by what it moves (docs/architecture.md):
//   the pool's reuse order   picks a free cached block to reuse (paged's `reuse_order`)
//   a tier policy            moves blocks between tiers (KvTierPolicy, kvlab/kv/kv_tiers.hpp)
//   a KV policy              drops positions from a sequence (KvPolicy, kvlab/kv_policy.hpp)
// The first two order what they give up with this function.
#include <compare>
#include <cstdint>
#include <optional>
#include <string_view>
#include <vector>

namespace kvlab {

// What an evictor knows of one thing it may give up.
struct EvictionFacts {
  std::uint64_t last_use = 0;  // its owner's clock when it was last freed, hit or asked for
  std::int64_t uses = 0;       // sequences that have held it (a prefix block's sharers)
};

enum class EvictionOrder : std::uint8_t {
  lru,           // the least recently used first
  least_shared,  // the fewest uses first, the least recently used among equals
};
const char* eviction_order_name(EvictionOrder order);  // "lru", "least_shared"
std::optional<EvictionOrder> eviction_order_named(std::string_view name);

// Compared lexicographically; the smallest leaves first.
struct EvictionPriority {
  std::int64_t first = 0;
  std::uint64_t then = 0;
  auto operator<=>(const EvictionPriority&) const = default;
};

inline EvictionPriority eviction_priority(EvictionOrder order, const EvictionFacts& facts) {
  switch (order) {
    case EvictionOrder::least_shared:
      return {facts.uses, facts.last_use};
    case EvictionOrder::lru:
      break;
  }
  return {0, facts.last_use};
}

// Entries [0, capacity) that may leave, by eviction_priority (the smaller id first among equal
// keys), no allocation after construction. Under lru the entries are a list sorted by priority,
// each add placed from the newest end: what is added or used now is the newest, so every change
// is O(1) (the block pool frees and re-hits a block on almost every prompt); under another order
// an indexed binary heap, O(log n) a change.
class EvictionQueue {
 public:
  explicit EvictionQueue(std::int64_t capacity = 0, EvictionOrder order = EvictionOrder::lru);

  EvictionOrder order() const { return order_; }
  std::int64_t size() const { return size_; }
  bool contains(std::int32_t id) const { return position_[index(id)] >= 0; }
  const EvictionFacts& facts(std::int32_t id) const { return facts_[index(id)]; }

  void add(std::int32_t id, const EvictionFacts& facts);     // not in the queue
  void update(std::int32_t id, const EvictionFacts& facts);  // in the queue: its facts changed
  void remove(std::int32_t id);                              // in the queue
  std::int32_t victim();  // removed: the first to leave (never on an empty queue)

 private:
  static std::size_t index(std::int32_t id) { return static_cast<std::size_t>(id); }
  bool before(std::int32_t a, std::int32_t b) const;
  void set(std::int32_t id, const EvictionFacts& facts);
  void link(std::int32_t id);  // into the sorted list, walking from its newest end
  void unlink(std::int32_t id);
  void place(std::size_t at, std::int32_t id);
  void sift_up(std::size_t at);
  void sift_down(std::size_t at);

  EvictionOrder order_;
  bool listed_;  // a sorted list (lru), else a heap
  std::int64_t size_ = 0;
  std::vector<std::int32_t> previous_, next_;  // the list: per id, -1 at its ends
  std::int32_t head_ = -1, tail_ = -1;         // head: the first to leave
  std::vector<std::int32_t> heap_;             // the heap: ids, the first to leave at the root
  std::vector<std::int32_t> position_;  // per id: its place in heap_ (listed: 0), -1 when absent
  std::vector<EvictionFacts> facts_;    // per id
  std::vector<EvictionPriority> priority_;  // per id: eviction_priority of its facts
};

}  // namespace kvlab

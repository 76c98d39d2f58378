#include "kvlab/kv/eviction_order.hpp"

#include <utility>

namespace kvlab {

const char* eviction_order_name(EvictionOrder order) {
  return order == EvictionOrder::least_shared ? "least_shared" : "lru";
}

std::optional<EvictionOrder> eviction_order_named(std::string_view name) {
  for (EvictionOrder order : {EvictionOrder::lru, EvictionOrder::least_shared})
    if (name == eviction_order_name(order)) return order;
  return std::nullopt;
}

EvictionQueue::EvictionQueue(std::int64_t capacity, EvictionOrder order)
    : order_(order),
      listed_(order == EvictionOrder::lru),
      position_(static_cast<std::size_t>(capacity), -1),
      facts_(static_cast<std::size_t>(capacity)),
      priority_(static_cast<std::size_t>(capacity)) {
  if (listed_) {
    previous_.assign(static_cast<std::size_t>(capacity), -1);
    next_.assign(static_cast<std::size_t>(capacity), -1);
  } else {
    heap_.reserve(static_cast<std::size_t>(capacity));
  }
}

bool EvictionQueue::before(std::int32_t a, std::int32_t b) const {
  const auto order = priority_[index(a)] <=> priority_[index(b)];
  return order < 0 || (order == 0 && a < b);
}

void EvictionQueue::set(std::int32_t id, const EvictionFacts& facts) {
  facts_[index(id)] = facts;
  priority_[index(id)] = eviction_priority(order_, facts);
}

void EvictionQueue::link(std::int32_t id) {
  std::int32_t after = tail_;  // the entry id goes after: the last one that leaves before it
  while (after >= 0 && before(id, after)) after = previous_[index(after)];
  const std::int32_t then = after >= 0 ? next_[index(after)] : head_;
  previous_[index(id)] = after;
  next_[index(id)] = then;
  (after >= 0 ? next_[index(after)] : head_) = id;
  (then >= 0 ? previous_[index(then)] : tail_) = id;
  position_[index(id)] = 0;
}

void EvictionQueue::unlink(std::int32_t id) {
  const std::int32_t before_it = previous_[index(id)], after_it = next_[index(id)];
  (before_it >= 0 ? next_[index(before_it)] : head_) = after_it;
  (after_it >= 0 ? previous_[index(after_it)] : tail_) = before_it;
  position_[index(id)] = -1;
}

void EvictionQueue::place(std::size_t at, std::int32_t id) {
  heap_[at] = id;
  position_[index(id)] = static_cast<std::int32_t>(at);
}

void EvictionQueue::sift_up(std::size_t at) {
  const std::int32_t id = heap_[at];
  while (at > 0) {
    const std::size_t parent = (at - 1) / 2;
    if (!before(id, heap_[parent])) break;
    place(at, heap_[parent]);
    at = parent;
  }
  place(at, id);
}

void EvictionQueue::sift_down(std::size_t at) {
  const std::int32_t id = heap_[at];
  for (;;) {
    std::size_t child = 2 * at + 1;
    if (child >= heap_.size()) break;
    if (child + 1 < heap_.size() && before(heap_[child + 1], heap_[child])) ++child;
    if (!before(heap_[child], id)) break;
    place(at, heap_[child]);
    at = child;
  }
  place(at, id);
}

void EvictionQueue::add(std::int32_t id, const EvictionFacts& facts) {
  set(id, facts);
  ++size_;
  if (listed_) return link(id);
  heap_.push_back(id);
  sift_up(heap_.size() - 1);
}

void EvictionQueue::update(std::int32_t id, const EvictionFacts& facts) {
  if (listed_) {
    unlink(id);
    set(id, facts);
    return link(id);
  }
  set(id, facts);
  sift_up(static_cast<std::size_t>(position_[index(id)]));
  sift_down(static_cast<std::size_t>(position_[index(id)]));
}

void EvictionQueue::remove(std::int32_t id) {
  --size_;
  if (listed_) return unlink(id);
  const auto at = static_cast<std::size_t>(position_[index(id)]);
  position_[index(id)] = -1;
  const std::int32_t last = heap_.back();
  heap_.pop_back();
  if (last == id) return;
  place(at, last);
  sift_up(at);
  sift_down(static_cast<std::size_t>(position_[index(last)]));
}

std::int32_t EvictionQueue::victim() {
  const std::int32_t id = listed_ ? head_ : heap_.front();
  remove(id);
  return id;
}

}  // namespace kvlab

// Allocator properties over long seeded random operation sequences. A shadow "backend" writes,
// for every token, a value that depends only on the token prefix (as real KV does) into the
// slot the allocator gave; every live sequence must then read back its own prefix values.
// Sharing a slot is only legal when the prefixes agree (prefix caching, fork before divergence).
#include <gtest/gtest.h>

#include <random>
#include <set>
#include <unordered_map>

#include "kvlab/plugin/plugin_loader.hpp"
#include "test_util.hpp"

namespace kvlab {
namespace {

struct AllocatorCase {
  std::string name;
  std::map<std::string, ParamValue, std::less<>> params;
  bool releases_window;  // exercise release_before (only the paged allocator frees early)
};

void PrintTo(const AllocatorCase& c, std::ostream* os) {
  *os << c.name;
}

// Value of the token at `position` given the whole prefix: exact in fp32 (< 2^23).
float prefix_value(const std::vector<std::int32_t>& tokens, std::size_t position) {
  std::uint64_t h = 1469598103934665603ULL;
  for (std::size_t i = 0; i <= position; ++i)
    h = (h ^ static_cast<std::uint64_t>(tokens[i] + 1)) * 1099511628211ULL;
  return static_cast<float>(h % (1u << 23));
}

class AllocatorProperties : public ::testing::TestWithParam<AllocatorCase> {
 protected:
  static constexpr std::int64_t kSlots = 256;
  AllocatorProperties() : registry_({KVLAB_PLUGIN_DIR}), pool_({1, 1, 1, kSlots}) {
    context_.pool = &pool_;
    context_.max_seq_len = 48;
    allocator_ =
        registry_.create<PluginKind::kv_allocator>(GetParam().name, GetParam().params, context_);
  }

  void write_from(SequenceId id, std::int64_t from) {
    const KvView view = allocator_->view(id);
    const auto& tokens = tokens_[id];
    for (std::int64_t p = std::max(from, view.first_position); p < view.end_position(); ++p)
      *pool_.key(0, view.slot_of(p)) = prefix_value(tokens, static_cast<std::size_t>(p));
    allocator_->mark_computed(id, static_cast<std::int64_t>(tokens.size()));
  }

  void check_invariants() {
    const KvAllocatorStats s = allocator_->stats();
    ASSERT_EQ(s.used + s.reserved_unused + s.last_block_slack + s.free, s.capacity)
        << "used " << s.used << " reserved " << s.reserved_unused << " slack " << s.last_block_slack
        << " free " << s.free;
    ASSERT_GE(s.unusable_free, 0);
    ASSERT_LE(s.unusable_free, s.free);
    ASSERT_EQ(s.live_sequences, static_cast<std::int64_t>(tokens_.size()));
    std::unordered_map<std::int64_t, std::pair<SequenceId, float>>
        owner;  // slot -> (sequence, value)
    std::int64_t distinct_tokens = 0;
    for (const auto& [id, tokens] : tokens_) {
      const KvView view = allocator_->view(id);
      ASSERT_EQ(view.end_position(), static_cast<std::int64_t>(tokens.size())) << "sequence " << id;
      for (std::int64_t p = view.first_position; p < view.end_position(); ++p) {
        const std::int64_t slot = view.slot_of(p);
        ASSERT_GE(slot, 0);
        ASSERT_LT(slot, kSlots);
        const float expected = prefix_value(tokens, static_cast<std::size_t>(p));
        ASSERT_EQ(*pool_.key(0, slot), expected)
            << "sequence " << id << " position " << p << " slot " << slot;
        auto [it, inserted] = owner.try_emplace(slot, id, expected);
        if (inserted)
          ++distinct_tokens;
        else
          ASSERT_EQ(it->second.second, expected)
              << "slot " << slot << " shared by different prefixes";
      }
    }
    ASSERT_EQ(s.used, distinct_tokens) << "used must count each live slot once";
  }

  PluginRegistry registry_;
  KvPool pool_;
  PluginContext context_;
  PluginObject<KvAllocator> allocator_;
  std::map<SequenceId, std::vector<std::int32_t>> tokens_;
};

TEST_P(AllocatorProperties, RandomOperationSequences) {
  for (unsigned seed : {1u, 2u, 3u}) {
    std::mt19937 rng(seed);
    auto uniform = [&](int lo, int hi) { return std::uniform_int_distribution<int>(lo, hi)(rng); };
    SequenceId next_id = 0;
    const std::vector<std::vector<std::int32_t>> prefixes{
        {5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17, 18, 19, 20},
        {1, 2, 3, 4, 5, 6, 7, 8, 9, 10}};
    int full_pool_refusals = 0;
    for (int op = 0; op < 3000; ++op) {
      const int kind = uniform(0, 9);
      if (kind <= 2 || tokens_.empty()) {  // admit a sequence, often with a shared prefix
        std::vector<std::int32_t> prompt;
        if (uniform(0, 1)) prompt = prefixes[static_cast<std::size_t>(uniform(0, 1))];
        const int extra = uniform(1, 20);
        for (int i = 0; i < extra; ++i) prompt.push_back(uniform(0, 3));
        const AllocateRequest request{next_id, prompt,
                                      static_cast<std::int64_t>(prompt.size()) + 10};
        const KvAllocatorStats before = allocator_->stats();
        const std::int64_t planned = allocator_->slots_to_allocate(request);
        const bool can = allocator_->can_allocate(request);
        const auto result = allocator_->allocate(request);
        ASSERT_EQ(can, result.has_value()) << "can_allocate must predict allocate";
        if (!result) {
          ++full_pool_refusals;
          const KvAllocatorStats after = allocator_->stats();
          ASSERT_EQ(after.used, before.used);
          ASSERT_EQ(after.free, before.free);
          continue;
        }
        ASSERT_LE(result->cached_tokens, static_cast<std::int64_t>(prompt.size()) - 1);
        ASSERT_EQ(before.free - allocator_->stats().free, planned)
            << "slots_to_allocate must be what allocate takes";
        ASSERT_EQ(allocator_->slots_held(next_id) > 0, true);
        tokens_[next_id] = prompt;
        write_from(next_id, result->cached_tokens);
        ++next_id;
      } else if (kind <= 5) {  // append 1-3 tokens to a random sequence
        auto it = std::next(tokens_.begin(), uniform(0, static_cast<int>(tokens_.size()) - 1));
        std::vector<std::int32_t> more(static_cast<std::size_t>(uniform(1, 3)));
        for (auto& t : more) t = uniform(0, 3);
        const std::int64_t old_length = static_cast<std::int64_t>(it->second.size());
        const std::int64_t free_before = allocator_->stats().free;
        const std::int64_t planned =
            allocator_->slots_to_append(it->first, static_cast<std::int64_t>(more.size()));
        const bool can = allocator_->can_append(it->first, static_cast<std::int64_t>(more.size()));
        const bool done = allocator_->append(it->first, more);
        ASSERT_EQ(can, done) << "can_append must predict append";
        if (!done) {
          ++full_pool_refusals;
          continue;
        }
        it->second.insert(it->second.end(), more.begin(), more.end());
        if (GetParam().name != "dynamic")  // dynamic may grow by more than asked (growth factor)
          ASSERT_EQ(free_before - allocator_->stats().free, planned)
              << "slots_to_append must be what append takes";
        else
          ASSERT_GE(free_before - allocator_->stats().free, planned);
        write_from(it->first, old_length);
        if (GetParam().releases_window && uniform(0, 1))
          allocator_->release_before(it->first, old_length - 8);
      } else if (kind <= 8) {  // finish a random sequence
        auto it = std::next(tokens_.begin(), uniform(0, static_cast<int>(tokens_.size()) - 1));
        allocator_->free(it->first);
        tokens_.erase(it);
      } else {  // fork (parallel sampling)
        auto it = std::next(tokens_.begin(), uniform(0, static_cast<int>(tokens_.size()) - 1));
        if (allocator_->view(it->first).first_position > 0)
          continue;  // released prefix: nothing to share
        if (allocator_->fork(it->first, next_id)) tokens_[next_id] = tokens_[it->first];
        ++next_id;
      }
      check_invariants();
      if (HasFatalFailure()) return;
    }
    EXPECT_GT(full_pool_refusals, 0) << "the workload should have filled the pool at least once";
    for (const auto& [id, tokens] : tokens_) allocator_->free(id);
    tokens_.clear();
    const KvAllocatorStats s = allocator_->stats();
    EXPECT_EQ(s.used, 0);
    EXPECT_EQ(s.free, s.capacity) << "every slot (and every reference count) returns";
    EXPECT_EQ(s.unusable_free, 0) << "freed runs coalesce";
    EXPECT_EQ(s.live_sequences, 0);
  }
}

INSTANTIATE_TEST_SUITE_P(
    Allocators, AllocatorProperties,
    ::testing::Values(
        AllocatorCase{"static", {}, false}, AllocatorCase{"dynamic", {}, false},
        AllocatorCase{"dynamic", {{"growth", 1.0}}, false},
        AllocatorCase{"paged", {{"block_size", std::int64_t{4}}}, true},
        AllocatorCase{"paged", {{"block_size", std::int64_t{16}}, {"prefix_caching", false}}, true},
        AllocatorCase{"paged", {{"block_size", std::int64_t{1}}}, false}),
    [](const auto& info) {
      std::string name = info.param.name;
      for (const auto& [key, value] : info.param.params)
        name += "_" + key + "_" + param_value_to_string(value);
      for (auto& ch : name)
        if (!std::isalnum(static_cast<unsigned char>(ch))) ch = '_';
      return name;
    });

TEST(PagedAllocator, CopyOnWriteNeverChangesTheOtherSequence) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  KvPool pool({1, 1, 1, 64});
  PluginContext context;
  context.pool = &pool;
  auto paged = registry.create<PluginKind::kv_allocator>("paged", {{"block_size", std::int64_t{4}}},
                                                         context);
  const std::vector<std::int32_t> prompt{1, 2, 3, 4, 5, 6};  // one full block + 2 tokens
  ASSERT_TRUE(paged->allocate({0, prompt, 20}));
  for (std::int64_t p = 0; p < 6; ++p)
    *pool.key(0, paged->view(0).slot_of(p)) = static_cast<float>(100 + p);
  ASSERT_TRUE(paged->fork(0, 1));
  EXPECT_EQ(paged->view(0).slot_of(5), paged->view(1).slot_of(5));  // shared until written
  const std::vector<std::int32_t> token{9};
  ASSERT_TRUE(
      paged->append(1, token));  // child writes position 6 in the shared last block: copy first
  const KvView parent = paged->view(0), child = paged->view(1);
  EXPECT_EQ(parent.slot_of(0), child.slot_of(0));  // the full block stays shared
  EXPECT_NE(parent.slot_of(5), child.slot_of(5));
  *pool.key(0, child.slot_of(6)) = -1.0f;
  for (std::int64_t p = 0; p < 6; ++p) {
    EXPECT_EQ(*pool.key(0, parent.slot_of(p)), static_cast<float>(100 + p));
    EXPECT_EQ(*pool.key(0, child.slot_of(p)), static_cast<float>(100 + p));  // copied
  }
  EXPECT_EQ(paged->stats().bytes_copied, 2 * pool.bytes_per_slot());
}

TEST(PagedAllocator, PrefixHitsAndLruEviction) {
  const PluginRegistry registry({KVLAB_PLUGIN_DIR});
  KvPool pool({1, 1, 1, 16});  // 4 blocks of 4
  PluginContext context;
  context.pool = &pool;
  auto paged = registry.create<PluginKind::kv_allocator>("paged", {{"block_size", std::int64_t{4}}},
                                                         context);
  const std::vector<std::int32_t> a{1, 2, 3, 4, 5, 6, 7, 8, 9};
  ASSERT_EQ(paged->allocate({0, a, 9})->cached_tokens, 0);
  paged->mark_computed(0, 9);
  paged->free(0);  // blocks stay cached
  EXPECT_EQ(paged->stats().cached_free, 8);
  const auto again = paged->allocate({1, a, 9});
  ASSERT_TRUE(again);
  EXPECT_EQ(again->cached_tokens, 8);  // two full blocks; the last token is always computed
  EXPECT_EQ(paged->stats().prefix_hit_tokens, 8);
  EXPECT_EQ(paged->stats().prefix_query_tokens, 18);
  paged->free(1);
  const std::vector<std::int32_t> other{7, 7, 7, 7, 7, 7, 7,
                                        7, 7, 7, 7, 7, 7, 7};  // needs all 4 blocks
  ASSERT_TRUE(paged->allocate({2, other, 14}));
  EXPECT_EQ(paged->stats().evictions, 2);
  EXPECT_EQ(paged->stats().cached_free, 0);
}

}  // namespace
}  // namespace kvlab

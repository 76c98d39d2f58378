// kvlab view's map of a paged pool: a function of the block pool and the tables holding it.
#include <algorithm>

#include "kvlab/kv/block_table.hpp"

namespace kvlab {
namespace {

void add_run(std::vector<KvSlotRun>& runs, const KvSlotRun& run) {
  if (!runs.empty()) {
    KvSlotRun& last = runs.back();
    if (last.start + last.length == run.start && last.owner == run.owner &&
        last.state == run.state) {
      last.length += run.length;
      return;
    }
  }
  runs.push_back(run);
}

// Block b's runs, merged into the last run when they continue it.
void add_block_runs(std::vector<KvSlotRun>& runs, const BlockPool& pool, BlockId b,
                    SequenceId holder, bool copied) {
  const std::int64_t size = pool.block_size();
  const std::int64_t start = std::int64_t{b} * size;
  const std::int32_t holders = pool.ref_count(b);
  if (holders == 0) {
    if (pool.hash_of(b) != 0) add_run(runs, {start, size, -1, KvSlotState::cached});
    return;
  }
  const KvSlotState state = holders > 1 ? KvSlotState::shared
                            : copied    ? KvSlotState::copied
                                        : KvSlotState::used;
  const std::int64_t fill = std::clamp<std::int64_t>(pool.fill(b), 0, size);
  if (fill > 0) add_run(runs, {start, fill, holder, state});
  if (fill < size) add_run(runs, {start + fill, size - fill, holder, KvSlotState::slack});
}

// Block b, index k of a table with dropped positions, slot by slot: the slots whose positions
// it keeps are live (shared with a fork that holds the block too), the dropped and unwritten
// ones slack.
void add_holey_block_runs(std::vector<KvSlotRun>& runs, const BlockPool& pool, BlockId b,
                          SequenceId id, const BlockTable& t, std::int64_t k) {
  const std::int64_t size = pool.block_size();
  const KvSlotState live = pool.ref_count(b) > 1 ? KvSlotState::shared : KvSlotState::used;
  for (std::int64_t j = 0; j < size; ++j) {
    const std::int64_t index = k * size + j;
    const bool held = index < t.slots && t.slot_positions[static_cast<std::size_t>(index)] >= 0;
    add_run(runs, {std::int64_t{b} * size + j, 1, id, held ? live : KvSlotState::slack});
  }
}

}  // namespace

void draw_block_pool(const BlockPool& pool, std::span<const HeldTable> tables,
                     const std::vector<bool>& copied, KvPoolMap& map) {
  struct Holder {
    SequenceId id = -1;
    const BlockTable* table = nullptr;
    std::int64_t index = 0;  // the block's index in the table
  };
  std::vector<Holder> holder(static_cast<std::size_t>(pool.blocks()));
  for (const auto& [id, t] : tables)
    for (std::size_t k = 0; k < t->blocks.size(); ++k)
      if (t->blocks[k] >= 0)
        holder[static_cast<std::size_t>(t->blocks[k])] = {id, t, static_cast<std::int64_t>(k)};
  for (BlockId b = 0; b < pool.blocks(); ++b) {
    const Holder& h = holder[static_cast<std::size_t>(b)];
    if (h.table != nullptr && h.table->dropped_positions())
      add_holey_block_runs(map.runs, pool, b, h.id, *h.table, h.index);
    else
      add_block_runs(map.runs, pool, b, h.id, copied[static_cast<std::size_t>(b)]);
  }
}

}  // namespace kvlab

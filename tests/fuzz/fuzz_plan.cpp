// libFuzzer: scheduler plans as a hostile plugin could return them, fed to apply_plan through
// plan_problem for several steps in a row. Each input byte string is a run: 8-24 requests on a
// paged allocator of 256 slots, then plans decoded from the bytes (ids a little outside the
// table, any token count, any preemption mode). A plan plan_problem accepts may still be one the
// allocator refuses (it was not planned with plan_work): that must be a kvlab::Error too.
// Anything else (a crash, an assertion, another exception, a sanitizer report) is a finding.
#include <cstdint>
#include <cstdlib>
#include <memory>
#include <vector>

#include "kvlab/engine/apply.hpp"
#include "kvlab/engine/plan_check.hpp"
#include "kvlab/error.hpp"
#include "kvlab/model_config.hpp"
#include "kvlab/plugin/plugin_loader.hpp"
#include "kvlab/workload/workload.hpp"

namespace {

struct Bytes {
  const std::uint8_t* data;
  std::size_t size, at = 0;
  bool empty() const { return at >= size; }
  std::uint8_t next() { return at < size ? data[at++] : 0; }
};

const kvlab::PluginRegistry& registry() {
  static const kvlab::PluginRegistry r({KVLAB_PLUGIN_DIR});
  return r;
}

kvlab::StepPlan decode_plan(Bytes& in, std::int64_t requests) {
  kvlab::StepPlan plan;
  const int entries = in.next() % 8;
  for (int e = 0; e < entries; ++e) {
    const std::uint8_t kind = in.next(), id_byte = in.next(), value = in.next();
    const kvlab::RequestId id = static_cast<kvlab::RequestId>(id_byte % (requests + 4)) - 2;
    if (kind % 3 == 0)
      plan.work.push_back({id, static_cast<std::int64_t>(value % 48) - 2});
    else if (kind % 3 == 1)
      plan.preempt.push_back({id, static_cast<kvlab::PreemptMode>(value % 3)});
    else
      plan.deferred.push_back({id, value % 2 ? "kv_full" : "max_batch"});
  }
  plan.pad_finished = (in.next() & 1) != 0;
  return plan;
}

}  // namespace

extern "C" int LLVMFuzzerTestOneInput(const std::uint8_t* data, std::size_t size) {
  Bytes in{data, size};
  const kvlab::ModelConfig model = kvlab::model_preset("tiny");
  kvlab::KvPool pool({model.num_hidden_layers, model.num_key_value_heads, model.head_dim, 256},
                     kvlab::KvStorage::none);
  kvlab::PluginContext context{&pool, &model, model.max_position_embeddings};
  auto allocator = registry().create<kvlab::PluginKind::kv_allocator>(
      "paged", {{"block_size", std::int64_t{16}}}, context);
  std::vector<kvlab::WorkloadRequest> requests(8 + in.next() % 17);
  for (std::size_t i = 0; i < requests.size(); ++i) {
    requests[i].id = static_cast<std::int64_t>(i);
    requests[i].arrival_s = static_cast<double>(in.next() % 4);
    requests[i].prompt.assign(1 + in.next() % 40, static_cast<std::int32_t>(i % 5));
    requests[i].output_tokens = 1 + in.next() % 8;
  }
  kvlab::RequestTable table(requests, false);
  kvlab::ApplyOptions options;
  options.rules.context = model.max_position_embeddings;
  options.pool = &pool;
  options.swap_slots = 64;
  kvlab::EventLog log;
  std::vector<kvlab::RequestId> held;
  for (std::int64_t step = 0; step < 16 && !in.empty(); ++step) {
    while (table.next_arrival() && table.at(*table.next_arrival()).arrival_s <= step)
      table.arrive();
    const kvlab::StepPlan plan = decode_plan(in, static_cast<std::int64_t>(requests.size()));
    if (!kvlab::plan_problem(plan, table).empty()) continue;  // refused before it touches state
    try {
      const kvlab::AppliedPlan applied =
          kvlab::apply_plan(plan, step, table, *allocator, options, log);
      const std::vector<std::int32_t> sampled(applied.batch.size(), 3);
      kvlab::apply_tokens(applied, sampled, static_cast<double>(step), table, *allocator, options,
                          log, &held);
    } catch (const kvlab::Error&) {
      return 0;  // a promise the allocator was never asked to make: a clear error, run over
    }
  }
  return 0;
}

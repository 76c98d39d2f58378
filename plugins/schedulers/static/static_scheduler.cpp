// static: the seed's static batching baseline. A batch is formed only when nothing runs, and
// runs until its last request finishes; requests that arrive meanwhile wait for the next batch.
// With padding (the default) a finished request stays in the batch, its KV held and its row
// priced every step, as Hugging Face generate() and FasterTransformer run a batch.
#include "kvlab/plugin.hpp"
#include "kvlab/scheduler.hpp"

namespace {

class StaticScheduler final : public kvlab::Scheduler {
 public:
  StaticScheduler(const kvlab::PluginParams& params, const kvlab::PluginContext&)
      : max_batch_(params.integer("max_batch")), padding_(params.boolean("padding")) {}
  kvlab::StepPlan schedule(const kvlab::SchedulerInput& input) override {
    return kvlab::schedule_static(input, max_batch_, padding_);
  }

 private:
  std::int64_t max_batch_;
  bool padding_;
};

const kvlab::ParamSpec kParams[] = {
    {"max_batch", kvlab::ParamType::param_integer, "requests per batch", "8", 1, 1 << 20},
    {"padding", kvlab::ParamType::param_boolean,
     "finished requests stay as padding (KV held, row priced) until the batch ends; false: "
     "they leave at once",
     "true", 0, 1},
};

}  // namespace

KVLAB_PLUGIN(kvlab::PluginKind::scheduler, StaticScheduler, "static",
             "static batching: a batch forms when idle and runs to completion (the baseline)",
             kParams)

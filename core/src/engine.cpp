#include "kvlab/engine.hpp"

#include <fmt/format.h>

#include <algorithm>
#include <chrono>
#include <map>
#include <nlohmann/json.hpp>
#include <thread>
#include <unordered_map>

#include "kvlab/error.hpp"
#include "kvlab/sampling.hpp"

namespace kvlab {
namespace {

// Sampling needs finite logits; NaN or inf means the backend (or the weights) broke: stop the run
// with the request and step rather than emit token 0 with a null logprob.
void throw_if_non_finite(std::span<const float> row, RequestId id, std::int64_t step) {
  if (auto bad = first_non_finite(row))
    throw Error(fmt::format(
        "request {}, step {}: the backend's logits hold {} at token id {}; the model's weights or "
        "the backend produced non-finite values, so no token can be sampled",
        id, step, row[*bad], *bad));
}

struct LiveRequest {
  LiveRequest(std::size_t submitted_index, const WorkloadRequest& request,
              const SamplingParams& sampling)
      : index(submitted_index), source(&request), tokens(request.prompt), sampler(sampling) {}
  std::size_t index = 0;  // into the submitted list
  const WorkloadRequest* source = nullptr;
  std::vector<std::int32_t> tokens;  // prompt + generated
  std::int64_t computed = 0;         // tokens whose KV is in the pool
  std::int64_t allocated = 0;        // tokens with a slot
  std::int64_t generated = 0;
  std::int64_t admitted_step = -1;
  Sampler sampler;
  bool needs_recompute = false;  // no-cache variant: rebuild the whole sequence next step
  // Swapped out: KV of positions [swap_first, computed) waits in `swap` (layers, K then V, tokens,
  // width).
  bool swapped = false;
  std::int64_t swap_first = 0;
  std::vector<float> swap;
};

// Copies the KV of positions [first, end) between the pool (through `view`) and a host buffer.
std::int64_t copy_kv(KvPool& pool, const KvView& view, std::int64_t first, std::int64_t end,
                     std::vector<float>& buffer, bool to_host) {
  const KvPoolShape& shape = pool.shape();
  const std::int64_t width = shape.slot_width(), tokens = end - first;
  const std::int64_t bytes =
      2 * shape.layers * tokens * width * static_cast<std::int64_t>(sizeof(float));
  if (KvDeviceStorage* device = pool.device()) {  // the K/V live on a GPU
    std::vector<std::int64_t> slots;
    for (std::int64_t p = first; p < end; ++p) slots.push_back(view.slot_of(p));
    if (to_host) {
      buffer.assign(static_cast<std::size_t>(2 * shape.layers * tokens * width), 0.0f);
      device->download(slots, buffer.data());
    } else {
      device->upload(slots, buffer.data());
    }
    return bytes;
  }
  if (!pool.has_storage()) return bytes;  // bookkeeping only (the simulated backend)
  if (to_host) buffer.assign(static_cast<std::size_t>(2 * shape.layers * tokens * width), 0.0f);
  for (std::int64_t layer = 0; layer < shape.layers; ++layer)
    for (std::int64_t p = first; p < end; ++p) {
      const std::int64_t slot = view.slot_of(p);
      float* k = buffer.data() + ((2 * layer) * tokens + (p - first)) * width;
      float* v = buffer.data() + ((2 * layer + 1) * tokens + (p - first)) * width;
      if (to_host) {
        std::copy_n(pool.key(layer, slot), width, k);
        std::copy_n(pool.value(layer, slot), width, v);
      } else {
        std::copy_n(k, width, pool.key(layer, slot));
        std::copy_n(v, width, pool.value(layer, slot));
      }
    }
  return 2 * shape.layers * tokens * width * static_cast<std::int64_t>(sizeof(float));
}

}  // namespace

Engine::Engine(Backend& backend, KvAllocator& allocator, Scheduler& scheduler,
               EngineOptions options)
    : backend_(backend),
      allocator_(allocator),
      scheduler_(scheduler),
      options_(std::move(options)) {}

EngineResult Engine::run(const std::vector<WorkloadRequest>& submitted) {
  EngineResult result;
  result.requests.resize(submitted.size());
  result.tokens.resize(submitted.size());
  const bool offline = options_.clock == EngineClock::offline;
  std::vector<std::size_t> arrival_order(submitted.size());
  for (std::size_t i = 0; i < submitted.size(); ++i) arrival_order[i] = i;
  auto arrival_of = [&](std::size_t i) { return offline ? 0.0 : submitted[i].arrival_s; };
  std::stable_sort(arrival_order.begin(), arrival_order.end(),
                   [&](std::size_t a, std::size_t b) { return arrival_of(a) < arrival_of(b); });

  std::map<RequestId, LiveRequest> live;  // waiting + running, by request id (= index)
  std::unordered_map<RequestId, std::string>
      last_deferral;  // why the scheduler last left it waiting
  std::vector<RequestId> waiting, running;
  std::size_t next_arrival = 0, done = 0;
  double now = 0;
  std::int64_t step = 0, idle_steps = 0;
  std::int64_t swap_used = 0;  // tokens in the host swap pool
  const std::int64_t capacity = allocator_.stats().capacity;

  const bool wall = options_.clock == EngineClock::wall;
  const auto wall_start = std::chrono::steady_clock::now();
  auto wall_now = [&] {
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - wall_start).count();
  };
  std::int64_t evictions_seen = allocator_.stats().evictions;
  auto event = [&](const char* kind, RequestId id, const std::string& reason = {}) {
    nlohmann::json e = {{"step", step}, {"t", now}, {"event", kind}, {"request", id}};
    if (!reason.empty()) e["reason"] = reason;
    result.events.push_back(e.dump());
  };
  auto finish = [&](RequestId id) {
    allocator_.free(id);
    result.requests[static_cast<std::size_t>(id)].finish_s = now;
    live.erase(id);
    ++done;
  };

  while (done < submitted.size()) {
    // Arrivals up to now; requests that can never fit are rejected with the reason.
    while (next_arrival < arrival_order.size() && arrival_of(arrival_order[next_arrival]) <= now) {
      const std::size_t i = arrival_order[next_arrival++];
      const WorkloadRequest& w = submitted[i];
      RequestTimeline& timeline = result.requests[i];
      timeline.id = static_cast<std::int64_t>(i);
      timeline.priority = w.priority;
      timeline.prompt_tokens = static_cast<std::int64_t>(w.prompt.size());
      timeline.arrival_s = arrival_of(i);
      const std::int64_t total = static_cast<std::int64_t>(w.prompt.size()) + w.output_tokens;
      std::string reason;
      if (w.prompt.empty())
        reason = "empty prompt";
      else if (total > options_.max_seq_len)
        reason = fmt::format("prompt {} + max tokens {} exceed the context of {}", w.prompt.size(),
                             w.output_tokens, options_.max_seq_len);
      else {
        const std::vector<std::int32_t> whole(static_cast<std::size_t>(total),
                                              -1);  // no prefix hits
        if (allocator_.slots_to_allocate({static_cast<RequestId>(i), whole, total}) > capacity)
          reason =
              fmt::format("prompt {} + max tokens {} need more KV than the pool holds ({} slots)",
                          w.prompt.size(), w.output_tokens, capacity);
      }
      if (!reason.empty()) {
        timeline.rejected = true;
        timeline.reject_reason = reason;
        event("reject", static_cast<RequestId>(i), reason);
        ++done;
        continue;
      }
      SamplingParams sampling = w.sampling;
      sampling.max_tokens = static_cast<std::int32_t>(w.output_tokens);
      LiveRequest request(i, w, sampling);
      live.emplace(static_cast<RequestId>(i), std::move(request));
      waiting.push_back(static_cast<RequestId>(i));
    }
    if (done == submitted.size()) break;
    if (waiting.empty() && running.empty()) {  // idle until the next arrival
      now = arrival_of(arrival_order[next_arrival]);
      if (wall) {  // really wait for it
        std::this_thread::sleep_until(wall_start + std::chrono::duration<double>(now));
        now = wall_now();
      }
      continue;
    }

    // 1. plan
    const auto step_start = std::chrono::steady_clock::now();
    std::vector<ScheduledRequest> waiting_view, running_view;
    auto view_of = [&](RequestId id) {
      const LiveRequest& r = live.at(id);
      ScheduledRequest v;
      v.id = id;
      v.arrival_s = result.requests[r.index].arrival_s;
      v.priority = r.source->priority;
      v.tokens = static_cast<std::int64_t>(r.tokens.size());
      v.computed_tokens = r.computed;
      v.generated = r.generated;
      v.max_new_tokens = r.source->output_tokens;
      v.oracle_remaining = r.source->output_tokens - r.generated;
      v.admitted_step = r.admitted_step;
      v.token_ids = r.tokens;
      v.swapped = r.swapped;
      return v;
    };
    for (RequestId id : waiting) waiting_view.push_back(view_of(id));
    for (RequestId id : running) running_view.push_back(view_of(id));
    const StepPlan plan = scheduler_.schedule({waiting_view, running_view, &allocator_, step});

    // 2. apply
    StepRecord record;
    record.step = step;
    record.start_s = now;
    std::int64_t swap_bytes = 0;
    for (RequestId id : plan.preempt) {
      LiveRequest& r = live.at(id);
      RequestTimeline& timeline = result.requests[r.index];
      if (plan.swap_preempted && options_.pool != nullptr && options_.caches_kv && r.computed > 0) {
        const KvView view = allocator_.view(id);
        const std::int64_t first = view.first_position, tokens = r.computed - first;
        if (swap_used + tokens <= options_.swap_slots) {
          const std::int64_t bytes = copy_kv(*options_.pool, view, first, r.computed, r.swap, true);
          swap_bytes += bytes;
          timeline.swapped_bytes += bytes;
          swap_used += tokens;
          r.swapped = true;
          r.swap_first = first;
          allocator_.free(id);
          ++timeline.preemptions;
          r.admitted_step = -1;
          std::erase(running, id);
          waiting.push_back(id);
          ++record.preempted;
          event("swap_out", id, fmt::format("tokens={}", tokens));
          continue;
        }
        event("swap_full", id,
              fmt::format("swap pool holds {} of {} tokens", swap_used, options_.swap_slots));
      }
      allocator_.free(id);
      ++timeline.preemptions;
      timeline.recomputed_tokens += r.computed;
      r.computed = 0;
      r.admitted_step = -1;
      std::erase(running, id);
      waiting.push_back(id);
      ++record.preempted;
      event("preempt", id, "kv_full");
    }
    std::unordered_map<RequestId, std::int64_t> chunks;
    for (const auto& c : plan.prefill) chunks[c.id] = c.tokens;
    for (const auto& d : plan.deferred) {  // logged when the reason is new for the request, not
                                           // every step it keeps waiting for the same reason
      auto [it, inserted] = last_deferral.try_emplace(d.id, d.reason);
      if (!inserted && it->second == d.reason) continue;
      it->second = d.reason;
      event("defer", d.id, d.reason);
    }
    for (RequestId id : plan.admit) {
      LiveRequest& r = live.at(id);
      const std::int64_t length = static_cast<std::int64_t>(r.tokens.size());
      const auto allocation =
          allocator_.allocate({id, r.tokens, length + (r.source->output_tokens - r.generated)});
      if (!allocation) {  // the plan's estimate was optimistic (fragmentation): try next step
        chunks.erase(id);
        event("defer", id, "kv_full_at_apply");
        continue;
      }
      last_deferral.erase(id);  // a later deferral (after a preemption) is news again
      r.allocated = length;
      r.admitted_step = step;
      if (r.swapped) {  // bring the KV back; prefix-cache hits already hold theirs
        const KvView view = allocator_.view(id);
        const std::int64_t tokens = r.computed - r.swap_first;
        const std::int64_t from = std::max(r.swap_first, allocation->cached_tokens);
        if (from < r.computed) {
          std::vector<float> part;
          if (from == r.swap_first ||
              (!options_.pool->has_storage() && options_.pool->device() == nullptr)) {
            part = std::move(r.swap);
          } else {  // skip the leading positions the cache already serves
            const std::int64_t width = options_.pool->shape().slot_width(),
                               layers = options_.pool->shape().layers;
            const std::int64_t keep = r.computed - from;
            part.resize(static_cast<std::size_t>(2 * layers * keep * width));
            for (std::int64_t half = 0; half < 2 * layers; ++half)
              std::copy_n(r.swap.data() + (half * tokens + (from - r.swap_first)) * width,
                          keep * width, part.data() + half * keep * width);
          }
          const std::int64_t bytes = copy_kv(*options_.pool, view, from, r.computed, part, false);
          swap_bytes += bytes;
          result.requests[r.index].swapped_bytes += bytes;
        }
        swap_used -= tokens;
        r.swap.clear();
        r.swapped = false;
        allocator_.mark_computed(id, r.computed);
        if (options_.window) allocator_.release_before(id, length - *options_.window);
        event("swap_in", id, fmt::format("tokens={}", tokens));
      } else {
        r.computed = options_.caches_kv ? allocation->cached_tokens : 0;
      }
      std::erase(waiting, id);
      running.push_back(id);
      RequestTimeline& timeline = result.requests[r.index];
      if (!timeline.first_scheduled_s) timeline.first_scheduled_s = now;
      event("admit", id,
            allocation->cached_tokens > 0
                ? fmt::format("prefix_hit_tokens={}", allocation->cached_tokens)
                : "");
    }
    std::vector<RequestId> decodes;
    for (RequestId id : plan.decode) {
      LiveRequest& r = live.at(id);
      if (r.needs_recompute) {  // no cache: drop the KV, recompute the whole sequence this step
        allocator_.free(id);
        const std::int64_t length = static_cast<std::int64_t>(r.tokens.size());
        if (!allocator_.allocate({id, r.tokens, length})) {
          r.computed = 0;
          r.admitted_step = -1;
          std::erase(running, id);
          waiting.push_back(id);
          event("preempt", id, "no_room_to_recompute");
          continue;
        }
        result.requests[r.index].recomputed_tokens += r.computed;
        r.computed = 0;
        r.allocated = length;
        chunks[id] = length;
        continue;
      }
      const std::int32_t newest = r.tokens.back();
      const bool has_slot = r.allocated == static_cast<std::int64_t>(r.tokens.size());
      if (!has_slot && !allocator_.append(id, std::span<const std::int32_t>(&newest, 1))) {
        allocator_.free(id);
        RequestTimeline& timeline = result.requests[r.index];
        ++timeline.preemptions;
        timeline.recomputed_tokens += r.computed;
        r.computed = 0;
        r.admitted_step = -1;
        std::erase(running, id);
        waiting.push_back(id);
        ++record.preempted;
        event("preempt", id, "append_failed_at_apply");
        continue;
      }
      r.allocated = static_cast<std::int64_t>(r.tokens.size());
      decodes.push_back(id);
    }
    std::sort(waiting.begin(), waiting.end(), [&](RequestId a, RequestId b) {
      const double ta = result.requests[static_cast<std::size_t>(a)].arrival_s;
      const double tb = result.requests[static_cast<std::size_t>(b)].arrival_s;
      return ta < tb || (ta == tb && a < b);
    });

    // 3. run
    std::vector<BatchEntry> batch;
    std::vector<RequestId> batch_ids;
    for (RequestId id : running) {
      LiveRequest& r = live.at(id);
      std::int64_t count = 0;
      if (auto it = chunks.find(id); it != chunks.end())
        count = std::min(it->second, static_cast<std::int64_t>(r.tokens.size()) - r.computed);
      else if (std::find(decodes.begin(), decodes.end(), id) != decodes.end())
        count = 1;
      if (count <= 0) continue;
      BatchEntry entry;
      entry.tokens = std::span<const std::int32_t>(r.tokens).subspan(
          static_cast<std::size_t>(r.computed), static_cast<std::size_t>(count));
      entry.start_position = r.computed;
      entry.view = allocator_.view(id);
      batch.push_back(std::move(entry));
      batch_ids.push_back(id);
      if (count == 1 && r.computed + 1 == static_cast<std::int64_t>(r.tokens.size()) &&
          r.generated > 0 && !r.needs_recompute)
        ++record.decode_tokens;
      else
        record.prefill_tokens += count;
    }
    if (batch.empty()) {
      if (++idle_steps > options_.max_idle_steps)
        throw Error(fmt::format(
            "engine: {} steps without progress ({} waiting, {} running): the scheduler stalls",
            idle_steps, waiting.size(), running.size()));
      if (running.empty() && !waiting.empty() && next_arrival == arrival_order.size()) {
        // Nothing runs, nothing will arrive, and the scheduler admits nobody: the head request
        // cannot be admitted even into an empty pool.
        const RequestId id = waiting.front();
        RequestTimeline& timeline = result.requests[live.at(id).index];
        timeline.rejected = true;
        const auto why = last_deferral.find(id);
        timeline.reject_reason = fmt::format(
            "not admitted even with nothing running (scheduler: {}): it exceeds the scheduler's "
            "limits or the KV pool",
            why == last_deferral.end() ? "no reason given" : why->second);
        event("reject", id, timeline.reject_reason);
        std::erase(waiting, id);
        live.erase(id);
        ++done;
      } else if (next_arrival < arrival_order.size()) {
        now = std::max(now, arrival_of(arrival_order[next_arrival]));
      }
      ++step;
      continue;
    }
    idle_steps = 0;
    const auto start = std::chrono::steady_clock::now();
    const std::span<const float> logits = backend_.forward(batch);
    const auto end = std::chrono::steady_clock::now();
    record.measured_forward_s = std::chrono::duration<double>(end - start).count();
    record.measured_step_s = std::chrono::duration<double>(end - step_start).count();
    const double swap_s = static_cast<double>(swap_bytes) / (options_.swap_gb_per_s * 1e9);
    if (options_.cost_model != nullptr)
      record.predicted_s = options_.cost_model->step(batch).total();
    if (options_.clock == EngineClock::measured) {  // the backend's real latency, as predicted
      record.duration_s = record.measured_forward_s + swap_s;
    } else if (options_.cost_model != nullptr) {
      record.duration_s = record.predicted_s + swap_s;
    } else {
      std::int64_t kv_tokens_read = 0;
      for (const auto& e : batch) kv_tokens_read += e.view.end_position() - e.view.first_position;
      const StepTimeModel& m = options_.time_model;
      record.duration_s = m.step_overhead_s +
                          m.prefill_token_s * static_cast<double>(record.prefill_tokens) +
                          m.decode_token_s * static_cast<double>(record.decode_tokens) +
                          m.kv_token_read_s * static_cast<double>(kv_tokens_read) + swap_s;
    }
    if (wall) {
      now = wall_now();
      record.duration_s = now - record.start_s;
    } else {
      now += record.duration_s;
    }
    record.batch = static_cast<std::int64_t>(batch.size());

    // 4-5. sample and update
    const std::int64_t vocab = backend_.vocab_size();
    const std::span<const std::int32_t> chosen = backend_.chosen_tokens();
    if (chosen.empty() ? logits.size() != batch.size() * static_cast<std::size_t>(vocab)
                       : chosen.size() != batch.size())
      throw Error(fmt::format(
          "backend returned {} logits and {} tokens for a batch of {} (vocab {}): it must return "
          "one row of logits or one chosen token per entry",
          logits.size(), chosen.size(), batch.size(), vocab));
    for (std::size_t e = 0; e < batch.size(); ++e) {
      const RequestId id = batch_ids[e];
      LiveRequest& r = live.at(id);
      r.computed += static_cast<std::int64_t>(batch[e].tokens.size());
      if (options_.caches_kv) allocator_.mark_computed(id, r.computed);
      if (r.computed < static_cast<std::int64_t>(r.tokens.size()))
        continue;  // prompt chunk, more to come
      const auto row =
          logits.subspan(e * static_cast<std::size_t>(vocab), static_cast<std::size_t>(vocab));
      if (chosen.empty()) throw_if_non_finite(row, id, step);
      const std::int32_t token = !chosen.empty() ? chosen[e] : r.sampler.sample(row);
      r.tokens.push_back(token);
      ++r.generated;
      r.needs_recompute = !options_.caches_kv;
      RequestTimeline& timeline = result.requests[r.index];
      timeline.token_times_s.push_back(now);
      result.tokens[r.index].push_back(token);
      const bool eos = !r.source->sampling.ignore_eos &&
                       std::find(options_.eos_token_ids.begin(), options_.eos_token_ids.end(),
                                 token) != options_.eos_token_ids.end();
      const bool full = static_cast<std::int64_t>(r.tokens.size()) >= options_.max_seq_len;
      if (eos || r.generated >= r.source->output_tokens || full) {
        event("finish", id, eos ? "eos" : full ? "context_full" : "max_tokens");
        std::erase(running, id);
        finish(id);
        continue;
      }
      if (options_.window)
        allocator_.release_before(id,
                                  static_cast<std::int64_t>(r.tokens.size()) - *options_.window);
    }
    record.waiting = static_cast<std::int64_t>(waiting.size());
    record.running = static_cast<std::int64_t>(running.size());
    record.kv = allocator_.stats();
    if (record.kv.evictions > evictions_seen) {  // cached prefix blocks reused for other data
      nlohmann::json e = {{"step", step},
                          {"t", now},
                          {"event", "evict"},
                          {"blocks", record.kv.evictions - evictions_seen}};
      result.events.push_back(e.dump());
      evictions_seen = record.kv.evictions;
    }
    result.steps.push_back(record);
    ++step;
  }
  result.duration_s = now;
  return result;
}

}  // namespace kvlab

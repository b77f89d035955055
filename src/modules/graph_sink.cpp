// RecordingSink and ReplayUse (graph_sink.h).
#include "modules/graph_sink.h"

#include <algorithm>

#include "common/check.h"

namespace fp8dp {

void RecordingSink::announce(int64_t p) {
  record_(SinkEvent{SinkEvent::Kind::kAnnounce, real_, p, Route::kFused, false});
}

void RecordingSink::withdraw(int64_t p, int64_t /*microbatch*/) {
  record_(SinkEvent{SinkEvent::Kind::kWithdraw, real_, p, Route::kFused, false});
}

GradSink::Token RecordingSink::expect(int64_t /*p*/, int64_t microbatch,
                                      const std::string& module) {
  // Only the warm-up queues a bound task (a capture keeps it as a template, graph_record.h), and
  // it runs and drops it without delivering: a token that counts nothing.
  return Token{microbatch, real_->iteration(), module, false};
}

void RecordingSink::check_accepting(int64_t p, Route route, bool counted_delivery) {
  record_(SinkEvent{SinkEvent::Kind::kCheck, real_, p, route, counted_delivery});
}

void RecordingSink::deliver(int64_t p, const at::Tensor& grad, Route route, Token /*token*/) {
  // A fused delivery carries no tensor (the GEMM accumulated into main_grad, inside the graph); a
  // tensor would be a static buffer the re-issue could not hand over, and no captured route makes
  // one (the delayed route delivers from backward_dw(), outside the capture).
  FP8DP_CHECK(!grad.defined(),
              "make_graphed_callables: a captured layer delivered a gradient "
              "tensor to DistributedDataParallel (route ",
              route_name(route), "); only fused deliveries can be re-issued");
  record_(SinkEvent{SinkEvent::Kind::kDeliver, real_, p, route, false});
}

std::shared_ptr<GradSink> real_sink(const std::shared_ptr<GradSink>& sink) {
  if (const auto* r = dynamic_cast<const RecordingSink*>(sink.get())) return r->real();
  return sink;
}

const ReplayUse::PerSink& ReplayUse::of(const std::shared_ptr<GradSink>& sink) {
  const auto it =
      std::find_if(sinks_.begin(), sinks_.end(), [&](const PerSink& s) { return s.sink == sink; });
  if (it != sinks_.end()) return *it;
  sinks_.push_back(PerSink{sink, sink->microbatch(), sink->iteration()});
  return sinks_.back();
}

void ReplayUse::announce(const std::vector<SinkEvent>& forward_events) {
  for (const SinkEvent& e : forward_events) {
    if (e.kind != SinkEvent::Kind::kAnnounce) continue;
    of(e.sink);
    e.sink->announce(e.p);
    announced_.push_back(e);
  }
}

ReplayUse::~ReplayUse() {
  if (consumed_) return;
  // Dropped without a backward: what its forward announced will not come (as ~SinkUse), within
  // the iteration that announced it only.
  for (const SinkEvent& e : announced_) {
    try {
      const PerSink& s = of(e.sink);
      if (e.sink->iteration() == s.iteration) e.sink->withdraw(e.p, s.microbatch);
    } catch (...) {  // a destructor must not throw; the ledger then reports it at finish
    }
  }
}

}  // namespace fp8dp

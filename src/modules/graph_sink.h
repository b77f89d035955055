// The DistributedDataParallel side of a captured fp8dp layer (graph_record.h): what its forward and
// backward tell the gradient sink (GradSink, C2 / C5 / C8 / C11), recorded at capture and re-issued
// against the real sink at every replay.
//
// During make_graphed_callables' warm-up and capture, a bound layer sees a RecordingSink instead of
// DDP's sink (LinearCore::grad_sink): queries (main_grad, param, micro-batch, iteration) go to the
// real sink, and what would change DDP's state is recorded (capture) or dropped (warm-up, whose
// gradients go nowhere; the caller restores main_grad). Nothing reaches the ledger, the readiness
// counts or the buckets until a replay re-issues it, after its graph: so a bucket's collective is
// launched after the GEMM that the graph ran into main_grad, on the same stream.
#pragma once

#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "grad_buffer/grad_sink.h"

namespace fp8dp {

// One call a captured layer made on the sink, to re-issue at each replay.
struct SinkEvent {
  enum class Kind { kAnnounce, kWithdraw, kCheck, kDeliver };
  Kind kind = Kind::kAnnounce;
  std::shared_ptr<GradSink> sink;  // the real one
  int64_t p = -1;
  Route route = Route::kFused;
  bool counted = false;  // kCheck: check_accepting's counted_delivery
};

// What one forward replay announced (per sink: the micro-batch it ran in, the iteration), for its
// backward replay, which counts its deliveries against that micro-batch, and for the withdrawal
// when the output is dropped without a backward, as ~SinkUse does eagerly.
class ReplayUse {
 public:
  struct PerSink {
    std::shared_ptr<GradSink> sink;
    int64_t microbatch = -1, iteration = -1;
  };
  ReplayUse() = default;
  ReplayUse(const ReplayUse&) = delete;
  ReplayUse& operator=(const ReplayUse&) = delete;
  ~ReplayUse();

  // Announces each forward event (kAnnounce) on its sink and remembers where it stood.
  void announce(const std::vector<SinkEvent>& forward_events);
  const PerSink& of(const std::shared_ptr<GradSink>& sink);  // added on first use
  bool consumed() const { return consumed_; }
  void consume() { consumed_ = true; }

 private:
  std::vector<PerSink> sinks_;
  std::vector<SinkEvent> announced_;
  bool consumed_ = false;
};

// The sink a layer sees while a record is active (see the header comment). `record(event)`
// receives what a capture phase records; `dropping`: the warm-up, which records nothing.
class RecordingSink final : public GradSink {
 public:
  using Recorder = std::function<void(SinkEvent)>;
  RecordingSink(std::shared_ptr<GradSink> real, Recorder record)
      : real_(std::move(real)), record_(std::move(record)) {}
  const std::shared_ptr<GradSink>& real() const { return real_; }

  at::Tensor main_grad(int64_t p) const override { return real_->main_grad(p); }
  const at::Tensor& param(int64_t p) const override { return real_->param(p); }
  int64_t microbatch() const override { return real_->microbatch(); }
  int64_t iteration() const override { return real_->iteration(); }
  void announce(int64_t p) override;
  void withdraw(int64_t p, int64_t microbatch) override;
  Token expect(int64_t p, int64_t microbatch, const std::string& module) override;
  void check_accepting(int64_t p, Route route, bool counted_delivery) override;
  void deliver(int64_t p, const at::Tensor& grad, Route route, Token token) override;

 private:
  std::shared_ptr<GradSink> real_;
  Recorder record_;
};

// The real sink behind `sink` (itself when it records nothing).
std::shared_ptr<GradSink> real_sink(const std::shared_ptr<GradSink>& sink);

}  // namespace fp8dp

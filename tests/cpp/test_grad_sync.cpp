// GradSync without a process group: C1 (views into one buffer, parameters moved into the param
// buffer), C2 (the hook's add / skip rules), C5 (learned golden counts, launch on completion,
// excess and incomplete errors, no_sync), the NaN check and the check_for_errors() fault-injection
// seam. The communicator is a world of one, where every collective is the identity; it counts
// launches.
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <limits>

#include "common/check.h"
#include "grad_buffer/grad_sync.h"

namespace fp8dp {
namespace {

class DoneWork : public CommWork {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

// A collective that, like gloo's, reads its input at launch and writes the result at wait(): the
// values present at launch are restored then (the identity reduction of a world of one), so a
// write in between is lost, as it is on a real wire.
class SnapshotWork : public CommWork {
 public:
  explicit SnapshotWork(const std::vector<at::Tensor>& t) : targets_(t) {
    for (const auto& x : t) snapshots_.push_back(x.clone());
  }
  void wait() override {
    for (size_t i = 0; i < targets_.size(); ++i) targets_[i].copy_(snapshots_[i]);
    snapshots_.clear();
    targets_.clear();
  }
  bool is_completed() override { return targets_.empty(); }

 private:
  std::vector<at::Tensor> targets_, snapshots_;
};

// A work that counts its waits (the parameter all-gathers: which ones were waited for, and when).
class CountingWork : public CommWork {
 public:
  void wait() override { ++waits; }
  bool is_completed() override { return waits > 0; }
  int waits = 0;
};

class SoloCommunicator : public Communicator {
 public:
  int rank() const override { return 0; }
  int size() const override { return 1; }
  std::string name() const override { return "solo"; }
  void check_for_errors() override {
    if (fail) throw Error("injected communicator failure");
  }
  int grad_launches = 0;  // all-reduces / reduce-scatters of more than one element
  bool fail = false;
  bool snapshot = false;  // gradient all-reduces complete at wait() (SnapshotWork)

 protected:
  std::shared_ptr<CommWork> do_all_reduce(const std::vector<at::Tensor>& b, ReduceOp) override {
    if (b[0].scalar_type() == at::kLong) return std::make_shared<DoneWork>();
    ++grad_launches;
    if (snapshot) return std::make_shared<SnapshotWork>(b);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<CommWork> do_reduce_scatter(const std::vector<at::Tensor>& in,
                                              const std::vector<at::Tensor>& out,
                                              ReduceOp) override {
    ++grad_launches;
    for (size_t i = 0; i < in.size(); ++i)
      if (!out[i].is_same(in[i])) out[i].copy_(in[i]);
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<CommWork> do_all_gather(const std::vector<at::Tensor>& in,
                                          const std::vector<at::Tensor>& out) override {
    for (size_t i = 0; i < in.size(); ++i)
      if (in[i].data_ptr() != out[i].data_ptr()) out[i].copy_(in[i]);
    if (in[0].scalar_type() == at::kLong) return std::make_shared<DoneWork>();  // layout check
    gathers.emplace_back(out[0].data_ptr(), std::make_shared<CountingWork>());
    return gathers.back().second;
  }

 public:
  // Parameter all-gathers in launch order: (first output buffer, its work).
  std::vector<std::pair<void*, std::shared_ptr<CountingWork>>> gathers;

 protected:
  std::shared_ptr<CommWork> do_broadcast(const std::vector<at::Tensor>&, int) override {
    return std::make_shared<DoneWork>();
  }
  std::shared_ptr<CommWork> do_all_to_all(const std::vector<at::Tensor>& in,
                                          const std::vector<at::Tensor>& out) override {
    for (size_t i = 0; i < in.size(); ++i) out[i].copy_(in[i]);
    return std::make_shared<DoneWork>();
  }
};

struct Fixture {
  // Registration order: a [4,3], b [5], c [2,2]; with bucket_size 8 and overlap, reverse order
  // gives bucket 0 = {c, b} (9 >= 8 elements) and bucket 1 = {a}.
  std::vector<at::Tensor> params{at::arange(12, at::kFloat).reshape({4, 3}),
                                 at::arange(5, at::kFloat),
                                 at::arange(4, at::kFloat).reshape({2, 2})};
  std::shared_ptr<SoloCommunicator> comm = std::make_shared<SoloCommunicator>();
  std::unique_ptr<GradSync> sync;
  explicit Fixture(GradSyncOptions o) {
    o.bucket_size = 8;
    sync = std::make_unique<GradSync>(params, std::vector<std::string>{"a", "b", "c"}, comm, o);
  }
  void all_ready() {
    for (int64_t p = 2; p >= 0; --p) sync->param_ready(p, at::ones_like(params[p]), false);
  }
};

GradSyncOptions overlap() {
  GradSyncOptions o;
  o.overlap_grad_reduce = true;
  return o;
}

template <typename F>
std::string error_of(F f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "";
}

TEST(GradSync, MainGradsAreViewsOfOneBufferAndParamsMoveIntoTheParamBuffer) {
  Fixture f(overlap());
  const auto& buf = f.sync->buffers().at(0);
  ASSERT_EQ(f.sync->buffers().size(), 1u);
  EXPECT_EQ(buf.grad_data.numel(), 21);
  const auto* g0 = buf.grad_data.data_ptr<float>();
  const auto* p0 = buf.param_data.data_ptr<float>();
  for (int64_t p = 0; p < 3; ++p) {
    const int64_t start = buf.layout().params[p].start;
    EXPECT_EQ(f.sync->main_grad(p).data_ptr<float>(), g0 + start);
    EXPECT_EQ(f.params[p].data_ptr<float>(), p0 + start);  // set_data moved the parameter
    EXPECT_EQ(f.sync->main_grad(p).sizes(), f.params[p].sizes());
  }
  EXPECT_TRUE(at::equal(f.params[0], at::arange(12, at::kFloat).reshape({4, 3})));  // values kept
  EXPECT_EQ(f.sync->num_bucket_groups(), 2);
}

TEST(GradSync, HookAddsOnlyWhatWasNotAlreadyAdded) {
  Fixture f(GradSyncOptions{});
  f.sync->param_ready(1, at::full({5}, 2.0f), false);   // (a): added
  f.sync->param_ready(1, at::full({5}, 100.0f), true);  // (b): fused, already in main_grad
  f.sync->param_ready(1, std::nullopt, false);          // moved by someone else: nothing
  EXPECT_TRUE(at::equal(f.sync->main_grad(1), at::full({5}, 2.0f)));
  EXPECT_THROW(f.sync->param_ready(1, at::ones({4}), false), ValueError);  // wrong shape
}

TEST(GradSync, FirstIterationLearnsLaterIterationsLaunchOnCompletion) {
  Fixture f(overlap());
  f.all_ready();
  EXPECT_EQ(f.comm->grad_launches, 0);  // iteration 1: collectives wait for finish_grad_sync
  f.sync->finish_grad_sync();
  EXPECT_EQ(f.comm->grad_launches, 2);
  f.sync->finish_grad_sync();  // idempotent
  EXPECT_EQ(f.comm->grad_launches, 2);
  f.sync->zero_grad_buffer();
  f.sync->param_ready(2, at::ones({2, 2}), false);
  EXPECT_EQ(f.comm->grad_launches, 2);
  f.sync->param_ready(1, at::ones({5}), false);  // completes bucket {c, b}
  EXPECT_EQ(f.comm->grad_launches, 3);
  EXPECT_TRUE(f.sync->group_launched(f.sync->group_of_param(1)));
  EXPECT_FALSE(f.sync->group_launched(f.sync->group_of_param(0)));
  f.sync->param_ready(0, at::ones({4, 3}), false);
  EXPECT_EQ(f.comm->grad_launches, 4);
  f.sync->finish_grad_sync();
  EXPECT_EQ(f.comm->grad_launches, 4);
  EXPECT_TRUE(at::equal(f.sync->main_grad(0), at::ones({4, 3})));  // dp = 1: no scaling
}

TEST(GradSync, NoSyncNeitherCountsNorLaunches) {
  Fixture f(overlap());
  f.all_ready();
  f.sync->finish_grad_sync();
  f.sync->zero_grad_buffer();
  f.sync->set_sync_enabled(false);
  f.all_ready();
  f.all_ready();
  EXPECT_EQ(f.comm->grad_launches, 2);
  f.sync->set_sync_enabled(true);
  f.all_ready();  // the last micro-batch launches both groups
  EXPECT_EQ(f.comm->grad_launches, 4);
  f.sync->finish_grad_sync();
  EXPECT_TRUE(at::equal(f.sync->main_grad(1), at::full({5}, 3.0f)));  // a plain sum over 3
}

TEST(GradSync, ExcessAndIncompleteReadinessNameTheParameters) {
  Fixture f(overlap());
  f.all_ready();
  f.sync->finish_grad_sync();
  f.sync->zero_grad_buffer();
  f.sync->param_ready(1, at::ones({5}), false);
  const std::string excess = error_of([&] { f.sync->param_ready(1, at::ones({5}), false); });
  EXPECT_NE(excess.find("'b' was reported ready 2 times"), std::string::npos) << excess;
  EXPECT_TRUE(at::equal(f.sync->main_grad(1), at::ones({5})));  // the excess was not added
  const std::string incomplete = error_of([&] { f.sync->finish_grad_sync(); });
  EXPECT_NE(incomplete.find("'c' (ready 0 of 1)"), std::string::npos) << incomplete;
  EXPECT_NE(incomplete.find("'a' (ready 0 of 1)"), std::string::npos) << incomplete;
  EXPECT_EQ(incomplete.find("'b'"), std::string::npos) << incomplete;
}

TEST(GradSync, NanCheckNamesOnlyTheParameterWithNaN) {
  GradSyncOptions o = overlap();
  o.check_for_nan_in_grad = true;
  Fixture f(o);
  f.all_ready();
  f.sync->main_grad(1)[3].fill_(std::numeric_limits<float>::quiet_NaN());
  const std::string msg = error_of([&] { f.sync->finish_grad_sync(); });
  EXPECT_NE(msg.find("rank 0 has NaN or Inf in the local gradients of 'b'"), std::string::npos)
      << msg;
  EXPECT_EQ(msg.find("'a'"), std::string::npos) << msg;
}

TEST(GradSync, CommunicatorErrorsSurfaceThroughCheckForErrors) {
  Fixture f(overlap());
  f.all_ready();
  f.comm->fail = true;  // the fault-injection seam: an asynchronous communicator failure
  EXPECT_NE(error_of([&] { f.sync->finish_grad_sync(); }).find("injected communicator failure"),
            std::string::npos);
}

TEST(GradSync, DistributedOptimizerShardsCoverEveryParameterOnce) {
  GradSyncOptions o = overlap();
  o.use_distributed_optimizer = true;
  Fixture f(o);
  const auto shards = f.sync->owned_shards();
  ASSERT_EQ(shards.size(), 3u);  // dp = 1 owns everything
  for (const auto& s : shards) EXPECT_EQ(s.numel, f.params[s.param].numel());
  // Alignment: every parameter starts on a 64-element boundary; buckets end on multiples of 128.
  for (const auto& b : f.sync->buffers()[0].buckets) EXPECT_EQ(b.numel % 128, 0);
  std::vector<at::Tensor> masters;
  for (const auto& s : shards) masters.push_back(at::full({s.numel}, 7.0f));
  f.sync->copy_shards_and_sync_params(masters);
  for (const auto& p : f.params) EXPECT_TRUE(at::equal(p, at::full_like(p, 7.0f)));
}

TEST(GradSync, ParamSyncLaunchesInForwardOrderAndWaitsPerGroup) {
  GradSyncOptions o = overlap();
  o.use_distributed_optimizer = true;
  Fixture f(o);
  // Layout (reverse order): group 0 = {c, b}, group 1 = {a}. Forward reads a (parameter 0) first,
  // so group 1's all-gather must be launched first.
  const int64_t ga = f.sync->group_of_param(0), gc = f.sync->group_of_param(2);
  ASSERT_NE(ga, gc);
  std::vector<at::Tensor> masters;
  for (const auto& s : f.sync->owned_shards()) masters.push_back(at::full({s.numel}, 3.0f));
  f.sync->copy_shards(masters);
  EXPECT_FALSE(f.sync->param_sync_pending());
  f.sync->start_param_sync();
  EXPECT_TRUE(f.sync->param_sync_pending());
  auto& g = f.comm->gathers;
  ASSERT_EQ(g.size(), 2u);
  const auto& bucket_of_a = f.sync->buffers()[0].buckets[1];
  EXPECT_EQ(g[0].first, bucket_of_a.param.data_ptr());  // a's group first
  // Waiting for a's group waits for that all-gather only.
  f.sync->finish_param_sync(ga);
  EXPECT_EQ(g[0].second->waits, 1);
  EXPECT_EQ(g[1].second->waits, 0);
  EXPECT_TRUE(f.sync->param_sync_pending());
  f.sync->finish_param_sync(ga);  // a second wait is a no-op
  EXPECT_EQ(g[0].second->waits, 1);
  // copy_shards (the next step without a forward) first finishes what is still in flight.
  f.sync->copy_shards(masters);
  EXPECT_EQ(g[1].second->waits, 1);
  EXPECT_FALSE(f.sync->param_sync_pending());
  f.sync->start_param_sync();
  f.sync->finish_param_sync(-1);
  EXPECT_EQ(g[2].second->waits + g[3].second->waits, 2);
  EXPECT_FALSE(f.sync->param_sync_pending());
  EXPECT_NE(error_of([&] {
              f.sync->finish_param_sync(2);
            }).find("group: expected -1 (all) or a bucket group in [0, 2), got 2"),
            std::string::npos);
}

// ---- C11: the iteration's phases -------------------------------------------------------------
// Learns the golden counts (iteration 1) and starts iteration 2: phase accumulating.
void learn(Fixture& f) {
  f.all_ready();
  f.sync->finish_grad_sync();
  f.sync->zero_grad_buffer();
}

// Mechanism removed (run 2026-12-03, H1b: check_accepting_locked() returning at once): the
// gradient is added to the bucket in flight, so the main_grad EXPECT fails and the error text
// checks fail (also "arrived in phase 'finished'").
TEST(GradSyncPhases, GradientForALaunchedGroupIsRefusedBeforeItIsAdded) {
  Fixture f(overlap());
  learn(f);
  EXPECT_STREQ(phase_name(f.sync->phase()), "accumulating");
  f.sync->param_ready(2, at::ones({2, 2}), false);
  f.sync->param_ready(1, at::ones({5}), false);  // completes and launches {c, b}
  EXPECT_STREQ(phase_name(f.sync->phase()), "sync_started");
  // A later micro-batch's gradient (under no_sync(): a graph built before the launch). Outside
  // no_sync() the same report is an excess one, which readiness names (its own test above).
  f.sync->set_sync_enabled(false);
  const std::string msg = error_of([&] { f.sync->param_ready(1, at::ones({5}), false); });
  f.sync->set_sync_enabled(true);
  EXPECT_NE(msg.find("a gradient of parameter 'b' arrived in phase 'sync_started'"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("It was not added"), std::string::npos) << msg;
  EXPECT_TRUE(at::equal(f.sync->main_grad(1), at::ones({5})));
  // The group not launched yet still accepts.
  f.sync->param_ready(0, at::ones({4, 3}), false);
  f.sync->finish_grad_sync();
  EXPECT_STREQ(phase_name(f.sync->phase()), "finished");
  // After the finish every gradient is refused (a graph built before it).
  EXPECT_NE(error_of([&] {
              f.sync->param_ready(0, at::ones({4, 3}), false);
            }).find("arrived in phase 'finished'"),
            std::string::npos);
  EXPECT_TRUE(at::equal(f.sync->main_grad(0), at::ones({4, 3})));
}

// Mechanism removed (run 2026-12-03, H1b): the grad_enabled check in begin_microbatch() removed:
// the four EXPECT_NEs on forward refusals fail (no error); enter_no_sync() without its check: the
// no_sync() in phase 'finished' is accepted and sync_enabled() is false (two failures).
TEST(GradSyncPhases, ForwardWithGradAndNoSyncAreRefusedOnceTheSyncStarted) {
  Fixture f(overlap());
  learn(f);
  f.sync->begin_microbatch(true);
  f.sync->param_ready(2, at::ones({2, 2}), false);
  f.sync->param_ready(1, at::ones({5}), false);  // launches {c, b}
  const std::string fwd = error_of([&] { f.sync->begin_microbatch(true); });
  EXPECT_NE(fwd.find("forward with grad enabled in phase 'sync_started'"), std::string::npos)
      << fwd;
  EXPECT_NE(fwd.find("Only the LAST micro-batch of an iteration runs outside no_sync()"),
            std::string::npos)
      << fwd;
  EXPECT_EQ(error_of([&] { f.sync->begin_microbatch(false); }), "");  // evaluation: allowed
  // no_sync() is allowed while groups are launched (a deferred backward_dw() of an earlier
  // micro-batch runs in it); a forward with grad inside it is refused all the same.
  EXPECT_EQ(error_of([&] { EXPECT_TRUE(f.sync->enter_no_sync()); }), "");
  EXPECT_NE(error_of([&] { f.sync->begin_microbatch(true); }).find("phase 'sync_started'"),
            std::string::npos);
  f.sync->set_sync_enabled(true);
  f.sync->param_ready(0, at::ones({4, 3}), false);
  f.sync->finish_grad_sync();
  EXPECT_NE(error_of([&] { f.sync->begin_microbatch(true); }).find("phase 'finished'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { f.sync->enter_no_sync(); }).find("no_sync() in phase 'finished'"),
            std::string::npos);
  EXPECT_TRUE(f.sync->sync_enabled());  // the refused no_sync() changed nothing
  f.sync->zero_grad_buffer();
  EXPECT_EQ(error_of([&] { f.sync->begin_microbatch(true); }), "");
  EXPECT_EQ(error_of([&] { f.sync->enter_no_sync(); }), "");
}

// Mechanism removed (run 2026-12-03, H1b): start_grad_sync() without its finished early return:
// grad_launches is 6, expected 4 (both groups reduced a second time).
TEST(GradSyncPhases, StartAfterFinishIsANoOpAndFinishIsIdempotent) {
  Fixture f(overlap());
  learn(f);
  f.all_ready();
  f.sync->finish_grad_sync();
  const int launches = f.comm->grad_launches;
  f.sync->start_grad_sync();
  f.sync->finish_grad_sync();
  EXPECT_EQ(f.comm->grad_launches, launches);
  EXPECT_STREQ(phase_name(f.sync->phase()), "finished");
}

// The collective reads its bucket at launch and writes the result at its end (SnapshotWork): a
// factor applied in between is lost unless scale_gradients() waits first.
// Mechanism removed (run 2026-12-03, H1b): the wait for launched groups in scale_gradients()
// removed: the main_grad == 0.5 EXPECT fails for the parameters of the launched group {c, b} (the
// factor lost); tests/distributed cases_phases scale_in_flight fails all 12 cases (ws 2 and 3).
TEST(GradSyncPhases, ScaleWaitsForLaunchedCollectives) {
  Fixture f(overlap());
  learn(f);
  f.comm->snapshot = true;
  f.sync->param_ready(2, at::ones({2, 2}), false);
  f.sync->param_ready(1, at::ones({5}), false);     // launches {c, b}
  f.sync->param_ready(0, at::ones({4, 3}), false);  // launches {a}
  f.sync->scale_gradients(0.5);
  f.sync->finish_grad_sync();
  for (int64_t p = 0; p < 3; ++p)
    EXPECT_TRUE(at::equal(f.sync->main_grad(p), at::full_like(f.params[p], 0.5f))) << p;
}

// Mechanism removed (run 2026-12-03, H1b): copy_shards() not marking the step: the phase is
// "finished", and the refusals of the forward and of scale_gradients() naming 'stepped' fail.
TEST(GradSyncPhases, StepThenForgottenZeroIsRefused) {
  GradSyncOptions o = overlap();
  o.use_distributed_optimizer = true;
  Fixture f(o);
  f.all_ready();
  f.sync->finish_grad_sync();
  std::vector<at::Tensor> masters;
  for (const auto& s : f.sync->owned_shards()) masters.push_back(at::zeros({s.numel}));
  f.sync->copy_shards_and_sync_params(masters);
  EXPECT_STREQ(phase_name(f.sync->phase()), "stepped");
  EXPECT_NE(error_of([&] {
              f.sync->begin_microbatch(true);
            }).find("forward with grad enabled in phase 'stepped'"),
            std::string::npos);
  EXPECT_NE(error_of([&] { f.sync->scale_gradients(2.0); }).find("phase 'stepped'"),
            std::string::npos);
  f.sync->finish_grad_sync();  // a second step() finishes again: a no-op
  f.sync->zero_grad_buffer();
  EXPECT_STREQ(phase_name(f.sync->phase()), "accumulating");
}

// Mechanism removed (run 2026-12-03, H1b): begin_microbatch() without the wait for param
// all-gathers: the waits stay 0 (expected 2) and a gather is still pending; cases_phases
// forward_waits_for_the_gather fails on ws 2 and 3 (a gloo all_gather timeout on rank 1).
TEST(GradSyncPhases, ForwardWaitsForEveryGatherWithoutOverlapParamGather) {
  GradSyncOptions o = overlap();
  o.use_distributed_optimizer = true;
  for (bool overlap_param_gather : {false, true}) {
    o.overlap_param_gather = overlap_param_gather;
    Fixture f(o);
    std::vector<at::Tensor> masters;
    for (const auto& s : f.sync->owned_shards()) masters.push_back(at::zeros({s.numel}));
    f.sync->copy_shards(masters);
    f.sync->start_param_sync();
    f.sync->begin_microbatch(false);
    const auto& g = f.comm->gathers;
    ASSERT_EQ(g.size(), 2u);
    // With overlap_param_gather each module's pre-hook waits for its own groups instead.
    EXPECT_EQ(g[0].second->waits + g[1].second->waits, overlap_param_gather ? 0 : 2);
    EXPECT_EQ(f.sync->param_sync_pending(), overlap_param_gather);
  }
}

// Mechanism removed (run 2026-12-03, H1b): the stale-.grad slot of the layout check ignored: the
// "has a .grad left" EXPECT fails (the constructor succeeds); zero_grad_buffer() without clearing
// .grad: the last EXPECT fails (.grad still defined).
TEST(GradSyncPhases, StaleGradIsRefusedAtWrapAndZeroClearsGrad) {
  std::vector<at::Tensor> params{at::zeros({3}).requires_grad_()};
  params[0].mutable_grad() = at::ones({3});
  auto comm = std::make_shared<SoloCommunicator>();
  const std::string msg = error_of([&] { GradSync(params, {"w"}, comm, GradSyncOptions{}); });
  EXPECT_NE(msg.find("parameter 'w' on rank 0 has a .grad left from a backward"), std::string::npos)
      << msg;
  params[0].mutable_grad() = at::Tensor();
  GradSync sync(params, {"w"}, comm, GradSyncOptions{});
  params[0].mutable_grad() = at::ones({3});
  sync.zero_grad_buffer();
  EXPECT_FALSE(params[0].grad().defined());
}

}  // namespace
}  // namespace fp8dp

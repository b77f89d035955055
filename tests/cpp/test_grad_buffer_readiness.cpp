// Readiness counts (C5) and the gradient ledger (C2): golden counts, completion, excess and missing
// reports, all without tensors or a process group.
#include <gtest/gtest.h>

#include <string>
#include <vector>

#include "common/check.h"
#include "grad_buffer/ledger.h"
#include "grad_buffer/readiness.h"

using fp8dp::Ledger;
using fp8dp::Readiness;
using fp8dp::Route;

namespace {

// Params 0,1 in group 0; param 2 in group 1. Param 1 is used twice per forward (golden 2).
Readiness learned() {
  Readiness r({0, 0, 1}, {"a", "b", "c"}, 2);
  for (int p : {0, 1, 1, 2}) EXPECT_FALSE(r.mark(p));  // first iteration: learn, never launch
  r.end_iteration();
  EXPECT_TRUE(r.golden_known());
  return r;
}

TEST(Readiness, GroupCompletesExactlyWhenEveryCountIsGolden) {
  Readiness r = learned();
  EXPECT_EQ(r.golden(1), 2);
  EXPECT_FALSE(r.mark(1));
  EXPECT_FALSE(r.mark(0));
  EXPECT_TRUE(r.mark(1));  // second use of b completes group 0
  EXPECT_TRUE(r.incomplete(0).empty());
  EXPECT_TRUE(r.mark(2));
  r.end_iteration();
  EXPECT_FALSE(r.mark(0));  // counts start over each iteration
}

TEST(Readiness, ExcessReportNamesTheParameter) {
  Readiness r = learned();
  EXPECT_TRUE(r.mark(2));
  try {
    r.mark(2);
    FAIL() << "excess readiness accepted";
  } catch (const fp8dp::Error& e) {
    EXPECT_NE(std::string(e.what()).find("'c' was reported ready 2 times in this iteration but 1"),
              std::string::npos)
        << e.what();
  }
}

TEST(Readiness, IncompleteListsMissingParameters) {
  Readiness r = learned();
  r.mark(1);
  const auto inc = r.incomplete(0);
  ASSERT_EQ(inc.size(), 2u);
  EXPECT_EQ(inc[0], "'a' (ready 0 of 1)");
  EXPECT_EQ(inc[1], "'b' (ready 1 of 2)");
}

// C11: a gradient queued for backward_dw() is counted exactly, not learned. Learned reports of b
// (its autograd hook) are the same whether or not the deferred GEMM makes b's gradient (FP8 off:
// it does; FP8 on: autograd has it), so an iteration of either route completes the group, the
// one with a queued gradient only when it is delivered.
// Mechanism removed (run 2026-12-03, H1b): expect_delivery() a no-op and mark_delivery() a learned
// mark(), the golden-count readiness before C11: r.mark(1) completes the group at once (true,
// expected false), incomplete() is empty, and the delivery throws as an excess report.
TEST(Readiness, LearnedFromOneRouteServesTheOther) {
  Readiness r = learned();  // learned without any queued gradient (the FP8-on route)
  r.expect_delivery(0);     // FP8 off: backward queues a's gradient...
  EXPECT_FALSE(r.mark(0));  // ...its hook fires: learned count golden, one delivery outstanding
  EXPECT_FALSE(r.mark(1));
  EXPECT_FALSE(r.mark(1));
  EXPECT_EQ(r.incomplete(0), std::vector<std::string>{
                                 "'a' (ready 1 of 1, 1 queued for backward_dw() not delivered)"});
  EXPECT_TRUE(r.mark_delivery(0));  // backward_dw(): group 0 complete
  r.end_iteration();
  // And back: no queued gradient this time; the hook alone completes a.
  EXPECT_FALSE(r.mark(1));
  EXPECT_FALSE(r.mark(1));
  EXPECT_TRUE(r.mark(0));
}

TEST(Readiness, DeliveryWithoutAnExpectationIsAnError) {
  Readiness r = learned();
  EXPECT_THROW(r.mark_delivery(2), fp8dp::Error);
  // Learning iteration: a queued gradient is never part of the golden count.
  Readiness fresh({0}, {"a"}, 1);
  fresh.expect_delivery(0);
  fresh.mark(0);
  fresh.mark_delivery(0);
  fresh.end_iteration();
  EXPECT_EQ(fresh.golden(0), 1);
}

// A gradient an earlier micro-batch queued (under no_sync(): not counted) and backward_dw()
// delivers only after the last micro-batch's backward: the group must wait for it. Before
// 2026-12-05 the last micro-batch's report of another use of the parameter (a tied weight whose
// delayed module runs in earlier micro-batches only) completed the group, which launched, and the
// late delivery was refused as arriving in a bucket being reduced (property test, seeds 71 and 72).
TEST(Readiness, AnEarlierMicrobatchsQueuedGradientHoldsItsGroup) {
  Readiness r = learned();
  r.expect_uncounted(0);    // micro-batch 0 queued a gradient of a (not counted)
  EXPECT_FALSE(r.mark(0));  // the last micro-batch's report of a: golden, but queued
  EXPECT_FALSE(r.mark(1));
  EXPECT_FALSE(r.mark(1));  // b golden too: the group still waits for a's queue
  ASSERT_EQ(r.incomplete(0).size(), 1u);
  EXPECT_EQ(r.incomplete(0)[0], "'a' (ready 1 of 1, 1 queued for backward_dw() not delivered)");
  EXPECT_TRUE(r.mark_uncounted_delivery(0));  // delivered: now the group completes
  r.end_iteration();
  EXPECT_EQ(r.golden(0), 1);  // nothing learned from the queued gradient
  EXPECT_THROW(r.mark_uncounted_delivery(0), fp8dp::Error);  // none queued in this iteration
}

TEST(Readiness, NothingLearnedFromAnIterationWithoutReports) {
  Readiness r({0}, {"a"}, 1);
  r.end_iteration();
  EXPECT_FALSE(r.golden_known());
}

// Each micro-batch's announced contributions arrive by any route: no error.
TEST(Ledger, AcceptsExactlyWhatWasAnnounced) {
  Ledger l({"w", "b"});
  for (int it = 0; it < 2; ++it) {
    for (int mb = 0; mb < 3; ++mb) {
      l.begin_microbatch();
      l.expect(0);
      l.expect(0);               // w: a tied weight, two uses (an autograd hook and a fused GEMM)
      if (mb != 1) l.expect(1);  // b: used only in some micro-batches
      l.record(0, Route::kAutograd);
      l.record(0, Route::kFused);
      if (mb != 1) l.record(1, Route::kNone);
    }
    EXPECT_EQ(l.end_iteration(), "") << "iteration " << it;
  }
}

TEST(Ledger, DuplicateAndMissingAreNamedPerMicrobatch) {
  Ledger l({"w", "b"});
  for (int mb = 0; mb < 2; ++mb) {
    l.begin_microbatch();
    l.expect(0);
    l.expect(1);
    l.record(0, Route::kAutograd);
    if (mb == 0) l.record(0, Route::kFused);     // duplicate of w in micro-batch 1
    if (mb == 1) l.record(1, Route::kAutograd);  // b missing in micro-batch 1
  }
  const std::string msg = l.end_iteration();
  EXPECT_NE(msg.find("'w': micro-batch 1: 2 of 1 (duplicated 1); routes: added from .grad 2, "
                     "hook without .grad 0, fused GEMM 1, backward_dw 0"),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("'b': micro-batch 1: 0 of 1 (missing 1)"), std::string::npos) << msg;
  EXPECT_EQ(l.end_iteration(), "") << "end_iteration starts the next iteration afresh";
}

// A use lost in one micro-batch and doubled in another keeps the iteration's total: each
// micro-batch is checked on its own. Comparing totals only passes this iteration.
TEST(Ledger, EachMicrobatchIsChecked) {
  Ledger l({"w"});
  l.begin_microbatch();
  l.expect(0);
  l.begin_microbatch();
  l.expect(0);
  l.record(0, Route::kFused, 0);  // micro-batch 1 twice (one of them late), 2 never
  l.record(0, Route::kDelayed, 0);
  const std::string msg = l.end_iteration();
  EXPECT_NE(msg.find("micro-batch 1: 2 of 1 (duplicated 1); micro-batch 2: 0 of 1 (missing 1)"),
            std::string::npos)
      << msg;
}

// A deferred gradient (backward_dw() after the next forward began) counts against the micro-batch
// whose forward announced it, not the one running when it arrives.
TEST(Ledger, DeferredContributionCountsForItsOwnMicrobatch) {
  Ledger l({"w"});
  l.begin_microbatch();
  l.expect(0);
  const int64_t mb0 = l.current_microbatch();
  l.begin_microbatch();
  l.expect(0);
  l.record(0, Route::kDelayed, mb0);  // micro-batch 1's, run during micro-batch 2
  l.record(0, Route::kDelayed);
  EXPECT_EQ(l.end_iteration(), "");
}

// Pipelined forwards run ahead (1F1B on a first stage: F0 F1 B0 F2 B1 B2): an autograd-hook
// contribution counts against the micro-batch whose backward DDP's output hook named, not the
// latest forward. Keyed by the latest forward (the former rule), this reports micro-batch 3 with
// 3 of 1 and micro-batches 1 and 2 missing.
TEST(Ledger, PipelinedBackwardCountsForItsOwnMicrobatch) {
  Ledger l({"w"});
  const auto forward = [&] {
    l.begin_microbatch();
    l.expect(0);
  };
  const auto backward = [&](int64_t mb) {
    l.set_backward_microbatch(mb);
    l.record(0, Route::kAutograd);
  };
  forward();
  forward();
  backward(0);
  forward();
  backward(1);
  backward(2);
  EXPECT_EQ(l.end_iteration(), "");
}

// A genuine loss in a pipelined iteration is still named by its micro-batch.
TEST(Ledger, PipelinedMissingIsNamed) {
  Ledger l({"w"});
  l.begin_microbatch();
  l.expect(0);
  l.begin_microbatch();
  l.expect(0);
  l.set_backward_microbatch(1);  // micro-batch 1's backward never delivered; 2's did
  l.record(0, Route::kAutograd);
  const std::string msg = l.end_iteration();
  EXPECT_NE(msg.find("'w': micro-batch 1: 0 of 1 (missing 1)"), std::string::npos) << msg;
}

// An unused parameter announces nothing and receives nothing: not an error (the former ledger,
// which learned counts, reported it missing).
TEST(Ledger, UnusedParameterIsFine) {
  Ledger l({"used", "unused"});
  l.begin_microbatch();
  l.expect(0);
  l.record(0, Route::kAutograd);
  EXPECT_EQ(l.end_iteration(), "");
}

}  // namespace

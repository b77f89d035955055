// check_ranks_agree (contract C12) in a world of threads: each rank is a thread with its own
// Communicator, whose all-gather really exchanges the ranks' tensors (a barrier before the
// exchange and one after it), so the test sees what every rank raises and how many collectives
// each ran. A collective whose sizes differ between ranks fails on every rank (as it would abort
// or hang in gloo), and a rank left alone in a collective fails after a timeout, never hangs.
//
// Mutations tried (each made the tests named fail, then was restored):
// - `if (same) return;` removed (the second gather always runs): AgreeingRanksPassWithOne-
//   Collective failed: every rank raised "the ranks' fingerprints differ although their fields
//   are equal" after 2 all-gathers.
// - the second gather's result replaced by this rank's own bytes for every rank: the 4 tests of
//   differing ranks failed: every rank raised, but only "fingerprints differ although their
//   fields are equal", naming no field and no value.
// - the length of the second gather taken from this rank's own bytes instead of the longest of
//   the gathered fingerprints: the same 4 tests failed: no ValueError, but the fake world's
//   "all_gather sizes differ between ranks" (gloo would abort or hang there).
#include <ATen/ATen.h>
#include <gtest/gtest.h>

#include <chrono>
#include <condition_variable>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "comm/agreement.h"
#include "common/check.h"

namespace fp8dp {
namespace {

class DoneWork : public CommWork {
 public:
  void wait() override {}
  bool is_completed() override { return true; }
};

// What the ranks' threads share: the tensors deposited for the current collective and a barrier.
class World {
 public:
  explicit World(int n) : n_(n), slots_(n) {}
  int size() const { return n_; }

  // Every rank deposits `in`; once all did, each reads every rank's tensor into `out`.
  void all_gather(int rank, const at::Tensor& in, const at::Tensor& out) {
    slots_[rank] = in.cpu().clone();
    barrier();
    for (int r = 0; r < n_; ++r)
      FP8DP_CHECK(
          slots_[r].numel() * n_ == out.numel() && slots_[r].scalar_type() == out.scalar_type(),
          "all_gather sizes differ between ranks: rank ", r, " sent ", slots_[r].numel(), " x ",
          slots_[r].scalar_type(), ", rank ", rank, " expects ", out.numel() / n_, " x ",
          out.scalar_type());
    out.copy_(at::cat(slots_));
    barrier();  // nobody deposits the next collective's tensor before everyone has read
  }

 private:
  void barrier() {
    std::unique_lock<std::mutex> lock(mu_);
    const int64_t gen = generation_;
    if (++arrived_ == n_) {
      arrived_ = 0;
      ++generation_;
      cv_.notify_all();
      return;
    }
    const bool done =
        cv_.wait_for(lock, std::chrono::seconds(20), [&] { return generation_ != gen; });
    FP8DP_CHECK(done, "a rank waited 20 s in a collective that another rank never joined");
  }

  int n_;
  std::vector<at::Tensor> slots_;
  std::mutex mu_;
  std::condition_variable cv_;
  int arrived_ = 0;
  int64_t generation_ = 0;
};

class ThreadCommunicator : public Communicator {
 public:
  ThreadCommunicator(World& world, int rank) : world_(world), rank_(rank) {}
  int rank() const override { return rank_; }
  int size() const override { return world_.size(); }
  std::string name() const override { return "threads"; }
  int collectives = 0;

 protected:
  std::shared_ptr<CommWork> do_all_gather(const std::vector<at::Tensor>& in,
                                          const std::vector<at::Tensor>& out) override {
    ++collectives;
    for (size_t i = 0; i < in.size(); ++i) world_.all_gather(rank_, in[i], out[i]);
    return std::make_shared<DoneWork>();
  }
  // check_ranks_agree needs only all-gathers: any other collective is a test failure.
  std::shared_ptr<CommWork> do_all_reduce(const std::vector<at::Tensor>&, ReduceOp) override {
    return unexpected("all_reduce");
  }
  std::shared_ptr<CommWork> do_reduce_scatter(const std::vector<at::Tensor>&,
                                              const std::vector<at::Tensor>&, ReduceOp) override {
    return unexpected("reduce_scatter");
  }
  std::shared_ptr<CommWork> do_all_to_all(const std::vector<at::Tensor>&,
                                          const std::vector<at::Tensor>&) override {
    return unexpected("all_to_all");
  }
  std::shared_ptr<CommWork> do_broadcast(const std::vector<at::Tensor>&, int) override {
    return unexpected("broadcast");
  }

 private:
  std::shared_ptr<CommWork> unexpected(const char* op) {
    ++collectives;
    throw Error(std::string("unexpected collective ") + op);
  }
  World& world_;
  int rank_;
};

struct Outcome {
  bool value_error = false;  // raised fp8dp::ValueError (Python's ValueError)
  std::string message;       // of whatever it raised; "" when it returned
  int collectives = 0;
};

// Runs check_ranks_agree on one thread per rank with fields_of(rank) and what_of(rank).
std::vector<Outcome> run(int n, const std::function<std::vector<AgreementField>(int)>& fields_of,
                         const std::function<std::string(int)>& what_of) {
  World world(n);
  std::vector<Outcome> out(n);
  std::vector<std::thread> threads;
  for (int r = 0; r < n; ++r) {
    threads.emplace_back([&, r] {
      ThreadCommunicator comm(world, r);
      try {
        check_ranks_agree(comm, fields_of(r), what_of(r));
      } catch (const ValueError& e) {
        out[r].value_error = true;
        out[r].message = e.what();
      } catch (const std::exception& e) {
        out[r].message = e.what();
      }
      out[r].collectives = comm.collectives;
    });
  }
  for (auto& t : threads) t.join();
  return out;
}

std::string ddp(int) { return "DistributedDataParallel"; }

std::vector<AgreementField> config(bool average_in_collective) {
  return {{"world size", "3"},
          {"config.average_in_collective", average_in_collective ? "True" : "False"},
          {"config.grad_reduce_wire", "'fp32'"}};
}

TEST(CheckRanksAgree, AgreeingRanksPassWithOneCollective) {
  for (int n : {2, 3, 5}) {
    const auto out = run(n, [](int) { return config(false); }, ddp);
    for (int r = 0; r < n; ++r) {
      EXPECT_EQ(out[r].message, "") << "rank " << r << " of " << n;
      EXPECT_EQ(out[r].collectives, 1) << "rank " << r << " of " << n;
    }
  }
}

TEST(CheckRanksAgree, OneRankRunsNoCollective) {
  const auto out = run(1, [](int) { return config(true); }, ddp);
  EXPECT_EQ(out[0].message, "");
  EXPECT_EQ(out[0].collectives, 0);
}

TEST(CheckRanksAgree, DifferingValueEveryRankRaisesNamingFieldAndValues) {
  const auto out = run(3, [](int r) { return config(r == 1); }, ddp);
  for (int r = 0; r < 3; ++r) {
    EXPECT_TRUE(out[r].value_error) << out[r].message;
    EXPECT_NE(out[r].message.find("DistributedDataParallel: ranks disagree on "
                                  "config.average_in_collective: ranks 0,2 False, rank 1 True"),
              std::string::npos)
        << out[r].message;
    EXPECT_EQ(out[r].collectives, 2) << "rank " << r;
  }
}

TEST(CheckRanksAgree, FirstDifferingFieldIsNamed) {
  // Rank 1 differs on two fields: the first one (in the order given) is reported.
  const auto out = run(
      2,
      [](int r) {
        auto f = config(false);
        if (r == 1) f[2].second = "'bf16'", f[1].second = "True";
        return f;
      },
      ddp);
  for (const auto& o : out)
    EXPECT_NE(o.message.find("ranks disagree on config.average_in_collective: rank 0 False, "
                             "rank 1 True"),
              std::string::npos)
        << o.message;
}

TEST(CheckRanksAgree, DifferentFieldCountsAreReportedWithoutMismatchedCollectives) {
  // Rank 1 runs code that checks one field more (a config field added in a newer version): its
  // serialized fields are longer, yet the second gather has one size on every rank.
  const auto out = run(
      3,
      [](int r) {
        auto f = config(false);
        if (r == 1) f.emplace_back("config.new_option", "True");
        return f;
      },
      ddp);
  for (const auto& o : out) {
    EXPECT_TRUE(o.value_error) << o.message;
    EXPECT_NE(o.message.find("ranks disagree on config.new_option: ranks 0,2 (no such field: it "
                             "checks 3), rank 1 True"),
              std::string::npos)
        << o.message;
  }
}

TEST(CheckRanksAgree, DifferentFieldNamesAtOnePosition) {
  const auto out = run(
      2,
      [](int r) {
        auto f = config(false);
        if (r == 0) f[1].first = "config.average";
        return f;
      },
      ddp);
  for (const auto& o : out)
    EXPECT_NE(o.message.find("ranks check different fields (different fp8dp versions?): field 2 "
                             "(counting from 1) is rank 0 config.average = False, rank 1 "
                             "config.average_in_collective = False"),
              std::string::npos)
        << o.message;
}

TEST(CheckRanksAgree, RanksBuildingDifferentObjectsAreTold) {
  const auto out = run(
      2, [](int) { return config(false); },
      [](int r) { return r == 0 ? "DistributedDataParallel" : "DistributedOptimizer"; });
  EXPECT_NE(out[0].message.find("DistributedDataParallel: ranks disagree on object being built: "
                                "rank 0 DistributedDataParallel, rank 1 DistributedOptimizer"),
            std::string::npos)
      << out[0].message;
  EXPECT_NE(out[1].message.find("DistributedOptimizer: ranks disagree on object being built"),
            std::string::npos)
      << out[1].message;
}

TEST(CheckRanksAgree, ValuesAreComparedByteForByte) {
  // Equal lengths, a NUL inside: only the bytes after it differ.
  const std::string a("x\0a", 3), b("x\0b", 3);
  const auto out =
      run(2, [&](int r) { return std::vector<AgreementField>{{"v", r ? b : a}}; }, ddp);
  for (const auto& o : out) EXPECT_TRUE(o.value_error) << o.message;
}

TEST(DescribeDisagreement, EqualFieldsGiveNoMessage) {
  const std::vector<std::vector<AgreementField>> same(4, {{"object being built", "X"}, {"a", "1"}});
  EXPECT_EQ(describe_disagreement(same, "X"), "");
}

TEST(DescribeDisagreement, ManyRanksAreGroupedAndLongValuesCut) {
  std::vector<std::vector<AgreementField>> per_rank;
  for (int r = 0; r < 12; ++r)
    per_rank.push_back({{"object being built", "X"}, {"p", std::string(400, 'a' + r % 10)}});
  const std::string msg = describe_disagreement(per_rank, "X");
  EXPECT_NE(msg.find("ranks 0,10 " + std::string(300, 'a') + "... (400 chars), ranks 1,11 "),
            std::string::npos)
      << msg;
  EXPECT_NE(msg.find("and 2 more different values"), std::string::npos) << msg;
  per_rank.assign(6, {{"object being built", "X"}, {"p", "1"}});
  per_rank[4][1].second = "2";
  EXPECT_NE(
      describe_disagreement(per_rank, "X").find("ranks disagree on p: ranks 0-3,5 1, rank 4 2"),
      std::string::npos);
}

}  // namespace
}  // namespace fp8dp

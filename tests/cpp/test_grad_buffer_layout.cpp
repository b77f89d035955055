// Layout rules of the gradient buffer: reverse order, no split parameters, alignment, bucket
// padding and the owned shards of the distributed optimizer, checked over many sizes and world
// sizes.
#include <gtest/gtest.h>

#include <numeric>
#include <tuple>

#include "common/check.h"
#include "grad_buffer/layout.h"

using fp8dp::compute_layout;
using fp8dp::LayoutOptions;

namespace {

// Sizes with primes, 1, and values straddling the 64-element alignment and 128-element padding.
const std::vector<std::vector<int64_t>> kModels = {
    {1}, {7, 1, 129}, {64, 64, 64}, {300, 5, 10, 70}, {4096, 4096, 17, 1, 127, 128, 129}};

class LayoutTest : public ::testing::TestWithParam<std::tuple<int, int64_t, bool, int64_t>> {};

TEST_P(LayoutTest, InvariantsHold) {
  const auto [model, dp, dist_opt, bucket_size] = GetParam();
  const auto& numels = kModels[model];
  LayoutOptions o;
  o.dp = dp;
  o.distributed_optimizer = dist_opt;
  o.bucket_size = bucket_size;
  const auto l = compute_layout(numels, o);
  ASSERT_EQ(l.params.size(), numels.size());
  // Reverse registration order: the last parameter comes first, starts strictly increase.
  for (size_t i = 0; i + 1 < numels.size(); ++i)
    EXPECT_GT(l.params[i].start, l.params[i + 1].start);
  EXPECT_EQ(l.params.back().start, 0);
  int64_t covered = 0;
  for (size_t b = 0; b < l.buckets.size(); ++b) {
    const auto& bk = l.buckets[b];
    EXPECT_EQ(bk.start, b == 0 ? 0 : l.buckets[b - 1].end);  // buckets tile the buffer
    EXPECT_EQ((bk.end - bk.start) % fp8dp::bucket_end_multiple(o), 0);
    if (dist_opt) EXPECT_EQ((bk.end - bk.start) % dp, 0);
    for (int64_t p : bk.params) {
      const auto& r = l.params[p];
      EXPECT_EQ(r.bucket, static_cast<int64_t>(b));
      EXPECT_GE(r.start, bk.start);  // never split
      EXPECT_LE(r.end, bk.end);
      EXPECT_EQ(r.end - r.start, numels[p]);
      if (dist_opt) EXPECT_EQ(r.start % 64, 0);
      covered += r.end - r.start;
    }
    // A bucket closes as soon as it reaches bucket_size: it was still below it before its last
    // parameter was added (alignment padding may push that parameter's start past it).
    const auto& last = l.params[bk.params.back()];
    if (bk.params.size() > 1)
      EXPECT_LT(l.params[bk.params[bk.params.size() - 2]].end - bk.start, bucket_size);
    if (b + 1 < l.buckets.size()) EXPECT_GE(last.end - bk.start, bucket_size);
  }
  EXPECT_EQ(covered, std::accumulate(numels.begin(), numels.end(), int64_t{0}));
  EXPECT_EQ(l.numel, l.buckets.back().end);
  if (!dist_opt) {  // no padding at all: the buffer is exactly the parameters
    EXPECT_EQ(l.numel, covered);
    return;
  }
  // Shards: the dp ranks' owned pieces cover every parameter element exactly once.
  std::vector<int64_t> seen(numels.size(), 0);
  for (int64_t r = 0; r < dp; ++r)
    for (const auto& s : fp8dp::owned_shards(l, dp, r)) {
      const auto& bk = l.buckets[l.params[s.param].bucket];
      const int64_t chunk = (bk.end - bk.start) / dp;
      EXPECT_GE(s.buffer_offset, bk.start + r * chunk);
      EXPECT_LE(s.buffer_offset + s.numel, bk.start + (r + 1) * chunk);
      EXPECT_EQ(s.buffer_offset, l.params[s.param].start + s.param_offset);
      seen[s.param] += s.numel;
    }
  for (size_t p = 0; p < numels.size(); ++p) EXPECT_EQ(seen[p], numels[p]) << "param " << p;
}

INSTANTIATE_TEST_SUITE_P(
    Sizes, LayoutTest,
    ::testing::Combine(::testing::Range(0, static_cast<int>(kModels.size())),
                       ::testing::Values<int64_t>(1, 2, 3, 8), ::testing::Bool(),
                       ::testing::Values<int64_t>(1, 100, 5000, int64_t{1} << 40)),
    [](const auto& info) {
      return "model" + std::to_string(std::get<0>(info.param)) + "_dp" +
             std::to_string(std::get<1>(info.param)) +
             (std::get<2>(info.param) ? "_distopt" : "_plain") + "_bucket" +
             std::to_string(std::get<3>(info.param) > 1000000 ? 0 : std::get<3>(info.param));
    });

TEST(Layout, ExactOffsetsWithDistributedOptimizer) {
  // Hand-derived: reverse order 70@0, 5@128 (64-aligned), 300@192 ends at 492 >= 200: the bucket
  // closes, padded to lcm(3, 128) = 384 -> 768; then 10@768, padded to 1152.
  LayoutOptions o;
  o.dp = 3;
  o.distributed_optimizer = true;
  o.bucket_size = 200;
  const auto l = compute_layout({10, 300, 5, 70}, o);
  EXPECT_EQ(l.params[3].start, 0);
  EXPECT_EQ(l.params[2].start, 128);
  EXPECT_EQ(l.params[1].start, 192);
  EXPECT_EQ(l.params[0].start, 768);
  ASSERT_EQ(l.buckets.size(), 2u);
  EXPECT_EQ(l.buckets[0].end, 768);
  EXPECT_EQ(l.numel, 1152);
}

TEST(Layout, HighBusBandwidthPadding) {
  LayoutOptions o;
  o.dp = 3;
  o.distributed_optimizer = true;
  o.pad_for_high_nccl_busbw = true;
  EXPECT_EQ(fp8dp::bucket_end_multiple(o), 3 * 65536);
  EXPECT_EQ(compute_layout({1000}, o).numel, 3 * 65536);
}

TEST(Layout, BadArgumentsNameTheArgument) {
  LayoutOptions o;
  o.bucket_size = 0;
  try {
    compute_layout({4}, o);
    FAIL() << "bucket_size 0 accepted";
  } catch (const fp8dp::ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("bucket_size: expected > 0 elements, got 0"),
              std::string::npos);
  }
  o.bucket_size = 10;
  EXPECT_THROW(compute_layout({4, 0}, o), fp8dp::ValueError);
  o.dp = 0;
  EXPECT_THROW(compute_layout({4}, o), fp8dp::ValueError);
}

}  // namespace

// Buffer layout rules (Megatron-style): reverse registration order, no split parameters, and with
// the distributed optimizer 64-element parameter alignment and bucket ends padded so that every
// bucket splits evenly across ranks into chunks that keep NCCL's bus bandwidth high.
#include "grad_buffer/layout.h"

#include <algorithm>
#include <numeric>

#include "common/check.h"

namespace fp8dp {
namespace {

int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }

// Parameter starts align to 64 elements (256 bytes in FP32): aligned vector loads in the optimizer
// and in the kernels that read main_grad.
constexpr int64_t kParamAlign = 64;

}  // namespace

int64_t bucket_end_multiple(const LayoutOptions& opts) {
  if (!opts.distributed_optimizer) return 1;
  int64_t m = std::lcm(opts.dp, int64_t{128});
  if (opts.pad_for_high_nccl_busbw) m = std::lcm(m, int64_t{1} << 16);
  return m;
}

Layout compute_layout(const std::vector<int64_t>& numels, const LayoutOptions& opts) {
  FP8DP_CHECK_ARG(opts.bucket_size > 0, "bucket_size: expected > 0 elements, got ",
                  opts.bucket_size);
  FP8DP_CHECK_ARG(opts.dp > 0, "dp: expected a world size > 0, got ", opts.dp);
  const int64_t align = opts.distributed_optimizer ? kParamAlign : 1;
  const int64_t end_multiple = bucket_end_multiple(opts);

  Layout out;
  out.params.resize(numels.size());
  BucketRange cur;
  int64_t offset = 0;
  auto close_bucket = [&] {
    cur.end = round_up(offset, end_multiple);
    offset = cur.end;
    out.buckets.push_back(std::move(cur));
    cur = BucketRange{};
    cur.start = offset;
  };
  for (size_t k = numels.size(); k-- > 0;) {
    FP8DP_CHECK_ARG(numels[k] > 0, "numels[", k, "]: expected a parameter with > 0 elements, got ",
                    numels[k]);
    const int64_t start = cur.params.empty() ? cur.start : round_up(offset, align);
    out.params[k] = ParamRange{start, start + numels[k], static_cast<int64_t>(out.buckets.size())};
    cur.params.push_back(static_cast<int64_t>(k));
    offset = start + numels[k];
    if (offset - cur.start >= opts.bucket_size) close_bucket();
  }
  if (!cur.params.empty()) close_bucket();
  out.numel = offset;
  return out;
}

std::vector<ShardRange> owned_shards(const Layout& layout, int64_t dp, int64_t rank) {
  FP8DP_CHECK_ARG(dp > 0 && rank >= 0 && rank < dp, "rank: expected in [0, ", dp, "), got ", rank);
  std::vector<ShardRange> out;
  for (const auto& b : layout.buckets) {
    const int64_t n = b.end - b.start;
    FP8DP_CHECK(n % dp == 0, "bucket [", b.start, ", ", b.end, ") does not split into ", dp,
                " equal chunks; was the layout computed with distributed_optimizer?");
    const int64_t lo = b.start + rank * (n / dp), hi = lo + n / dp;
    for (int64_t p : b.params) {
      const auto& r = layout.params[p];
      const int64_t s = std::max(r.start, lo), e = std::min(r.end, hi);
      if (s < e) out.push_back(ShardRange{p, s - r.start, s, e - s});
    }
  }
  return out;
}

}  // namespace fp8dp

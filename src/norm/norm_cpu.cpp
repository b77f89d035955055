// CPU LayerNorm / RMSNorm forward fused with the FP8 cast: rows in parallel, one row per step.
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <cmath>
#include <limits>
#include <vector>

#include "common/check.h"
#include "common/parallel.h"
#include "norm/norm_kernel.h"

namespace fp8dp {
namespace {

template <typename T>
float load(const void* p, int64_t i) {
  return static_cast<float>(static_cast<const T*>(p)[i]);
}

template <Format F, typename T>
void norm_rows(const NormFwdParams& p, int64_t r0, int64_t r1, float* amax_out) {
  const T* in = static_cast<const T*>(p.input);
  const T* gamma = static_cast<const T*>(p.gamma);
  const T* beta = static_cast<const T*>(p.beta);
  T* out = static_cast<T*>(p.out);
  const int64_t n = p.cols;
  const float scale = p.out_fp8 ? *p.scale : 1.0f;
  const float gshift = p.zero_centered_gamma ? 1.0f : 0.0f;
  float amax = 0.0f;
  int nan = 0;
  for (int64_t r = r0; r < r1; ++r) {
    const T* x = in + r * n;
    // The row stays in cache between the statistics and the output loop, so memory sees one pass.
    float mu = 0.0f;
    if (!p.rms) {
      for (int64_t c = 0; c < n; ++c) mu += static_cast<float>(x[c]);
      mu /= static_cast<float>(n);
    }
    float var = 0.0f;
    for (int64_t c = 0; c < n; ++c) {
      const float d = static_cast<float>(x[c]) - mu;
      var += d * d;
    }
    var /= static_cast<float>(n);
    const float rs = 1.0f / std::sqrt(var + p.eps);
    if (p.mu) p.mu[r] = mu;
    if (p.rsigma) p.rsigma[r] = rs;
    for (int64_t c = 0; c < n; ++c) {
      float z = (static_cast<float>(x[c]) - mu) * rs * (static_cast<float>(gamma[c]) + gshift);
      if (beta) z += static_cast<float>(beta[c]);
      const T zt = static_cast<T>(z);  // round to the activation dtype (identity for float)
      const float zr = static_cast<float>(zt);
      if (out) out[r * n + c] = zt;
      nan |= (zr != zr);
      const float a = std::fabs(zr);
      amax = a > amax ? a : amax;
      if (p.out_fp8) p.out_fp8[r * n + c] = quantize_one<F>(zr * scale);
    }
  }
  *amax_out = nan ? std::numeric_limits<float>::quiet_NaN() : amax;
}

template <Format F, typename T>
void norm_dispatch(const NormFwdParams& p) {
  // Parallel over row blocks; each block reports its amax and the blocks are combined in order.
  const int64_t grain = std::max<int64_t>(1, 16384 / std::max<int64_t>(p.cols, 1));
  const int64_t nblocks = (p.rows + grain - 1) / grain;
  std::vector<float> amax(static_cast<size_t>(nblocks), 0.0f);
  parallel_for(0, nblocks, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t b = b0; b < b1; ++b) {
      norm_rows<F, T>(p, b * grain, std::min(p.rows, (b + 1) * grain), &amax[b]);
    }
  });
  float total = (p.amax != nullptr && p.amax_accumulate) ? *p.amax : 0.0f;
  for (float a : amax) {
    total = (std::isnan(a) || std::isnan(total)) ? std::numeric_limits<float>::quiet_NaN()
                                                 : std::max(total, a);
  }
  if (p.amax) *p.amax = total;
}

template <Format F>
void norm_dispatch_dtype(const NormFwdParams& p) {
  switch (p.dtype) {
    case DType::kFloat32:
      return norm_dispatch<F, float>(p);
    case DType::kBFloat16:
      return norm_dispatch<F, c10::BFloat16>(p);
    case DType::kFloat16:
      return norm_dispatch<F, c10::Half>(p);
    default:
      break;
  }
  FP8DP_CHECK(false, "norm_fwd_cpu: no kernel for dtype ", dtype_name(p.dtype));
}

}  // namespace

void norm_fwd_cpu(const NormFwdParams& p) {
  FP8DP_CHECK(p.rows >= 0 && p.cols > 0, "norm_fwd_cpu: bad shape [", p.rows, ", ", p.cols, "]");
  FP8DP_CHECK(p.rows == 0 || (p.input != nullptr && p.gamma != nullptr),
              "norm_fwd_cpu: input or gamma is null");
  FP8DP_CHECK(p.out_fp8 == nullptr || p.scale != nullptr, "norm_fwd_cpu: out_fp8 needs a scale");
  FP8DP_CHECK(p.scale_inv == nullptr || p.scale != nullptr,
              "norm_fwd_cpu: scale_inv needs a scale");
  if (p.scale_inv != nullptr) *p.scale_inv = scale_inverse(*p.scale);
  if (p.format == Format::kE4M3) {
    norm_dispatch_dtype<Format::kE4M3>(p);
  } else {
    norm_dispatch_dtype<Format::kE5M2>(p);
  }
}

}  // namespace fp8dp

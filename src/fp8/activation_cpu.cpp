// CPU kernel of the activation + FP8 cast (activation_kernel.h): the activation into a buffer of
// the high-precision dtype (the bytes the unfused path would store), then quantize_cpu over it.
// The buffer is the CPU emulation's scratch, not a saved tensor; the CUDA kernel never writes it.
// Compiled with -ffp-contract=off (CMakeLists.txt): activation_math.h must not be contracted.
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <limits>
#include <vector>

#include "common/check.h"
#include "fp8/activation_kernel.h"
#include "fp8/quantize.h"

namespace fp8dp {
namespace {

template <typename T>
void compute(const ActParams& p, T* out) {
  const T* h = static_cast<const T*>(p.input);
  const T* da = static_cast<const T*>(p.grad);
  const int64_t cols = p.cols, in_cols = p.in_cols(), out_cols = p.out_cols();
  // RNE into T; every NaN as the positive quiet NaN (c10 stores it as 0x7FC0 in bf16, 0x7E00 in
  // half): the sign of a NaN the activation makes differs between x86 (-Inf * 0 is -NaN) and the
  // GPU, and the FP8 byte keeps it. The CUDA kernels store the same (activation_cast.cu).
  auto round = [](float v) {
    return static_cast<T>(v != v ? std::numeric_limits<float>::quiet_NaN() : v);
  };
  at::parallel_for(0, p.rows, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const T* hr = h + r * in_cols;
      T* o = out + r * out_cols;
      if (!p.backward) {
        for (int64_t c = 0; c < cols; ++c) {
          o[c] = round(p.act == Activation::kGelu ? act::gelu(static_cast<float>(hr[c]))
                                                  : act::swiglu(static_cast<float>(hr[c]),
                                                                static_cast<float>(hr[cols + c])));
        }
      } else {
        const T* dr = da + r * cols;
        for (int64_t c = 0; c < cols; ++c) {
          const float g = static_cast<float>(dr[c]);
          if (p.act == Activation::kGelu) {
            o[c] = round(act::mul(g, act::dgelu(static_cast<float>(hr[c]))));
          } else {
            float dgate, dup;
            act::dswiglu(g, static_cast<float>(hr[c]), static_cast<float>(hr[cols + c]), dgate,
                         dup);
            o[c] = round(dgate);
            o[cols + c] = round(dup);
          }
        }
      }
    }
  });
}

template <typename T>
void run(const ActParams& p) {
  const int64_t n = p.rows * p.out_cols();
  std::vector<T> scratch;
  T* buf = static_cast<T*>(p.out_hp);
  if (buf == nullptr) {
    scratch.resize(static_cast<size_t>(n));
    buf = scratch.data();
  }
  compute<T>(p, buf);
  if (p.out == nullptr && p.out_t == nullptr && p.amax == nullptr && p.dbias == nullptr) return;
  const float one = 1.0f;
  QuantizeParams q;
  q.input = buf;
  q.input_dtype = p.dtype;
  q.rows = p.rows;
  q.cols = p.out_cols();
  q.scale = p.scale != nullptr ? p.scale : &one;  // the amax pass casts nothing
  q.format = p.format;
  q.out = p.out;
  q.out_t = p.out_t;
  q.amax = p.amax;
  q.amax_accumulate = p.amax_accumulate;
  q.scale_inv = p.scale_inv;
  q.dbias = p.dbias;
  q.dbias_dtype = p.dbias_dtype;
  quantize_cpu(q);
}

}  // namespace

void activation_cpu(const ActParams& p) {
  FP8DP_CHECK(p.scale != nullptr || (p.out == nullptr && p.out_t == nullptr),
              "activation_cpu: an FP8 output needs a scale");
  switch (p.dtype) {
    case DType::kFloat32:
      return run<float>(p);
    case DType::kBFloat16:
      return run<c10::BFloat16>(p);
    case DType::kFloat16:
      return run<c10::Half>(p);
    default:
      FP8DP_CHECK(false, "activation_cpu: no kernel for input dtype ", dtype_name(p.dtype));
  }
}

}  // namespace fp8dp

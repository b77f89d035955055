// Buffer: the contiguous main_grad storage of every parameter of one (param dtype, grad dtype), and
// a contiguous parameter storage with the same layout that the parameters' data are moved into (so
// one broadcast or all-gather per bucket updates them). Bucket: views and offsets into both.
#pragma once

#include <ATen/core/Tensor.h>

#include <vector>

#include "grad_buffer/layout.h"

namespace fp8dp {

struct Bucket {
  at::Tensor grad;   // [numel] view into the grad storage
  at::Tensor param;  // [numel] view into the param storage
  int64_t offset = 0;
  int64_t numel = 0;
  std::vector<int64_t> params;        // global parameter indices, in layout order
  std::vector<int64_t> param_starts;  // params[k] occupies [param_starts[k], +param_numels[k])
  std::vector<int64_t> param_numels;  // of the bucket's views
};

class Buffer {
 public:
  // params: all of one dtype and device; global_index[i]: params[i]'s index in the owner. Copies
  // each parameter into the param storage and points its data there (set_data keeps the autograd
  // identity), and zero-fills the grad storage, padding included.
  Buffer(const std::vector<at::Tensor>& params, std::vector<int64_t> global_index,
         at::ScalarType grad_dtype, const LayoutOptions& opts);

  // params[local]'s main_grad: a view shaped like the parameter, valid for the buffer's lifetime.
  at::Tensor main_grad(int64_t local) const;
  // params[local]'s place in the param storage (what its data must view).
  at::Tensor param_view(int64_t local) const;
  const Layout& layout() const { return layout_; }

  at::ScalarType param_dtype;
  at::ScalarType grad_dtype;
  at::Tensor grad_data;
  at::Tensor param_data;
  std::vector<Bucket> buckets;
  std::vector<int64_t> global_index;

 private:
  Layout layout_;
  std::vector<std::vector<int64_t>> shapes_;
};

}  // namespace fp8dp

#include "grad_buffer/buffer.h"

#include <ATen/ATen.h>

#include "common/check.h"

namespace fp8dp {

Buffer::Buffer(const std::vector<at::Tensor>& params, std::vector<int64_t> global_index_,
               at::ScalarType grad_dtype_, const LayoutOptions& opts)
    : param_dtype(params.at(0).scalar_type()),
      grad_dtype(grad_dtype_),
      global_index(std::move(global_index_)) {
  std::vector<int64_t> numels;
  for (const auto& p : params) {
    numels.push_back(p.numel());
    shapes_.push_back(p.sizes().vec());
  }
  layout_ = compute_layout(numels, opts);
  const auto dev = params[0].device();
  grad_data = at::zeros({layout_.numel}, at::TensorOptions().dtype(grad_dtype).device(dev));
  param_data = at::zeros({layout_.numel}, at::TensorOptions().dtype(param_dtype).device(dev));
  for (size_t i = 0; i < params.size(); ++i) {
    const auto& r = layout_.params[i];
    at::Tensor view = param_data.narrow(0, r.start, r.end - r.start).view(shapes_[i]);
    view.copy_(params[i].detach());
    at::Tensor p = params[i];
    p.set_data(view);
  }
  for (const auto& b : layout_.buckets) {
    Bucket bucket;
    bucket.offset = b.start;
    bucket.numel = b.end - b.start;
    bucket.grad = grad_data.narrow(0, b.start, bucket.numel);
    bucket.param = param_data.narrow(0, b.start, bucket.numel);
    for (int64_t local : b.params) {
      bucket.params.push_back(global_index[local]);
      bucket.param_starts.push_back(layout_.params[local].start - b.start);
      bucket.param_numels.push_back(numels[local]);
    }
    buckets.push_back(std::move(bucket));
  }
}

at::Tensor Buffer::main_grad(int64_t local) const {
  const auto& r = layout_.params.at(local);
  return grad_data.narrow(0, r.start, r.end - r.start).view(shapes_[local]);
}

at::Tensor Buffer::param_view(int64_t local) const {
  const auto& r = layout_.params.at(local);
  return param_data.narrow(0, r.start, r.end - r.start).view(shapes_[local]);
}

}  // namespace fp8dp

#include "grad_buffer/bucket_group.h"

#include <ATen/ATen.h>

#include "common/check.h"

namespace fp8dp {

BucketGroup::BucketGroup(std::vector<const Bucket*> buckets, const std::vector<std::string>* names)
    : buckets_(std::move(buckets)), names_(names) {}

void BucketGroup::check_local_finite() {
  if (checked_) return;
  checked_ = true;
  for (const Bucket* b : buckets_) {
    if (at::isfinite(b->grad).all().item<bool>()) continue;  // one pass for the common case
    // Name the culprits: the views of the parameters that hold a NaN or Inf.
    for (size_t k = 0; k < b->params.size(); ++k) {
      at::Tensor v = b->grad.narrow(0, b->param_starts[k], b->param_numels[k]);
      if (!at::isfinite(v).all().item<bool>()) nonfinite_.push_back((*names_)[b->params[k]]);
    }
  }
}

void BucketGroup::start_grad_sync(Communicator& comm, const SyncSettings& s) {
  FP8DP_CHECK(!launched_, "bucket group launched twice in one iteration");
  if (s.check_for_nan) check_local_finite();
  const int dp = comm.size();
  std::vector<at::Tensor> grads;
  for (const Bucket* b : buckets_) {
    if (!s.average_in_collective && dp > 1) b->grad.mul_(1.0 / dp);
    grads.push_back(b->grad);
  }
  const ReduceOp op = s.average_in_collective ? ReduceOp::kAvg : ReduceOp::kSum;
  if (s.reduce_scatter) {
    std::vector<at::Tensor> chunks;
    for (const auto& g : grads) {
      const int64_t n = g.numel() / dp;
      chunks.push_back(g.narrow(0, comm.rank() * n, n));
    }
    grad_work_ = comm.reduce_scatter(grads, chunks, op);
  } else {
    grad_work_ = comm.all_reduce(grads, op);
  }
  launched_ = true;
}

void BucketGroup::finish_grad_sync() {
  if (!grad_work_) return;
  auto w = std::move(grad_work_);
  grad_work_.reset();
  w->wait();
}

void BucketGroup::start_param_sync(Communicator& comm) {
  const int dp = comm.size();
  std::vector<at::Tensor> chunks, whole;
  for (const Bucket* b : buckets_) {
    const int64_t n = b->param.numel() / dp;
    chunks.push_back(b->param.narrow(0, comm.rank() * n, n));
    whole.push_back(b->param);
  }
  param_work_ = comm.all_gather(chunks, whole);
}

void BucketGroup::finish_param_sync() {
  if (!param_work_) return;
  auto w = std::move(param_work_);
  param_work_.reset();
  w->wait();
}

void BucketGroup::reset() {
  launched_ = false;
  checked_ = false;
  nonfinite_.clear();
}

}  // namespace fp8dp

#include "grad_buffer/bucket_group.h"

#include <ATen/ATen.h>

#include "common/check.h"

namespace fp8dp {

BucketGroup::BucketGroup(std::vector<const Bucket*> buckets, const std::vector<std::string>* names)
    : buckets_(std::move(buckets)), names_(names) {}

void BucketGroup::flag_local_nonfinite() {
  if (nonfinite_.defined()) return;
  // One multi-tensor L1 norm per group: NaN and Inf propagate through a sum of magnitudes, so a
  // parameter is flagged iff its norm is not finite. Everything stays on the device; the one host
  // read happens in GradSync::finish_grad_sync for all groups together (a .item() per bucket would
  // stall the backward pass at every launch).
  std::vector<at::Tensor> views;
  for (const Bucket* b : buckets_)
    for (size_t k = 0; k < b->params.size(); ++k)
      views.push_back(b->grad.narrow(0, b->param_starts[k], b->param_numels[k]));
  nonfinite_ = at::isfinite(at::stack(at::_foreach_norm(views, 1))).logical_not();
}

std::vector<std::string> BucketGroup::nonfinite_names() const {
  std::vector<std::string> out;
  if (!nonfinite_.defined()) return out;
  const at::Tensor flags = nonfinite_.cpu();
  const bool* f = flags.const_data_ptr<bool>();
  int64_t i = 0;
  for (const Bucket* b : buckets_)
    for (int64_t p : b->params)
      if (f[i++]) out.push_back((*names_)[p]);
  return out;
}

void BucketGroup::start_grad_sync(Communicator& comm, const SyncSettings& s) {
  FP8DP_CHECK(!launched_, "bucket group launched twice in one iteration");
  if (s.check_for_nan) flag_local_nonfinite();
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
  FP8DP_CHECK(!param_work_, "bucket group: parameter all-gather started twice without a finish");
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
  nonfinite_ = at::Tensor();
}

}  // namespace fp8dp

#include "grad_buffer/param_sync.h"

#include <ATen/ATen.h>

#include <algorithm>
#include <limits>

#include "common/check.h"

namespace fp8dp {

ParamSync::ParamSync(std::vector<at::Tensor>& params, std::vector<Buffer>& buffers,
                     std::vector<BucketGroup>& groups, const std::vector<int64_t>& group_of_param,
                     Communicator& comm, bool distributed_optimizer)
    : params_(params),
      buffers_(buffers),
      groups_(groups),
      comm_(comm),
      distributed_optimizer_(distributed_optimizer) {
  std::vector<int64_t> first(groups_.size(), std::numeric_limits<int64_t>::max());
  for (size_t p = 0; p < params_.size(); ++p)
    first[group_of_param[p]] = std::min(first[group_of_param[p]], static_cast<int64_t>(p));
  for (size_t g = 0; g < groups_.size(); ++g) order_.push_back(static_cast<int64_t>(g));
  std::stable_sort(order_.begin(), order_.end(),
                   [&](int64_t a, int64_t b) { return first[a] < first[b]; });
}

std::vector<OwnedShard> ParamSync::owned_shards() const {
  FP8DP_CHECK(distributed_optimizer_,
              "owned_shards: the buffers were built without use_distributed_optimizer");
  std::vector<OwnedShard> out;
  for (size_t b = 0; b < buffers_.size(); ++b)
    for (const auto& s : fp8dp::owned_shards(buffers_[b].layout(), comm_.size(), comm_.rank()))
      out.push_back(OwnedShard{buffers_[b].global_index[s.param], s.param_offset, s.numel,
                               static_cast<int64_t>(b), s.buffer_offset});
  return out;
}

at::Tensor ParamSync::grad_shard(const OwnedShard& s) const {
  return buffers_.at(s.buffer).grad_data.narrow(0, s.buffer_offset, s.numel);
}

at::Tensor ParamSync::param_shard(const OwnedShard& s) const {
  return buffers_.at(s.buffer).param_data.narrow(0, s.buffer_offset, s.numel);
}

void ParamSync::check_masters(const std::vector<at::Tensor>& masters) const {
  const auto shards = owned_shards();
  FP8DP_CHECK_ARG(masters.size() == shards.size(), "masters: expected ", shards.size(),
                  " shards, got ", masters.size());
  for (size_t k = 0; k < shards.size(); ++k)
    FP8DP_CHECK_ARG(masters[k].numel() == shards[k].numel, "masters[", k, "]: expected ",
                    shards[k].numel, " elements, got ", masters[k].numel());
}

void ParamSync::copy_shards(const std::vector<at::Tensor>& masters) {
  const auto shards = owned_shards();
  finish(-1);  // a step without a forward in between: the last gather writes here
  // param_data is plain storage (no autograd history), so the copies need no grad-mode guard.
  for (size_t k = 0; k < shards.size(); ++k)
    param_shard(shards[k]).copy_(masters[k].detach().reshape({-1}));
  bump_param_versions();
}

void ParamSync::start() {
  FP8DP_CHECK(distributed_optimizer_,
              "start_param_sync: the buffers were built without use_distributed_optimizer");
  finish(-1);
  bump_param_versions();
  for (int64_t g : order_) {
    groups_[g].start_param_sync(comm_);
    ++in_flight_;
  }
}

void ParamSync::finish(int64_t group) {
  FP8DP_CHECK_ARG(group >= -1 && group < static_cast<int64_t>(groups_.size()),
                  "group: expected -1 (all) or a bucket group in [0, ", groups_.size(), "), got ",
                  group);
  if (in_flight_ == 0) return;
  for (int64_t g : order_) {
    if (group != -1 && g != group) continue;
    if (!groups_[g].param_sync_in_flight()) continue;
    --in_flight_;  // counted first: a failed wait is reported once, not again
    groups_[g].finish_param_sync();
  }
}

void ParamSync::broadcast(int root) {
  finish(-1);  // an all-gather in flight would overwrite what arrives here
  bump_param_versions();
  std::vector<at::Tensor> data;
  for (auto& b : buffers_) data.push_back(b.param_data);
  comm_.broadcast(data, root)->wait();
}

void ParamSync::bump_param_versions() {
  // The param buffers are written through their own views (copies, all-gathers, broadcasts),
  // which autograd's version counters do not see: the parameters' counters say nothing changed.
  // Bumped here so that whoever caches something derived from a parameter (the FP8 weight cache,
  // C8) sees the write.
  for (auto& p : params_) p.unsafeGetTensorImpl()->bump_version();
}

}  // namespace fp8dp

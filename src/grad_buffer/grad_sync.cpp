#include "grad_buffer/grad_sync.h"

#include <ATen/ATen.h>

#include <limits>
#include <map>
#include <sstream>

#include "common/check.h"

namespace fp8dp {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

GradSync::GradSync(std::vector<at::Tensor> params, std::vector<std::string> names,
                   std::shared_ptr<Communicator> comm, GradSyncOptions opts)
    : params_(std::move(params)), names_(std::move(names)), comm_(std::move(comm)), opts_(opts) {
  FP8DP_CHECK_ARG(comm_, "communicator: expected one, got None");
  FP8DP_CHECK_ARG(!params_.empty(),
                  "module: expected at least one parameter that requires grad, "
                  "got none");
  FP8DP_CHECK_ARG(names_.size() == params_.size(), "names: expected ", params_.size(),
                  " names, got ", names_.size());
  FP8DP_CHECK_ARG(opts_.bucket_size > 0, "bucket_size: expected > 0 elements, got ",
                  opts_.bucket_size);
  const auto dev = params_[0].device();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto dt = params_[i].scalar_type();
    FP8DP_CHECK_ARG(params_[i].device() == dev, "parameter '", names_[i], "': expected device ",
                    dev, " like '", names_[0], "', got ", params_[i].device());
    FP8DP_CHECK_ARG(dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf, "parameter '",
                    names_[i], "': expected dtype float32, bfloat16 or float16, got ", dt);
  }
  settings_.reduce_scatter = opts_.use_distributed_optimizer;
  settings_.average_in_collective = opts_.average_in_collective;
  settings_.check_for_nan = opts_.check_for_nan_in_grad;

  LayoutOptions lo;
  // Without overlap there is nothing to overlap with: one bucket per buffer, one collective.
  lo.bucket_size =
      opts_.overlap_grad_reduce ? opts_.bucket_size : std::numeric_limits<int64_t>::max() / 2;
  lo.dp = comm_->size();
  lo.distributed_optimizer = opts_.use_distributed_optimizer;
  lo.pad_for_high_nccl_busbw = opts_.pad_buckets_for_high_nccl_busbw;

  // One buffer per (param dtype, grad dtype), in order of first appearance.
  std::vector<at::ScalarType> order;
  std::map<at::ScalarType, std::vector<int64_t>> members;
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto dt = params_[i].scalar_type();
    if (!members.count(dt)) order.push_back(dt);
    members[dt].push_back(static_cast<int64_t>(i));
  }
  where_.resize(params_.size());
  buffers_.reserve(order.size());
  for (auto dt : order) {
    std::vector<at::Tensor> ps;
    for (int64_t i : members[dt]) {
      where_[i] = {static_cast<int64_t>(buffers_.size()), static_cast<int64_t>(ps.size())};
      ps.push_back(params_[i]);
    }
    buffers_.emplace_back(ps, members[dt], opts_.grad_reduce_in_fp32 ? at::kFloat : dt, lo);
  }

  // Bucket groups: one per bucket with overlap (launched as each completes), else one for all.
  group_of_param_.assign(params_.size(), 0);
  std::vector<std::vector<const Bucket*>> grouped;
  for (const auto& b : buffers_)
    for (const auto& bucket : b.buckets) {
      if (opts_.overlap_grad_reduce || grouped.empty()) grouped.emplace_back();
      grouped.back().push_back(&bucket);
      for (int64_t p : bucket.params) group_of_param_[p] = static_cast<int64_t>(grouped.size()) - 1;
    }
  for (auto& g : grouped) groups_.emplace_back(std::move(g), &names_);
  readiness_ =
      std::make_unique<Readiness>(group_of_param_, names_, static_cast<int64_t>(groups_.size()));
  ledger_ = std::make_unique<Ledger>(names_);
  check_same_layout_on_all_ranks();
}

void GradSync::check_same_layout_on_all_ranks() {
  // Signature: parameter count, total elements, and a hash of every size and dtype. A rank whose
  // model differs would otherwise pair its buckets with the wrong ones and reduce garbage.
  int64_t numel = 0;
  uint64_t h = 1469598103934665603ull;
  for (size_t i = 0; i < params_.size(); ++i) {
    numel += params_[i].numel();
    for (int64_t s : params_[i].sizes()) h = (h ^ static_cast<uint64_t>(s)) * 1099511628211ull;
    h = (h ^ static_cast<uint64_t>(params_[i].scalar_type())) * 1099511628211ull;
  }
  const int dp = comm_->size();
  auto opts = at::TensorOptions().dtype(at::kLong).device(params_[0].device());
  at::Tensor mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(params_.size()), numel,
                                                    static_cast<int64_t>(h >> 2), dp},
                               opts);
  at::Tensor all = at::empty({4 * dp}, opts);
  comm_->all_gather({mine}, {all})->wait();
  at::Tensor cpu = all.cpu();
  const int64_t* a = cpu.const_data_ptr<int64_t>();
  for (int r = 0; r < dp; ++r) {
    FP8DP_CHECK_ARG(a[4 * r + 3] == dp, "process_group: rank ", r, " sees world size ",
                    a[4 * r + 3], " but rank ", comm_->rank(), " sees ", dp,
                    ": mismatched world sizes");
    FP8DP_CHECK_ARG(a[4 * r] == a[0] && a[4 * r + 1] == a[1] && a[4 * r + 2] == a[2],
                    "module: rank ", r, " has ", a[4 * r], " trainable parameters with ",
                    a[4 * r + 1], " elements but rank 0 has ", a[0], " with ", a[1],
                    " (or their shapes/dtypes differ): every rank must wrap the same model");
  }
}

at::Tensor GradSync::main_grad(int64_t p) const {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  return buffers_[where_[p].first].main_grad(where_[p].second);
}

void GradSync::param_ready(int64_t p, const std::optional<at::Tensor>& grad,
                           bool grad_added_to_main_grad) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  const bool has_grad = grad.has_value() && grad->defined();
  finished_ = false;
  if (opts_.grad_ledger)
    ledger_->record(p, grad_added_to_main_grad ? Route::kFused
                       : has_grad              ? Route::kAccumulated
                                               : Route::kExternal);
  // Count first: an excess report throws before its gradient could be added a second time.
  const bool complete = sync_enabled_ && readiness_->mark(p);
  if (has_grad && !grad_added_to_main_grad) {
    at::Tensor mg = main_grad(p);
    FP8DP_CHECK_ARG(grad->sizes() == mg.sizes(), "gradient of '", names_[p], "': expected shape ",
                    mg.sizes(), ", got ", grad->sizes());
    mg.add_(*grad);
  }
  if (complete && opts_.overlap_grad_reduce && !groups_[group_of_param_[p]].launched())
    groups_[group_of_param_[p]].start_grad_sync(*comm_, settings_);
}

void GradSync::begin_microbatch() {
  std::lock_guard<std::mutex> lock(mu_);
  finished_ = false;
  ledger_->begin_microbatch();
}

void GradSync::start_grad_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& g : groups_)
    if (!g.launched()) g.start_grad_sync(*comm_, settings_);
}

std::string GradSync::local_errors() {
  std::ostringstream err;
  if (sync_enabled_ && readiness_->golden_known()) {
    std::vector<std::string> missing;
    for (size_t g = 0; g < groups_.size(); ++g)
      if (!groups_[g].launched())
        for (auto& s : readiness_->incomplete(static_cast<int64_t>(g))) missing.push_back(s);
    if (!missing.empty())
      err << "finish_grad_sync: bucket(s) still incomplete, these parameters were not reported "
             "ready as often as in the first iteration: "
          << join(missing) << " (a skipped backward_dw() or a hook that did not fire?)";
  }
  if (opts_.grad_ledger) {
    const std::string l = ledger_->end_iteration();
    if (!l.empty()) err << (err.tellp() > 0 ? "\n" : "") << l;
  }
  if (opts_.check_for_nan_in_grad) {
    std::vector<std::string> bad;
    for (auto& g : groups_) {
      if (!g.launched()) g.check_local_finite();
      for (const auto& n : g.nonfinite()) bad.push_back("'" + n + "'");
    }
    if (!bad.empty())
      err << (err.tellp() > 0 ? "\n" : "") << "check_for_nan_in_grad: rank " << comm_->rank()
          << " has NaN or Inf in the local gradients of " << join(bad);
  }
  return err.str();
}

void GradSync::abandon_iteration() {
  for (auto& g : groups_) {
    try {
      g.finish_grad_sync();
    } catch (const std::exception&) {
      // the error being raised already says what went wrong
    }
    g.reset();
  }
  readiness_->reset();
  ledger_->reset();
}

void GradSync::finish_grad_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_) return;
  const std::string err = local_errors();
  if (opts_.grad_ledger || opts_.check_for_nan_in_grad) {
    // Agree before raising: a rank that raised alone would leave the others blocked in the next
    // collective. One tiny all-reduce; each rank sets its own slot.
    const int dp = comm_->size();
    at::Tensor flags =
        at::zeros({dp}, at::TensorOptions().dtype(at::kLong).device(params_[0].device()));
    if (!err.empty()) flags[comm_->rank()].fill_(1);
    comm_->all_reduce({flags}, ReduceOp::kSum)->wait();
    at::Tensor cpu = flags.cpu();
    std::vector<std::string> failed;
    for (int r = 0; r < dp; ++r)
      if (cpu.const_data_ptr<int64_t>()[r]) failed.push_back(std::to_string(r));
    if (!failed.empty()) {
      abandon_iteration();
      FP8DP_CHECK(false, err.empty() ? "finish_grad_sync: rank(s) " + join(failed) +
                                           " found errors (see their messages); main_grad is "
                                           "not reduced"
                                     : err);
    }
  } else if (!err.empty()) {
    abandon_iteration();
    FP8DP_CHECK(false, err);
  }
  for (auto& g : groups_)
    if (!g.launched()) g.start_grad_sync(*comm_, settings_);
  try {
    for (auto& g : groups_) g.finish_grad_sync();
  } catch (const std::exception& e) {
    abandon_iteration();
    throw Error(std::string(e.what()) +
                "\nfinish_grad_sync: main_grad is NOT reduced (buckets may be pre-scaled or "
                "partially reduced); zero_grad_buffer() and redo the iteration");
  }
  for (auto& g : groups_) g.reset();
  readiness_->end_iteration();
  finished_ = true;
}

void GradSync::zero_grad_buffer() {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& g : groups_) g.finish_grad_sync();
  for (auto& g : groups_) g.reset();
  for (auto& b : buffers_) b.grad_data.zero_();
  readiness_->reset();
  ledger_->reset();
  finished_ = false;
}

void GradSync::scale_gradients(double factor) {
  std::lock_guard<std::mutex> lock(mu_);
  for (auto& b : buffers_) b.grad_data.mul_(factor);
}

void GradSync::broadcast_params(int root) {
  std::lock_guard<std::mutex> lock(mu_);
  std::vector<at::Tensor> data;
  for (auto& b : buffers_) data.push_back(b.param_data);
  comm_->broadcast(data, root)->wait();
}

std::vector<OwnedShard> GradSync::owned_shards() const {
  FP8DP_CHECK(opts_.use_distributed_optimizer,
              "owned_shards: the buffers were built without use_distributed_optimizer");
  std::vector<OwnedShard> out;
  for (size_t b = 0; b < buffers_.size(); ++b)
    for (const auto& s : fp8dp::owned_shards(buffers_[b].layout(), comm_->size(), comm_->rank()))
      out.push_back(OwnedShard{buffers_[b].global_index[s.param], s.param_offset, s.numel,
                               static_cast<int64_t>(b), s.buffer_offset});
  return out;
}

at::Tensor GradSync::grad_shard(const OwnedShard& s) const {
  return buffers_.at(s.buffer).grad_data.narrow(0, s.buffer_offset, s.numel);
}

at::Tensor GradSync::param_shard(const OwnedShard& s) const {
  return buffers_.at(s.buffer).param_data.narrow(0, s.buffer_offset, s.numel);
}

void GradSync::copy_shards_and_sync_params(const std::vector<at::Tensor>& masters) {
  const auto shards = owned_shards();
  FP8DP_CHECK_ARG(masters.size() == shards.size(), "masters: expected ", shards.size(),
                  " shards, got ", masters.size());
  std::lock_guard<std::mutex> lock(mu_);
  // param_data is plain storage (no autograd history), so the copies need no grad-mode guard.
  for (size_t k = 0; k < shards.size(); ++k) {
    FP8DP_CHECK_ARG(masters[k].numel() == shards[k].numel, "masters[", k, "]: expected ",
                    shards[k].numel, " elements, got ", masters[k].numel());
    param_shard(shards[k]).copy_(masters[k].detach().reshape({-1}));
  }
  for (auto& g : groups_) g.start_param_sync(*comm_);
  for (auto& g : groups_) g.finish_param_sync();
}

}  // namespace fp8dp

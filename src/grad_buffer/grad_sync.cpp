#include "grad_buffer/grad_sync.h"

#include <ATen/ATen.h>
#include <c10/core/impl/VirtualGuardImpl.h>

#include <algorithm>
#include <limits>
#include <map>
#include <sstream>

#include "common/check.h"
#include "common/tensor_checks.h"

namespace fp8dp {
namespace {

std::string join(const std::vector<std::string>& v) {
  std::string s;
  for (const auto& x : v) s += (s.empty() ? "" : ", ") + x;
  return s;
}

}  // namespace

const char* phase_name(Phase p) {
  switch (p) {
    case Phase::kAccumulating:
      return "accumulating";
    case Phase::kSyncStarted:
      return "sync_started";
    case Phase::kFinished:
      return "finished";
    case Phase::kStepped:
      return "stepped";
    case Phase::kFailed:
      return "failed";
  }
  return "?";
}

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
  FP8DP_CHECK_ARG(!opts_.defer_nan_check || (opts_.check_for_nan_in_grad && !opts_.grad_ledger),
                  "defer_nan_check: True needs check_for_nan_in_grad=True and grad_ledger=False, "
                  "got check_for_nan_in_grad=",
                  opts_.check_for_nan_in_grad, ", grad_ledger=", opts_.grad_ledger);
  const auto dev = params_[0].device();
  for (size_t i = 0; i < params_.size(); ++i) {
    const auto dt = params_[i].scalar_type();
    FP8DP_CHECK_ARG(params_[i].device() == dev, "parameter '", names_[i], "': expected device ",
                    dev, " like '", names_[0], "', got ", params_[i].device());
    FP8DP_CHECK_ARG(is_high_precision(dt), "parameter '", names_[i],
                    "': expected dtype float32, bfloat16 or float16, got ", dt);
  }
  settings_.reduce_scatter = opts_.use_distributed_optimizer;
  settings_.average_in_collective = opts_.average_in_collective;
  settings_.check_for_nan = opts_.check_for_nan_in_grad;
  settings_.wire = wire_from_name(opts_.grad_reduce_wire);

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

  if (settings_.wire != Wire::kFP32)
    for (const auto& b : buffers_)
      FP8DP_CHECK_ARG(b.grad_dtype == at::kFloat, "grad_reduce_wire: '", opts_.grad_reduce_wire,
                      "' encodes FP32 gradient buffers, but parameter '",
                      names_[b.global_index.at(0)], "' has a ", b.grad_dtype,
                      " buffer (grad_reduce_in_fp32=False): set grad_reduce_in_fp32=True or "
                      "grad_reduce_wire='fp32'");

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
  for (const auto& g : groups_) {
    const std::vector<int64_t> ps = g.flag_params();
    deferred_order_.insert(deferred_order_.end(), ps.begin(), ps.end());
  }
  param_sync_ = std::make_unique<ParamSync>(params_, buffers_, groups_, group_of_param_, *comm_,
                                            opts_.use_distributed_optimizer);
  readiness_ =
      std::make_unique<Readiness>(group_of_param_, names_, static_cast<int64_t>(groups_.size()));
  ledger_ = std::make_unique<Ledger>(names_);
  for (size_t i = 0; i < params_.size(); ++i)
    param_ptrs_.push_back(buffers_[where_[i].first].param_view(where_[i].second).data_ptr());
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
  // Slot 4: 1 + the first parameter that still holds a .grad from before wrapping (0: none).
  // Agreed here, with the layout, so that every rank raises, not only the one that has it.
  int64_t stale = 0;
  for (size_t i = 0; i < params_.size() && stale == 0; ++i)
    if (params_[i].grad().defined()) stale = static_cast<int64_t>(i) + 1;
  constexpr int kSlots = 5;
  const int dp = comm_->size();
  auto opts = at::TensorOptions().dtype(at::kLong).device(params_[0].device());
  at::Tensor mine = at::tensor(std::vector<int64_t>{static_cast<int64_t>(params_.size()), numel,
                                                    static_cast<int64_t>(h >> 2), dp, stale},
                               opts);
  at::Tensor all = at::empty({kSlots * dp}, opts);
  comm_->all_gather({mine}, {all})->wait();
  at::Tensor cpu = all.cpu();
  comm_->check_for_errors();  // an aborted collective unblocks the copy with garbage: raise first
  const int64_t* a = cpu.const_data_ptr<int64_t>();
  for (int r = 0; r < dp; ++r) {
    const int64_t* x = a + kSlots * r;
    FP8DP_CHECK_ARG(x[3] == dp, "process_group: rank ", r, " sees world size ", x[3], " but rank ",
                    comm_->rank(), " sees ", dp, ": mismatched world sizes");
    FP8DP_CHECK_ARG(x[0] == a[0] && x[1] == a[1] && x[2] == a[2], "module: rank ", r, " has ", x[0],
                    " trainable parameters with ", x[1], " elements but rank 0 has ", a[0],
                    " with ", a[1],
                    " (or their shapes/dtypes differ): every rank must wrap the same model");
  }
  for (int r = 0; r < dp; ++r) {
    const int64_t s = a[kSlots * r + 4];
    // A gradient left from a backward before wrapping (a warm-up step, a reference computed on the
    // same model) would be added to main_grad with the first micro-batch's: the autograd hook adds
    // whatever p.grad holds. Dropping it silently could hide a mistake as well; torch's optimizers
    // leave clearing .grad to the user, so ask for it.
    FP8DP_CHECK_ARG(s == 0, "module: parameter '", names_.at(s - 1), "' on rank ", r,
                    " has a .grad left from a backward before DistributedDataParallel was built: "
                    "it would be added into main_grad with the first micro-batch's gradient; call "
                    "model.zero_grad(set_to_none=True) before wrapping the model");
  }
}

at::Tensor GradSync::main_grad(int64_t p) const {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  return buffers_[where_[p].first].main_grad(where_[p].second);
}

const at::Tensor& GradSync::param(int64_t p) const {
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  return params_[p];
}

void GradSync::param_ready(int64_t p, const std::optional<at::Tensor>& grad,
                           bool grad_added_to_main_grad) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  const bool has_grad = grad.has_value() && grad->defined();
  // A module outside fp8dp that fused into main_grad itself (Megatron's protocol) marks p.grad as
  // a stand-in with grad_added_to_main_grad: it is not added.
  const Route route = grad_added_to_main_grad ? Route::kFused
                      : has_grad              ? Route::kAutograd
                                              : Route::kNone;
  accept_locked(p, route == Route::kAutograd ? *grad : at::Tensor(), route, -1, false);
}

int64_t GradSync::microbatch() const {
  std::lock_guard<std::mutex> lock(mu_);
  return ledger_->current_microbatch();
}

void GradSync::announce(int64_t p) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opts_.grad_ledger) ledger_->expect(p);
}

void GradSync::withdraw(int64_t p, int64_t microbatch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opts_.grad_ledger) ledger_->unexpect(p, microbatch);
}

void GradSync::announce_hooks(const std::vector<int64_t>& params, int64_t microbatch) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!opts_.grad_ledger) return;
  for (int64_t p : params) ledger_->expect(p, microbatch);
}

void GradSync::set_backward_microbatch(int64_t mb) {
  std::lock_guard<std::mutex> lock(mu_);
  if (opts_.grad_ledger) ledger_->set_backward_microbatch(mb);
}

GradSink::Token GradSync::expect(int64_t p, int64_t microbatch, const std::string& module) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  check_accepting_locked(p, Route::kDelayed, "a weight gradient queued for backward_dw()", false);
  ++undelivered_[{p, module}];
  // Counted exactly (readiness.h): the queue of the last micro-batch, whose backward runs outside
  // no_sync(), is what completes the bucket; earlier micro-batches' queues only accumulate, but a
  // bucket still waits for them (one may be delivered after the last backward).
  const bool counted = sync_enabled_;
  if (counted) {
    readiness_->expect_delivery(p);
  } else {
    readiness_->expect_uncounted(p);
  }
  return Token{microbatch, iteration_, module, counted};
}

void GradSync::deliver(int64_t p, const at::Tensor& grad, Route route, Token token) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  check_accepting_locked(p, route, "a gradient", route == Route::kFused);
  if (route == Route::kDelayed) {
    FP8DP_CHECK(token.iteration == iteration_, "parameter '", names_[p],
                "': a weight gradient queued in an earlier iteration was delivered (stale "
                "backward_dw()); it is not added");
    const auto it = undelivered_.find({p, token.module});
    FP8DP_CHECK(it != undelivered_.end(), "parameter '", names_[p],
                "': backward_dw() delivered a weight gradient that no backward queued; it is not "
                "added");
    if (--it->second == 0) undelivered_.erase(it);
  }
  accept_locked(p, grad, route, token.microbatch, route == Route::kDelayed && token.counted);
}

Phase GradSync::phase_locked() const {
  if (failed_) return Phase::kFailed;
  if (stepped_) return Phase::kStepped;
  if (finished_) return Phase::kFinished;
  for (const auto& g : groups_)
    if (g.launched()) return Phase::kSyncStarted;
  return Phase::kAccumulating;
}

Phase GradSync::phase() const {
  std::lock_guard<std::mutex> lock(mu_);
  return phase_locked();
}

void GradSync::check_accepting(int64_t p, Route route, bool counted_delivery) {
  std::lock_guard<std::mutex> lock(mu_);
  FP8DP_CHECK_ARG(p >= 0 && p < static_cast<int64_t>(params_.size()),
                  "param index: expected in [0, ", params_.size(), "), got ", p);
  check_accepting_locked(p, route,
                         route == Route::kDelayed ? "a weight gradient from backward_dw()"
                                                  : "a weight gradient from the fused GEMM",
                         false);
  // What accept_locked() would count next (it throws before adding; here before the GEMM).
  if (route == Route::kDelayed) {
    if (counted_delivery) readiness_->check_mark_delivery(p);
  } else if (sync_enabled_) {
    readiness_->check_mark(p);
  }
}

void GradSync::check_accepting_locked(int64_t p, Route route, const char* what, bool written) {
  const Phase ph = phase_locked();
  if (ph == Phase::kAccumulating) return;
  if (ph == Phase::kSyncStarted && !groups_[group_of_param_[p]].launched()) return;
  // One report more than learned for a launched group: readiness names that cause more precisely
  // (a hook firing twice), and refuses it before anything is added too.
  if (ph == Phase::kSyncStarted && sync_enabled_ && route != Route::kDelayed &&
      readiness_->golden_known() && readiness_->count(p) >= readiness_->golden(p))
    return;
  // A fused GEMM that wrote into main_grad before handing over (the layers ask first, through
  // check_accepting(), so this is a sink user that did not): too late to refuse cleanly.
  if (written) failed_ = true;
  std::string why;
  if (ph == Phase::kSyncStarted)
    why =
        "its bucket group's collective has started (by the last micro-batch's backward or by "
        "start_grad_sync()): it would be added to a bucket that is being reduced. Run every "
        "micro-batch but the LAST under no_sync(), call start_grad_sync() only after the last "
        "backward (and backward_dw()), and zero_grad_buffer() to start the next iteration";
  else if (ph == Phase::kFailed)
    why =
        "finish_grad_sync() failed and main_grad is not reduced: call zero_grad_buffer() and redo "
        "the iteration";
  else
    why =
        "finish_grad_sync() has reduced this iteration's gradients (a backward through a graph "
        "built before the sync finished?): call zero_grad_buffer() (or "
        "DistributedOptimizer.zero_grad()) to start the next iteration, then run its forward "
        "and backward";
  FP8DP_CHECK(false, what, " of parameter '", names_[p], "' arrived in phase '", phase_name(ph),
              "': ", why, ". ",
              written ? "The fused GEMM already accumulated it into main_grad, which is no longer "
                        "valid: zero_grad_buffer() and redo the iteration"
                      : "It was not added");
}

void GradSync::accept_locked(int64_t p, const at::Tensor& grad, Route route, int64_t microbatch,
                             bool delivery) {
  check_accepting_locked(p, route, "a gradient", route == Route::kFused);
  if (opts_.grad_ledger) ledger_->record(p, route, microbatch);
  // Count first: an excess report throws before its gradient could be added a second time. A
  // delayed gradient counts by its token (readiness.h), a learned report only outside no_sync().
  bool complete = false;
  if (route == Route::kDelayed) {
    // An earlier micro-batch's gradient completes its group only outside no_sync(): inside it
    // the last micro-batch has not run yet (a group of queued gradients alone would launch early).
    complete = delivery ? readiness_->mark_delivery(p)
                        : readiness_->mark_uncounted_delivery(p) && sync_enabled_;
  } else if (sync_enabled_) {
    complete = readiness_->mark(p);
  }
  if (grad.defined()) {
    at::Tensor mg = main_grad(p);
    FP8DP_CHECK_ARG(grad.sizes() == mg.sizes(), "gradient of '", names_[p], "': expected shape ",
                    mg.sizes(), ", got ", grad.sizes());
    mg.add_(grad);
  }
  if (complete && opts_.overlap_grad_reduce && !groups_[group_of_param_[p]].launched())
    groups_[group_of_param_[p]].start_grad_sync(*comm_, settings_);
}

void GradSync::check_params_in_buffers() const {
  // One pointer compare per parameter (this runs at every forward): set_data() to anything else,
  // which is what Module._apply does for .to(), changes the data pointer.
  for (size_t i = 0; i < params_.size(); ++i) {
    const at::Tensor& p = params_[i];
    const auto& b = buffers_[where_[i].first];
    if (p.data_ptr() == param_ptrs_[i] && p.scalar_type() == b.param_dtype) continue;
    FP8DP_CHECK_ARG(false, "parameter '", names_[i],
                    "' no longer lives in DistributedDataParallel's buffer: it was ", b.param_dtype,
                    " on ", b.param_data.device(), " when wrapped and is now ", p.scalar_type(),
                    " on ", p.device(),
                    " (model.to(), .half(), .cuda() or param.data = ... after wrapping?): its "
                    "gradient and the optimizer's updates would no longer reach it; convert the "
                    "model first, then wrap it");
  }
}

void GradSync::begin_microbatch(bool grad_enabled) {
  std::lock_guard<std::mutex> lock(mu_);
  check_params_in_buffers();
  const Phase ph = phase_locked();
  if (grad_enabled && ph != Phase::kAccumulating) {
    std::string why;
    if (ph == Phase::kSyncStarted)
      why =
          "bucket groups of this iteration have launched their collectives (by the last "
          "micro-batch's backward, or by start_grad_sync()), and this micro-batch's gradients "
          "would land on buckets being reduced. Only the LAST micro-batch of an iteration runs "
          "outside no_sync(), start_grad_sync() comes after its backward, and zero_grad_buffer() "
          "starts the next iteration";
    else if (ph == Phase::kFailed)
      why =
          "finish_grad_sync() failed and main_grad is not reduced: call zero_grad_buffer() and "
          "redo the iteration";
    else
      why = std::string(ph == Phase::kStepped ? "the optimizer has stepped on"
                                              : "finish_grad_sync() has reduced") +
            " this iteration's gradients, and new ones would be added on top of them: call "
            "zero_grad_buffer() (or DistributedOptimizer.zero_grad()) to start the next iteration";
    FP8DP_CHECK(false, "forward with grad enabled in phase '", phase_name(ph), "': ", why,
                ". (A forward under torch.no_grad(), e.g. evaluation, is allowed in every phase.)");
  }
  // C5: only the last micro-batch runs outside no_sync(). Once a parameter was reported ready as
  // often as in the first iteration, another backward outside no_sync() would be refused by
  // readiness partway through (after earlier hooks and queued backward_dw() entries changed
  // state), with overlap off as well, where nothing has launched yet: refuse its forward instead.
  if (grad_enabled && sync_enabled_) {
    const int64_t p = readiness_->first_at_golden();
    FP8DP_CHECK(p < 0,
                "forward with grad enabled outside no_sync() after the iteration's last "
                "micro-batch: parameter '",
                names_[p], "' was already reported ready ", readiness_->count(p),
                " time(s) in this iteration, as often as in the first one, "
                "so this micro-batch's backward would report it once more. Run every micro-batch "
                "but the LAST under no_sync(), then finish_grad_sync() (or the optimizer step) "
                "and zero_grad_buffer() before the next iteration's forward. (A forward under "
                "torch.no_grad(), e.g. evaluation, is allowed.)");
  }
  // Without overlap_param_gather nothing else waits before the module reads its weights.
  if (!opts_.overlap_param_gather) param_sync_->finish(-1);
  ledger_->begin_microbatch();
}

bool GradSync::enter_no_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  const Phase ph = phase_locked();
  // While some groups are launched (sync_started), no_sync() is what a deferred backward_dw() of
  // an earlier micro-batch runs in (its own micro-batch's context, as after a pipeline schedule's
  // last B step); it delivers into a group that is still waiting for it. Nothing can reach a
  // launched bucket from inside either: a forward with grad is refused (begin_microbatch) and so
  // is any gradient for a launched group (check_accepting_locked). Once the iteration is reduced
  // no micro-batch of it is left to run: refused here, the earliest place.
  FP8DP_CHECK(ph == Phase::kAccumulating || ph == Phase::kSyncStarted, "no_sync() in phase '",
              phase_name(ph),
              "': a micro-batch under no_sync() must come before the last one of the iteration, "
              "and this iteration's gradients are ",
              ph == Phase::kFailed ? "not reduced (finish_grad_sync() failed)" : "reduced",
              "; its gradients would land on reduced buckets. Call zero_grad_buffer() to start the "
              "next iteration");
  const bool previous = sync_enabled_;
  sync_enabled_ = false;
  return previous;
}

void GradSync::start_grad_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  const Phase ph = phase_locked();
  if (ph == Phase::kFinished) return;  // reduced already: launching again would reduce twice
  FP8DP_CHECK(ph != Phase::kStepped && ph != Phase::kFailed, "start_grad_sync() in phase '",
              phase_name(ph), "': ",
              ph == Phase::kStepped
                  ? "the optimizer has stepped on this iteration's reduced gradients"
                  : "finish_grad_sync() failed and main_grad is not reduced",
              "; call zero_grad_buffer() to start the next iteration");
  // A queued weight gradient would be delivered into a launched bucket.
  FP8DP_CHECK(undelivered_.empty(), "start_grad_sync(): ", describe_undelivered(),
              ". Call backward_dw() for them first; nothing was launched");
  for (auto& g : groups_)
    if (!g.launched()) g.start_grad_sync(*comm_, settings_);
}

std::string GradSync::describe_undelivered() const {
  // Entries are ordered by parameter, then module: one line per parameter, naming its modules.
  std::vector<std::string> lost;
  for (auto it = undelivered_.begin(); it != undelivered_.end();) {
    const int64_t p = it->first.first;
    int64_t queued = 0;
    std::vector<std::string> modules;
    for (; it != undelivered_.end() && it->first.first == p; ++it) {
      queued += it->second;
      modules.push_back("'" + it->first.second + "'");
    }
    lost.push_back("'" + names_[p] + "' (" + std::to_string(queued) + " queued, by module " +
                   join(modules) + ")");
  }
  if (lost.empty()) return "";
  return "weight gradients queued by backward were never computed by backward_dw(): " + join(lost);
}

std::string GradSync::undelivered_locked() {
  const std::string lost = describe_undelivered();
  undelivered_.clear();
  ++iteration_;  // what is still queued belongs to the abandoned iteration: modules drop it
  if (lost.empty()) return "";
  return lost +
         ". Call module.backward_dw() once per backward that reached a module built with "
         "delay_wgrad_compute=True, before finish_grad_sync(); the queued ones are dropped";
}

std::string GradSync::local_errors() const {
  std::ostringstream err;
  const std::string lost = describe_undelivered();
  if (!lost.empty())
    err << lost
        << ". Call module.backward_dw() once per backward that reached a module built with "
           "delay_wgrad_compute=True, before finish_grad_sync()";
  // A forgotten backward_dw() also leaves its bucket incomplete: the message above says why. Only
  // a PARTIAL iteration is an error: one without any report outside no_sync() (no micro-batch, or
  // every one inside it) reduces what was accumulated, as the first iteration does and as
  // Megatron's finish_grad_sync does without overlap.
  if (err.tellp() == 0 && sync_enabled_ && readiness_->golden_known() &&
      readiness_->any_reported()) {
    std::vector<std::string> missing;
    for (size_t g = 0; g < groups_.size(); ++g)
      if (!groups_[g].launched())
        for (auto& s : readiness_->incomplete(static_cast<int64_t>(g))) missing.push_back(s);
    if (!missing.empty())
      err << "finish_grad_sync: bucket(s) still incomplete, these parameters were not reported "
             "ready as often as in the first iteration: "
          << join(missing)
          << " (a skipped backward_dw(), a hook that did not fire, or fewer micro-batches outside "
             "no_sync() than in the first iteration, which learned these counts? Only the last "
             "micro-batch of an iteration runs outside no_sync())";
  }
  if (opts_.grad_ledger) {
    const std::string l = ledger_->check();
    if (!l.empty()) err << (err.tellp() > 0 ? "\n" : "") << l;
  }
  return err.str();
}

void GradSync::refuse_finish_locked(const std::string& msg, bool launched) {
  if (!launched) {
    // Nothing was reduced: main_grad, the counts, the ledger and the queued backward_dw() entries
    // stay, so the caller can fix the cause and call again. Only the NaN flags this check computed
    // are dropped (no group is launched, so reset() does nothing else): a later finish computes
    // them again from the buckets as they are then.
    for (auto& g : groups_) g.reset();
    FP8DP_CHECK(false, msg,
                "\nfinish_grad_sync: no collective of this iteration was launched and nothing "
                "changed (main_grad, the queued backward_dw() entries, phase '",
                phase_name(phase_locked()),
                "'): fix the cause (e.g. run the missing backward_dw()) and call "
                "finish_grad_sync() again, or call zero_grad_buffer() to drop this iteration's "
                "gradients");
  }
  abandon_iteration();
  FP8DP_CHECK(false, msg,
              "\nfinish_grad_sync: bucket groups of this iteration had already launched their "
              "collectives, so main_grad is NOT reduced consistently (phase 'failed'); call "
              "zero_grad_buffer() and redo the iteration");
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
  undelivered_locked();
  failed_ = true;  // main_grad is not reduced: only zero_grad_buffer() goes on from here
}

at::Tensor GradSync::agree_flags_locked(const std::string& err) {
  const int dp = comm_->size(), rank = comm_->rank();
  at::Tensor flags =
      at::zeros({2 * dp}, at::TensorOptions().dtype(at::kLong).device(params_[0].device()));
  if (!err.empty()) flags.narrow(0, rank, 1).fill_(1);
  if (opts_.check_for_nan_in_grad) {
    std::vector<at::Tensor> nonfinite;
    for (auto& g : groups_) {
      g.flag_local_nonfinite();  // a no-op for launched groups: flagged before their pre-scale
      nonfinite.push_back(g.nonfinite_flags());
    }
    flags.narrow(0, dp + rank, 1).copy_(at::cat(nonfinite).any().reshape({1}));
  }
  comm_->all_reduce({flags}, ReduceOp::kSum)->wait();
  return flags;
}

std::string GradSync::flags_message(
    const at::Tensor& cpu, const std::string& err,
    const std::function<std::vector<std::string>()>& nonfinite_names) const {
  const int dp = comm_->size(), rank = comm_->rank();
  const int64_t* f = cpu.const_data_ptr<int64_t>();
  std::vector<std::string> failed;
  for (int r = 0; r < dp; ++r)
    if (f[r] || f[dp + r]) failed.push_back(std::to_string(r));
  if (failed.empty()) return "";
  std::string msg = err;
  if (f[dp + rank]) {
    std::vector<std::string> bad;
    for (const auto& n : nonfinite_names()) bad.push_back("'" + n + "'");
    msg += (msg.empty() ? "" : "\n") + std::string("check_for_nan_in_grad: rank ") +
           std::to_string(rank) + " has NaN or Inf in the local gradients of " + join(bad);
  }
  if (msg.empty())
    return "finish_grad_sync: rank(s) " + join(failed) + " found errors (see their messages)";
  // Every rank's error names every failed rank: this rank's names only its own parameters (the
  // others' names never left their hosts).
  std::vector<std::string> others;
  for (const auto& r : failed)
    if (r != std::to_string(rank)) others.push_back(r);
  if (!others.empty())
    msg += "\nfinish_grad_sync: rank(s) " + join(others) + " found errors too (see their messages)";
  return msg;
}

std::string GradSync::take_deferred_locked() {
  if (!deferred_flags_.defined()) return "";
  // On CUDA the flags were copied to pinned memory right after their all-reduce, and the event
  // marks that copy: waiting for it does not wait for the work queued since (a .cpu() here would
  // queue its copy behind this iteration's backward and wait for all of it, as the synchronous
  // check does). On the CPU the all-reduce has completed.
  if (deferred_event_) deferred_event_->synchronize();
  const at::Tensor cpu = deferred_flags_;
  deferred_event_.reset();
  comm_->check_for_errors();  // an aborted collective unblocks the copy with garbage: raise first
  const bool any = cpu.any().item<bool>();
  const at::Tensor flagged = any ? deferred_params_.cpu() : at::Tensor();  // the error path only
  deferred_flags_ = deferred_params_ = at::Tensor();
  if (!any) return "";
  const std::string msg = flags_message(cpu, "", [&] {
    std::vector<std::string> bad;
    const bool* f = flagged.const_data_ptr<bool>();
    for (size_t i = 0; i < deferred_order_.size(); ++i)
      if (f[i]) bad.push_back(names_[deferred_order_[i]]);
    return bad;
  });
  return msg + "\n(defer_nan_check: the gradients of iteration " +
         std::to_string(deferred_iteration_) +
         " (counted by zero_grad_buffer() calls), read after it finished; the distributed "
         "optimizer skipped that iteration's step on the device, so the parameters and the "
         "optimizer state are as they were before it)";
}

void GradSync::check_deferred() {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string msg = take_deferred_locked();
  FP8DP_CHECK(msg.empty(), msg);
}

at::Tensor GradSync::found_nonfinite() const {
  std::lock_guard<std::mutex> lock(mu_);
  return found_;
}

void GradSync::finish_grad_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  if (finished_ || stepped_) return;  // reduced already (DistributedOptimizer.step() calls it)
  FP8DP_CHECK(!failed_,
              "finish_grad_sync() in phase 'failed': an earlier finish_grad_sync() (or a "
              "gradient added to a launched bucket) failed and main_grad is not reduced; call "
              "zero_grad_buffer() and redo the iteration");
  // Until a bucket collective of this iteration runs, main_grad holds exactly the accumulated
  // local gradients and a refusal can leave everything as it was (contract C11).
  bool launched = false;
  for (const auto& g : groups_) launched = launched || g.launched();
  const std::string err = local_errors();
  if (opts_.defer_nan_check) {
    // The last iteration's verdict first. Its flags were copied to the host a whole forward and
    // backward ago (take_deferred_locked waits for that copy alone), so the host reads them
    // without waiting for this iteration's queued work: the GPU does not run dry.
    const std::string previous = take_deferred_locked();
    if (!previous.empty()) refuse_finish_locked(previous, launched);
    // Errors known on this host refuse at once, as without the check (config: no ledger here).
    if (!err.empty()) refuse_finish_locked(err, launched);
    const at::Tensor flags = agree_flags_locked("");
    found_ = flags.sum().gt(0).to(at::kFloat);
    std::vector<at::Tensor> nonfinite;
    for (const auto& g : groups_) nonfinite.push_back(g.nonfinite_flags());
    deferred_params_ = at::cat(nonfinite);  // a copy: reset() below drops the groups' flags
    deferred_iteration_ = iteration_;
    const c10::Device dev = flags.device();
    if (dev.is_cpu()) {
      deferred_flags_ = flags;
    } else {
      deferred_flags_ =
          at::empty(flags.sizes(), flags.options().device(at::kCPU).pinned_memory(true));
      deferred_flags_.copy_(flags, /*non_blocking=*/true);
      const c10::impl::VirtualGuardImpl guard(dev.type());
      deferred_event_ = std::make_unique<c10::Event>(dev.type());
      deferred_event_->record(guard.getStream(dev));
    }
  } else if (opts_.grad_ledger || opts_.check_for_nan_in_grad) {
    // Agree before raising: a rank that raised alone would leave the others blocked in the next
    // collective. The iteration's one host read.
    at::Tensor cpu = agree_flags_locked(err).cpu();
    comm_->check_for_errors();  // an aborted collective unblocks the copy with garbage: raise first
    const std::string msg = flags_message(cpu, err, [this] {
      std::vector<std::string> bad;
      for (auto& g : groups_)
        for (const auto& n : g.nonfinite_names()) bad.push_back(n);
      return bad;
    });
    // Every rank saw the same flags and the same launches (lockstep), so all take one branch.
    if (!msg.empty()) refuse_finish_locked(msg, launched);
  } else if (!err.empty()) {
    refuse_finish_locked(err, launched);
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
  ledger_->reset();
  finished_ = true;
}

void GradSync::zero_grad_buffer() {
  std::lock_guard<std::mutex> lock(mu_);
  check_params_in_buffers();
  for (auto& g : groups_) g.finish_grad_sync();
  for (auto& g : groups_) g.reset();
  for (auto& b : buffers_) b.grad_data.zero_();
  // A .grad left on a parameter (a backward outside the hooks' reach, autograd.grad's
  // accumulation, a user's write) would be added by the next hook: the iteration starts clean.
  for (auto& p : params_) p.mutable_grad() = at::Tensor();
  readiness_->reset();
  ledger_->reset();
  finished_ = stepped_ = failed_ = false;
  // A new iteration: weight gradients still queued from the last one must not land in it.
  const std::string lost = undelivered_locked();
  FP8DP_CHECK(lost.empty(), "zero_grad_buffer: ", lost);
}

void GradSync::scale_gradients(double factor) {
  std::lock_guard<std::mutex> lock(mu_);
  const Phase ph = phase_locked();
  FP8DP_CHECK(ph != Phase::kStepped && ph != Phase::kFailed, "scale_gradients() in phase '",
              phase_name(ph), "': ",
              ph == Phase::kStepped ? "the optimizer has already stepped on these gradients, so "
                                      "the factor could not act; call it before the step"
                                    : "finish_grad_sync() failed and main_grad is not reduced; "
                                      "call zero_grad_buffer() and redo the iteration",
              "");
  if (ph == Phase::kSyncStarted) {
    // A launched collective reads its bucket (or its encoding, made at launch) and writes the
    // result at its end: a product taken in between would be lost. Wait (stream-ordered on CUDA,
    // no host sync), then scale the reduced values; the groups not launched yet are scaled before
    // their reduction, which is linear.
    try {
      for (auto& g : groups_)
        if (g.launched()) g.finish_grad_sync();
    } catch (const std::exception& e) {
      abandon_iteration();
      throw Error(std::string(e.what()) +
                  "\nscale_gradients: main_grad is NOT reduced; zero_grad_buffer() and redo the "
                  "iteration");
    }
  }
  for (auto& b : buffers_) b.grad_data.mul_(factor);
}

void GradSync::broadcast_params(int root) {
  std::lock_guard<std::mutex> lock(mu_);
  param_sync_->broadcast(root);
}

void GradSync::copy_shards(const std::vector<at::Tensor>& masters) {
  param_sync_->check_masters(masters);
  std::lock_guard<std::mutex> lock(mu_);
  param_sync_->copy_shards(masters);
  if (finished_) stepped_ = true;  // the optimizer step of this iteration's gradients
}

void GradSync::note_params_written() {
  std::lock_guard<std::mutex> lock(mu_);
  param_sync_->bump_param_versions();
}

void GradSync::start_param_sync() {
  std::lock_guard<std::mutex> lock(mu_);
  param_sync_->start();
}

void GradSync::finish_param_sync(int64_t group) {
  std::lock_guard<std::mutex> lock(mu_);
  param_sync_->finish(group);
}

void GradSync::copy_shards_and_sync_params(const std::vector<at::Tensor>& masters) {
  copy_shards(masters);
  start_param_sync();
  finish_param_sync(-1);
}

}  // namespace fp8dp

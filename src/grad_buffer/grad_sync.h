// GradSync: everything DistributedDataParallel does with gradients, in one C++ object: the buffers
// (contract C1), the exactly-once accumulation done by the hooks (C2), readiness and the
// bucket-group launches (C5), the collectives (C6), the ledger, the NaN check and the iteration's
// phase (C11). The distributed optimizer's parameter side (shards, all-gather) is ParamSync
// (param_sync.h), which it owns and calls under its lock. The Python wrapper owns the module and
// forwards hook calls here.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/core/Event.h>

#include <atomic>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "grad_buffer/bucket_group.h"
#include "grad_buffer/buffer.h"
#include "grad_buffer/grad_sink.h"
#include "grad_buffer/ledger.h"
#include "grad_buffer/param_sync.h"
#include "grad_buffer/readiness.h"

namespace fp8dp {

struct GradSyncOptions {
  bool grad_reduce_in_fp32 = true;
  bool overlap_grad_reduce = false;
  bool use_distributed_optimizer = false;
  int64_t bucket_size = 40000000;
  bool average_in_collective = false;
  bool check_for_nan_in_grad = false;
  // With check_for_nan_in_grad (and no ledger): finish_grad_sync() does not wait for the agreed
  // NaN flags; found_nonfinite() hands them to the optimizer, which skips its step on the device,
  // and the next finish_grad_sync() (or check_deferred()) raises. Host errors refuse at once.
  bool defer_nan_check = false;
  bool pad_buckets_for_high_nccl_busbw = false;
  bool grad_ledger = false;
  // What the bucket reductions put on the wire: "fp32" (the buffer as it is), "bf16", "fp8_e4m3"
  // or "fp8_e5m2" (wire.h; the buffers must be FP32).
  std::string grad_reduce_wire = "fp32";
  // Without it a forward waits for every parameter all-gather in flight before the module runs
  // (begin_microbatch); with it each module's pre-hook waits for its own bucket groups.
  bool overlap_param_gather = false;
};

// Where one DDP iteration stands (contract C11). Every public call of GradSync checks it and
// either does the right thing or refuses, before it changes anything, naming the call, the phase
// and what to call instead:
//   accumulating  -> sync_started (a bucket group launched: by readiness or start_grad_sync())
//                 -> finished (finish_grad_sync()) -> stepped (the optimizer's copy_shards())
//   any phase     -> accumulating (zero_grad_buffer(): the next iteration)
//   finish_grad_sync() that fails -> failed (main_grad is not reduced; zero_grad_buffer()).
enum class Phase : int { kAccumulating, kSyncStarted, kFinished, kStepped, kFailed };
const char* phase_name(Phase p);

class GradSync : public GradSink {
 public:
  // params: the trainable parameters in registration order (one device); names for messages.
  // Builds the buffers, moves every parameter's data into its param buffer and checks with every
  // rank that they all built the same layout (a ValueError naming the first differing rank).
  GradSync(std::vector<at::Tensor> params, std::vector<std::string> names,
           std::shared_ptr<Communicator> comm, GradSyncOptions opts);

  at::Tensor main_grad(int64_t p) const override;
  const at::Tensor& param(int64_t p) const override;

  // The DDP hook for parameter p (C2): unless grad_added_to_main_grad, adds grad (if any) to
  // main_grad; the caller then sets p.grad = None. Outside no_sync counts p ready and, with
  // overlap_grad_reduce, launches p's bucket group the moment it is complete.
  void param_ready(int64_t p, const std::optional<at::Tensor>& grad, bool grad_added_to_main_grad);

  // GradSink (grad_sink.h): the fp8dp modules bound to this object deliver here directly.
  int64_t microbatch() const override;
  void announce(int64_t p) override;
  void withdraw(int64_t p, int64_t microbatch) override;
  Token expect(int64_t p, int64_t microbatch, const std::string& module) override;
  // The ledger's announcement of the autograd-hook contributions of one forward: one for each
  // parameter whose autograd hook the forward's graph reaches (DDP's forward finds them), for
  // micro-batch `microbatch` (-1: the current one; a reentrant checkpoint's recompute runs in its
  // micro-batch's backward, when later forwards may have begun).
  void announce_hooks(const std::vector<int64_t>& params, int64_t microbatch = -1);
  // The backward of micro-batch mb began (DDP's hook on the forward's outputs; for the ledger,
  // which counts the autograd-hook contributions that follow against mb: ledger.h).
  void set_backward_microbatch(int64_t mb);
  int64_t iteration() const override { return iteration_; }
  void check_accepting(int64_t p, Route route, bool counted_delivery) override;
  void deliver(int64_t p, const at::Tensor& grad, Route route, Token token) override;

  // A micro-batch's forward began (for the ledger). Also checks that every parameter still lives
  // in its buffer: model.to(dtype) / .half() / .cuda() after wrapping moves a parameter's data out
  // of it, and the model would silently stop training (the optimizer steps the buffer).
  // grad_enabled (torch.is_grad_enabled()): a forward that builds a graph is refused outside the
  // accumulating phase (its gradients would land on launched or reduced buckets); one under
  // no_grad (evaluation) is allowed in every phase. Without overlap_param_gather it then waits for
  // every parameter all-gather in flight, so the module never reads half-gathered weights.
  void begin_microbatch(bool grad_enabled = true);
  // Raises a ValueError naming the first parameter whose data no longer views its buffer.
  void check_params_in_buffers() const;
  // false suppresses readiness counting and launches; unchecked (the pipeline's per-step policy
  // toggles it between B and W steps).
  void set_sync_enabled(bool enabled) { sync_enabled_ = enabled; }
  bool sync_enabled() const { return sync_enabled_; }
  // DDP's no_sync(): disables sync and returns the previous setting. Refused once the iteration is
  // finished, stepped or failed (no micro-batch of it is left); allowed while groups are launched
  // (sync_started), where a deferred backward_dw() of an earlier micro-batch runs in it, and where
  // a forward with grad is refused anyway.
  bool enter_no_sync();
  // Where the iteration stands (Phase), and its name for Python and messages.
  Phase phase() const;

  // Launches every bucket group not launched yet. Refused while a gradient queued for
  // backward_dw() is not delivered (it would land in a launched bucket), after the optimizer step
  // and after a failed finish; a no-op once finished.
  void start_grad_sync();
  // With defer_nan_check, first raises the last iteration's pending NaN (check_deferred()).
  // Checks readiness (and the ledger and NaN check when enabled; then every rank agrees on the
  // outcome first, so all raise together: one tiny all-reduce and the iteration's only host read;
  // defer_nan_check launches the NaN flags' all-reduce and reads it at the next finish),
  // launches what is left, waits (stream-ordered on CUDA). A no-op when finished or stepped
  // (the gradients are reduced); refused after a failed finish.
  void finish_grad_sync();
  // defer_nan_check: a float32 scalar on the parameters' device, nonzero when any rank flagged
  // NaN or Inf in its local gradients of the iteration finish_grad_sync() last finished, for the
  // optimizer's found_inf (its step then changes nothing); undefined before the first finish and
  // without defer_nan_check. Reads nothing on the host.
  at::Tensor found_nonfinite() const;
  // defer_nan_check: reads the flags of the last finished iteration on the host (waiting for
  // their copy, not for the work queued after it) and raises, naming the rank and the parameters,
  // when any rank flagged it; the flags are consumed either way. finish_grad_sync() calls it first;
  // call it after the last step and before saving a checkpoint. A no-op when nothing is pending.
  void check_deferred();
  // Waits for any gradient collective in flight, zeroes every grad buffer, clears every
  // parameter's .grad, forgets this iteration's counts: the accumulating phase of the next one.
  void zero_grad_buffer();
  // main_grad *= factor. Waits first for the collectives of launched groups (they would overwrite
  // or have already encoded their buckets), so the factor applies to every gradient whatever the
  // wire or collective. Refused after the optimizer step (it could no longer act) and after a
  // failed finish.
  void scale_gradients(double factor);
  // Finishes any parameter all-gather in flight, then broadcasts every param buffer from root.
  // Allowed in every phase: it writes the param buffers only, never a gradient.
  void broadcast_params(int root);

  // Distributed optimizer: this rank's shards, their views, and the parameter all-gather
  // (ParamSync, under this object's lock).
  std::vector<OwnedShard> owned_shards() const { return param_sync_->owned_shards(); }
  at::Tensor grad_shard(const OwnedShard& s) const { return param_sync_->grad_shard(s); }
  at::Tensor param_shard(const OwnedShard& s) const { return param_sync_->param_shard(s); }
  // Copies each master shard (any float dtype) into its param_shard, first finishing any parameter
  // all-gather still in flight (it writes the same storage). After finish_grad_sync() this is the
  // optimizer step: the phase becomes stepped. (Elsewhere, e.g. a checkpoint load, the phase
  // stays.)
  void copy_shards(const std::vector<at::Tensor>& masters);
  // Launches every bucket group's parameter all-gather, asynchronously, in forward order: the group
  // holding the earliest-registered parameter first, so the first layers' parameters arrive first
  // (overlap_param_gather: the next forward waits for each group just before it needs it).
  void start_param_sync();
  // Waits for bucket group `group`'s all-gather (stream-ordered on CUDA: the current stream waits;
  // blocking on the CPU), or for every group's with group = -1. A no-op when none is in flight.
  void finish_param_sync(int64_t group = -1);
  // The parameters were written in a way their version counters do not see (through p.data:
  // DistributedOptimizer.reload_model_params says so): bumps the counters, so that whatever was
  // derived from the old values (the FP8 weight cache, C8) is made again.
  void note_params_written();
  // True while any group's parameter all-gather was started and not finished.
  bool param_sync_pending() const { return param_sync_->pending(); }
  // copy_shards(), start_param_sync(), finish_param_sync(): the non-overlapped step.
  void copy_shards_and_sync_params(const std::vector<at::Tensor>& masters);

  int rank() const { return comm_->rank(); }
  int world_size() const { return comm_->size(); }
  const std::vector<Buffer>& buffers() const { return buffers_; }
  int64_t num_bucket_groups() const { return static_cast<int64_t>(groups_.size()); }
  int64_t golden_count(int64_t p) const { return readiness_->golden(p); }
  int64_t group_of_param(int64_t p) const { return group_of_param_.at(p); }
  bool group_launched(int64_t g) const { return groups_.at(g).launched(); }
  Communicator& communicator() { return *comm_; }

 private:
  void check_same_layout_on_all_ranks();
  // Adds grad (when defined) to main_grad, records the route, counts p ready (learned, or a
  // delivery announced by expect() when `delivery`) and launches its bucket group when complete.
  // mu_ held.
  void accept_locked(int64_t p, const at::Tensor& grad, Route route, int64_t microbatch,
                     bool delivery);
  Phase phase_locked() const;
  // Refuses a gradient of p (`what`) that would land in a launched or reduced bucket.
  // written: the gradient is already in main_grad (a fused GEMM that did not ask first).
  void check_accepting_locked(int64_t p, Route route, const char* what, bool written);
  std::string describe_undelivered() const;
  // What finish_grad_sync() must refuse (undelivered queued gradients, a partial iteration, the
  // ledger), "" when nothing; changes nothing.
  std::string local_errors() const;
  // Raises msg. When no bucket collective of this iteration was launched nothing changes (the
  // caller may fix the cause and call again); else the iteration is abandoned: phase failed.
  [[noreturn]] void refuse_finish_locked(const std::string& msg, bool launched);
  // Raises if a queued weight gradient was never delivered; forgets them and starts a new
  // iteration either way (mu_ held).
  std::string undelivered_locked();
  void abandon_iteration();
  // The agreement all-reduce of finish_grad_sync(): [2 * dp] int64 on the device, slot r set when
  // rank r has a host error, slot dp + r when its local gradients hold NaN or Inf (the groups are
  // flagged first); `err` is this rank's host error ("" when none). Launches, reads nothing.
  at::Tensor agree_flags_locked(const std::string& err);
  // The message of agreed flags read on the host ("" when no rank flagged); `err` is this rank's
  // host error, `nonfinite_names` lists its flagged parameters (called only when it has some).
  std::string flags_message(const at::Tensor& flags_cpu, const std::string& err,
                            const std::function<std::vector<std::string>()>& nonfinite_names) const;
  // check_deferred() with mu_ held: the message of the pending flags ("" when none), consumed.
  std::string take_deferred_locked();

  std::vector<at::Tensor> params_;
  std::vector<std::string> names_;
  std::shared_ptr<Communicator> comm_;
  GradSyncOptions opts_;
  SyncSettings settings_;
  std::vector<Buffer> buffers_;
  std::vector<std::pair<int64_t, int64_t>> where_;  // param -> (buffer, local index)
  std::vector<BucketGroup> groups_;
  std::vector<int64_t> group_of_param_;
  std::unique_ptr<Readiness> readiness_;
  std::unique_ptr<Ledger> ledger_;
  std::unique_ptr<ParamSync> param_sync_;  // views params_, buffers_ and groups_
  bool sync_enabled_ = true;
  bool finished_ = false;  // finish_grad_sync() succeeded (the groups are reset then)
  bool stepped_ = false;   // copy_shards() after finishing: the optimizer stepped
  bool failed_ = false;    // a finish (or a gradient into a launched bucket) spoiled main_grad
  // Queued weight gradients (expect()) not delivered yet, per (parameter, queueing module), entries
  // at zero erased; and the iteration they belong to (zero_grad_buffer() and an abandoned
  // finish_grad_sync() start the next one).
  std::map<std::pair<int64_t, std::string>, int64_t> undelivered_;
  std::vector<const void*> param_ptrs_;  // where each parameter's data lives in its buffer
  std::atomic<int64_t> iteration_{0};
  // defer_nan_check: the last finished iteration's agreed flags (agree_flags_locked) on the host
  // (pinned and copied without waiting on CUDA; deferred_event_ marks the copy) and its local
  // per-parameter NaN flags on the device (in deferred_order_), undefined once read; its number;
  // the optimizer's found_inf made from the flags.
  at::Tensor deferred_flags_, deferred_params_, found_;
  std::unique_ptr<c10::Event> deferred_event_;
  int64_t deferred_iteration_ = -1;
  std::vector<int64_t> deferred_order_;  // the parameter of each entry of deferred_params_
  mutable std::mutex mu_;                // hooks may run on autograd's device threads
};

}  // namespace fp8dp

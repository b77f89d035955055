// BucketGroup: the buckets whose collectives are issued together (one grouped call on the
// communicator). start_grad_sync() flags non-finite local gradients (on the device), pre-scales and
// launches; finish waits. start_param_sync() / finish_param_sync() do the same for the parameter
// all-gather of the distributed optimizer. With a low-precision wire (wire.h) the reduction is an
// all-to-all of encoded chunks plus an FP32 sum on the owner, and, for an all-reduce, an all-gather
// of the encoded sums.
#pragma once

#include <ATen/core/Tensor.h>

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "grad_buffer/buffer.h"
#include "grad_buffer/wire.h"

namespace fp8dp {

struct SyncSettings {
  bool reduce_scatter = false;         // distributed optimizer: rank r keeps chunk r of each bucket
  bool average_in_collective = false;  // AVG in the collective instead of a 1/dp pre-scale
  bool check_for_nan = false;
  Wire wire = Wire::kFP32;  // what goes on the wire for FP32 buckets (wire.h)
};

class BucketGroup {
 public:
  // buckets must outlive the group; names: parameter names by global index.
  BucketGroup(std::vector<const Bucket*> buckets, const std::vector<std::string>* names);

  // Flags the parameters whose local gradient is non-finite (when asked; on the device, no host
  // sync: every rank must still join the collective, so nothing is thrown here), pre-scales by
  // 1/dp unless the collective averages, and launches one grouped all-reduce or in-place
  // reduce-scatter.
  void start_grad_sync(Communicator& comm, const SyncSettings& s);
  // Waits for the launched collective; a no-op when nothing is in flight. With a low-precision wire
  // it then sums the received chunks into this rank's chunk and, for an all-reduce, launches the
  // all-gather of the encoded sums and waits for it too (so on the CPU that half does not overlap
  // the backward pass; on CUDA the waits are stream-ordered and this only enqueues).
  void finish_grad_sync();
  // All-gathers every bucket's param views from the rank chunks (after the optimizer step).
  void start_param_sync(Communicator& comm);
  void finish_param_sync();
  bool param_sync_in_flight() const { return static_cast<bool>(param_work_); }

  bool launched() const { return launched_; }
  // Computes, on the device and without a host sync, one flag per parameter of the group: true
  // when its local gradient holds a NaN or Inf (or magnitudes whose sum overflows). Idempotent
  // within an iteration; start_grad_sync() calls it before the gradients are scaled or reduced.
  void flag_local_nonfinite();
  // The flags of flag_local_nonfinite() (a bool tensor, one entry per parameter in layout order),
  // undefined when it has not run this iteration.
  const at::Tensor& nonfinite_flags() const { return nonfinite_; }
  // Names of the flagged parameters (copies the flags to the host: the error path only).
  std::vector<std::string> nonfinite_names() const;
  // The parameter of each entry of nonfinite_flags(), in order.
  std::vector<int64_t> flag_params() const;
  const std::vector<const Bucket*>& buckets() const { return buckets_; }
  void reset();

 private:
  // Per bucket: the wire's buffers, allocated at the first launch and reused every iteration (a
  // collective in flight reads and writes them until its wait; the group owns them, and on CUDA
  // the communicator records them on its stream).
  struct WireScratch {
    at::Tensor send, recv;              // [dp * m] wire dtype; send's padding past numel stays 0
    at::Tensor send_scale, recv_scale;  // [dp] float32: the chunks' scale_inv (1 for BF16)
    at::Tensor tmp;                     // [m] float32: FP8 decode target
    int64_t m = 0;                      // chunk length: ceil(numel / dp)
  };
  void start_wire_reduce(Communicator& comm, const SyncSettings& s);
  void finish_wire_reduce();
  enum class WireStage { kNone, kReduce, kGather };
  std::vector<const Bucket*> buckets_;
  const std::vector<std::string>* names_;
  std::shared_ptr<CommWork> grad_work_, param_work_;
  bool launched_ = false;
  at::Tensor nonfinite_;
  std::vector<WireScratch> wire_;
  WireStage wire_stage_ = WireStage::kNone;
  Communicator* wire_comm_ = nullptr;  // the launch's communicator, for the all-gather half
  SyncSettings wire_settings_;
};

}  // namespace fp8dp

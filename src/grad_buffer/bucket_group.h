// BucketGroup: the buckets whose collectives are issued together (one grouped call on the
// communicator). start_grad_sync() checks the local gradients, pre-scales and launches; finish
// waits.
#pragma once

#include <memory>
#include <string>
#include <vector>

#include "comm/communicator.h"
#include "grad_buffer/buffer.h"

namespace fp8dp {

struct SyncSettings {
  bool reduce_scatter = false;         // distributed optimizer: rank r keeps chunk r of each bucket
  bool average_in_collective = false;  // AVG in the collective instead of a 1/dp pre-scale
  bool check_for_nan = false;
};

class BucketGroup {
 public:
  // buckets must outlive the group; names: parameter names by global index.
  BucketGroup(std::vector<const Bucket*> buckets, const std::vector<std::string>* names);

  // Records which parameters hold non-finite local gradients (when asked: every rank must still
  // join the collective, so nothing is thrown here), pre-scales by 1/dp unless the collective
  // averages, and launches one grouped all-reduce or in-place reduce-scatter.
  void start_grad_sync(Communicator& comm, const SyncSettings& s);
  // Waits for the launched collective; a no-op when nothing is in flight.
  void finish_grad_sync();
  // All-gathers every bucket's param views from the rank chunks (after the optimizer step).
  void start_param_sync(Communicator& comm);
  void finish_param_sync();

  bool launched() const { return launched_; }
  // Names of parameters whose local gradient was non-finite at launch ("" entries never).
  const std::vector<std::string>& nonfinite() const { return nonfinite_; }
  // Scans the local gradients now (for groups that finish_grad_sync has not launched yet).
  void check_local_finite();
  const std::vector<const Bucket*>& buckets() const { return buckets_; }
  void reset();

 private:
  std::vector<const Bucket*> buckets_;
  const std::vector<std::string>* names_;
  std::shared_ptr<CommWork> grad_work_, param_work_;
  bool launched_ = false;
  bool checked_ = false;
  std::vector<std::string> nonfinite_;
};

}  // namespace fp8dp

// ParamSync: the distributed optimizer's side of the buffers (ZeRO-1): the shards of the param
// buffers this rank owns, copying the stepped master shards into them, and the per-bucket-group
// parameter all-gather that sends every rank's shards to all. GradSync owns one and calls it under
// its own lock (GradSync decides the iteration's phase; this class only moves parameters).
#pragma once

#include <ATen/core/Tensor.h>

#include <atomic>
#include <cstdint>
#include <vector>

#include "comm/communicator.h"
#include "grad_buffer/bucket_group.h"
#include "grad_buffer/buffer.h"

namespace fp8dp {

// One shard of a parameter owned by this rank under the distributed optimizer.
struct OwnedShard {
  int64_t param = 0;         // global parameter index
  int64_t param_offset = 0;  // first owned element of the flattened parameter
  int64_t numel = 0;
  int64_t buffer = 0;
  int64_t buffer_offset = 0;
};

class ParamSync {
 public:
  // Views GradSync's parameters, buffers and bucket groups (which outlive it: GradSync owns all
  // four). group_of_param[p]: the bucket group holding parameter p.
  ParamSync(std::vector<at::Tensor>& params, std::vector<Buffer>& buffers,
            std::vector<BucketGroup>& groups, const std::vector<int64_t>& group_of_param,
            Communicator& comm, bool distributed_optimizer);

  // This rank's shards, and their views into the grad and param buffers.
  std::vector<OwnedShard> owned_shards() const;
  at::Tensor grad_shard(const OwnedShard& s) const;
  at::Tensor param_shard(const OwnedShard& s) const;
  // Raises a ValueError unless masters holds one tensor per owned shard with its element count;
  // changes nothing.
  void check_masters(const std::vector<at::Tensor>& masters) const;
  // Copies each master shard (any float dtype) into its param_shard, first finishing any
  // all-gather still in flight (it writes the same storage). check_masters() first.
  void copy_shards(const std::vector<at::Tensor>& masters);
  // Launches every group's all-gather, asynchronously, in forward order: the group holding the
  // earliest-registered parameter first, so the first layers' parameters arrive first.
  void start();
  // Waits for group `group`'s all-gather, or for every group's with -1; a no-op when none is in
  // flight.
  void finish(int64_t group);
  // True while any group's all-gather was started and not finished (read without a lock).
  bool pending() const { return in_flight_ > 0; }
  // Finishes any all-gather in flight, then broadcasts every param buffer from root.
  void broadcast(int root);
  // Bumps every parameter's version counter: its buffer was written through a view (the
  // writes above) or through p.data (GradSync::note_params_written), which the counters miss.
  void bump_param_versions();

 private:
  std::vector<at::Tensor>& params_;
  std::vector<Buffer>& buffers_;
  std::vector<BucketGroup>& groups_;
  Communicator& comm_;
  bool distributed_optimizer_;
  std::vector<int64_t> order_;         // group indices by their earliest parameter
  std::atomic<int64_t> in_flight_{0};  // read without GradSync's lock by pending()
};

}  // namespace fp8dp

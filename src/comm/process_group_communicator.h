// ProcessGroupCommunicator: the Communicator over any c10d ProcessGroup (gloo on the CPU; torch's
// NCCL group works too). Backend gaps are filled correctly: AVG becomes SUM then a divide, a
// missing reduce-scatter becomes an all-reduce then a copy of the rank's chunk.
#pragma once

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/communicator.h"

namespace fp8dp {

class ProcessGroupCommunicator : public Communicator {
 public:
  // group: a live process group; the communicator keeps it alive. native_avg /
  // native_reduce_scatter false make it use the fallbacks even where the backend has the native op
  // (so tests cover them).
  explicit ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                    bool native_avg = true, bool native_reduce_scatter = true);

  int rank() const override;
  int size() const override;
  std::string name() const override;

 protected:
  std::shared_ptr<CommWork> do_all_reduce(const std::vector<at::Tensor>& buffers,
                                          ReduceOp op) override;
  std::shared_ptr<CommWork> do_reduce_scatter(const std::vector<at::Tensor>& inputs,
                                              const std::vector<at::Tensor>& outputs,
                                              ReduceOp op) override;
  std::shared_ptr<CommWork> do_all_gather(const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& outputs) override;
  std::shared_ptr<CommWork> do_all_to_all(const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& outputs) override;
  std::shared_ptr<CommWork> do_broadcast(const std::vector<at::Tensor>& buffers, int root) override;

 private:
  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  bool avg_supported_ = true;             // cleared the first time the backend refuses AVG
  bool reduce_scatter_supported_ = true;  // cleared the first time it refuses reduce_scatter
};

}  // namespace fp8dp

// NcclCommunicator: the Communicator over its own ncclComm_t (CUDA builds only). Collectives run on
// a dedicated high-priority stream, ordered after the caller's current stream by an event; the
// returned work orders the caller's stream after the collective's end event (no host wait). A
// watchdog thread watches every collective in flight: a stuck or failed one aborts the
// communicator (which unblocks the streams waiting on it) and every later call raises instead of
// hanging.
#pragma once

#include <c10/cuda/CUDAStream.h>
#include <cuda_runtime.h>
#include <nccl.h>

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <vector>

#include "comm/communicator.h"
#include "comm/cuda/nccl_comm_state.h"

namespace fp8dp {

class NcclCommunicator : public Communicator {
 public:
  // Creates the ncclComm_t on the current CUDA device: rank 0 of `group` generates the unique id
  // and broadcasts it through the group. Collective over `group`. high_priority_stream: whether
  // the comm stream's kernels take SMs ahead of the compute stream's.
  NcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group, bool high_priority_stream);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  // Throws fp8dp::Error when the communicator was aborted (by the watchdog, a timed-out blocking
  // wait or an async error) or when ncclCommGetAsyncError reports an error (which aborts it).
  void check_for_errors() override;

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
  // Orders the comm stream after the caller's stream, runs `body` (the NCCL calls) inside one
  // ncclGroupStart/End on the comm stream, records the end event and returns the work.
  template <typename Body>
  std::shared_ptr<CommWork> launch(const std::string& what, const std::vector<at::Tensor>& tensors,
                                   Body&& body);
  void check_device(const std::vector<at::Tensor>& tensors, const char* what) const;

  c10::intrusive_ptr<c10d::ProcessGroup> group_;
  int rank_ = 0;
  int size_ = 1;
  std::shared_ptr<NcclCommState> state_;
  c10::cuda::CUDAStream stream_;
};

// The factory hook make_communicator() calls for "nccl" / "auto" on CUDA tensors.
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                     bool high_priority_stream);

}  // namespace fp8dp

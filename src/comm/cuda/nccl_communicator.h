// NcclCommunicator: the Communicator over its own ncclComm_t (CUDA builds only). Collectives run on
// a dedicated high-priority stream, ordered after the caller's current stream by an event; the
// returned work orders the caller's stream after the collective's end event. A stuck or failed
// collective aborts the communicator and raises on wait() instead of hanging.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <c10/cuda/CUDAStream.h>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include <memory>
#include <mutex>
#include <string>

#include "comm/communicator.h"

namespace fp8dp {

// The NCCL communicator and its state, shared by the communicator and every work it returned, so
// that a work can abort it (timeout) and later calls see the abort.
struct NcclCommState {
  ncclComm_t comm = nullptr;
  int device = 0;
  bool aborted = false;
  std::string abort_reason;  // why it was aborted: every later call repeats it
  std::mutex mutex;
  cudaStream_t stream = nullptr;  // the comm stream (the destructor checks it is idle)

  // Aborts the communicator once (frees it; in-flight kernels are torn down) and remembers why.
  void abort(const std::string& reason);
  ~NcclCommState();
};

class NcclCommunicator : public Communicator {
 public:
  // Creates the ncclComm_t on the current CUDA device: rank 0 of `group` generates the unique id
  // and broadcasts it through the group. Collective over `group`.
  explicit NcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

  int rank() const override { return rank_; }
  int size() const override { return size_; }
  std::string name() const override { return "nccl"; }
  // Polls ncclCommGetAsyncError; an error aborts the communicator and throws fp8dp::Error.
  void check_for_errors() override;

 protected:
  std::shared_ptr<CommWork> do_all_reduce(const std::vector<at::Tensor>& buffers,
                                          ReduceOp op) override;
  std::shared_ptr<CommWork> do_reduce_scatter(const std::vector<at::Tensor>& inputs,
                                              const std::vector<at::Tensor>& outputs,
                                              ReduceOp op) override;
  std::shared_ptr<CommWork> do_all_gather(const std::vector<at::Tensor>& inputs,
                                          const std::vector<at::Tensor>& outputs) override;
  std::shared_ptr<CommWork> do_broadcast(const std::vector<at::Tensor>& buffers,
                                         int root) override;

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
std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group);

}  // namespace fp8dp

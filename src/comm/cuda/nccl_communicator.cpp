// The native NCCL communicator: unique-id exchange through the c10d group, one ncclGroupStart/End
// per call on a dedicated stream, event ordering both ways (wait() is a device-side event wait),
// and every collective handed to the state's watchdog, which aborts the communicator when one
// fails or outlives the timeout instead of hanging.
#include "comm/cuda/nccl_communicator.h"

#include <ATen/ATen.h>
#include <c10/cuda/CUDACachingAllocator.h>
#include <c10/cuda/CUDAFunctions.h>
#include <c10/cuda/CUDAGuard.h>

#include <chrono>
#include <cstring>
#include <thread>

#include "comm/cuda/nccl_check.h"
#include "common/cuda_check.h"

namespace fp8dp {
namespace {

ncclDataType_t nccl_dtype(at::ScalarType t) {
  switch (t) {
    case at::kFloat:
      return ncclFloat32;
    case at::kBFloat16:
      return ncclBfloat16;
    case at::kHalf:
      return ncclFloat16;
    case at::kLong:
      return ncclInt64;
    case at::kByte:
      return ncclUint8;
    default:
      FP8DP_CHECK_ARG(false, "nccl: expected float32, bfloat16, float16, int64 or uint8, got ", t);
  }
}

ncclRedOp_t nccl_op(ReduceOp op) { return op == ReduceOp::kSum ? ncclSum : ncclAvg; }

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

// NCCL runs reduce-scatter / all-gather in place only when the small buffer is exactly chunk `rank`
// of the big one; any other overlap would read what it writes.
void check_in_place(const at::Tensor& big, const at::Tensor& small, int rank, const char* what,
                    size_t i) {
  if (!overlaps(big, small)) return;
  const auto* chunk = static_cast<const char*>(big.const_data_ptr()) + rank * small.nbytes();
  FP8DP_CHECK_ARG(small.const_data_ptr() == chunk, what, "[", i,
                  "]: the per-rank buffer overlaps the full buffer but is not its chunk ", rank,
                  " (in place needs exactly that chunk)");
}

class NcclWork : public CommWork {
 public:
  NcclWork(std::string what, std::shared_ptr<NcclCommState> state,
           std::shared_ptr<NcclEvents> events, std::chrono::milliseconds timeout, bool blocking)
      : what_(std::move(what)),
        state_(std::move(state)),
        events_(std::move(events)),
        timeout_(timeout),
        blocking_(blocking) {}

  // Stream-ordered: the caller's current stream waits on the end event on the device and the
  // host returns at once ("by using an event instead of a host sync we can enqueue new work right
  // away"); the watchdog turns a collective that never ends into an abort, which unblocks that
  // stream, and an error on the next call. Blocking mode polls the end event on the host first.
  void wait() override {
    if (done_) return;
    done_ = true;  // a failure is reported once; a second wait() returns at once
    if (blocking_) wait_on_host();
    state_->throw_if_aborted(what_);
    c10::cuda::CUDAGuard guard(state_->device);
    FP8DP_CHECK_CUDA(cudaStreamWaitEvent(c10::cuda::getCurrentCUDAStream(state_->device).stream(),
                                         events_->end, 0));
  }

  bool is_completed() override { return done_ || cudaEventQuery(events_->end) == cudaSuccess; }

 private:
  void wait_on_host() {
    const auto deadline = std::chrono::steady_clock::now() + timeout_;
    for (int spins = 0;; ++spins) {
      const cudaError_t e = cudaEventQuery(events_->end);
      if (e == cudaSuccess) return;
      if (e != cudaErrorNotReady) FP8DP_CHECK_CUDA(e);
      state_->throw_if_aborted(what_);  // the watchdog may have given up first
      const std::string async = state_->poll_async_error();
      FP8DP_CHECK(async.empty(), what_, " failed: ", async);
      if (std::chrono::steady_clock::now() > deadline) {
        const std::string reason =
            detail::concat(what_, " did not finish within ", timeout_.count(), " ms");
        state_->abort(reason);
        FP8DP_CHECK(false, reason,
                    "; the NCCL communicator is aborted (a rank skipped or is "
                    "stuck in this collective)");
      }
      // Spin briefly for the common short wait, then sleep so that a long wait costs no core.
      if (spins > 1000) std::this_thread::sleep_for(std::chrono::microseconds(50));
    }
  }

  std::string what_;
  std::shared_ptr<NcclCommState> state_;
  std::shared_ptr<NcclEvents> events_;
  std::chrono::milliseconds timeout_;
  bool blocking_ = false;
  bool done_ = false;
};

// Rank 0's unique id reaches every rank through the group: a byte tensor broadcast, on the CPU for
// gloo and on the current CUDA device for other backends (torch's NCCL group takes only CUDA).
ncclUniqueId exchange_unique_id(c10d::ProcessGroup& group, int device) {
  ncclUniqueId id;
  std::memset(&id, 0, sizeof(id));
  if (group.getRank() == 0) FP8DP_CHECK_NCCL(ncclGetUniqueId(&id), nullptr, "ncclGetUniqueId");
  at::Tensor host = at::empty({static_cast<int64_t>(sizeof(id))}, at::kByte);
  std::memcpy(host.data_ptr(), &id, sizeof(id));
  const bool cpu = group.getBackendName() == "gloo";
  at::Tensor t = cpu ? host : host.to(at::Device(at::kCUDA, device));
  std::vector<at::Tensor> v{t};
  c10d::BroadcastOptions opts;
  opts.rootRank = 0;
  group.broadcast(v, opts)->wait();
  host = t.cpu();
  std::memcpy(&id, host.data_ptr(), sizeof(id));
  return id;
}

}  // namespace

NcclCommunicator::NcclCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                   bool high_priority_stream)
    : group_(std::move(group)),
      state_(std::make_shared<NcclCommState>()),
      stream_(c10::cuda::getStreamFromPool(high_priority_stream, c10::cuda::current_device())) {
  FP8DP_CHECK_ARG(group_, "process_group: expected a live c10d ProcessGroup, got None");
  rank_ = group_->getRank();
  size_ = group_->getSize();
  state_->device = stream_.device_index();
  state_->stream = stream_.stream();
  c10::cuda::CUDAGuard guard(state_->device);
  const ncclUniqueId id = exchange_unique_id(*group_, state_->device);
  FP8DP_CHECK_NCCL(ncclCommInitRank(&state_->comm, size_, id, rank_), nullptr,
                   "ncclCommInitRank (rank ", rank_, " of ", size_, ", cuda:", state_->device, ")");
  state_->start_watchdog();
}

void NcclCommunicator::check_for_errors() {
  state_->throw_if_aborted("nccl");
  const std::string async = state_->poll_async_error();
  FP8DP_CHECK(async.empty(), async);
}

void NcclCommunicator::check_device(const std::vector<at::Tensor>& tensors,
                                    const char* what) const {
  for (size_t i = 0; i < tensors.size(); ++i) {
    const auto& t = tensors[i];
    FP8DP_CHECK_ARG(t.is_cuda() && t.device().index() == state_->device, what, "[", i,
                    "]: the NCCL communicator lives on cuda:", state_->device,
                    ", the buffer is on ", t.device());
  }
}

template <typename Body>
std::shared_ptr<CommWork> NcclCommunicator::launch(const std::string& what,
                                                   const std::vector<at::Tensor>& tensors,
                                                   Body&& body) {
  c10::cuda::CUDAGuard guard(state_->device);
  const cudaStream_t compute = c10::cuda::getCurrentCUDAStream(state_->device).stream();
  state_->throw_if_aborted(what);
  auto events = std::make_shared<NcclEvents>();
  FP8DP_CHECK_CUDA(cudaEventRecord(events->start, compute));
  FP8DP_CHECK_CUDA(cudaStreamWaitEvent(stream_.stream(), events->start, 0));
  {
    std::lock_guard<std::mutex> lock(state_->mutex);
    FP8DP_CHECK(state_->comm != nullptr, what,
                ": the NCCL communicator was aborted (see the earlier error)");
    ncclComm_t comm = state_->comm;
    FP8DP_CHECK_NCCL(ncclGroupStart(), comm, what);
    ncclResult_t r = ncclSuccess;
    try {
      r = body(comm, stream_.stream());
    } catch (...) {
      ncclGroupEnd();
      throw;
    }
    const ncclResult_t end = ncclGroupEnd();
    FP8DP_CHECK_NCCL(r, comm, what);
    FP8DP_CHECK_NCCL(end, comm, what);
  }
  // The caching allocator must not hand these blocks out again before the comm stream is done.
  for (const auto& t : tensors)
    c10::cuda::CUDACachingAllocator::recordStream(t.storage().data_ptr(), stream_);
  FP8DP_CHECK_CUDA(cudaEventRecord(events->end, stream_.stream()));
  state_->watch(events, what, timeout());
  return std::make_shared<NcclWork>(what, state_, std::move(events), timeout(), blocking_wait());
}

std::shared_ptr<CommWork> NcclCommunicator::do_all_reduce(const std::vector<at::Tensor>& buffers,
                                                          ReduceOp op) {
  check_device(buffers, "all_reduce buffers");
  const std::string what =
      detail::concat("nccl all_reduce ", reduce_op_name(op), " of ", buffers.size(), " buffer(s)");
  return launch(what, buffers, [&](ncclComm_t comm, cudaStream_t s) {
    for (const auto& b : buffers) {
      const ncclResult_t r = ncclAllReduce(b.const_data_ptr(), b.data_ptr(), b.numel(),
                                           nccl_dtype(b.scalar_type()), nccl_op(op), comm, s);
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  });
}

std::shared_ptr<CommWork> NcclCommunicator::do_reduce_scatter(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, ReduceOp op) {
  check_device(inputs, "reduce_scatter inputs");
  check_device(outputs, "reduce_scatter outputs");
  for (size_t i = 0; i < inputs.size(); ++i)
    check_in_place(inputs[i], outputs[i], rank_, "reduce_scatter outputs", i);
  const std::string what = detail::concat("nccl reduce_scatter ", reduce_op_name(op), " of ",
                                          inputs.size(), " buffer(s)");
  std::vector<at::Tensor> all(inputs);
  all.insert(all.end(), outputs.begin(), outputs.end());
  return launch(what, all, [&](ncclComm_t comm, cudaStream_t s) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const ncclResult_t r =
          ncclReduceScatter(inputs[i].const_data_ptr(), outputs[i].data_ptr(), outputs[i].numel(),
                            nccl_dtype(inputs[i].scalar_type()), nccl_op(op), comm, s);
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  });
}

std::shared_ptr<CommWork> NcclCommunicator::do_all_gather(const std::vector<at::Tensor>& inputs,
                                                          const std::vector<at::Tensor>& outputs) {
  check_device(inputs, "all_gather inputs");
  check_device(outputs, "all_gather outputs");
  for (size_t i = 0; i < inputs.size(); ++i)
    check_in_place(outputs[i], inputs[i], rank_, "all_gather inputs", i);
  const std::string what = detail::concat("nccl all_gather of ", inputs.size(), " buffer(s)");
  std::vector<at::Tensor> all(inputs);
  all.insert(all.end(), outputs.begin(), outputs.end());
  return launch(what, all, [&](ncclComm_t comm, cudaStream_t s) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const ncclResult_t r =
          ncclAllGather(inputs[i].const_data_ptr(), outputs[i].data_ptr(), inputs[i].numel(),
                        nccl_dtype(inputs[i].scalar_type()), comm, s);
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  });
}

std::shared_ptr<CommWork> NcclCommunicator::do_all_to_all(const std::vector<at::Tensor>& inputs,
                                                          const std::vector<at::Tensor>& outputs) {
  check_device(inputs, "all_to_all inputs");
  check_device(outputs, "all_to_all outputs");
  const std::string what = detail::concat("nccl all_to_all of ", inputs.size(), " buffer(s)");
  std::vector<at::Tensor> all(inputs);
  all.insert(all.end(), outputs.begin(), outputs.end());
  // NCCL has no all-to-all collective: one send and one receive per peer inside the group call
  // (what torch's ProcessGroupNCCL does too), on bytes, since the data is only moved.
  return launch(what, all, [&](ncclComm_t comm, cudaStream_t s) {
    for (size_t i = 0; i < inputs.size(); ++i) {
      const size_t chunk = inputs[i].nbytes() / static_cast<size_t>(size_);
      const auto* in = static_cast<const char*>(inputs[i].const_data_ptr());
      auto* out = static_cast<char*>(outputs[i].data_ptr());
      for (int peer = 0; peer < size_; ++peer) {
        ncclResult_t r = ncclSend(in + peer * chunk, chunk, ncclUint8, peer, comm, s);
        if (r != ncclSuccess) return r;
        r = ncclRecv(out + peer * chunk, chunk, ncclUint8, peer, comm, s);
        if (r != ncclSuccess) return r;
      }
    }
    return ncclSuccess;
  });
}

std::shared_ptr<CommWork> NcclCommunicator::do_broadcast(const std::vector<at::Tensor>& buffers,
                                                         int root) {
  check_device(buffers, "broadcast buffers");
  const std::string what =
      detail::concat("nccl broadcast from rank ", root, " of ", buffers.size(), " buffer(s)");
  return launch(what, buffers, [&](ncclComm_t comm, cudaStream_t s) {
    for (const auto& b : buffers) {
      const ncclResult_t r = ncclBroadcast(b.const_data_ptr(), b.data_ptr(), b.numel(),
                                           nccl_dtype(b.scalar_type()), root, comm, s);
      if (r != ncclSuccess) return r;
    }
    return ncclSuccess;
  });
}

std::shared_ptr<Communicator> make_nccl_communicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                     bool high_priority_stream) {
  return std::make_shared<NcclCommunicator>(std::move(group), high_priority_stream);
}

}  // namespace fp8dp

// The shared NCCL communicator state: abort bookkeeping and the watchdog. The watchdog exists so
// that CommWork::wait() can be a device-side event wait: the host no longer polls each collective
// itself, yet a collective that a peer never joins (or that fails asynchronously) still ends in
// an abort and an error rather than a stream blocked forever. (torch's ProcessGroupNCCL has the
// same split: stream-ordered waits plus a watchdog thread that aborts on timeout.)
#include "comm/cuda/nccl_comm_state.h"

#include "comm/cuda/nccl_check.h"
#include "common/cuda_check.h"

namespace fp8dp {
namespace {

// How often the watchdog looks at the collectives in flight. Timeouts are seconds to minutes, so a
// few milliseconds of resolution are plenty; each look costs one cudaEventQuery per collective.
constexpr std::chrono::milliseconds kWatchdogPoll{10};

}  // namespace

NcclEvents::NcclEvents() {
  FP8DP_CHECK_CUDA(cudaEventCreateWithFlags(&start, cudaEventDisableTiming));
  FP8DP_CHECK_CUDA(cudaEventCreateWithFlags(&end, cudaEventDisableTiming));
}

NcclEvents::~NcclEvents() {
  cudaEventDestroy(start);  // no throw from a destructor; an error here leaks two events at most
  cudaEventDestroy(end);
}

void NcclCommState::abort(const std::string& reason) {
  std::lock_guard<std::mutex> lock(mutex);
  if (aborted_) return;
  aborted_ = true;
  abort_reason_ = reason;
  if (comm != nullptr) {
    ncclCommAbort(comm);  // its own result cannot improve on the error being reported
    comm = nullptr;
  }
}

void NcclCommState::throw_if_aborted(const std::string& what) {
  std::lock_guard<std::mutex> lock(mutex);
  FP8DP_CHECK(!aborted_, what, " failed: the NCCL communicator was aborted (", abort_reason_,
              "); build a new DistributedDataParallel to continue");
}

std::string NcclCommState::poll_async_error() {
  ncclResult_t r = ncclSuccess;
  std::string reason;
  {
    std::lock_guard<std::mutex> lock(mutex);
    if (aborted_ || comm == nullptr) return "";
    const ncclResult_t q = ncclCommGetAsyncError(comm, &r);
    if (q != ncclSuccess) r = q;
    if (r != ncclSuccess && r != ncclInProgress)
      reason = detail::concat("nccl: asynchronous error: ", detail::nccl_error_text(r, comm));
  }
  if (!reason.empty()) abort(reason);
  return reason;
}

void NcclCommState::start_watchdog() {
  watchdog_ = std::thread([this] { watchdog_loop(); });
}

void NcclCommState::watch(std::shared_ptr<NcclEvents> events, std::string what,
                          std::chrono::milliseconds timeout) {
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    watched_.push_back(Watched{std::move(events), std::move(what), timeout,
                               std::chrono::steady_clock::now() + timeout});
  }
  watch_cv_.notify_one();
}

void NcclCommState::watchdog_loop() {
  // The events and the communicator live on `device`; without this the thread's CUDA calls would
  // create a context on device 0.
  cudaSetDevice(device);
  // This thread never captures; its event queries must not invalidate a CUDA graph capture that
  // another thread runs in the default global mode (torch.cuda.graph), which they would under
  // the global interaction mode. Thread-local: only this thread's own captures would restrict it.
  cudaStreamCaptureMode mode = cudaStreamCaptureModeThreadLocal;
  cudaThreadExchangeStreamCaptureMode(&mode);
  std::unique_lock<std::mutex> lock(watch_mutex_);
  while (!stop_) {
    if (watched_.empty()) {
      watch_cv_.wait(lock, [this] { return stop_ || !watched_.empty(); });
      continue;
    }
    if (watch_cv_.wait_for(lock, kWatchdogPoll, [this] { return stop_; })) break;
    // Look at a snapshot without the lock, so launches (which add entries) never wait on CUDA or
    // NCCL calls made here.
    std::vector<Watched> pending;
    pending.swap(watched_);
    lock.unlock();
    const auto now = std::chrono::steady_clock::now();
    std::string failure;
    std::vector<Watched> still;
    for (auto& w : pending) {
      const cudaError_t e = cudaEventQuery(w.events->end);
      if (e == cudaSuccess) continue;
      if (e != cudaErrorNotReady) {
        failure = detail::concat(w.what, " failed: CUDA error ", cudaGetErrorName(e), ": ",
                                 cudaGetErrorString(e));
        break;
      }
      if (now > w.deadline) {
        failure = detail::concat(w.what, " did not finish within ", w.timeout.count(),
                                 " ms (a rank skipped or is stuck in this collective)");
        break;
      }
      still.push_back(std::move(w));
    }
    if (failure.empty())
      failure = poll_async_error();  // aborts itself on an error
    else
      abort(failure);
    lock.lock();
    // After an abort nothing is left to watch: every collective in flight has been torn down.
    if (failure.empty())
      watched_.insert(watched_.end(), std::make_move_iterator(still.begin()),
                      std::make_move_iterator(still.end()));
  }
}

NcclCommState::~NcclCommState() {
  {
    std::lock_guard<std::mutex> lock(watch_mutex_);
    stop_ = true;
  }
  watch_cv_.notify_all();
  if (watchdog_.joinable()) watchdog_.join();
  watched_.clear();
  if (comm == nullptr) return;
  // ncclCommAbort, not ncclCommDestroy: Destroy is an intra-node collective in current NCCL, so a
  // peer that aborted, exited, or destroys its communicators in another order would hang us. Abort
  // is local and, on an idle stream, just frees the resources. When the CUDA runtime is already
  // unloading (interpreter exit) the communicator is left to the process teardown instead.
  const cudaError_t e = stream ? cudaStreamQuery(stream) : cudaSuccess;
  if (e == cudaSuccess || e == cudaErrorNotReady) ncclCommAbort(comm);
}

}  // namespace fp8dp

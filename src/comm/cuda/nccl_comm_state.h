// NcclCommState: one ncclComm_t shared by the NcclCommunicator and every work it returned, its
// abort state, and the watchdog thread that turns a stuck or failed collective into an abort (and
// an error on the next call) instead of a hang.
#pragma once

#include <cuda_runtime.h>
#include <nccl.h>

#include <chrono>
#include <condition_variable>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace fp8dp {

// The start and end events of one collective, shared by its work and the watchdog: whichever
// lets go last destroys them.
struct NcclEvents {
  cudaEvent_t start = nullptr;
  cudaEvent_t end = nullptr;
  NcclEvents();
  ~NcclEvents();
  NcclEvents(const NcclEvents&) = delete;
  NcclEvents& operator=(const NcclEvents&) = delete;
};

// The NCCL communicator and its state, shared by the communicator and every work it returned, so
// that a work or the watchdog can abort it and later calls see the abort.
class NcclCommState {
 public:
  ncclComm_t comm = nullptr;  // guarded by mutex; nullptr once aborted
  int device = 0;
  cudaStream_t stream = nullptr;  // the comm stream (the destructor checks it is idle)
  std::mutex mutex;

  // Aborts the communicator once (frees it; in-flight kernels are torn down, so streams waiting
  // on them run on) and remembers why: every later call repeats it.
  void abort(const std::string& reason);
  // Throws fp8dp::Error "<what> failed: the NCCL communicator was aborted (<reason>)" if aborted.
  void throw_if_aborted(const std::string& what);
  // Polls ncclCommGetAsyncError; an error aborts the communicator and is returned as text ("" when
  // there is none or the communicator is already aborted).
  std::string poll_async_error();

  // Starts the watchdog thread (once the communicator exists).
  void start_watchdog();
  // Watches one collective until its end event completes; past launch + timeout (or on an NCCL
  // async error) the communicator is aborted.
  void watch(std::shared_ptr<NcclEvents> events, std::string what,
             std::chrono::milliseconds timeout);
  ~NcclCommState();

 private:
  struct Watched {
    std::shared_ptr<NcclEvents> events;
    std::string what;
    std::chrono::milliseconds timeout;
    std::chrono::steady_clock::time_point deadline;
  };
  void watchdog_loop();

  bool aborted_ = false;      // guarded by mutex
  std::string abort_reason_;  // guarded by mutex
  std::mutex watch_mutex_;    // guards watched_ and stop_
  std::condition_variable watch_cv_;
  std::vector<Watched> watched_;
  bool stop_ = false;
  std::thread watchdog_;
};

}  // namespace fp8dp

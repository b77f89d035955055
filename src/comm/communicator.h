// Communicator: the collectives the gradient buffer needs (all-reduce, reduce-scatter, all-gather,
// all-to-all, broadcast of flat buffers), grouped per bucket group and asynchronous, behind one
// interface that the ProcessGroup (any c10d group, e.g. gloo) and the native NCCL communicators
// implement.
#pragma once

#include <ATen/core/Tensor.h>

#include <chrono>
#include <memory>
#include <string>
#include <vector>

namespace fp8dp {

enum class ReduceOp { kSum, kAvg };

const char* reduce_op_name(ReduceOp op);

// Handle of one grouped collective in flight.
class CommWork {
 public:
  virtual ~CommWork() = default;
  // CPU: blocks until the collective has finished. CUDA (default, stream-ordered): makes the
  // caller's current stream wait on the collective's end event and returns at once, so the host
  // keeps queueing work (e.g. the optimizer's kernels) while the collective runs; a collective
  // that never finishes is aborted by the communicator's watchdog after timeout(), which
  // unblocks the stream, and the next call on the communicator raises. With blocking_wait() the
  // CUDA work polls its end event on the host instead and raises right here on a timeout.
  // Throws fp8dp::Error naming the collective when it failed (or the communicator was aborted).
  // A second call returns at once.
  virtual void wait() = 0;
  // True once the collective has finished on the device (or wait() was already called).
  virtual bool is_completed() = 0;
};

// Every collective takes a list of flat (1-D, contiguous, same device) buffers and runs them as one
// group (one ncclGroupStart/End on NCCL): one call per bucket group. Dtypes: float32, bfloat16,
// float16 (and int64 for the small bookkeeping tensors); the collectives that only move data
// (all-gather, all-to-all, broadcast) also take uint8, which carries FP8 bytes. The public methods
// check their arguments and call check_for_errors() first, then hand off to the do_* hooks that
// implementations override.
//
// Contract for implementations (the CUDA one in src/comm/cuda/ included):
// - do_* return at once; the collective runs asynchronously. On CUDA: record an event on the
//   caller's current stream, make the communicator's own stream wait on it (so writes made before
//   the call, e.g. the 1/dp pre-scale, are seen), launch there, record a completion event.
// - CommWork::wait() orders the caller's current stream after the completion event and keeps every
//   buffer (and any scratch) alive until then, or tells the caching allocator (recordStream); on
//   the CPU it blocks. To turn a missing peer into an error rather than a hang, the NCCL
//   implementation watches every collective from a watchdog thread (end event, async error,
//   deadline = launch + timeout()) and aborts the communicator when one fails; with
//   blocking_wait() wait() itself polls the end event on the host until timeout().
// - Failures surface as fp8dp::Error from wait() or check_for_errors(), never as a hang: a
//   collective that does not finish within timeout() aborts the communicator and raises, naming
//   the collective.
class Communicator {
 public:
  virtual ~Communicator() = default;

  virtual int rank() const = 0;
  virtual int size() const = 0;
  // A short name for messages, e.g. "process_group(gloo)" or "nccl".
  virtual std::string name() const = 0;

  // buffers[i] <- reduce over ranks of buffers[i], in place.
  std::shared_ptr<CommWork> all_reduce(const std::vector<at::Tensor>& buffers, ReduceOp op);
  // outputs[i] <- chunk `rank()` of the reduction of inputs[i]; inputs[i].numel() must be
  // size() * outputs[i].numel(). outputs[i] may be that very chunk of inputs[i] (in place).
  std::shared_ptr<CommWork> reduce_scatter(const std::vector<at::Tensor>& inputs,
                                           const std::vector<at::Tensor>& outputs, ReduceOp op);
  // outputs[i] <- concatenation over ranks of inputs[i]; outputs[i].numel() must be
  // size() * inputs[i].numel(). inputs[i] may be chunk `rank()` of outputs[i] (in place).
  std::shared_ptr<CommWork> all_gather(const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs);
  // Chunk j of outputs[i] <- chunk rank() of rank j's inputs[i], where each buffer is split into
  // size() equal chunks (numel divisible by size(); inputs[i] and outputs[i] equally long, of one
  // dtype, not overlapping). Moves bytes only, so any dtype above (uint8: FP8 bytes) works alike.
  std::shared_ptr<CommWork> all_to_all(const std::vector<at::Tensor>& inputs,
                                       const std::vector<at::Tensor>& outputs);
  // buffers[i] <- root's buffers[i].
  std::shared_ptr<CommWork> broadcast(const std::vector<at::Tensor>& buffers, int root);

  // Throws fp8dp::Error when an earlier collective failed asynchronously (a NCCL async error, an
  // aborted communicator). Virtual so that tests can inject a failure.
  virtual void check_for_errors() {}

  // How long a collective may take before it is declared failed (default 10 minutes).
  void set_timeout(std::chrono::milliseconds timeout);
  std::chrono::milliseconds timeout() const { return timeout_; }
  // CUDA communicators: true makes wait() block the host until the collective finished and raise
  // there on a timeout (a debugging aid; the host then cannot queue work behind the collective).
  // Default false: stream-ordered waits. Host-side communicators always block. Applies to
  // collectives launched after the call.
  void set_blocking_wait(bool blocking) { blocking_wait_ = blocking; }
  bool blocking_wait() const { return blocking_wait_; }

 protected:
  virtual std::shared_ptr<CommWork> do_all_reduce(const std::vector<at::Tensor>& buffers,
                                                  ReduceOp op) = 0;
  virtual std::shared_ptr<CommWork> do_reduce_scatter(const std::vector<at::Tensor>& inputs,
                                                      const std::vector<at::Tensor>& outputs,
                                                      ReduceOp op) = 0;
  virtual std::shared_ptr<CommWork> do_all_gather(const std::vector<at::Tensor>& inputs,
                                                  const std::vector<at::Tensor>& outputs) = 0;
  virtual std::shared_ptr<CommWork> do_all_to_all(const std::vector<at::Tensor>& inputs,
                                                  const std::vector<at::Tensor>& outputs) = 0;
  virtual std::shared_ptr<CommWork> do_broadcast(const std::vector<at::Tensor>& buffers,
                                                 int root) = 0;

 private:
  std::chrono::milliseconds timeout_{std::chrono::minutes(10)};
  bool blocking_wait_ = false;
};

}  // namespace fp8dp

// Argument checks shared by every Communicator implementation.
#include "comm/communicator.h"

#include <ATen/ATen.h>

#include "common/check.h"

namespace fp8dp {

const char* reduce_op_name(ReduceOp op) { return op == ReduceOp::kSum ? "SUM" : "AVG"; }

namespace {

// bytes: the collective only moves data (all-gather, all-to-all, broadcast), so uint8 (FP8 bytes)
// is fine too; a reduction over uint8 would be meaningless for gradients.
void check_buffer(const at::Tensor& t, const char* what, size_t i, const at::Tensor& first,
                  bool bytes) {
  FP8DP_CHECK_ARG(t.defined(), what, "[", i, "]: expected a tensor, got an undefined one");
  const auto dt = t.scalar_type();
  const bool ok = dt == at::kFloat || dt == at::kBFloat16 || dt == at::kHalf || dt == at::kLong ||
                  (bytes && dt == at::kByte);
  FP8DP_CHECK_ARG(ok, what, "[", i, "]: expected dtype float32, bfloat16, float16, int64",
                  bytes ? " or uint8" : "", ", got ", dt);
  FP8DP_CHECK_ARG(t.dim() == 1 && t.is_contiguous(), what, "[", i,
                  "]: expected a flat contiguous buffer, got sizes ", t.sizes(), " strides ",
                  t.strides());
  FP8DP_CHECK_ARG(t.device() == first.device(), what, "[", i, "]: expected device ", first.device(),
                  " like the first buffer, got ", t.device());
}

void check_list(const std::vector<at::Tensor>& v, const char* what, bool bytes = false) {
  FP8DP_CHECK_ARG(!v.empty(), what, ": expected at least one buffer, got none");
  for (size_t i = 0; i < v.size(); ++i) check_buffer(v[i], what, i, v[0], bytes);
}

// big[i].numel() == factor * small[i].numel(), same dtype.
void check_pairs(const std::vector<at::Tensor>& big, const char* big_name,
                 const std::vector<at::Tensor>& small, const char* small_name, int factor,
                 bool bytes = false) {
  check_list(big, big_name, bytes);
  check_list(small, small_name, bytes);
  FP8DP_CHECK_ARG(big.size() == small.size(), big_name, " and ", small_name,
                  ": expected lists of equal length, got ", big.size(), " and ", small.size());
  for (size_t i = 0; i < big.size(); ++i) {
    FP8DP_CHECK_ARG(big[i].scalar_type() == small[i].scalar_type(), small_name, "[", i,
                    "]: expected dtype ", big[i].scalar_type(), " like ", big_name, "[", i,
                    "], got ", small[i].scalar_type());
    FP8DP_CHECK_ARG(big[i].numel() == factor * small[i].numel(), big_name, "[", i, "]: expected ",
                    factor, " (world size) x ", small_name, "[", i,
                    "].numel() = ", factor * small[i].numel(), " elements, got ", big[i].numel());
  }
}

}  // namespace

std::shared_ptr<CommWork> Communicator::all_reduce(const std::vector<at::Tensor>& buffers,
                                                   ReduceOp op) {
  check_list(buffers, "all_reduce buffers");
  check_for_errors();
  return do_all_reduce(buffers, op);
}

std::shared_ptr<CommWork> Communicator::reduce_scatter(const std::vector<at::Tensor>& inputs,
                                                       const std::vector<at::Tensor>& outputs,
                                                       ReduceOp op) {
  check_pairs(inputs, "reduce_scatter inputs", outputs, "reduce_scatter outputs", size());
  check_for_errors();
  return do_reduce_scatter(inputs, outputs, op);
}

std::shared_ptr<CommWork> Communicator::all_gather(const std::vector<at::Tensor>& inputs,
                                                   const std::vector<at::Tensor>& outputs) {
  check_pairs(outputs, "all_gather outputs", inputs, "all_gather inputs", size(), true);
  check_for_errors();
  return do_all_gather(inputs, outputs);
}

std::shared_ptr<CommWork> Communicator::all_to_all(const std::vector<at::Tensor>& inputs,
                                                   const std::vector<at::Tensor>& outputs) {
  check_pairs(outputs, "all_to_all outputs", inputs, "all_to_all inputs", 1, true);
  for (size_t i = 0; i < inputs.size(); ++i) {
    FP8DP_CHECK_ARG(inputs[i].numel() % size() == 0, "all_to_all inputs[", i,
                    "]: expected a multiple of the world size ", size(), " elements, got ",
                    inputs[i].numel());
    FP8DP_CHECK_ARG(
        !inputs[i].storage().is_alias_of(outputs[i].storage()) || inputs[i].numel() == 0,
        "all_to_all outputs[", i, "]: expected a buffer apart from inputs[", i,
        "] (an all-to-all cannot run in place), got one sharing its storage");
  }
  check_for_errors();
  return do_all_to_all(inputs, outputs);
}

std::shared_ptr<CommWork> Communicator::broadcast(const std::vector<at::Tensor>& buffers,
                                                  int root) {
  check_list(buffers, "broadcast buffers", true);
  FP8DP_CHECK_ARG(root >= 0 && root < size(), "broadcast root: expected a rank in [0, ", size(),
                  "), got ", root);
  check_for_errors();
  return do_broadcast(buffers, root);
}

void Communicator::set_timeout(std::chrono::milliseconds timeout) {
  FP8DP_CHECK_ARG(timeout.count() > 0, "timeout: expected > 0 ms, got ", timeout.count());
  timeout_ = timeout;
}

}  // namespace fp8dp

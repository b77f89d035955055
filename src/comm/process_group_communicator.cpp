// c10d collectives behind the Communicator interface; each grouped call returns one CommWork whose
// wait() waits for every c10d work of the group, then runs the fix-ups (copies, AVG divide).
#include "comm/process_group_communicator.h"

#include <ATen/ATen.h>

#include <functional>
#include <type_traits>
#include <utility>

#include "common/check.h"

namespace fp8dp {
namespace {

// torch renamed the flat-buffer collectives: 2.11 has _reduce_scatter_base / _allgather_base, newer
// releases reduce_scatter_single / all_gather_single (and drop or deprecate the old names). Pick
// whichever this torch has at compile time, so one source builds against both.
template <typename G, typename = void>
struct HasSingleCollectives : std::false_type {};
template <typename G>
struct HasSingleCollectives<G, std::void_t<decltype(std::declval<G&>().reduce_scatter_single(
                                   std::declval<at::Tensor&>(), std::declval<at::Tensor&>(),
                                   std::declval<const c10d::ReduceScatterOptions&>()))>>
    : std::true_type {};

template <typename G>
c10::intrusive_ptr<c10d::Work> reduce_scatter_flat(G& g, at::Tensor& out, at::Tensor& in,
                                                   const c10d::ReduceScatterOptions& opts) {
  if constexpr (HasSingleCollectives<G>::value) {
    return g.reduce_scatter_single(out, in, opts);
  } else {
    return g._reduce_scatter_base(out, in, opts);
  }
}

template <typename G>
c10::intrusive_ptr<c10d::Work> all_gather_flat(G& g, at::Tensor& out, at::Tensor& in,
                                               const c10d::AllgatherOptions& opts) {
  if constexpr (HasSingleCollectives<G>::value) {
    return g.all_gather_single(out, in, opts);
  } else {
    return g._allgather_base(out, in, opts);
  }
}

// torch 2.11's name for the flat all-to-all is alltoall_base; newer releases call it
// all_to_all_single and deprecate the old name.
template <typename G, typename = void>
struct HasAllToAllSingle : std::false_type {};
template <typename G>
struct HasAllToAllSingle<
    G, std::void_t<decltype(std::declval<G&>().all_to_all_single(
           std::declval<at::Tensor&>(), std::declval<at::Tensor&>(),
           std::declval<std::vector<int64_t>&>(), std::declval<std::vector<int64_t>&>(),
           std::declval<const c10d::AllToAllOptions&>()))>> : std::true_type {};

template <typename G>
c10::intrusive_ptr<c10d::Work> all_to_all_flat(G& g, at::Tensor& out, at::Tensor& in) {
  std::vector<int64_t> equal;  // empty split sizes: equal chunks
  c10d::AllToAllOptions opts;
  if constexpr (HasAllToAllSingle<G>::value) {
    return g.all_to_all_single(out, in, equal, equal, opts);
  } else {
    return g.alltoall_base(out, in, equal, equal, opts);
  }
}

// The backend's own operation timeout stays the group's (init_process_group(timeout=...)); wait()
// gives up after the communicator's timeout, whichever comes first.
class ProcessGroupWork : public CommWork {
 public:
  ProcessGroupWork(std::string what, std::chrono::milliseconds timeout,
                   std::vector<c10::intrusive_ptr<c10d::Work>> works, std::function<void()> after)
      : what_(std::move(what)),
        timeout_(timeout),
        works_(std::move(works)),
        after_(std::move(after)) {}

  void wait() override {
    if (done_) return;
    done_ = true;  // a failed collective is reported once; later waits do not hang on it again
    for (auto& w : works_) {
      try {
        w->wait(timeout_);
      } catch (const std::exception& e) {
        FP8DP_CHECK(false, what_, " failed or did not finish within ", timeout_.count(),
                    " ms: ", e.what());
      }
    }
    if (after_) after_();
  }

  bool is_completed() override {
    if (done_) return true;
    for (auto& w : works_)
      if (!w->isCompleted()) return false;
    return true;
  }

 private:
  std::string what_;
  std::chrono::milliseconds timeout_;
  std::vector<c10::intrusive_ptr<c10d::Work>> works_;
  std::function<void()> after_;
  bool done_ = false;
};

bool overlaps(const at::Tensor& a, const at::Tensor& b) {
  if (!a.storage().is_alias_of(b.storage())) return false;
  const auto* a0 = static_cast<const char*>(a.const_data_ptr());
  const auto* b0 = static_cast<const char*>(b.const_data_ptr());
  return a0 < b0 + b.nbytes() && b0 < a0 + a.nbytes();
}

}  // namespace

ProcessGroupCommunicator::ProcessGroupCommunicator(c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                   bool native_avg, bool native_reduce_scatter)
    : group_(std::move(group)),
      avg_supported_(native_avg),
      reduce_scatter_supported_(native_reduce_scatter) {
  FP8DP_CHECK_ARG(group_, "process_group: expected a live c10d ProcessGroup, got None");
}

int ProcessGroupCommunicator::rank() const { return group_->getRank(); }
int ProcessGroupCommunicator::size() const { return group_->getSize(); }
std::string ProcessGroupCommunicator::name() const {
  return "process_group(" + group_->getBackendName() + ")";
}

std::shared_ptr<CommWork> ProcessGroupCommunicator::do_all_reduce(
    const std::vector<at::Tensor>& buffers, ReduceOp op) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  c10d::AllreduceOptions opts;
  bool divide = false;
  for (const auto& b : buffers) {
    std::vector<at::Tensor> one{b};
    if (op == ReduceOp::kAvg && avg_supported_) {
      opts.reduceOp = c10d::ReduceOp::AVG;
      try {
        works.push_back(group_->allreduce(one, opts));
        continue;
      } catch (const c10::Error&) {
        avg_supported_ = false;  // the backend refused before launching: fall back below
      }
    }
    opts.reduceOp = c10d::ReduceOp::SUM;
    divide = divide || op == ReduceOp::kAvg;
    works.push_back(group_->allreduce(one, opts));
  }
  std::function<void()> after;
  if (divide) {
    const double n = size();
    after = [buffers, n] {
      for (const auto& b : buffers) b.div_(n);
    };
  }
  return std::make_shared<ProcessGroupWork>(name() + " all_reduce " + reduce_op_name(op), timeout(),
                                            std::move(works), std::move(after));
}

std::shared_ptr<CommWork> ProcessGroupCommunicator::do_reduce_scatter(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs, ReduceOp op) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  // The result lands in a scratch tensor and is copied into the output on wait(): the output may
  // alias the input (in place), which not every backend allows.
  std::vector<at::Tensor> scratch;
  std::vector<bool> full;  // scratch holds the whole reduction (fallback), not just the chunk
  bool divide = false;
  c10d::ReduceScatterOptions opts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor in = inputs[i];
    if (reduce_scatter_supported_) {
      at::Tensor out = at::empty_like(outputs[i]);
      bool avg = op == ReduceOp::kAvg && avg_supported_;
      opts.reduceOp = avg ? c10d::ReduceOp::AVG : c10d::ReduceOp::SUM;
      try {
        works.push_back(reduce_scatter_flat(*group_, out, in, opts));
        scratch.push_back(out);
        full.push_back(false);
        divide = divide || (op == ReduceOp::kAvg && !avg);
        continue;
      } catch (const c10::Error&) {
        if (avg)
          avg_supported_ = false;
        else
          reduce_scatter_supported_ = false;
      }
      if (reduce_scatter_supported_) {  // AVG was refused: SUM, divide on wait()
        opts.reduceOp = c10d::ReduceOp::SUM;
        try {
          works.push_back(reduce_scatter_flat(*group_, out, in, opts));
          scratch.push_back(out);
          full.push_back(false);
          divide = divide || op == ReduceOp::kAvg;
          continue;
        } catch (const c10::Error&) {
          reduce_scatter_supported_ = false;
        }
      }
    }
    // Fallback: all-reduce a copy of the whole input, keep chunk `rank` (correct, 1/size as fast).
    at::Tensor copy = in.clone();
    std::vector<at::Tensor> one{copy};
    c10d::AllreduceOptions ar;
    ar.reduceOp = c10d::ReduceOp::SUM;
    works.push_back(group_->allreduce(one, ar));
    scratch.push_back(copy);
    full.push_back(true);
    divide = divide || op == ReduceOp::kAvg;
  }
  const int r = rank();
  const double n = size();
  auto after = [outputs, scratch, full, divide, r, n] {
    for (size_t i = 0; i < outputs.size(); ++i) {
      const int64_t m = outputs[i].numel();
      at::Tensor src = full[i] ? scratch[i].narrow(0, r * m, m) : scratch[i];
      if (divide) src = src.div(n);
      outputs[i].copy_(src);
    }
  };
  return std::make_shared<ProcessGroupWork>(name() + " reduce_scatter " + reduce_op_name(op),
                                            timeout(), std::move(works), std::move(after));
}

std::shared_ptr<CommWork> ProcessGroupCommunicator::do_all_gather(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> copies;  // kept alive until wait() returns
  c10d::AllgatherOptions opts;
  for (size_t i = 0; i < inputs.size(); ++i) {
    at::Tensor out = outputs[i];
    // In place (input = own chunk of output): send a copy so the backend never reads what it
    // writes.
    at::Tensor in = overlaps(inputs[i], out) ? inputs[i].clone() : inputs[i];
    copies.push_back(in);
    works.push_back(all_gather_flat(*group_, out, in, opts));
  }
  return std::make_shared<ProcessGroupWork>(name() + " all_gather", timeout(), std::move(works),
                                            [copies] {});
}

std::shared_ptr<CommWork> ProcessGroupCommunicator::do_all_to_all(
    const std::vector<at::Tensor>& inputs, const std::vector<at::Tensor>& outputs) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  std::vector<at::Tensor> keep;  // the byte views, kept alive until wait() returns
  for (size_t i = 0; i < inputs.size(); ++i) {
    // An all-to-all only moves bytes: sending the buffers as uint8 spares us the backends' dtype
    // gaps (gloo's all-to-all, for one, has no bfloat16 everywhere) and gives equal byte chunks.
    at::Tensor in = inputs[i].view(at::kByte);
    at::Tensor out = outputs[i].view(at::kByte);
    works.push_back(all_to_all_flat(*group_, out, in));
    keep.push_back(in);
    keep.push_back(out);
  }
  return std::make_shared<ProcessGroupWork>(name() + " all_to_all", timeout(), std::move(works),
                                            [keep] {});
}

std::shared_ptr<CommWork> ProcessGroupCommunicator::do_broadcast(
    const std::vector<at::Tensor>& buffers, int root) {
  std::vector<c10::intrusive_ptr<c10d::Work>> works;
  c10d::BroadcastOptions opts;
  opts.rootRank = root;
  for (const auto& b : buffers) {
    std::vector<at::Tensor> one{b};
    works.push_back(group_->broadcast(one, opts));
  }
  return std::make_shared<ProcessGroupWork>(name() + " broadcast", timeout(), std::move(works),
                                            nullptr);
}

}  // namespace fp8dp

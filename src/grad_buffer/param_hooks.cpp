#include "grad_buffer/param_hooks.h"

#include <torch/csrc/autograd/function.h>
#include <torch/csrc/autograd/function_hook.h>
#include <torch/csrc/autograd/variable.h>

#include <optional>
#include <utility>

#include "common/check.h"
#include "grad_buffer/grad_sync.h"

namespace fp8dp {
namespace {

namespace ag = torch::autograd;

// Runs after AccumulateGrad has summed this backward's uses of the parameter into p.grad (one call
// per backward however many uses, like the Python post-accumulate hook it replaces).
class AccumulatedGradHook final : public ag::FunctionPostHook {
 public:
  AccumulatedGradHook(std::weak_ptr<GradSync> sync, int64_t index, at::Tensor param)
      : sync_(std::move(sync)), index_(index), param_(std::move(param)) {}

  ag::variable_list operator()(const ag::variable_list& outputs,
                               const ag::variable_list& /*inputs*/) override {
    if (auto sync = sync_.lock()) {
      at::Tensor& grad = param_.mutable_grad();
      sync->param_ready(index_, grad.defined() ? std::optional<at::Tensor>(grad) : std::nullopt,
                        /*grad_added_to_main_grad=*/false);
      grad = at::Tensor();  // p.grad = None: main_grad holds it now
    }
    return outputs;
  }

 private:
  std::weak_ptr<GradSync> sync_;
  int64_t index_;
  at::Tensor param_;  // the node holds it too; no cycle (a variable holds its node weakly)
};

// shared_ptr<Node> in older torch, intrusive_ptr<Node> in newer: whatever grad_accumulator returns.
using NodePtr = decltype(ag::impl::grad_accumulator(std::declval<const ag::Variable&>()));

}  // namespace

struct ParamHooks::Registered {
  NodePtr node;  // a variable holds its AccumulateGrad weakly: keep it, or the hook goes with it
  uintptr_t key = 0;
};

ParamHooks::ParamHooks(const std::shared_ptr<GradSync>& sync, const std::vector<int64_t>& indices,
                       const std::vector<at::Tensor>& params) {
  FP8DP_CHECK_ARG(sync, "sync: expected a GradSync, got None");
  FP8DP_CHECK_ARG(indices.size() == params.size(), "indices: expected ", params.size(),
                  " (one per parameter), got ", indices.size());
  for (size_t i = 0; i < params.size(); ++i) {
    const at::Tensor& p = params[i];
    FP8DP_CHECK_ARG(p.defined() && p.is_leaf() && p.requires_grad(), "params[", i,
                    "]: expected a leaf tensor that requires grad");
    FP8DP_CHECK_ARG(p.unsafeGetTensorImpl() == sync->param(indices[i]).unsafeGetTensorImpl(),
                    "params[", i, "]: expected the parameter GradSync knows as index ", indices[i]);
    auto r = std::make_unique<Registered>();
    r->node = ag::impl::grad_accumulator(p);
    FP8DP_CHECK(r->node, "params[", i, "]: autograd gave it no gradient accumulator");
    r->key = r->node->add_post_hook(std::make_unique<AccumulatedGradHook>(sync, indices[i], p));
    hooks_.push_back(std::move(r));
  }
}

ParamHooks::~ParamHooks() {
  for (auto& r : hooks_) r->node->del_post_hook(r->key);
}

}  // namespace fp8dp

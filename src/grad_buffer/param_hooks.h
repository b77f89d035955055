// ParamHooks: DistributedDataParallel's autograd hook (C2 a) in C++. For each parameter it puts a
// post hook on the parameter's AccumulateGrad node that hands the accumulated p.grad to
// GradSync::param_ready and clears p.grad, without a trip through Python per parameter and
// micro-batch. Only for parameters no module outside fp8dp and torch registers: such a module may
// follow Megatron's protocol (it fused into main_grad itself and set grad_added_to_main_grad),
// which only the Python hook can read.
#pragma once

#include <ATen/core/Tensor.h>

#include <cstdint>
#include <memory>
#include <vector>

namespace fp8dp {

class GradSync;

class ParamHooks {
 public:
  // Hooks params[i] as GradSync parameter indices[i]. The hooks hold `sync` weakly: once it is
  // gone they do nothing. The parameters must be leaves that require grad.
  ParamHooks(const std::shared_ptr<GradSync>& sync, const std::vector<int64_t>& indices,
             const std::vector<at::Tensor>& params);
  // Removes every hook.
  ~ParamHooks();
  ParamHooks(const ParamHooks&) = delete;
  ParamHooks& operator=(const ParamHooks&) = delete;

  int64_t size() const { return static_cast<int64_t>(hooks_.size()); }

 private:
  struct Registered;  // the AccumulateGrad node (kept alive here) and the hook's key on it
  std::vector<std::unique_ptr<Registered>> hooks_;
};

}  // namespace fp8dp

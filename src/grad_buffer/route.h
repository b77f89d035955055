// Route: how one use's gradient of a parameter reached main_grad (GradSink's deliveries and the
// ledger's counts). Torch-free, so that the ledger builds in the kernels library.
#pragma once

namespace fp8dp {

// How one use's gradient of a parameter reached main_grad (the ledger counts each route).
enum class Route : int {
  kAutograd = 0,  // autograd accumulated it into p.grad; the DDP hook added p.grad
  kNone = 1,      // the DDP hook ran with p.grad None (an external consumer moved it)
  kFused = 2,     // the wgrad GEMM in backward accumulated it into main_grad
  kDelayed = 3,   // backward_dw() computed it (into main_grad, or handed over as a tensor)
};
constexpr int kNumRoutes = 4;
const char* route_name(Route r);

}  // namespace fp8dp

// parallel_for / parallel_reduce for the CPU kernels, on a thread pool installed from above.
// The kernels library (fp8dp_kernels) does not link libtorch, so that the layer rule is enforced
// by the linker, and so has no pool of its own: the LibTorch layer installs ATen's
// (at::parallel_for, the one torch.set_num_threads sizes) before it runs a CPU kernel
// (dispatch_kernel); until then, e.g. in the kernels' own gtests, loops run on the calling thread.
// With ATen's pool the chunks are exactly ATen's (the same grain), and every kernel's result is
// independent of the chunking anyway (elementwise work, maxima, partials added in a fixed order).
#pragma once

#include <cstdint>
#include <functional>
#include <mutex>

namespace fp8dp {

// f(begin, end) for [begin, end) split into chunks of at least `grain` elements.
using ParallelForFn = void (*)(int64_t begin, int64_t end, int64_t grain,
                               const std::function<void(int64_t, int64_t)>& f);

// Installs the pool (nullptr: back to the calling thread). Not synchronised with running kernels:
// install once, before the first kernel runs.
void set_parallel_for(ParallelForFn fn);
void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f);

// combine(ident, f(b, e, ident)) over the chunks of [begin, end). combine must be commutative and
// associative (a max, an integer sum): the chunks finish in any order.
template <typename T, typename F, typename C>
T parallel_reduce(int64_t begin, int64_t end, int64_t grain, T ident, const F& f,
                  const C& combine) {
  T result = ident;
  std::mutex mu;
  parallel_for(begin, end, grain, [&](int64_t b, int64_t e) {
    const T part = f(b, e, ident);
    std::lock_guard<std::mutex> lock(mu);
    result = combine(result, part);
  });
  return result;
}

}  // namespace fp8dp

#include "common/parallel.h"

#include <atomic>

namespace fp8dp {
namespace {

std::atomic<ParallelForFn> g_parallel_for{nullptr};

}  // namespace

void set_parallel_for(ParallelForFn fn) { g_parallel_for.store(fn); }

void parallel_for(int64_t begin, int64_t end, int64_t grain,
                  const std::function<void(int64_t, int64_t)>& f) {
  if (begin >= end) return;
  const ParallelForFn fn = g_parallel_for.load(std::memory_order_relaxed);
  if (fn != nullptr) {
    fn(begin, end, grain, f);
  } else {
    f(begin, end);
  }
}

}  // namespace fp8dp

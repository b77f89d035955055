// Per-(device, stream) cache of the cast-transpose kernel's scratch (see cast_workspace.h).
#include "fp8/cuda/cast_workspace.h"

#include <algorithm>
#include <map>
#include <utility>

#include "common/cuda_check.h"

namespace fp8dp::cuda {
namespace {

struct Entry {
  float* partial = nullptr;
  size_t partial_cap = 0;
  unsigned int* counters = nullptr;
  size_t counters_cap = 0;
};

std::mutex& cache_mutex() {
  static std::mutex m;
  return m;
}

// Never destroyed: at process exit the CUDA runtime may already be gone, and freeing then would
// fail. The buffers live as long as the process (a few MiB per stream that casts with dbias).
std::map<std::pair<int, cudaStream_t>, Entry>& cache() {
  static auto* m = new std::map<std::pair<int, cudaStream_t>, Entry>();
  return *m;
}

// Grows geometrically, so a run of slowly growing shapes reallocates O(log n) times.
size_t grown(size_t have, size_t need) { return std::max(need, 2 * have); }

}  // namespace

CastWorkspace cast_workspace(cudaStream_t st, size_t partial_floats, size_t counters,
                             std::unique_lock<std::mutex>& lock) {
  int dev = 0;
  FP8DP_CHECK_CUDA(cudaGetDevice(&dev));
  lock = std::unique_lock<std::mutex>(cache_mutex());
  Entry& e = cache()[{dev, st}];
  if (e.partial_cap < partial_floats) {
    const size_t cap = grown(e.partial_cap, partial_floats);
    if (e.partial != nullptr) FP8DP_CHECK_CUDA(cudaFreeAsync(e.partial, st));
    e.partial = nullptr;
    e.partial_cap = 0;
    FP8DP_CHECK_CUDA(
        cudaMallocAsync(reinterpret_cast<void**>(&e.partial), cap * sizeof(float), st));
    e.partial_cap = cap;
  }
  if (e.counters_cap < counters) {
    const size_t cap = grown(e.counters_cap, counters);
    if (e.counters != nullptr) FP8DP_CHECK_CUDA(cudaFreeAsync(e.counters, st));
    e.counters = nullptr;
    e.counters_cap = 0;
    FP8DP_CHECK_CUDA(
        cudaMallocAsync(reinterpret_cast<void**>(&e.counters), cap * sizeof(unsigned int), st));
    FP8DP_CHECK_CUDA(cudaMemsetAsync(e.counters, 0, cap * sizeof(unsigned int), st));
    e.counters_cap = cap;
  }
  return {e.partial, e.counters};
}

}  // namespace fp8dp::cuda

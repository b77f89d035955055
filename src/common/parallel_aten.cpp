#include "common/parallel_aten.h"

#include <ATen/Parallel.h>

#include "common/parallel.h"

namespace fp8dp {
namespace {

void aten_parallel_for(int64_t begin, int64_t end, int64_t grain,
                       const std::function<void(int64_t, int64_t)>& f) {
  at::parallel_for(begin, end, grain, f);
}

}  // namespace

void install_aten_parallel_for() {
  static const bool installed = (set_parallel_for(&aten_parallel_for), true);
  (void)installed;
}

}  // namespace fp8dp

// Installs ATen's thread pool as the CPU kernels' parallel_for (common/parallel.h).
#pragma once

namespace fp8dp {

// Idempotent and cheap after the first call (one static guard): dispatch_kernel calls it before
// every CPU kernel, so the pool is in place whichever front end runs first.
void install_aten_parallel_for();

}  // namespace fp8dp

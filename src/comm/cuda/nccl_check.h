// FP8DP_CHECK_NCCL: the NCCL member of the FP8DP_CHECK family. Include only from CUDA builds.
#pragma once

#include <nccl.h>

#include "common/check.h"

namespace fp8dp::detail {

// "NCCL 2.27.3 (headers 2.27.3)": the runtime library can differ from the headers we built with.
inline std::string nccl_version_string() {
  int v = 0;
  ncclGetVersion(&v);
  auto fmt = [](int code) {
    // NCCL >= 2.9 encodes MAJOR*10000 + MINOR*100 + PATCH.
    return concat(code / 10000, ".", (code % 10000) / 100, ".", code % 100);
  };
  return concat("NCCL ", fmt(v), " (headers ", fmt(NCCL_VERSION_CODE), ")");
}

inline std::string nccl_error_text(ncclResult_t r, ncclComm_t comm) {
  const char* last = ncclGetLastError(comm);
  return concat(nccl_version_string(), " error ", static_cast<int>(r), ": ", ncclGetErrorString(r),
                (last && *last) ? concat(" (last error: ", last, ")") : std::string());
}

}  // namespace fp8dp::detail

// FP8DP_CHECK_NCCL(ncclAllReduce(...), comm, "all_reduce of bucket group 3") -> fp8dp::Error naming
// the call, the NCCL version, its error string and ncclGetLastError(comm). comm may be nullptr.
#define FP8DP_CHECK_NCCL(expr, comm, ...)                                                          \
  do {                                                                                             \
    ncclResult_t _r = (expr);                                                                      \
    if (_r != ncclSuccess)                                                                         \
      ::fp8dp::detail::fail(                                                                       \
          __FILE__, __LINE__, #expr,                                                               \
          ::fp8dp::detail::concat(__VA_ARGS__, ": ", ::fp8dp::detail::nccl_error_text(_r, comm))); \
  } while (0)

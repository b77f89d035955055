// What this build was compiled with; versions of CUDA libraries are read at run time ("" without
// CUDA).
#pragma once

#include <string>

namespace fp8dp {

struct BuildInfo {
  std::string version;
  std::string torch_version;
  bool cuda = false;
  std::string cuda_runtime_version;
  std::string cublaslt_version;
  std::string nccl_version;
};

BuildInfo build_info();

}  // namespace fp8dp

// Binds build_info(): what this build of fp8dp was compiled with.
#include <torch/csrc/utils/pybind.h>

#include "common/build_info.h"

namespace fp8dp::python {

void bind_build_info(pybind11::module_& m) {
  m.def("build_info", [] {
    const BuildInfo b = build_info();
    pybind11::dict d;
    d["version"] = b.version;
    d["torch_version"] = b.torch_version;
    d["cuda"] = b.cuda;
    d["cuda_runtime_version"] = b.cuda_runtime_version;
    d["cublaslt_version"] = b.cublaslt_version;
    d["nccl_version"] = b.nccl_version;
    return d;
  });
}

}  // namespace fp8dp::python

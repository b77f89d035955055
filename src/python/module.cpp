// fp8dp._C: the extension module. Each subsystem binds itself in its own bind_*.cpp.
#include <torch/csrc/utils/pybind.h>

namespace fp8dp::python {
void bind_build_info(pybind11::module_& m);
void bind_comm(pybind11::module_& m);
void bind_fp8(pybind11::module_& m);
void bind_grad_buffer(pybind11::module_& m);
void bind_modules(pybind11::module_& m);
void bind_gemm(pybind11::module_& m);
void bind_gemm_cuda(pybind11::module_& m);
void bind_norm(pybind11::module_& m);
void bind_mlp(pybind11::module_& m);
}  // namespace fp8dp::python

PYBIND11_MODULE(_C, m) {
  m.doc() = "fp8dp C++ core";
  fp8dp::python::bind_build_info(m);
  fp8dp::python::bind_fp8(m);
  // Communicator first: GradSync takes one, ProcessGroupCommunicator derives from it.
  fp8dp::python::bind_comm(m);
  fp8dp::python::bind_grad_buffer(m);
  fp8dp::python::bind_modules(m);
  fp8dp::python::bind_gemm(m);
  fp8dp::python::bind_gemm_cuda(m);
  fp8dp::python::bind_norm(m);
  fp8dp::python::bind_mlp(m);  // after bind_modules: takes LinearCores
}

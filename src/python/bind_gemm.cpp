// Binds src/gemm: the TN GEMM front end (tests and benchmarks call it directly).
#include <torch/csrc/utils/pybind.h>

#include "gemm/gemm.h"

namespace py = pybind11;

namespace fp8dp::python {

void bind_gemm(py::module_& m) {
  m.def(
      "gemm",
      [](const at::Tensor& a, const at::Tensor& b, const std::optional<at::Tensor>& a_scale_inv,
         const std::optional<at::Tensor>& b_scale_inv, const std::optional<at::Tensor>& bias,
         const std::optional<at::Tensor>& out, bool accumulate, at::ScalarType out_dtype,
         bool use_split_accumulator, const std::optional<at::Tensor>& residual) {
        GemmArgs g;
        g.a = a;
        g.b = b;
        g.a_scale_inv = a_scale_inv.value_or(at::Tensor());
        g.b_scale_inv = b_scale_inv.value_or(at::Tensor());
        g.bias = bias.value_or(at::Tensor());
        g.out = out.value_or(at::Tensor());
        g.accumulate = accumulate;
        g.out_dtype = out_dtype;
        g.use_split_accumulator = use_split_accumulator;
        g.residual = residual.value_or(at::Tensor());
        return gemm(g);
      },
      py::arg("a"), py::arg("b"), py::arg("a_scale_inv") = py::none(),
      py::arg("b_scale_inv") = py::none(), py::arg("bias") = py::none(),
      py::arg("out") = py::none(), py::arg("accumulate") = false, py::arg("out_dtype") = at::kFloat,
      py::arg("use_split_accumulator") = true, py::arg("residual") = py::none(),
      "out[m, n] = a[m, k] · b[n, k]ᵀ (+ bias) (+ residual) (+ out when accumulate), summed in "
      "FP32 and rounded once; FP8 operands need scale_inv and k, n multiples of 16.");
}

}  // namespace fp8dp::python

// Binds the cuBLASLt GEMM directly (_gemm_cuda) plus its plan-cache controls, for the GPU tests and
// benchmarks; fp8dp's own code calls gemm(), which dispatches CUDA tensors to gemm_cuda.
#include <torch/csrc/utils/pybind.h>

#include "gemm/gemm.h"
#if defined(FP8DP_WITH_CUDA)
#include "gemm/cuda/cublaslt_gemm.h"
#endif

namespace py = pybind11;

namespace fp8dp::python {

void bind_gemm_cuda(py::module_& m) {
#if defined(FP8DP_WITH_CUDA)
  m.def(
      "_gemm_cuda",
      [](const at::Tensor& a, const at::Tensor& b, std::optional<at::Tensor> a_scale_inv,
         std::optional<at::Tensor> b_scale_inv, std::optional<at::Tensor> bias,
         std::optional<at::Tensor> out, bool accumulate, at::ScalarType out_dtype,
         bool use_split_accumulator, std::optional<at::Tensor> residual) {
        GemmArgs g;
        g.a = a;
        g.b = b;
        if (a_scale_inv) g.a_scale_inv = *a_scale_inv;
        if (b_scale_inv) g.b_scale_inv = *b_scale_inv;
        if (bias) g.bias = *bias;
        if (out) g.out = *out;
        if (residual) g.residual = *residual;
        g.accumulate = accumulate;
        g.out_dtype = out_dtype;
        g.use_split_accumulator = use_split_accumulator;
        return gemm_cuda(g);
      },
      py::arg("a"), py::arg("b"), py::arg("a_scale_inv") = py::none(),
      py::arg("b_scale_inv") = py::none(), py::arg("bias") = py::none(),
      py::arg("out") = py::none(), py::arg("accumulate") = false, py::arg("out_dtype") = at::kFloat,
      py::arg("use_split_accumulator") = true, py::arg("residual") = py::none());
  m.def("_gemm_set_autotune", &gemm_lt_set_autotune, py::arg("on"));
  m.def("_gemm_set_candidates", &gemm_lt_set_candidates, py::arg("max_algos") = 8,
        py::arg("algo_override") = -1);
  m.def("_gemm_plans", [] {
    py::list out;
    for (const auto& p : gemm_lt_plans())
      out.append(py::dict(py::arg("shape") = p.shape, py::arg("pick") = p.pick,
                          py::arg("candidates") = p.candidates, py::arg("config") = p.config));
    return out;
  });
  m.def("_gemm_cache_size", &gemm_lt_cache_size);
  m.def("_gemm_clear_cache", &gemm_lt_clear_cache);
#else
  (void)m;
#endif
}

}  // namespace fp8dp::python

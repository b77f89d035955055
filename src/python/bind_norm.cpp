// Binds the tensor-level LayerNorm / RMSNorm of src/norm/norm.h (for the kernel tests and the
// benchmarks; the modules call them from C++).
#include <torch/csrc/utils/pybind.h>

#include "norm/norm.h"

namespace py = pybind11;

namespace fp8dp::python {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

NormConfig config(bool rms, float eps, bool zero_centered_gamma) {
  NormConfig c;
  c.rms = rms;
  c.eps = eps;
  c.zero_centered_gamma = zero_centered_gamma;
  return c;
}

}  // namespace

void bind_norm(py::module_& m) {
  py::class_<NormForward>(m, "NormForward")
      .def_readonly("out", &NormForward::out)
      .def_readonly("out_fp8", &NormForward::out_fp8)
      .def_readonly("scale_inv", &NormForward::scale_inv)
      .def_readonly("amax", &NormForward::amax)
      .def_readonly("mu", &NormForward::mu)
      .def_readonly("rsigma", &NormForward::rsigma);
  m.def(
      "norm_forward",
      [](const at::Tensor& x, const at::Tensor& gamma, const std::optional<at::Tensor>& beta,
         bool rms, float eps, bool zero_centered_gamma, bool want_out,
         const std::optional<at::Tensor>& scale, Format format) {
        return norm_forward(x, gamma, or_undefined(beta), config(rms, eps, zero_centered_gamma),
                            want_out, or_undefined(scale), format);
      },
      py::arg("x"), py::arg("gamma"), py::arg("beta") = py::none(), py::kw_only(),
      py::arg("rms") = false, py::arg("eps") = 1e-5f, py::arg("zero_centered_gamma") = false,
      py::arg("want_out") = true, py::arg("scale") = py::none(), py::arg("format") = Format::kE4M3);
  m.def(
      "norm_forward_aten",
      [](const at::Tensor& x, const at::Tensor& gamma, const std::optional<at::Tensor>& beta,
         bool rms, float eps, bool zero_centered_gamma, const std::optional<at::Tensor>& scale,
         Format format) {
        const NormConfig c = config(rms, eps, zero_centered_gamma);
        return norm_forward_aten(x, gamma, or_undefined(beta), c, or_undefined(scale), format);
      },
      py::arg("x"), py::arg("gamma"), py::arg("beta") = py::none(), py::kw_only(),
      py::arg("rms") = false, py::arg("eps") = 1e-5f, py::arg("zero_centered_gamma") = false,
      py::arg("scale") = py::none(), py::arg("format") = Format::kE4M3);
  m.def(
      "norm_backward",
      [](const at::Tensor& dz, const at::Tensor& x, const at::Tensor& mu, const at::Tensor& rsigma,
         const at::Tensor& gamma, bool has_beta, bool rms, bool zero_centered_gamma,
         const std::optional<at::Tensor>& dx_add) {
        // eps only enters through rsigma, which the forward computed.
        const NormGrads g =
            norm_backward(dz, x, mu, rsigma, gamma, has_beta,
                          config(rms, 0.0f, zero_centered_gamma), or_undefined(dx_add));
        return py::make_tuple(g.dx, g.dgamma,
                              g.dbeta.defined() ? py::cast(g.dbeta) : py::object(py::none()));
      },
      py::arg("dz"), py::arg("x"), py::arg("mu"), py::arg("rsigma"), py::arg("gamma"),
      py::kw_only(), py::arg("has_beta"), py::arg("rms") = false,
      py::arg("zero_centered_gamma") = false, py::arg("dx_add") = py::none());
}

}  // namespace fp8dp::python

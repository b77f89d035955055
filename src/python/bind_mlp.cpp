// Binds LayerNormMLP's C++ half (src/modules/layernorm_mlp.h) and its activation kernels
// (src/fp8/activation.h: the standalone ops serve the unfused composition and the tests).
#include <torch/csrc/utils/pybind.h>

#include <string>

#include "fp8/activation.h"
#include "modules/layernorm_mlp.h"

namespace py = pybind11;

namespace fp8dp::python {
namespace {

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

}  // namespace

void bind_mlp(py::module_& m) {
  py::class_<LayerNormMLPCore, std::shared_ptr<LayerNormMLPCore>>(m, "LayerNormMLPCore")
      .def(py::init([](std::string name, const std::string& activation, int64_t ffn_hidden_size,
                       std::shared_ptr<LinearCore> fc1, std::shared_ptr<LinearCore> fc2) {
             MLPConfig c;
             c.activation = parse_activation(activation, name);
             c.name = std::move(name);
             c.ffn_hidden_size = ffn_hidden_size;
             return std::make_shared<LayerNormMLPCore>(std::move(c), std::move(fc1),
                                                       std::move(fc2));
           }),
           py::arg("name"), py::arg("activation"), py::arg("ffn_hidden_size"), py::arg("fc1"),
           py::arg("fc2"))
      .def(
          "forward",
          [](LayerNormMLPCore& core, const at::Tensor& x, const at::Tensor& ln_weight,
             const std::optional<at::Tensor>& ln_bias, const at::Tensor& fc1_weight,
             const std::optional<at::Tensor>& fc1_bias, const at::Tensor& fc2_weight,
             const std::optional<at::Tensor>& fc2_bias, std::optional<bool> is_first_microbatch,
             const std::optional<at::Tensor>& residual) {
            return core.forward(x, ln_weight, or_undefined(ln_bias), fc1_weight,
                                or_undefined(fc1_bias), fc2_weight, or_undefined(fc2_bias),
                                is_first_microbatch, or_undefined(residual));
          },
          py::arg("x"), py::arg("ln_weight"), py::arg("ln_bias"), py::arg("fc1_weight"),
          py::arg("fc1_bias"), py::arg("fc2_weight"), py::arg("fc2_bias"),
          py::arg("is_first_microbatch"), py::arg("residual") = py::none())
      .def_property_readonly("name", [](LayerNormMLPCore& c) { return c.config().name; });

  m.def(
      "activation_forward",
      [](const at::Tensor& h, const std::string& activation) {
        return activation_forward(h, parse_activation(activation, "fp8dp.activation"));
      },
      py::arg("h"), py::arg("activation"));
  m.def(
      "activation_backward",
      [](const at::Tensor& da, const at::Tensor& h, const std::string& activation) {
        return activation_backward(da, h, parse_activation(activation, "fp8dp.activation"));
      },
      py::arg("da"), py::arg("h"), py::arg("activation"));
  m.def(
      "_set_activation_lut", &set_activation_lut, py::arg("enabled"),
      "Internal: the CUDA activation kernels look bf16 inputs up in tables (True, the default) or "
      "compute them (False); the same bits. Returns the previous setting.");
  m.def(
      "activation_cast",
      [](const std::optional<at::Tensor>& da, const at::Tensor& h, const std::string& activation,
         const at::Tensor& scale, Format format, bool data, bool transpose, bool dbias,
         const std::optional<at::Tensor>& amax_into, at::ScalarType dbias_dtype) {
        return activation_cast(
            or_undefined(da), h, parse_activation(activation, "fp8dp.activation_cast"), scale,
            format, QuantizeOptions{data, transpose, dbias, dbias_dtype}, or_undefined(amax_into));
      },
      py::arg("da"), py::arg("h"), py::arg("activation"), py::arg("scale"), py::arg("format"),
      py::arg("data") = true, py::arg("transpose") = false, py::arg("dbias") = false,
      py::arg("amax_into") = py::none(), py::arg("dbias_dtype") = at::kFloat);
  m.def(
      "activation_amax",
      [](const std::optional<at::Tensor>& da, const at::Tensor& h, const std::string& activation) {
        return activation_amax(or_undefined(da), h,
                               parse_activation(activation, "fp8dp.activation_amax"));
      },
      py::arg("da"), py::arg("h"), py::arg("activation"));
}

}  // namespace fp8dp::python

// Binds src/fp8: formats, recipes, the autocast stack and the tensor-level casts.
#include <torch/csrc/utils/pybind.h>

#include <vector>

#include "fp8/block_cast.h"
#include "fp8/cast.h"
#include "fp8/recipe.h"
#include "fp8/scaling_update.h"

namespace py = pybind11;

namespace fp8dp::python {

void bind_fp8(py::module_& m) {
  py::enum_<Format>(m, "Format").value("E4M3", Format::kE4M3).value("E5M2", Format::kE5M2);
  m.def("fp8_max", &fp8_max, py::arg("format"));
  py::enum_<AmaxAlgo>(m, "AmaxAlgo")
      .value("MAX", AmaxAlgo::kMax)
      .value("MOST_RECENT", AmaxAlgo::kMostRecent);
  py::enum_<RecipeKind>(m, "RecipeKind")
      .value("DELAYED", RecipeKind::kDelayed)
      .value("CURRENT", RecipeKind::kCurrent)
      .value("BLOCK", RecipeKind::kBlock);
  py::class_<BlockQParams>(m, "BlockQParams")
      .def(py::init<>())
      .def_readwrite("power_2_scale", &BlockQParams::power_2_scale)
      .def_readwrite("amax_epsilon", &BlockQParams::amax_epsilon);
  py::enum_<BlockShape>(m, "BlockShape")
      .value("TILE_1x128", BlockShape::k1x128)
      .value("BLOCK_128x128", BlockShape::k128x128);

  py::class_<Recipe>(m, "Recipe")
      .def(py::init<>())
      .def_readwrite("kind", &Recipe::kind)
      .def_readwrite("fwd_format", &Recipe::fwd_format)
      .def_readwrite("bwd_format", &Recipe::bwd_format)
      .def_readwrite("amax_history_len", &Recipe::amax_history_len)
      .def_readwrite("amax_compute_algo", &Recipe::amax_compute_algo)
      .def_readwrite("margin", &Recipe::margin)
      .def_readwrite("split_accumulator_fprop", &Recipe::split_accumulator_fprop)
      .def_readwrite("split_accumulator_dgrad", &Recipe::split_accumulator_dgrad)
      .def_readwrite("split_accumulator_wgrad", &Recipe::split_accumulator_wgrad)
      .def_readwrite("fprop_high_precision", &Recipe::fprop_high_precision)
      .def_readwrite("dgrad_high_precision", &Recipe::dgrad_high_precision)
      .def_readwrite("wgrad_high_precision", &Recipe::wgrad_high_precision)
      .def_readwrite("block_inp", &Recipe::block_inp)
      .def_readwrite("block_weight", &Recipe::block_weight)
      .def_readwrite("block_grad", &Recipe::block_grad);
  py::class_<AutocastState>(m, "AutocastState")
      .def_readonly("enabled", &AutocastState::enabled)
      .def_readonly("recipe", &AutocastState::recipe);
  m.def("autocast_enter", &autocast_enter, py::arg("enabled"), py::arg("recipe"));
  m.def("autocast_exit", &autocast_exit);
  m.def("autocast_current", &autocast_current);
  m.def("autocast_depth", &autocast_depth);

  py::class_<Quantized>(m, "Quantized")
      .def_readonly("data", &Quantized::data)
      .def_readonly("data_t", &Quantized::data_t)
      .def_readonly("scale_inv", &Quantized::scale_inv)
      .def_readonly("amax", &Quantized::amax)
      .def_readonly("dbias", &Quantized::dbias)
      .def_readonly("scale_inv_t", &Quantized::scale_inv_t);
  m.def(
      "quantize",
      [](const at::Tensor& x, const at::Tensor& scale, Format format, bool data, bool transpose,
         bool dbias, const std::optional<at::Tensor>& amax_into, at::ScalarType dbias_dtype) {
        return quantize(x, scale, format, QuantizeOptions{data, transpose, dbias, dbias_dtype},
                        amax_into.value_or(at::Tensor()));
      },
      py::arg("x"), py::arg("scale"), py::arg("format"), py::arg("data") = true,
      py::arg("transpose") = false, py::arg("dbias") = false, py::arg("amax_into") = py::none(),
      py::arg("dbias_dtype") = at::kFloat);
  m.def(
      "quantize_parts",
      [](const std::vector<at::Tensor>& parts, const at::Tensor& scale, Format format, bool data,
         bool transpose, bool dbias, const std::optional<at::Tensor>& amax_into,
         at::ScalarType dbias_dtype) {
        return quantize_parts(parts, scale, format,
                              QuantizeOptions{data, transpose, dbias, dbias_dtype},
                              amax_into.value_or(at::Tensor()));
      },
      py::arg("parts"), py::arg("scale"), py::arg("format"), py::arg("data") = true,
      py::arg("transpose") = false, py::arg("dbias") = false, py::arg("amax_into") = py::none(),
      py::arg("dbias_dtype") = at::kFloat);
  m.def(
      "quantize_parts_strided",
      [](const std::vector<at::Tensor>& parts) { return quantize_parts_strided(parts); },
      py::arg("parts"));
  m.def(
      "amax_parts", [](const std::vector<at::Tensor>& parts) { return amax_parts(parts); },
      py::arg("parts"));
  m.def(
      "block_quantize",
      [](const at::Tensor& x, Format format, BlockShape shape, bool power_2_scale,
         float amax_epsilon, bool data, bool transpose, bool dbias, at::ScalarType dbias_dtype) {
        return block_quantize(x, format, shape, BlockQParams{power_2_scale, amax_epsilon},
                              QuantizeOptions{data, transpose, dbias, dbias_dtype});
      },
      py::arg("x"), py::arg("format"), py::arg("shape"), py::arg("power_2_scale") = true,
      py::arg("amax_epsilon") = 0.0f, py::arg("data") = true, py::arg("transpose") = false,
      py::arg("dbias") = false, py::arg("dbias_dtype") = at::kFloat);
  m.def("block_dequantize", &block_dequantize, py::arg("data"), py::arg("scale_inv"),
        py::arg("dtype"));
  m.def("amax", &amax, py::arg("x"));
  m.def("transpose_fp8", &transpose_fp8, py::arg("data"));
  m.def("dequantize", &dequantize, py::arg("data"), py::arg("scale_inv"), py::arg("dtype"));
  m.def(
      "update_scaling",
      [](at::Tensor amax_history, at::Tensor scale, at::Tensor scale_inv, const at::Tensor& fp8_max,
         AmaxAlgo algo,
         float margin) { update_scaling(amax_history, scale, scale_inv, fp8_max, algo, margin); },
      py::arg("amax_history"), py::arg("scale"), py::arg("scale_inv"), py::arg("fp8_max"),
      py::arg("algo"), py::arg("margin"));
}

}  // namespace fp8dp::python

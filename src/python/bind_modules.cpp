// Binds src/modules: LinearCore (the C++ half of fp8dp.Linear / LayerNormLinear) and the
// delayed-scaling registry behind fp8dp.update_fp8_scales.
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/utils/pybind.h>

#include <optional>
#include <string>

#include "common/check.h"
#include "fp8/activation.h"
#include "fp8/scaling_registry.h"
#include "fp8/scaling_state.h"
#include "modules/graph_record.h"
#include "modules/linear_core.h"

namespace py = pybind11;

namespace fp8dp::python {
namespace {

// A Python callable that C++ may call and drop on any thread: the GIL is taken for both.
class PyCallable {
 public:
  explicit PyCallable(py::object fn)
      : fn_(new py::object(std::move(fn)), [](py::object* o) {
          py::gil_scoped_acquire gil;
          delete o;
        }) {}
  template <typename R>
  R call_as(R none_value) const {
    py::gil_scoped_acquire gil;
    py::object r = (*fn_)();
    return r.is_none() ? none_value : r.cast<R>();
  }
  void call() const {
    py::gil_scoped_acquire gil;
    (*fn_)();
  }

 private:
  std::shared_ptr<py::object> fn_;
};

at::Tensor or_undefined(const std::optional<at::Tensor>& t) { return t ? *t : at::Tensor(); }

py::object extra_state(LinearCore& core) {
  const ScalingState::Snapshot s = core.scaling().snapshot();
  if (!s.amax_history.defined()) return py::none();
  py::dict d;
  d["amax_history"] = s.amax_history;
  d["scale"] = s.scale;
  d["scale_inv"] = s.scale_inv;
  d["fp8_max"] = s.fp8_max;
  d["initialized"] = s.initialized;
  d["amax_compute_algo"] = s.algo;
  d["margin"] = s.margin;
  return d;
}

// The keys of the extra state, in the order get_extra_state writes them.
constexpr const char* kExtraStateKeys[] = {
    "amax_history", "scale", "scale_inv", "fp8_max", "initialized", "amax_compute_algo", "margin"};

std::string type_name(const py::handle& o) { return py::str(py::type::of(o).attr("__name__")); }

at::Tensor tensor_at(const py::dict& d, const char* key, const std::string& where) {
  const py::object o = d[key];
  FP8DP_CHECK_ARG(THPVariable_Check(o.ptr()), where, ": '", key, "' must be a tensor, got ",
                  type_name(o));
  return o.cast<at::Tensor>();
}

// Parses what get_extra_state wrote (checkpoints are user input): a ValueError naming `where`
// (the state-dict key), the key inside it, what was expected and what came, never a KeyError.
// ScalingState::restore checks the values.
void set_extra_state(LinearCore& core, const py::object& state, const std::string& where) {
  ScalingState::Snapshot s;
  if (!state.is_none()) {
    std::string keys;
    for (const char* k : kExtraStateKeys) keys += std::string(keys.empty() ? "" : ", ") + k;
    FP8DP_CHECK_ARG(py::isinstance<py::dict>(state), where, ": expected None or a dict with keys ",
                    keys, ", got ", type_name(state));
    const py::dict d = state.cast<py::dict>();
    for (const char* k : kExtraStateKeys) {
      FP8DP_CHECK_ARG(d.contains(k), where, ": missing key '", k, "' (expected keys: ", keys, ")");
    }
    for (const auto& item : d) {
      const std::string k = py::str(item.first);
      bool known = false;
      for (const char* e : kExtraStateKeys) known = known || k == e;
      FP8DP_CHECK_ARG(known, where, ": unexpected key '", k, "' (expected keys: ", keys, ")");
    }
    s.amax_history = tensor_at(d, "amax_history", where);
    s.scale = tensor_at(d, "scale", where);
    s.scale_inv = tensor_at(d, "scale_inv", where);
    s.fp8_max = tensor_at(d, "fp8_max", where);
    s.initialized = tensor_at(d, "initialized", where);
    const py::object algo = d["amax_compute_algo"], margin = d["margin"];
    FP8DP_CHECK_ARG(py::isinstance<py::int_>(algo) && !py::isinstance<py::bool_>(algo), where,
                    ": 'amax_compute_algo' must be an int, got ", type_name(algo));
    FP8DP_CHECK_ARG((py::isinstance<py::int_>(margin) || py::isinstance<py::float_>(margin)) &&
                        !py::isinstance<py::bool_>(margin),
                    where, ": 'margin' must be a number, got ", type_name(margin));
    s.algo = algo.cast<int64_t>();
    s.margin = margin.cast<double>();
  }
  core.scaling().restore(s, where);
}

}  // namespace

void bind_modules(py::module_& m) {
  py::class_<LinearCore, std::shared_ptr<LinearCore>>(m, "LinearCore")
      .def(py::init([](std::string name, int64_t in_features, int64_t out_features,
                       bool fuse_wgrad_accumulation, bool delay_wgrad_compute, bool layernorm,
                       bool rms, float eps, bool zero_centered_gamma, bool return_layernorm_output,
                       int64_t qkv_heads, bool return_layernorm_input,
                       const std::optional<std::string>& activation,
                       const std::optional<std::string>& input_activation) {
             LinearConfig c;
             c.name = std::move(name);
             c.in_features = in_features;
             c.out_features = out_features;
             c.fuse_wgrad_accumulation = fuse_wgrad_accumulation;
             c.delay_wgrad_compute = delay_wgrad_compute;
             c.layernorm = layernorm;
             c.norm.rms = rms;
             c.norm.eps = eps;
             c.norm.zero_centered_gamma = zero_centered_gamma;
             c.return_layernorm_output = return_layernorm_output;
             c.qkv_heads = qkv_heads;
             c.return_layernorm_input = return_layernorm_input;
             if (activation) c.activation = parse_activation(*activation, c.name);
             if (input_activation) c.input_activation = parse_activation(*input_activation, c.name);
             return std::make_shared<LinearCore>(std::move(c));
           }),
           py::arg("name"), py::arg("in_features"), py::arg("out_features"),
           py::arg("fuse_wgrad_accumulation"), py::arg("delay_wgrad_compute"), py::arg("layernorm"),
           py::arg("rms"), py::arg("eps"), py::arg("zero_centered_gamma"),
           py::arg("return_layernorm_output"), py::arg("qkv_heads") = 0,
           py::arg("return_layernorm_input") = false, py::arg("activation") = py::none(),
           py::arg("input_activation") = py::none())
      .def(
          "set_weight_attrs",
          [](LinearCore& core, py::object main_grad, py::object zero_out_wgrad,
             py::object mark_grad_added_to_main_grad) {
            PyCallable mg(std::move(main_grad)), zo(std::move(zero_out_wgrad)),
                mark(std::move(mark_grad_added_to_main_grad));
            WeightAttrs a;
            a.main_grad = [mg] { return mg.call_as<at::Tensor>(at::Tensor()); };
            a.zero_out_wgrad = [zo] { return zo.call_as<bool>(false); };
            a.mark_grad_added_to_main_grad = [mark] { mark.call(); };
            // Tensor.register_hook keeps the hooks in the tensor's _backward_hooks dict.
            a.tensor_hooks = [](const at::Tensor& w) {
              py::gil_scoped_acquire gil;
              const py::object hooks = py::getattr(py::cast(w), "_backward_hooks", py::none());
              return !hooks.is_none() && py::len(hooks) > 0;
            };
            core.set_weight_attrs(std::move(a));
          },
          py::arg("main_grad"), py::arg("zero_out_wgrad"), py::arg("mark_grad_added_to_main_grad"))
      .def(
          "forward",
          [](LinearCore& core, const at::Tensor& x, const at::Tensor& weight,
             const std::optional<at::Tensor>& bias, const std::optional<at::Tensor>& ln_weight,
             const std::optional<at::Tensor>& ln_bias, std::optional<bool> is_first_microbatch,
             const std::optional<at::Tensor>& residual) {
            return core.forward(x, weight, or_undefined(bias), or_undefined(ln_weight),
                                or_undefined(ln_bias), is_first_microbatch, or_undefined(residual));
          },
          py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("ln_weight"),
          py::arg("ln_bias"), py::arg("is_first_microbatch"), py::arg("residual") = py::none())
      .def("bind_grad_sink", &LinearCore::bind_grad_sink, py::arg("sink"), py::arg("weight"),
           py::arg("bias"), py::arg("name"))
      .def_property_readonly("grad_sink_bound",
                             [](const LinearCore& c) { return c.grad_sink() != nullptr; })
      .def("backward_dw", &LinearCore::backward_dw, py::call_guard<py::gil_scoped_release>())
      .def("need_backward_dw", &LinearCore::need_backward_dw)
      .def_property_readonly("queued_wgrads", &LinearCore::queued_wgrads)
      .def(
          "register_wgrad_hook",
          [](LinearCore& core, py::object hook) {
            PyCallable h(std::move(hook));
            core.register_wgrad_hook([h] { h.call(); });
          },
          py::arg("hook"))
      .def("get_extra_state", &extra_state)
      .def("set_extra_state", &set_extra_state, py::arg("state"),
           py::arg("where") = std::string("_extra_state"))
      .def_property_readonly("name", [](LinearCore& c) { return c.config().name; })
      .def_property(
          "fp8_identity", [](LinearCore& c) { return c.scaling().identity(); },
          [](LinearCore& c, std::string identity) {
            c.scaling().set_identity(std::move(identity));
          })
      .def_property_readonly("amax_history",
                             [](LinearCore& c) { return c.scaling().amax_history(); })
      .def_property_readonly("scale", [](LinearCore& c) { return c.scaling().scale(); })
      .def_property_readonly("scale_inv", [](LinearCore& c) { return c.scaling().scale_inv(); })
      .def("drop_weight_cache", &LinearCore::drop_weight_cache)
      .def("warm_queued_wgrads", &LinearCore::warm_queued_wgrads)
      .def(
          "fp8_capture_refusal",
          [](LinearCore& c, const Recipe& recipe, bool with_grad_output) {
            return c.scaling().capture_refusal(recipe, with_grad_output);
          },
          py::arg("recipe"), py::arg("with_grad_output"));

  py::enum_<GraphRecord::Phase>(m, "GraphPhase")
      .value("WARMUP", GraphRecord::Phase::kWarmup)
      .value("FORWARD", GraphRecord::Phase::kForward)
      .value("BACKWARD", GraphRecord::Phase::kBackward);
  py::class_<ReplayUse, std::shared_ptr<ReplayUse>>(m, "ReplayUse");
  py::class_<GraphRecord, std::shared_ptr<GraphRecord>>(m, "GraphRecord")
      .def(py::init<>())
      .def("begin", &GraphRecord::begin, py::arg("phase"))
      .def("end", &GraphRecord::end)
      .def("before_forward", &GraphRecord::before_forward)
      .def("watch_state", &GraphRecord::watch_state, py::arg("core"))
      .def("replay_forward", &GraphRecord::replay_forward)
      .def("before_backward", &GraphRecord::before_backward, py::arg("use"))
      .def("replay_backward", &GraphRecord::replay_backward, py::arg("use"))
      .def_property_readonly("wgrad_count", &GraphRecord::wgrad_count)
      .def("capture_wgrad", &GraphRecord::capture_wgrad, py::arg("index"))
      .def(
          "set_wgrad_replay",
          [](GraphRecord& r, int64_t index, py::object replay) {
            PyCallable fn(std::move(replay));
            r.set_wgrad_replay(index, [fn] { fn.call(); });
          },
          py::arg("index"), py::arg("replay"))
      .def_property_readonly("forward_observed", &GraphRecord::forward_observed)
      .def_property_readonly("backward_observed", &GraphRecord::backward_observed)
      .def_property_readonly("grad_added_count", &GraphRecord::grad_added_count);
  m.def("graph_record_active", [] { return active_graph_record() != nullptr; });
  m.def("same_autocast", &same_autocast, py::arg("a"), py::arg("b"));

  m.def("fp8_registry_signature", [] {
    const RegistrySignature sig = registry_signature();
    return py::make_tuple(sig.hash, sig.observed, sig.size, sig.recipes_hash);
  });
  m.def("fp8_registry_descriptions", &registry_descriptions);
  m.def("fp8_registry_amaxes", &registry_amaxes);
  m.def("fp8_registry_update", &registry_update, py::arg("reduced"));
  m.def("fp8_registry_update_local", &registry_update_local);
  m.def("fp8_registry_size", &registry_size);
  m.def("fp8_registry_forget_recipes", &registry_forget_recipes);
}

}  // namespace fp8dp::python

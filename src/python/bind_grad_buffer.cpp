// Binds src/grad_buffer: the layout and GradSync (the Communicator it takes: bind_comm.cpp).
#include <torch/csrc/utils/pybind.h>

#include "grad_buffer/grad_sync.h"
#include "grad_buffer/layout.h"
#include "grad_buffer/param_hooks.h"

namespace py = pybind11;

namespace fp8dp::python {

void bind_grad_buffer(py::module_& m) {
  py::class_<LayoutOptions>(m, "LayoutOptions")
      .def(py::init<>())
      .def_readwrite("bucket_size", &LayoutOptions::bucket_size)
      .def_readwrite("dp", &LayoutOptions::dp)
      .def_readwrite("distributed_optimizer", &LayoutOptions::distributed_optimizer)
      .def_readwrite("pad_for_high_nccl_busbw", &LayoutOptions::pad_for_high_nccl_busbw);
  m.def(
      "compute_layout",
      [](const std::vector<int64_t>& numels, const LayoutOptions& o) {
        const Layout l = compute_layout(numels, o);
        py::list params, buckets;
        for (const auto& p : l.params) params.append(py::make_tuple(p.start, p.end, p.bucket));
        for (const auto& b : l.buckets) buckets.append(py::make_tuple(b.start, b.end, b.params));
        return py::make_tuple(params, buckets, l.numel);
      },
      py::arg("numels"), py::arg("options"));

  py::class_<GradSyncOptions>(m, "GradSyncOptions")
      .def(py::init<>())
      .def_readwrite("grad_reduce_in_fp32", &GradSyncOptions::grad_reduce_in_fp32)
      .def_readwrite("overlap_grad_reduce", &GradSyncOptions::overlap_grad_reduce)
      .def_readwrite("use_distributed_optimizer", &GradSyncOptions::use_distributed_optimizer)
      .def_readwrite("bucket_size", &GradSyncOptions::bucket_size)
      .def_readwrite("average_in_collective", &GradSyncOptions::average_in_collective)
      .def_readwrite("check_for_nan_in_grad", &GradSyncOptions::check_for_nan_in_grad)
      .def_readwrite("defer_nan_check", &GradSyncOptions::defer_nan_check)
      .def_readwrite("pad_buckets_for_high_nccl_busbw",
                     &GradSyncOptions::pad_buckets_for_high_nccl_busbw)
      .def_readwrite("grad_ledger", &GradSyncOptions::grad_ledger)
      .def_readwrite("grad_reduce_wire", &GradSyncOptions::grad_reduce_wire)
      .def_readwrite("overlap_param_gather", &GradSyncOptions::overlap_param_gather);
  py::class_<OwnedShard>(m, "OwnedShard")
      .def_readonly("param", &OwnedShard::param)
      .def_readonly("param_offset", &OwnedShard::param_offset)
      .def_readonly("numel", &OwnedShard::numel)
      .def_readonly("buffer", &OwnedShard::buffer)
      .def_readonly("buffer_offset", &OwnedShard::buffer_offset);

  // DDP's autograd hook in C++ (param_hooks.h); removed when the object is dropped.
  py::class_<ParamHooks>(m, "ParamHooks")
      .def(py::init<const std::shared_ptr<GradSync>&, const std::vector<int64_t>&,
                    const std::vector<at::Tensor>&>(),
           py::arg("sync"), py::arg("indices"), py::arg("params"))
      .def("__len__", &ParamHooks::size);
  // Opaque: fp8dp modules take it in bind_grad_sink; its methods are C++-only.
  py::class_<GradSink, std::shared_ptr<GradSink>>(m, "GradSink");
  py::class_<GradSync, GradSink, std::shared_ptr<GradSync>>(m, "GradSync")
      .def(py::init<std::vector<at::Tensor>, std::vector<std::string>,
                    std::shared_ptr<Communicator>, GradSyncOptions>(),
           py::arg("params"), py::arg("names"), py::arg("communicator"), py::arg("options"),
           // Every entry that may enqueue a collective drops the GIL: gloo's worker threads take
           // the GIL (to release Python state captured with a finished work) while holding their
           // queue lock, which the enqueue needs too.
           py::call_guard<py::gil_scoped_release>())
      .def("main_grad", &GradSync::main_grad, py::arg("index"))
      .def("param_ready", &GradSync::param_ready, py::arg("index"), py::arg("grad"),
           py::arg("grad_added_to_main_grad"), py::call_guard<py::gil_scoped_release>())
      // Without overlap_param_gather it may wait for all-gathers in flight: without the GIL.
      .def("begin_microbatch", &GradSync::begin_microbatch, py::arg("grad_enabled") = true,
           py::call_guard<py::gil_scoped_release>())
      .def("check_params_in_buffers", &GradSync::check_params_in_buffers)
      .def("announce_hooks", &GradSync::announce_hooks, py::arg("params"),
           py::arg("microbatch") = -1)
      .def("withdraw", &GradSync::withdraw, py::arg("param"), py::arg("microbatch"))
      .def("set_backward_microbatch", &GradSync::set_backward_microbatch, py::arg("mb"))
      .def("ledger_microbatch", &GradSync::microbatch)
      .def_property("sync_enabled", &GradSync::sync_enabled, &GradSync::set_sync_enabled)
      .def("enter_no_sync", &GradSync::enter_no_sync)
      // The iteration's phase (grad_sync.h), read-only: "accumulating", "sync_started",
      // "finished", "stepped" or "failed".
      .def_property_readonly("phase", [](const GradSync& s) { return phase_name(s.phase()); })
      .def("start_grad_sync", &GradSync::start_grad_sync, py::call_guard<py::gil_scoped_release>())
      .def("finish_grad_sync", &GradSync::finish_grad_sync,
           py::call_guard<py::gil_scoped_release>())
      .def("zero_grad_buffer", &GradSync::zero_grad_buffer,
           py::call_guard<py::gil_scoped_release>())
      .def("found_nonfinite", &GradSync::found_nonfinite)
      .def("check_deferred", &GradSync::check_deferred, py::call_guard<py::gil_scoped_release>())
      .def("scale_gradients", &GradSync::scale_gradients, py::arg("factor"),
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast_params", &GradSync::broadcast_params, py::arg("root"),
           py::call_guard<py::gil_scoped_release>())
      .def("owned_shards", &GradSync::owned_shards)
      .def("grad_shard", &GradSync::grad_shard, py::arg("shard"))
      .def("param_shard", &GradSync::param_shard, py::arg("shard"))
      .def("copy_shards_and_sync_params", &GradSync::copy_shards_and_sync_params,
           py::arg("masters"), py::call_guard<py::gil_scoped_release>())
      .def("copy_shards", &GradSync::copy_shards, py::arg("masters"),
           py::call_guard<py::gil_scoped_release>())
      .def("start_param_sync", &GradSync::start_param_sync,
           py::call_guard<py::gil_scoped_release>())
      .def("finish_param_sync", &GradSync::finish_param_sync, py::arg("group") = -1,
           py::call_guard<py::gil_scoped_release>())
      .def("note_params_written", &GradSync::note_params_written)
      .def_property_readonly("param_sync_pending", &GradSync::param_sync_pending)
      .def_property_readonly("rank", &GradSync::rank)
      .def_property_readonly("world_size", &GradSync::world_size)
      .def_property_readonly("num_bucket_groups", &GradSync::num_bucket_groups)
      .def("golden_count", &GradSync::golden_count, py::arg("index"))
      .def("group_of_param", &GradSync::group_of_param, py::arg("index"))
      .def("group_launched", &GradSync::group_launched, py::arg("group"))
      .def("communicator", &GradSync::communicator, py::return_value_policy::reference_internal)
      .def("buckets", [](const GradSync& s) {
        // [(buffer, grad dtype, offset, numel, [param indices])] for tests and debugging
        py::list out;
        for (size_t b = 0; b < s.buffers().size(); ++b)
          for (const auto& k : s.buffers()[b].buckets)
            out.append(py::make_tuple(b, py::str(c10::toString(s.buffers()[b].grad_dtype)),
                                      k.offset, k.numel, k.params));
        return out;
      });
}

}  // namespace fp8dp::python

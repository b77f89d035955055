// Binds src/comm: the Communicator interface and its collectives, the process-group
// implementation, the factory that picks NCCL or the process group, and the ranks' agreement
// check.
#include <torch/csrc/utils/pybind.h>

#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/agreement.h"
#include "comm/make_communicator.h"
#include "comm/process_group_communicator.h"

namespace py = pybind11;

namespace fp8dp::python {

void bind_comm(py::module_& m) {
  py::class_<Communicator, std::shared_ptr<Communicator>> communicator(m, "Communicator");
  communicator.def_property_readonly("rank", &Communicator::rank)
      .def_property_readonly("size", &Communicator::size)
      .def_property_readonly("name", &Communicator::name)
      .def(
          "set_timeout",
          [](Communicator& c, double seconds) {
            c.set_timeout(std::chrono::milliseconds(static_cast<int64_t>(seconds * 1000.0)));
          },
          py::arg("seconds"))
      .def_property("blocking_wait", &Communicator::blocking_wait, &Communicator::set_blocking_wait)
      .def("check_for_errors", &Communicator::check_for_errors,
           py::call_guard<py::gil_scoped_release>());
  py::enum_<ReduceOp>(m, "ReduceOp").value("SUM", ReduceOp::kSum).value("AVG", ReduceOp::kAvg);
  py::class_<CommWork, std::shared_ptr<CommWork>>(m, "CommWork")
      .def("wait", &CommWork::wait, py::call_guard<py::gil_scoped_release>())
      .def("is_completed", &CommWork::is_completed);
  // The collectives, bound so that every Communicator (and the NCCL one) is testable from Python.
  communicator
      .def("all_reduce", &Communicator::all_reduce, py::arg("buffers"), py::arg("op"),
           py::call_guard<py::gil_scoped_release>())
      .def("reduce_scatter", &Communicator::reduce_scatter, py::arg("inputs"), py::arg("outputs"),
           py::arg("op"), py::call_guard<py::gil_scoped_release>())
      .def("all_gather", &Communicator::all_gather, py::arg("inputs"), py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("all_to_all", &Communicator::all_to_all, py::arg("inputs"), py::arg("outputs"),
           py::call_guard<py::gil_scoped_release>())
      .def("broadcast", &Communicator::broadcast, py::arg("buffers"), py::arg("root"),
           py::call_guard<py::gil_scoped_release>());
  py::class_<ProcessGroupCommunicator, Communicator, std::shared_ptr<ProcessGroupCommunicator>>(
      m, "ProcessGroupCommunicator")
      .def(py::init<c10::intrusive_ptr<c10d::ProcessGroup>, bool, bool>(), py::arg("process_group"),
           py::arg("native_avg") = true, py::arg("native_reduce_scatter") = true);
  // Without the GIL: the NCCL communicator's unique-id broadcast runs on the group (gloo's workers
  // take the GIL).
  m.def("make_communicator", &make_communicator, py::arg("backend"), py::arg("process_group"),
        py::arg("cuda"), py::arg("high_priority_stream") = true,
        py::call_guard<py::gil_scoped_release>());
  m.def("native_nccl_available", &native_nccl_available);
  // Without the GIL: gloo's workers take it.
  m.def("check_ranks_agree", &check_ranks_agree, py::arg("communicator"), py::arg("fields"),
        py::arg("what"), py::arg("device") = c10::Device(c10::kCPU),
        py::call_guard<py::gil_scoped_release>());
}

}  // namespace fp8dp::python

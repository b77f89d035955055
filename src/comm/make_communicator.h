// Picks the Communicator for DistributedDataParallelConfig.comm_backend.
#pragma once

#include <memory>
#include <string>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>

#include "comm/communicator.h"

namespace fp8dp {

// backend: "auto" (native NCCL for CUDA tensors when this build has it, else the process group),
// "nccl" (native NCCL; an error when the build has none) or "process_group".
// cuda: whether the tensors to communicate live on a CUDA device. high_priority_stream: the native
// NCCL communicator's stream priority (see
// DistributedDataParallelConfig.nccl_high_priority_stream).
std::shared_ptr<Communicator> make_communicator(const std::string& backend,
                                                c10::intrusive_ptr<c10d::ProcessGroup> group,
                                                bool cuda, bool high_priority_stream = true);

// Whether this build has the native NCCL communicator.
bool native_nccl_available();

}  // namespace fp8dp

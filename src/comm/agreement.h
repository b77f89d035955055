// check_ranks_agree: what every rank of a communicator must build alike (contract C12), compared
// once, at construction, so that nothing is left to fail (or silently differ) inside a collective.
#pragma once

#include <c10/core/Device.h>

#include <string>
#include <utility>
#include <vector>

#include "comm/communicator.h"

namespace fp8dp {

// One thing the ranks must share: its name for messages ("config.bucket_size") and its value as
// text ("None"). Two ranks agree on a field when both strings are equal byte for byte.
using AgreementField = std::pair<std::string, std::string>;

// Every rank of `comm` calls it with its own `fields`, in the same order, and `what`, the object
// being built ("DistributedDataParallel"), which is compared too. Costs one all-gather of four
// int64 per rank (a fingerprint: protocol, length and two 64-bit hashes of the serialized fields)
// when the ranks agree. On any difference every rank sees the same gathered fingerprints, so
// every rank takes the same path: one more all-gather of the serialized fields (padded to the
// longest, a length every rank read from the fingerprints, never from its own fields), then
// every rank throws fp8dp::ValueError naming `what`, the first differing field and each rank's
// value, e.g. "DistributedDataParallel: ranks disagree on config.average_in_collective: rank 0
// False, rank 1 True". Ranks with different numbers of fields (different code versions) are
// reported at the first position where they differ. `device`: where the small tensors of the
// collectives live (CUDA for an NCCL communicator or process group, CPU for gloo). Blocks until
// the collectives are done; a failed collective raises fp8dp::Error.
void check_ranks_agree(Communicator& comm, const std::vector<AgreementField>& fields,
                       const std::string& what, const c10::Device& device = c10::kCPU);

// The message check_ranks_agree raises for the fields of every rank (`per_rank[r]`: rank r's
// fields, `what` first as field "object being built"), or "" when they are all equal. Pure, for
// tests and for the second phase above.
std::string describe_disagreement(const std::vector<std::vector<AgreementField>>& per_rank,
                                  const std::string& what);

}  // namespace fp8dp

// Layout of one contiguous gradient (and parameter) buffer: where each parameter lives, where each
// bucket starts and ends, and which part of every bucket a rank owns under the distributed
// optimizer. Pure arithmetic on sizes, so the rules are tested without tensors or a process group.
#pragma once

#include <cstdint>
#include <vector>

namespace fp8dp {

struct LayoutOptions {
  int64_t bucket_size = 40000000;      // elements; a bucket closes once it holds at least this many
  int64_t dp = 1;                      // data-parallel world size
  bool distributed_optimizer = false;  // align params to 64, pad bucket ends to lcm(dp, 128)
  bool pad_for_high_nccl_busbw = false;  // also pad bucket ends to a multiple of 2^16
};

struct ParamRange {
  int64_t start = 0;  // first element in the buffer
  int64_t end = 0;    // one past the last
  int64_t bucket = 0;
};

struct BucketRange {
  int64_t start = 0;
  int64_t end = 0;  // padded end; (end - start) % dp == 0 with the distributed optimizer
  std::vector<int64_t> params;  // indices into the input, in layout order
};

struct Layout {
  std::vector<ParamRange> params;  // indexed like the input numels
  std::vector<BucketRange> buckets;
  int64_t numel = 0;  // total buffer size, padding included
};

// numels: element counts in registration order (each > 0). Parameters are laid out in reverse
// registration order (the order backward produces their gradients), never split across buckets.
Layout compute_layout(const std::vector<int64_t>& numels, const LayoutOptions& opts);

// What bucket ends are padded to: 1 without the distributed optimizer, else lcm(dp, 128), and with
// pad_for_high_nccl_busbw lcm(dp, 128, 2^16).
int64_t bucket_end_multiple(const LayoutOptions& opts);

// The part of a parameter that rank `rank` owns: chunk `rank` of each bucket split into dp equal
// chunks, intersected with the parameter.
struct ShardRange {
  int64_t param = 0;          // index into the input numels
  int64_t param_offset = 0;   // first owned element within the flattened parameter
  int64_t buffer_offset = 0;  // the same element in the buffer
  int64_t numel = 0;
};

// Needs a layout computed with distributed_optimizer (so buckets split evenly).
std::vector<ShardRange> owned_shards(const Layout& layout, int64_t dp, int64_t rank);

}  // namespace fp8dp
